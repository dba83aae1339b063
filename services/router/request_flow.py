"""The transport-agnostic request path shared by the HTTP and gRPC front doors.

Per request (DESIGN.md section 2)::

    validated RouterRequest
      -> admission: open the flow_control stream, Enqueue, wait for DISPATCHED   (429 / 504 on rejection)
      -> late binding: epp Pick (token ids when given, else text or messages)   (503 when nothing is live)
      -> forward the body to candidate.url + path; on a transport error before the
         response headers arrive, try the next candidate (the Pick's fallbacks, then a
         new Pick excluding every endpoint tried), at most ``max_fallback_attempts``
      -> FlowSession: the caller streams ``iter_bytes()`` (or ``read_all()``) back
      -> FlowSession.close(): close the engine response (cancels it when unfinished),
         send Complete(tokens, ttft, e2e, success), close the admission stream (slot freed)

``RequestFlow.start`` releases everything itself when it raises; after it returns, the caller
owns the session and must call ``close()`` exactly once in a ``finally`` (a second call is a no-op),
passing ``client_gone=True`` when the client disconnected.

Tracing: one ``router.request`` span per request (parent: the caller's context) and one
``router.proxy`` CLIENT span per engine attempt whose W3C context goes to the engine in the HTTP
headers. Spans are started and ended explicitly (no context left attached across tasks), since
the HTTP layer streams the body from another task than the one that started the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh import errors
from kvmesh.tracing import inject_http_headers, tracer
from kvmesh.types import Endpoint
from services.router import metrics
from services.router.catalog import ModelCatalog
from services.router.clients import AdmissionRequest, AdmissionTicket, CompletionReport, PickQuery, PickResult
from services.router.config import RouterConfig
from services.router.metrics import Outcome
from services.router.sse import SseParser, Usage, parse_completion, parse_event
from services.router.validation import RouterRequest, check_context

logger = logging.getLogger(__name__)
_tracer = tracer("kvmesh.router")

REQUEST_ID_HEADER = "x-request-id"
ENDPOINT_HEADER = "x-kvmesh-endpoint"


def _event_boundary(data: bytes) -> int:
    """Length of the prefix of ``data`` made of whole SSE events (ending in a blank line); 0 when none."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class Admission(Protocol):
    async def admit(self, request: AdmissionRequest) -> AdmissionTicket: ...


