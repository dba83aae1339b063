"""kvmesh.tracing's sampler: without an OTLP endpoint a request with no sampled parent records no
spans but still carries a trace id on; a caller's sampled ``traceparent`` is recorded and passed on
sampled; ``OTEL_TRACES_SAMPLER`` (OpenTelemetry SDK configuration, opentelemetry-sdk 1.x) wins."""

from __future__ import annotations

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from kvmesh import tracing

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CALLER_UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> TracerProvider:
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    monkeypatch.setattr(trace, "set_tracer_provider", lambda p: None)  # keep the process's global provider
    return tracing.setup_tracing("kvmesh-test", None)


def _sent_on(span: trace.Span) -> str:
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers["traceparent"]


def test_no_endpoint_root_request_records_nothing_but_has_a_trace_id(provider: TracerProvider) -> None:
    span = provider.get_tracer("router").start_span("router.request")
    assert not span.is_recording()
    context = span.get_span_context()
    assert context.is_valid and not context.trace_flags.sampled
    _version, trace_id, _, flags = _sent_on(span).split("-")
    assert trace_id == f"{context.trace_id:032x}" and not int(flags, 16) & 1  # the sampled bit off


def test_no_endpoint_sampled_caller_is_recorded_and_passed_on_sampled(provider: TracerProvider) -> None:
    parent = propagate.extract({"traceparent": CALLER})
    span = provider.get_tracer("router").start_span("router.request", context=parent)
    assert span.is_recording()
    _, trace_id, parent_id, flags = _sent_on(span).split("-")
    assert trace_id == "0af7651916cd43dd8448eb211c80319c" and int(flags, 16) & 1
    assert parent_id != "b7ad6b7169203331"  # the router's span is the engine's parent


def test_no_endpoint_unsampled_caller_keeps_its_trace_id_unsampled(provider: TracerProvider) -> None:
    span = provider.get_tracer("router").start_span("router.request", context=propagate.extract({"traceparent": CALLER_UNSAMPLED}))
    assert not span.is_recording()
    assert _sent_on(span).split("-")[1] == "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:4317"])
def test_otel_traces_sampler_wins(monkeypatch: pytest.MonkeyPatch, endpoint: str | None) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    monkeypatch.setattr(trace, "set_tracer_provider", lambda p: None)
    provider = tracing.setup_tracing("kvmesh-test", endpoint)
    try:
        assert provider.get_tracer("router").start_span("router.request").is_recording()
    finally:
        provider.shutdown()


def test_with_an_endpoint_the_sdk_default_records_root_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    monkeypatch.setattr(trace, "set_tracer_provider", lambda p: None)
    provider = tracing.setup_tracing("kvmesh-test", "http://127.0.0.1:4317")
    try:
        assert provider.get_tracer("router").start_span("router.request").is_recording()
    finally:
        provider.shutdown()
