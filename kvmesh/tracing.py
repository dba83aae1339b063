"""OpenTelemetry set-up: a tracer provider per process, OTLP/gRPC export when configured.

W3C trace context (``traceparent``) travels in gRPC metadata through the interceptors in
:mod:`kvmesh.interceptors` / :mod:`kvmesh.channels`, and in HTTP headers via
:func:`inject_http_headers` (router -> engine).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler

logger = logging.getLogger(__name__)


def setup_tracing(service_name: str, otlp_endpoint: str | None) -> TracerProvider:
    """Install a global tracer provider named ``service_name``.

    Spans are exported over OTLP/gRPC to ``otlp_endpoint`` (e.g. ``http://127.0.0.1:4317``) in
    batches. Without an endpoint nothing is exported, so a request that arrives without a sampled
    parent records no spans (sampler ``parentbased_always_off``: a trace id is still made and sent
    on, e.g. to the engine's ``traceparent``, unsampled); a request whose caller sent a sampled
    ``traceparent`` is recorded and its context passed on sampled, so an engine that exports its own
    spans continues the caller's trace. As vLLM does with no ``--otlp-traces-endpoint``, tracing
    costs next to nothing then (issue 10: the spans were ~0.1 ms of epp's Pick, helper P's trace,
    ``docs/BENCHMARKS.md``). The standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``
    environment variables, when set, choose the sampler in both cases (OpenTelemetry SDK
    configuration; ``parentbased_always_on`` restores recording without an endpoint). The flag
    sent on steers the next hop's parent-based sampler: a router without an endpoint in front of
    engines or services that export should get ``parentbased_always_on`` (``docs/tracing.md``,
    "Mixed deployments").
    """
    sampler: Sampler | None = None  # None: the SDK's own choice (OTEL_TRACES_SAMPLER or parentbased_always_on)
    if not otlp_endpoint and not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(ALWAYS_OFF)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
        logger.info("tracing export=otlp endpoint=%s", otlp_endpoint)
    trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the global provider (no-op when none was installed)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_millis=2000)
        provider.shutdown()


def inject_http_headers(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's W3C ``traceparent``/``tracestate`` to outgoing HTTP headers."""
    propagate.inject(headers)
    return headers


def extract_http_context(headers: Mapping[str, str]) -> Context:
    """The trace context carried by incoming HTTP headers (for a server span's parent)."""
    return propagate.extract(headers)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
