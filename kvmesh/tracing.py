"""OpenTelemetry set-up: a tracer provider per process, OTLP/gRPC export when configured.

W3C trace context (``traceparent``) travels in gRPC metadata through the interceptors in
:mod:`kvmesh.interceptors` / :mod:`kvmesh.channels`, and in HTTP headers via
:func:`inject_http_headers` (router -> engine).

Export never blocks a request: a finished span goes into the ``BatchSpanProcessor``'s bounded queue
(``OTEL_BSP_MAX_QUEUE_SIZE``, 2048 by default; when it is full the oldest span is dropped and the SDK
logs "Queue full") and a worker thread sends batches. A collector that is down costs the dropped spans
only: one rate-limited WARNING ``N span(s) dropped: OTLP export to ... failed`` says so. At stop
the last spans get ``otlp_shutdown_timeout_seconds`` (1 s by default) to reach the collector, not the
exporter's retries with back-off (~10 s per batch at a dead endpoint; issue of wave 13's fresh user).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler

from kvmesh.logging import RateLimitedLog

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_SECONDS = 1.0
"""How long the last spans may take to reach the collector at stop (``ProcessConfig.otlp_shutdown_timeout_seconds``)."""
_ABORT_SECONDS = 1.0
"""After the shutdown bound, how long the aborted export may take to end before :func:`shutdown_tracing`
leaves it behind (a daemon thread: it does not keep the process alive)."""
DROPPED_LOG_INTERVAL_SECONDS = 60.0
"""At most one ``spans dropped`` WARNING per this many seconds while the collector stays unreachable."""


class DropCountingExporter(SpanExporter):
    """The OTLP exporter plus what kvmesh needs around it (runs on the ``BatchSpanProcessor``'s worker
    thread, never on a request's).

    - counts the spans of every batch whose export failed (``dropped``: spans) and says so in one
      WARNING per :data:`DROPPED_LOG_INTERVAL_SECONDS` (the SDK's exporter logs each failed try too);
    - :meth:`abort` (the stop's bound ran out): the exporter's retry back-off ends at once and its
      channel closes (an RPC in flight is cancelled); every later batch is dropped and counted without
      a try.
    """

    def __init__(self, inner: SpanExporter, endpoint: str, log_interval_seconds: float = DROPPED_LOG_INTERVAL_SECONDS) -> None:
        self._inner = inner
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self.stopping = False
        """Set by :func:`shutdown_tracing`: failures are then summed up in its one line, not logged here."""
        self.dropped = 0
        self._log = RateLimitedLog(logger, log_interval_seconds, thread_safe=True,
                                   suffix=" (+{more} more failed exports in the last {interval:.0f}s)")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._aborted:
            self._count(len(spans))
            return SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        except Exception:  # the SDK's exporter returns FAILURE; anything else must not kill the worker either
            logger.debug("OTLP export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            total = self._count(len(spans))
            if not self.stopping:
                self._log.warning("export", "%d span(s) dropped: OTLP export to %s failed (%d dropped since "
                                  "start; requests are not slowed)", len(spans), self.endpoint, total)
        return result

    def _count(self, n: int) -> int:
        with self._lock:
            self.dropped += n
            return self.dropped

    def abort(self) -> None:
        """End the export in progress now and drop what follows (thread-safe; idempotent)."""
        self._aborted = True
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


_exporters: dict[TracerProvider, tuple[DropCountingExporter, float]] = {}
"""Each provider :func:`setup_tracing` made with an endpoint and :func:`shutdown_tracing` has not stopped yet
-> its exporter and shutdown bound (seconds)."""


def setup_tracing(service_name: str, otlp_endpoint: str | None,
                  shutdown_timeout_seconds: float = DEFAULT_SHUTDOWN_TIMEOUT_SECONDS) -> TracerProvider:
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

    ``shutdown_timeout_seconds`` bounds :func:`shutdown_tracing` (also run at interpreter exit, so a
    process that never stopped its service is bounded too; the SDK's own exit hook, unbounded, is off).
    """
    sampler: Sampler | None = None  # None: the SDK's own choice (OTEL_TRACES_SAMPLER or parentbased_always_on)
    if not otlp_endpoint and not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(ALWAYS_OFF)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler,
                              shutdown_on_exit=False)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = DropCountingExporter(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True), otlp_endpoint)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _exporters[provider] = (exporter, shutdown_timeout_seconds)
        atexit.register(shutdown_tracing, provider)
        logger.info("tracing export=otlp endpoint=%s", otlp_endpoint)
    trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing(provider: TracerProvider | None = None) -> None:
    """Flush and stop ``provider`` (default: the global one; a no-op when it is no SDK provider),
    within the ``shutdown_timeout_seconds`` given to :func:`setup_tracing` plus at most
    :data:`_ABORT_SECONDS`: past the bound the export is aborted and the spans not sent are dropped,
    with one WARNING ``N span(s) not exported at stop ...``. Idempotent; blocks the caller
    (the flush runs on a daemon thread, which a stuck exporter cannot keep alive past the bound)."""
    if provider is None:
        current = trace.get_tracer_provider()
        if not isinstance(current, TracerProvider):
            return
        provider = current
    entry = _exporters.pop(provider, None)
    if entry is None:  # no exporter: nothing to flush
        provider.shutdown()
        return
    exporter, bound = entry
    exporter.stopping = True
    dropped_before = exporter.dropped
    started = time.monotonic()
    # provider.shutdown: the batch worker sends all that is queued, then the exporter closes
    flusher = threading.Thread(target=provider.shutdown, name="kvmesh-tracing-shutdown", daemon=True)
    flusher.start()
    flusher.join(bound)
    if flusher.is_alive():
        exporter.abort()
        flusher.join(_ABORT_SECONDS)
    dropped = exporter.dropped - dropped_before
    if flusher.is_alive():
        logger.warning("span export still running %.1f s after stop began; left behind (%d span(s) "
                       "dropped so far)", time.monotonic() - started, dropped)
    elif dropped:
        logger.warning("%d span(s) not exported at stop: the OTLP collector at %s did not take them "
                       "within otlp_shutdown_timeout_seconds=%.1f", dropped, exporter.endpoint, bound)


def inject_http_headers(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current span's W3C ``traceparent``/``tracestate`` to outgoing HTTP headers."""
    propagate.inject(headers)
    return headers


def extract_http_context(headers: Mapping[str, str]) -> Context:
    """The trace context carried by incoming HTTP headers (for a server span's parent)."""
    return propagate.extract(headers)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