class Picker(Protocol):
    async def pick(self, query: PickQuery) -> PickResult: ...


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who is asking: request id, flow (fairness id), priority band, and the caller's trace context.

    ``server_span`` makes the request span a SERVER span (HTTP); under gRPC the shared interceptor
    already opened the server span, so the request span is INTERNAL.
    """

    request_id: str
    flow_id: str
    priority: int
    trace_context: Context | None = None
    server_span: bool = False


@dataclass
class FlowSession:
    """One admitted request with an open engine response. Owned by the caller until ``close()``."""

    request: RouterRequest
    meta: RequestMeta
    endpoint: Endpoint
    status_code: int
    content_type: str
    attempts: int
    _response: httpx.Response
    _ticket: AdmissionTicket
    _span: trace.Span
    _proxy_span: trace.Span
    _clock: Callable[[], float]
    _started: float
    _first_byte_at: float | None = None
    _finished: bool = False
    _closed: bool = False
    _usage: Usage | None = None
    _chunks: int = 0
    _body: bytearray = field(default_factory=bytearray)

    @property
    def ttft_seconds(self) -> float:
        return (self._first_byte_at - self._started) if self._first_byte_at is not None else 0.0

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The engine's response bytes, unchanged (SSE when the request streams).

        A streamed answer is passed on in whole events only (up to the last blank line seen; the
        rest follows with the next chunk, or at the end), so an in-stream error event sent after an
        engine failure never lands inside a half-sent event.

        Raises:
            httpx.HTTPError: the engine connection failed mid-answer.
        """
        parser = SseParser() if self.request.stream else None
        held = b""
        async for chunk in self._response.aiter_bytes():
            if not chunk:
                continue
            if self._first_byte_at is None:
                self._first_byte_at = self._clock()
                metrics.record_ttft(self.request.model, self.ttft_seconds)
            if parser is not None:
                for payload in parser.feed(chunk):
                    piece = parse_event(payload)
                    if piece is None:
                        continue
                    if piece.text or piece.finish_reason:
                        self._chunks += 1
                    if piece.usage is not None:
                        self._usage = piece.usage
                held += chunk
                cut = _event_boundary(held)
                if cut == 0:
                    continue
                chunk, held = held[:cut], held[cut:]
            else:
                self._body += chunk
            yield chunk
        if held:
            yield held
        self._finished = True
        if parser is None:
            _, _, self._usage, _ = parse_completion(bytes(self._body))

    async def read_all(self) -> bytes:
        """The whole (non-streamed) response body."""
        async for _ in self.iter_bytes():
            pass
        return bytes(self._body)

    async def close(self, client_gone: bool = False, error: BaseException | None = None) -> Outcome:
        """Close the engine response (cancelling it when unfinished), report to flow_control, free the slot."""
        if self._closed:
            return Outcome.CANCELLED if client_gone else Outcome.ERROR
        self._closed = True
        try:
            await self._response.aclose()
        except Exception:
            logger.debug("closing engine response failed request_id=%s", self.meta.request_id, exc_info=True)
        e2e = self._clock() - self._started
        success = self._finished and not client_gone and error is None and self.status_code < 400
        if client_gone:
            outcome = Outcome.CANCELLED
        elif success:
            outcome = Outcome.SUCCESS
        elif self.status_code >= 400:
            outcome = metrics.outcome_for_status(self.status_code)
        else:
            outcome = Outcome.UPSTREAM_ERROR
        usage = self._usage or Usage()
        report = CompletionReport(
            prompt_tokens=usage.prompt_tokens or self.request.prompt_tokens_estimate,
            completion_tokens=usage.completion_tokens or self._chunks,
            ttft_seconds=self.ttft_seconds,
            e2e_seconds=e2e,
            success=success,
        )
        try:
            await self._ticket.close(report)
        finally:
            if success:
                metrics.record_e2e(self.request.model, e2e)
            metrics.record_outcome(outcome)
            metrics.IN_FLIGHT.dec()
            for span in (self._proxy_span, self._span):
                span.set_attribute("kvmesh.outcome", outcome.value)
                if not success:
                    span.set_status(Status(StatusCode.ERROR, outcome.value))
                span.end()
            logger.debug(
                "request done request_id=%s endpoint=%s outcome=%s ttft=%.4f e2e=%.4f",
                self.meta.request_id, self.endpoint.id, outcome.value, self.ttft_seconds, e2e,
            )
        return outcome

    @property
    def usage(self) -> Usage | None:
        return self._usage


