"""One HTTP request through the mesh yields one trace with spans from every service on its path.

An in-process OTLP receiver (``opentelemetry-proto``'s TraceService on a real gRPC server) collects
what the services export when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, as a user's collector would.

The spans carry what an operator looks for (issue 11, docs/tracing.md): on the router's
``router.request`` the request id, model, chosen endpoint, queue time and TTFT; on the engine hop
(``router.proxy``) the URL and status; on flow_control's Admit the admission and queue time; on
epp's Pick the chosen endpoint and its scores; on kv_indexer's Score the prefix match per medium
(epp in ``prefix_index_mode=rpc``: with its default local replica, a pick calls no kv_indexer).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans as (service.name, span name, trace id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []
        self.attributes: list[dict[str, object]] = []  # parallel to spans
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((service, span.name, span.trace_id))
                        self.attributes.append({a.key: _value(a.value) for a in span.attributes})
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_one_request_one_trace_across_services(start_service, etcd: str, run_dir: Path, otlp_receiver) -> None:
    receiver, endpoint = otlp_receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    events_port = free_port()
    _, indexer = start_service("kv_indexer", "--events-bind-endpoint", f"tcp://127.0.0.1:{events_port}", env=env)
    _, flow = start_service("flow_control", env=env)
    _, epp = start_service(
        # the Score RPC path: with the default local replica (``prefix_index_mode=replica``) a pick makes
        # no kv_indexer call, so kv_indexer has no span on the request path (docs/tracing.md)
        "epp", "--kv-indexer-address", indexer, "--scheduling-config", "precise-prefix",
        "--prefix-index-mode", "rpc", env=env
    )
    engine_port = free_port()
    engine = ManagedProcess(
        "engine",
        python_module(
            "engine_simulator", "--host", "127.0.0.1", "--port", str(engine_port), "--model", "sim",
            "--events-endpoint", f"tcp://127.0.0.1:{events_port}", "--etcd-endpoints", etcd,
            "--lease-ttl-seconds", "3", "--time-scale", "50",
        ),
        run_dir / f"engine-{engine_port}.log",
    ).start()
    http_port = free_port()
    try:
        wait_http_ok(f"http://127.0.0.1:{engine_port}/health", 60)
        start_service(
            "router", "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address", epp, env=env
        )
        base = f"http://127.0.0.1:{http_port}"
        # The router learns the model from etcd.
        wait_until(lambda: httpx.get(f"{base}/v1/models").json().get("data"), 30, "the router to list the model")
        reply = httpx.post(
            f"{base}/v1/completions",
            json={"model": "sim", "prompt": "hello tracing " * 40, "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text

        wanted = {"kvmesh-router", "kvmesh-flow_control", "kvmesh-epp", "kvmesh-kv_indexer"}

        def services_by_trace() -> dict[bytes, set[str]]:
            by_trace: dict[bytes, set[str]] = defaultdict(set)
            with receiver.lock:
                for service, _name, trace_id in receiver.spans:
                    by_trace[trace_id].add(service)
            return dict(by_trace)

        by_trace = wait_until(
            services_by_trace,
            20,
            f"one trace spanning all of {sorted(wanted)}",
            until=lambda traces: any(wanted <= services for services in traces.values()),
            interval=0.1,
        )
        complete = [t for t, services in by_trace.items() if wanted <= services]
        # The request's trace is one trace: the router's server span is its root.
        with receiver.lock:
            names = {(s, n) for s, n, t in receiver.spans if t == complete[0]}
        assert any(s == "kvmesh-epp" and "Pick" in n for s, n in names), names
        assert any(s == "kvmesh-kv_indexer" and "Score" in n for s, n in names), names

        # The same prompt again, with its own request id: its prefix is now cached on the engine,
        # and the trace says so per medium.
        def span_attrs(trace_id: bytes) -> dict[tuple[str, str], dict[str, object]]:
            with receiver.lock:
                return {(s, n): a for (s, n, t), a in zip(receiver.spans, receiver.attributes, strict=True) if t == trace_id}

        def second_trace() -> dict[tuple[str, str], dict[str, object]] | None:
            reply = httpx.post(
                f"{base}/v1/completions", headers={"x-request-id": "trace-attrs-2"},
                json={"model": "sim", "prompt": "hello tracing " * 40, "max_tokens": 4}, timeout=30,
            )
            assert reply.status_code == 200, reply.text
            time.sleep(0.5)  # the batch span processor's schedule delay is 100 ms
            with receiver.lock:
                ids = [t for (s, n, t), a in zip(receiver.spans, receiver.attributes, strict=True)
                       if n == "router.request" and a.get("kvmesh.request_id") == "trace-attrs-2"]
            for trace_id in ids[-1:]:
                spans = span_attrs(trace_id)
                score = next((a for (s, n), a in spans.items() if s == "kvmesh-kv_indexer" and "Score" in n), {})
                if int(score.get("kvmesh.prefix.matched_blocks.GPU", 0) or 0) > 0:
                    return spans
            return None

        spans = wait_until(second_trace, 30, "a trace whose Score span shows a GPU prefix match", interval=0.2)
        root = next(a for (s, n), a in spans.items() if s == "kvmesh-router" and n == "router.request")
        assert root["kvmesh.request_id"] == "trace-attrs-2" and root["kvmesh.model"] == "sim"
        endpoint = root["kvmesh.endpoint"]
        assert endpoint == f"127.0.0.1:{engine_port}"
        assert float(root["kvmesh.ttft_seconds"]) > 0 and float(root["kvmesh.queue_seconds"]) >= 0
        assert root["kvmesh.outcome"] == "success" and int(root["kvmesh.completion_tokens"]) == 4
        hop = next(a for (s, n), a in spans.items() if s == "kvmesh-router" and n == "router.proxy")
        assert hop["kvmesh.endpoint"] == endpoint and hop["http.response.status_code"] == 200
        assert str(hop["url.full"]).endswith("/v1/completions")
        admit = next(a for (s, n), a in spans.items() if s == "kvmesh-flow_control" and "Admit" in n)
        assert admit["kvmesh.request_id"] == "trace-attrs-2" and admit["kvmesh.admission"] == "dispatched"
        assert float(admit["kvmesh.queue_seconds"]) >= 0
        pick = next(a for (s, n), a in spans.items() if s == "kvmesh-epp" and "Pick" in n)
        # epp knows the request by the client's id plus a suffix unique to this router request (docs/tracing.md)
        assert str(pick["kvmesh.request_id"]).startswith("trace-attrs-2~") and pick["kvmesh.endpoint"] == endpoint
        assert root["kvmesh.epp_request_id"] == pick["kvmesh.request_id"]
        assert "kvmesh.score.total" in pick
        score = next(a for (s, n), a in spans.items() if s == "kvmesh-kv_indexer" and "Score" in n)
        assert score["kvmesh.prefix.best_endpoint"] == endpoint
        assert 0 < int(score["kvmesh.prefix.matched_blocks.GPU"]) <= int(score["kvmesh.prefix.total_blocks"])
    finally:
        engine.stop()
