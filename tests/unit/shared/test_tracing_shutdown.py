"""kvmesh.tracing's export with a real OTLP/gRPC exporter: a live collector gets every span at stop; a dead one
(a port that refuses connections) costs the spans, counted in one WARNING, and never more than the stop bound
(``otlp_shutdown_timeout_seconds``) plus the abort grace; failed exports while running are one rate-limited
WARNING. The process-level check (SIGTERM of a real service) is tests/integration/test_tracing_shutdown.py."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from kvmesh import tracing


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP TraceService that counts the spans it receives."""

    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    """A port bound and not listening: connections are refused (held, so no one takes it meanwhile)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture(autouse=True)
def _keep_global_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "set_tracer_provider", lambda p: None)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)


def _spans(provider: TracerProvider, n: int) -> None:
    tracer = provider.get_tracer("test")
    for i in range(n):
        tracer.start_span(f"span-{i}").end()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvmesh.tracing" and r.levelno == logging.WARNING]


def test_a_live_collector_gets_every_span_at_stop(collector: tuple[Collector, str], caplog: pytest.LogCaptureFixture) -> None:
    servicer, endpoint = collector
    provider = tracing.setup_tracing("kvmesh-test", endpoint, shutdown_timeout_seconds=5.0)
    _spans(provider, 30)
    tracing.shutdown_tracing(provider)
    assert servicer.spans == 30
    assert _warnings(caplog) == []


@pytest.mark.parametrize("bound", [0.0, 0.5])
def test_a_dead_collector_costs_the_spans_not_the_exit(
    dead_endpoint: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, bound: float
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")  # the exporter alone would retry with back-off for 30 s
    provider = tracing.setup_tracing("kvmesh-test", dead_endpoint, shutdown_timeout_seconds=bound)
    _spans(provider, 600)  # two batches (512 per export)
    started = time.monotonic()
    tracing.shutdown_tracing(provider)
    took = time.monotonic() - started
    assert took < bound + tracing._ABORT_SECONDS + 0.5, took
    assert _warnings(caplog) == [
        f"600 span(s) not exported at stop: the OTLP collector at {dead_endpoint} did not take them within "
        f"otlp_shutdown_timeout_seconds={bound:.1f}"]
    tracing.shutdown_tracing(provider)  # idempotent: nothing more to flush, nothing more said
    assert len(_warnings(caplog)) == 1


def _readable(provider: TracerProvider, n: int) -> list[ReadableSpan]:
    spans = []
    for i in range(n):
        span = provider.get_tracer("test").start_span(f"s{i}")
        span.end()
        spans.append(span)  # an SDK span is a ReadableSpan
    return spans


def test_failed_exports_while_running_are_one_rate_limited_warning(
    dead_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    spans = _readable(TracerProvider(), 3)
    # timeout 0.5 s: the first retry's back-off (0.8-1.2 s) is past the deadline, so each export gives up at once
    exporter = tracing.DropCountingExporter(OTLPSpanExporter(endpoint=dead_endpoint, insecure=True, timeout=0.5),
                                            dead_endpoint)
    try:
        for _ in range(3):
            assert exporter.export(spans).name == "FAILURE"
    finally:
        exporter.shutdown()
    assert exporter.dropped == 9
    assert _warnings(caplog) == [
        f"3 span(s) dropped: OTLP export to {dead_endpoint} failed (3 dropped since start; requests are not slowed)"]