class RequestFlow:
    """Admit, pick, forward: see the module docstring."""

    def __init__(
        self,
        config: RouterConfig,
        catalog: Callable[[], ModelCatalog],
        admission: Admission,
        picker: Picker,
        http: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._catalog = catalog
        self._admission = admission
        self._picker = picker
        self._http = http
        self._clock = clock

    async def start(self, request: RouterRequest, meta: RequestMeta) -> FlowSession:
        """Admit the request, pick an endpoint and open the engine response.

        Raises:
            QueueFull | Shed | Saturated | QueueTTLExpired | NotReady: from admission.
            NoEndpointsAvailable: nothing to pick, or every attempt failed before the first byte.
            InvalidRequest: epp's token count shows the prompt does not fit the model's context.
        """
        started = self._clock()
        span = _tracer.start_span(
            "router.request",
            context=meta.trace_context,
            kind=SpanKind.SERVER if meta.server_span else SpanKind.INTERNAL,
            attributes={"kvmesh.request_id": meta.request_id, "kvmesh.model": request.model, "kvmesh.flow_id": meta.flow_id},
        )
        metrics.IN_FLIGHT.inc()
        try:
            with trace.use_span(span, end_on_exit=False):
                ticket = await self._admission.admit(
                    AdmissionRequest(
                        request_id=meta.request_id,
                        flow_id=meta.flow_id,
                        priority=meta.priority,
                        prompt_tokens=request.prompt_tokens_estimate,
                        max_tokens=request.max_tokens or 0,
                        model=request.model,
                    )
                )
                try:
                    response, endpoint, proxy_span, attempts = await self._connect(request, meta)
                except BaseException:
                    await ticket.close(CompletionReport(request.prompt_tokens_estimate, 0, 0.0, self._clock() - started, False))
                    raise
        except BaseException as exc:
            metrics.IN_FLIGHT.dec()
            if isinstance(exc, asyncio.CancelledError):
                metrics.record_outcome(Outcome.CANCELLED)  # other errors are counted where they are answered
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        span.set_attribute("kvmesh.endpoint", endpoint.id)
        return FlowSession(
            request=request,
            meta=meta,
            endpoint=endpoint,
            status_code=response.status_code,
            content_type=response.headers.get("content-type", "application/json"),
            attempts=attempts,
            _response=response,
            _ticket=ticket,
            _span=span,
            _proxy_span=proxy_span,
            _clock=self._clock,
            _started=started,
        )

    async def _connect(self, request: RouterRequest, meta: RequestMeta) -> tuple[httpx.Response, Endpoint, trace.Span, int]:
        tried: list[str] = []
        last_error: Exception | None = None
        max_attempts = self._config.max_fallback_attempts
        while len(tried) < max_attempts:
            try:
                pick = await self._picker.pick(
                    PickQuery(
                        request_id=meta.request_id,
                        model=request.model,
                        prompt_token_ids=request.prompt_token_ids,
                        prompt=request.prompt_text,
                        messages=request.messages,
                        exclude_endpoint_ids=tuple(tried),
                    )
                )
            except errors.NoEndpointsAvailable:
                if last_error is None:
                    raise
                break
            if pick.prompt_tokens and not tried:
                info = self._catalog().get(request.model)
                check_context(request.model, info.max_model_len if info else None, pick.prompt_tokens, request.max_tokens)
            fresh = [ep for ep in pick.candidates if ep.id not in tried]
            if not fresh:
                break
            for endpoint in fresh:
                if len(tried) >= max_attempts:
                    break
                tried.append(endpoint.id)
                try:
                    response, proxy_span = await self._send(request, meta, endpoint, len(tried))
                    return response, endpoint, proxy_span, len(tried)
                except httpx.TransportError as exc:
                    last_error = exc
                    metrics.record_retry()
                    logger.warning(
                        "engine failed before first byte request_id=%s endpoint=%s attempt=%d error=%r",
                        meta.request_id, endpoint.id, len(tried), exc,
                    )
        raise errors.NoEndpointsAvailable(
            f"no endpoint answered for model '{request.model}' after {len(tried)} attempt(s): {last_error!r}"
        )

    async def _send(
        self, request: RouterRequest, meta: RequestMeta, endpoint: Endpoint, attempt: int
    ) -> tuple[httpx.Response, trace.Span]:
        span = _tracer.start_span(
            "router.proxy",
            kind=SpanKind.CLIENT,
            attributes={
                "http.request.method": "POST",
                "url.full": endpoint.url + request.kind.value,
                "kvmesh.endpoint": endpoint.id,
                "kvmesh.attempt": attempt,
            },
        )
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if request.stream else "application/json",
            REQUEST_ID_HEADER: meta.request_id,
        }
        with trace.use_span(span, end_on_exit=False):
            inject_http_headers(headers)
        try:
            outbound = self._http.build_request(
                "POST", endpoint.url + request.kind.value, content=json.dumps(request.body).encode(), headers=headers
            )
            response = await self._http.send(outbound, stream=True)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        return response, span


def build_http_client(config: RouterConfig) -> httpx.AsyncClient:
    """The pooled engine client: connect timeout from config, everything else bounded by the request timeout."""
    timeout = httpx.Timeout(config.request_timeout_seconds, connect=config.connect_timeout_seconds)
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=min(256, config.max_connections))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
