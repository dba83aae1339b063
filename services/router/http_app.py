"""The OpenAI-compatible HTTP front door (Starlette on uvicorn, inside the service's event loop).

| route | answer |
| --- | --- |
| ``POST /v1/completions`` | proxied engine answer (JSON, or SSE passthrough ending ``data: [DONE]``) |
| ``POST /v1/chat/completions`` | same, chat |
| ``POST /v1/embeddings``, ``POST /v1/responses`` | same path (admission, pick, forward); a pool that does not serve the route: the engine's 404 as an OpenAI error; a ``previous_response_id`` this router saw answered goes to the endpoint that stored it (:mod:`services.router.response_affinity`) |
| ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` | from the endpoint that stored it (:mod:`services.router.response_affinity`); 404 in vLLM's words when no live endpoint is known to hold it |
| ``POST /tokenize``, ``POST /detokenize`` | passed to the least-loaded live endpoint of the model, no admission (:mod:`services.router.passthrough`) |
| ``GET /v1/models`` | OpenAI model list aggregated over the live etcd endpoints: models (``max_model_len``, endpoint count) and their LoRA adapters (``parent``) |
| ``GET /v1/models/{model}`` | OpenAI's model retrieve: that model's (or adapter's) card from the list, else 404 (the error body of an unknown model in a request) |
| ``GET /health`` | 200 ``{"status": "ok", ...}`` when ready, else 503 naming what fails (:mod:`services.router.readiness`) |

Request headers: ``x-request-id`` (kept as sent, else generated; over 256 characters or with a
character outside printable ASCII (space included) it is a 400 naming the header: it is forwarded to
the engine, logged and echoed, and silently cutting or replacing it would break the client's
correlation; epp knows the request by it plus a router-unique suffix, ``RequestMeta.epp_request_id``,
as clients may reuse one id on concurrent requests), ``x-gateway-inference-fairness-id`` (GIE/llm-d's current name) or ``x-llm-d-inference-fairness-id``
(flow, default ``default``; over 256 characters or with a control character is a 400), priority from ``x-kvmesh-priority`` (an
integer; wins when both are sent) or ``x-gateway-inference-objective`` / ``x-llm-d-inference-objective``
(an integer, or a name in ``objective_priorities``: critical 10, standard 0, sheddable -10; unknown
names are a 400). Integers are plain decimal (``[+-]?[0-9]+``: no spaces, no ``_``) within int32,
else 400. ``x-slo-ttft-ms`` (GIE's TTFT objective, read by the slo-deadline ordering) and
``x-kvmesh-queue-ttl-ms`` (this request's queue TTL; flow_control uses the minimum of it, the band's
and the global one): positive integers of milliseconds up to 3,600,000, else 400. W3C ``traceparent``.
API keys (``Authorization: Bearer <key>`` or ``x-api-key``) bind the request to a tenant's fairness
id, maximum priority and quotas once tenants are configured (:mod:`services.router.tenants`); a
malformed or unknown key is a 401 with an OpenAI error body.
Headers to the engine: :mod:`services.router.headers` (hop-by-hop, kvmesh's own and credentials
never; ``authorization``: the pool's engine key, else the client's in open mode only); more than
16 KiB of them in all is a 431 (an engine's uvicorn would refuse the request).
Response headers: ``x-request-id`` and ``x-kvmesh-endpoint`` (the endpoint id that served it). An
admission rejection (429) carries ``retry-after`` (flow_control's hint, at least
``retry_after_seconds``) and ``x-llm-d-request-dropped-reason`` (llm-d's header:
``rejected-saturated`` for a full queue, ``rejected-ttl-expired``, ``rejected-shed``,
``rejected-rate-limited``). Every 429 and 503, the router's or an engine's, carries ``retry-after``.
An engine error whose body is not an OpenAI error (FastAPI's ``{"detail": ...}`` for a route the
pool does not serve, vLLM's ``{"error": "Unauthorized"}``) is rewritten to one, status kept.

Bodies: a ``content-type`` other than JSON (``application/json`` or ``*/*+json``), when sent with a
body, is a 400 (as vLLM/OpenAI reject non-JSON bodies with a 4xx JSON error); no content-type is read as
JSON. Bodies over ``max_request_body_bytes`` are a 413, from ``content-length`` before reading and
counted while reading a chunked body. ``content-encoding: gzip`` (``x-gzip``) or ``deflate`` bodies are
decoded, the same bound applied to the decoded bytes while inflating (a zip bomb is a 413 after
``max_request_body_bytes + 1`` bytes); any other coding (``br``, ``zstd``, two codings) is a 415
naming it, a corrupt or truncated one a 400.

Errors are OpenAI error bodies everywhere, status from the one error table
(:mod:`services.router.http_errors`): including unknown paths (404), wrong methods (405, with
``allow``) and unhandled exceptions (500, traceback logged). When an engine fails after a streamed
answer has started, the client gets an SSE ``data: {"error": {...}}`` event (503
``service_unavailable``) followed by ``data: [DONE]`` (vLLM's convention for in-stream errors) and a
cleanly ended body; the outcome counts as ``upstream_error``. Only whole SSE events are passed on,
so the error event never lands inside a half-sent one.

Lifetime: a validated request's answer is a :class:`_ProxiedAnswer`, whose work runs inside one
``RequestFlow.session`` (admission, pick, engine, close). A :class:`_DisconnectGuard` races that
work against ``http.disconnect`` until the answer's last byte is sent (queued, waiting for the
engine, streaming): a disconnect cancels it, so the session closes as ``cancelled``, the engine
response is closed (the engine sees its request cancelled) and the flow-control slot is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from kvmesh import errors
from kvmesh.openai_stream import DONE_EVENT, sse_event
from kvmesh.tracing import extract_http_context
from services.router import metrics
from services.router.catalog import ModelCatalog
from services.router.clients import AdmitOptions
from services.router.config import RouterConfig
from services.router.headers import forwarded_headers
from services.router.http_errors import (
    MAX_ENGINE_ERROR_BYTES,
    HeadersTooLarge,
    RequestTimedOut,
    RequestTooLarge,
    UnsupportedMediaType,
    body_snippet,
    engine_error_status,
    error_body,
    http_error,
    normalize_engine_error,
    render_json,
)
from services.router.passthrough import PassedAnswer, Passthrough
from services.router.readiness import ReadinessProbe
from services.router.request_flow import (
    ENDPOINT_HEADER,
    REQUEST_ID_HEADER,
    ClientGone,
    EngineFailed,
    EngineStalled,
    FlowSession,
    RequestFlow,
    RequestMeta,
    ShuttingDown,
    client_credentials_reach_engine,
)
from services.router.response_affinity import (
    ResponseAffinity,
    StoredResponseGone,
    response_id_in_events,
    response_id_of,
    stores,
)
from services.router.tenants import TenantDirectory, api_key_from_headers
from services.router.validation import RequestKind, RouterRequest, parse_json_body, resolve_model, validate_request

logger = logging.getLogger(__name__)

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
GIE_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
GIE_OBJECTIVE_HEADER = "x-gateway-inference-objective"
PRIORITY_HEADER = "x-kvmesh-priority"
TTFT_SLO_HEADER = "x-slo-ttft-ms"
QUEUE_TTL_HEADER = "x-kvmesh-queue-ttl-ms"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
MAX_FLOW_ID_CHARS = 256
MAX_HEADER_MS = 3_600_000

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_LOOSE_INT = re.compile(r"\s*[+-]?[0-9][0-9_]*\s*")
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")
MAX_REQUEST_ID_CHARS = 256
"""Longest ``x-request-id`` accepted (Envoy's and OpenAI's ids are 36-64 characters; a longer one is a 400)."""
MAX_FORWARDED_HEADER_BYTES = 16 * 1024
"""Most bytes of client headers passed on to an engine (uvicorn's h11 refuses a header block over 16 KiB:
a larger one would fail every engine tried, so it is the client's 431 here instead)."""
_JSON_CONTENT = re.compile(r"application/(?:[\w.+-]+\+)?json", re.IGNORECASE)


def _int32_header(name: str, raw: str) -> int | None:
    """``raw`` as an int32 when it is plain decimal (``[+-]?[0-9]+``), None when it is not numeric at all.

    Raises:
        InvalidRequest: a decimal outside [-2^31, 2^31-1] (naming the header and the range), or a
            number in a form Python's ``int()`` would take but HTTP clients should not send
            (``1_0``, surrounding spaces).
    """
    if _DECIMAL.fullmatch(raw):
        digits = raw.lstrip("+-").lstrip("0")
        if len(digits) <= 10 and INT32_MIN <= (value := int(raw)) <= INT32_MAX:
            return value
        raise errors.InvalidRequest(f"'{name}' header must be an int32 in [{INT32_MIN}, {INT32_MAX}], got {raw[:40]!r}")
    if _LOOSE_INT.fullmatch(raw):
        raise errors.InvalidRequest(f"'{name}' header must be a plain decimal integer, got {raw[:40]!r}")
    return None


def _ms_header(headers: dict[str, str] | Any, name: str) -> float:
    """A positive millisecond header as seconds (0.0 when absent).

    Raises:
        InvalidRequest: not a plain decimal integer in [1, 3,600,000].
    """
    raw = headers.get(name)
    if raw is None:
        return 0.0
    value = _int32_header(name, raw)
    if value is None or not 1 <= value <= MAX_HEADER_MS:
        raise errors.InvalidRequest(f"'{name}' header must be an integer of milliseconds in [1, {MAX_HEADER_MS}], got {raw[:40]!r}")
    return value / 1000.0


def request_meta(
    headers: dict[str, str] | Any, config: RouterConfig, trace_context: Any = None, tenants: TenantDirectory | None = None,
) -> RequestMeta:
    """Flow, priority, request id and admission options from request headers (see the module docstring).

    Raises:
        InvalidRequest: a priority header that is neither an int32 nor a known objective name, a
            fairness id over 256 characters, a bad ``x-slo-ttft-ms`` / ``x-kvmesh-queue-ttl-ms``, or an
            ``x-request-id`` with characters outside printable ASCII.
        Unauthenticated: a malformed or unknown API key, or none while ``require_api_key`` (tenants configured).
    """
    raw_id = headers.get(REQUEST_ID_HEADER)
    if raw_id and len(raw_id) > MAX_REQUEST_ID_CHARS:
        raise errors.InvalidRequest(f"'{REQUEST_ID_HEADER}' header is {len(raw_id)} characters (at most {MAX_REQUEST_ID_CHARS})")
    if raw_id and not _REQUEST_ID.fullmatch(raw_id):
        raise errors.InvalidRequest(f"'{REQUEST_ID_HEADER}' header must be printable ASCII without spaces")
    request_id = raw_id or uuid.uuid4().hex
    for name in (GIE_FAIRNESS_HEADER, FAIRNESS_HEADER):
        value_of = headers.get(name)
        if value_of is not None and len(value_of) > MAX_FLOW_ID_CHARS:
            raise errors.InvalidRequest(f"'{name}' header is {len(value_of)} characters (at most {MAX_FLOW_ID_CHARS})")
        if value_of is not None and not value_of.isprintable():  # it is logged, labelled and sent to flow_control
            raise errors.InvalidRequest(f"'{name}' header must be printable text (no control characters)")
    header_flow = headers.get(GIE_FAIRNESS_HEADER) or headers.get(FAIRNESS_HEADER)
    priority: int | None = None
    raw_priority = headers.get(PRIORITY_HEADER)
    objective = headers.get(GIE_OBJECTIVE_HEADER) or headers.get(OBJECTIVE_HEADER)
    if raw_priority is not None:
        value = _int32_header(PRIORITY_HEADER, raw_priority)
        if value is None:
            raise errors.InvalidRequest(f"'{PRIORITY_HEADER}' header must be an integer, got {raw_priority[:40]!r}")
        priority = value
    elif objective:
        objective_header = GIE_OBJECTIVE_HEADER if headers.get(GIE_OBJECTIVE_HEADER) else OBJECTIVE_HEADER
        value = _int32_header(objective_header, objective)
        if value is not None:
            priority = value
        elif objective.lower() in config.objective_priorities:
            priority = config.objective_priorities[objective.lower()]
        else:
            known = ", ".join(sorted(config.objective_priorities))
            raise errors.InvalidRequest(f"unknown inference objective {objective[:40]!r} (known: {known})")
    ttft_slo = _ms_header(headers, TTFT_SLO_HEADER)
    queue_ttl = _ms_header(headers, QUEUE_TTL_HEADER)
    directory = tenants if tenants is not None else TenantDirectory([], config.default_flow_id)
    binding = directory.bind(api_key_from_headers(headers) if directory.enabled else None, header_flow, priority)
    options = AdmitOptions(
        ttl_seconds=queue_ttl, ttft_slo_seconds=ttft_slo, max_concurrency=binding.max_concurrency,
        rate_per_second=binding.rate_per_second, burst=binding.burst,
    )
    items: list[tuple[str, str]] = list(headers.items())
    forward = forwarded_headers(items, pass_authorization=not directory.enabled)
    forward_bytes = sum(len(k) + len(v) + 4 for k, v in forward)
    if forward_bytes > MAX_FORWARDED_HEADER_BYTES:
        raise HeadersTooLarge(f"'headers' passed on to the engine total {forward_bytes} bytes (at most "
                              f"{MAX_FORWARDED_HEADER_BYTES}); send fewer or shorter custom headers")
    return RequestMeta(
        request_id=request_id, flow_id=binding.flow_id or config.default_flow_id,
        priority=binding.priority, trace_context=trace_context, server_span=True, admit_options=options,
        forward_headers=forward,
    )


def _valid_request_id(raw: str | None) -> str | None:
    """The client's request id when it may be echoed in a response header, else None."""
    return raw if raw and len(raw) <= MAX_REQUEST_ID_CHARS and _REQUEST_ID.fullmatch(raw) else None


class OpenAIJSONResponse(Response):
    """JSON response rendered by :func:`render_json` (ASCII-escaped: request text can never break it)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return render_json(content)


async def read_body(request: Request, limit: int, timeout_seconds: float | None = None) -> bytes:
    """The request body, at most ``limit`` bytes, all of it within ``timeout_seconds`` (None: no bound).

    Raises:
        RequestTooLarge: ``content-length`` says more than ``limit``, or the bytes read exceed it.
        InvalidRequest: a ``content-length`` that is not a number.
        RequestTimedOut: the body did not arrive in time (fewer bytes than ``content-length`` said,
            or a drip): 408, and the connection is closed.
    """
    _check_declared(request, limit)
    receive = request.receive
    # Most bodies are whole in the first receive() (they came with the headers): no deadline is armed
    # for them. One is armed for a first receive() that would wait (uvicorn's cycle: its message event
    # not set yet; unknown receivers: always), and for the rest once ``more_body`` says there is more.
    cycle = getattr(receive, "__self__", None)
    event = getattr(cycle, "message_event", None)
    ready = isinstance(event, asyncio.Event) and event.is_set()
    if timeout_seconds is None or ready:
        message = await receive()
        if not message.get("more_body", False) or timeout_seconds is None:
            return await _finish_body(request, message, limit)
    try:
        async with asyncio.timeout(timeout_seconds):
            if not ready:
                message = await receive()
            return await _finish_body(request, message, limit)
    except TimeoutError:
        declared = request.headers.get("content-length")
        raise RequestTimedOut(f"request body not received within {timeout_seconds:g}s"
                              + (f" (content-length says {declared} bytes)" if declared else "")) from None


def _check_declared(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise errors.InvalidRequest("'content-length' header must be a non-negative integer")
        if int(declared) > limit:
            raise RequestTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")


async def _finish_body(request: Request, message: Message, limit: int) -> bytes:
    """The body from its first ASGI message on (Starlette's ``Request.stream`` semantics: a disconnect
    raises ClientDisconnect); kept as ``request._body`` so a later ``request.body()`` returns it."""
    body = bytearray()
    while True:
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body += message.get("body", b"")
        if len(body) > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            break
        message = await request.receive()
    request._body = data = bytes(body)
    return data


_DECODERS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
"""``content-encoding`` codings the router decodes (RFC 9110 8.4.1: gzip, its x-gzip alias, deflate = zlib
format) -> zlib's ``wbits``; ``identity`` is no coding. Anything else (``br``, ``zstd``, ``compress``) is a 415."""


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``raw`` decoded by its ``content-encoding`` (at most one coding besides ``identity``), at most ``limit``
    bytes decoded: the bound is enforced while inflating (a zip bomb stops at ``limit + 1`` bytes).

    Raises:
        UnsupportedMediaType: a coding other than gzip / x-gzip / deflate / identity, or more than one (415).
        RequestTooLarge: the decoded body exceeds ``limit`` (413).
        InvalidRequest: the body is not valid data of its coding (400).
    """
    if not content_encoding:
        return raw
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip() and c.strip().lower() != "identity"]
    if not codings:
        return raw
    if len(codings) > 1 or codings[0] not in _DECODERS:
        raise UnsupportedMediaType(f"'content-encoding' {content_encoding[:60]!r} is not supported "
                                   "(send the body uncompressed, or gzip / deflate encoded)")
    coding = codings[0]
    out = bytearray()
    data = raw
    try:
        while data:  # gzip may hold several members back to back (RFC 1952 2.2)
            inflate = zlib.decompressobj(_DECODERS[coding])
            out += inflate.decompress(data, limit + 1 - len(out))
            if len(out) > limit:
                raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes once decoded ({coding})")
            if not inflate.eof:
                raise errors.InvalidRequest(f"'content-encoding' {coding} body is truncated")
            data = inflate.unused_data if coding != "deflate" else b""
    except zlib.error as exc:
        raise errors.InvalidRequest(f"'content-encoding' {coding} body is not valid {coding} data: {exc}") from None
    return bytes(out)


def check_content_type(content_type: str | None, body: bytes) -> None:
    """A body must be JSON: no ``content-type`` (read as JSON), ``application/json`` or ``application/*+json``.

    Raises:
        InvalidRequest: another media type with a non-empty body.
    """
    if not body or content_type is None:
        return
    media = content_type.split(";", 1)[0].strip()
    if not _JSON_CONTENT.fullmatch(media):
        raise errors.InvalidRequest(f"'content-type' must be application/json, got {media[:60]!r}")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _DisconnectGuard:
    """Runs one request's work, cancelling it when the HTTP client disconnects before its answer is complete.

    Cancelling the work ends its session as ``cancelled`` (engine request cancelled, slot freed).
    Once the last body message went out (``more_body`` false), a disconnect no longer cancels:
    ASGI servers report ``http.disconnect`` as soon as the response is complete, and the
    session's close (the flow_control round trip) must not be cut short by it.
    """

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.response_started = False
        self._answered = False

    async def send(self, message: Message) -> None:
        """The ASGI ``send`` for the work: notes when the response starts and when it is complete."""
        await self._send(message)
        if message["type"] == "http.response.start":
            self.response_started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self._answered = True

    async def run(self, work: Awaitable[None]) -> None:
        """Await ``work`` in this task (no task of its own: no event-loop hand-off on the way in or
        out); re-raise its error. A watcher task reading ``receive`` cancels this task when the
        client disconnects before the answer is complete.

        Raises:
            ClientGone: the client disconnected first (the work was cancelled and has cleaned up).
        """
        task = asyncio.current_task()
        assert task is not None
        finished = client_gone = False

        def on_disconnect(watch: asyncio.Future[None]) -> None:
            nonlocal client_gone
            if not watch.cancelled():
                watch.exception()  # retrieved (a failing receive counts as a disconnect, as before)
            if not finished and not self._answered:
                client_gone = True
                task.cancel()

        gone = asyncio.ensure_future(_wait_disconnect(self._receive))
        gone.add_done_callback(on_disconnect)
        try:
            await work
        except asyncio.CancelledError:
            if client_gone and task.uncancel() == 0:  # our cancellation, not the server's shutdown
                raise ClientGone() from None
            raise
        finally:
            finished = True
            gone.remove_done_callback(on_disconnect)
            gone.cancel()
        if client_gone:  # the work swallowed the cancellation and returned
            task.uncancel()
            raise ClientGone()


def _response_headers(session: FlowSession) -> dict[str, str]:
    return {REQUEST_ID_HEADER: session.meta.request_id, ENDPOINT_HEADER: session.endpoint.id}


class _ProxiedAnswer(Response):
    """The engine's answer to one validated request, its whole life inside one ``flow.session``.

    Streamed: the engine's status and headers, then its SSE events as they come (whole events);
    if the engine fails mid-stream, an in-stream error event and ``data: [DONE]`` end the body.
    Non-streamed: the whole answer is read, sent, and only then is the session closed (the
    flow_control round trip stays off the client's critical path). Errors before the answer
    starts (admission, pick, engine) become OpenAI error responses.
    """

    def __init__(
        self, flow: RequestFlow, error_response: Callable[[BaseException, str | None], Response], routed: RouterRequest,
        meta: RequestMeta, retry_after_seconds: int = 1, affinity: ResponseAffinity | None = None,
    ) -> None:
        self._flow = flow
        self._error_response = error_response
        self._routed = routed
        self._meta = meta
        self._retry_after = retry_after_seconds
        # a stored /v1/responses answer: remember which endpoint holds it (response_affinity)
        self._affinity = affinity if routed.kind is RequestKind.RESPONSES and stores(routed.body) else None
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = _DisconnectGuard(receive, send)
        try:
            await guard.run(self._answer(scope, receive, guard))
        except ClientGone:
            if not guard.response_started:
                logger.info("client disconnected request_id=%s before the answer started", self._meta.request_id)
                await Response(status_code=499)(scope, receive, send)
            else:
                logger.info("client disconnected request_id=%s mid-answer", self._meta.request_id)

    async def _answer(self, scope: Scope, receive: Receive, guard: _DisconnectGuard) -> None:
        try:
            async with self._flow.session(self._routed, self._meta) as session:
                if session.status_code >= 400:
                    payload, cut = await session.read_error(MAX_ENGINE_ERROR_BYTES)
                    await engine_error_response(session, payload, self._retry_after, cut)(scope, receive, guard.send)
                elif self._routed.stream:
                    await self._stream(session, guard.send)
                else:
                    payload = await session.read_all()
                    if self._affinity is not None:
                        self._affinity.remember(response_id_of(payload) or "", session.endpoint.id, session.request.model)
                    answer = Response(payload, session.status_code, _response_headers(session), session.content_type)
                    await answer(scope, receive, guard.send)
        except ClientGone:
            raise
        except Exception as exc:
            if guard.response_started:
                logger.warning("stream failed request_id=%s error=%r", self._meta.request_id, exc)
                return
            await self._error_response(exc, self._meta.request_id)(scope, receive, guard.send)

    async def _stream(self, session: FlowSession, send: Send) -> None:
        """Pass the engine's events on; on an engine failure end the body with the in-stream error, then raise it."""
        headers = {**_response_headers(session), "cache-control": "no-cache", "content-type": session.content_type}
        start = {"type": "http.response.start", "status": session.status_code,
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}
        try:
            await send(start)
            try:
                pin = self._affinity
                async for chunk in session.iter_events():
                    if pin is not None and (response_id := response_id_in_events(chunk.raw)):
                        pin.remember(response_id, session.endpoint.id, session.request.model)
                        pin = None
                    await send({"type": "http.response.body", "body": chunk.raw, "more_body": True})
            except EngineFailed as exc:
                if session.content_type.startswith("text/event-stream"):
                    await send({"type": "http.response.body", "body": _error_event(exc), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                raise
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError as exc:  # writing to the client failed: it is gone
            raise ClientGone() from exc


def engine_error_response(session: FlowSession, payload: bytes, retry_after_seconds: int, truncated: bool = False) -> Response:
    """An engine's error answer for the client: an OpenAI error body, ``retry-after`` on 429/503.

    :func:`~services.router.http_errors.normalize_engine_error` decides: vLLM's own OpenAI error
    passes byte for byte with its status; anything else (plain text, HTML, JSON without ``error``,
    an oversized or cut body) is rewritten to one, its message bounded, the status kept when it is a
    4xx/5xx (else 502). The fallback message names what happened: a 404 means the engine does not
    serve the route (vLLM registers ``/v1/embeddings`` only for pooling models, ``/v1/responses`` only
    for generative ones), a 401 that it refused the credentials it was sent (kvmesh's pool key when one
    is configured, else the client's); else an excerpt of the body.
    """
    status = session.status_code
    path, model = session.request.kind.value, session.request.model
    headers = _response_headers(session)
    if status in (404, 401) and not _is_openai_error(payload):
        payload = b""  # FastAPI's {"detail": "Not Found"}, vLLM's {"error": "Unauthorized"}: say what they mean
    if status == 401:
        logger.warning("engine refused credentials request_id=%s endpoint=%s", session.meta.request_id, session.endpoint.id)
    if status == 404:
        fallback = f"the pool serving model '{model}' does not serve {path} (engine {session.endpoint.id} answered 404)"
    elif status == 401:
        fallback = f"engine {session.endpoint.id} refused the credentials for model '{model}' (engine_api_keys / Authorization)"
    else:
        snippet = body_snippet(payload)
        fallback = f"engine {session.endpoint.id} answered HTTP {status}" + (f": {snippet}" if snippet else "")
    body = normalize_engine_error(status, payload, fallback, truncated)
    client_status = engine_error_status(status)
    if client_status in (429, 503):
        headers["retry-after"] = _retry_after(session.engine_header("retry-after"), retry_after_seconds)
    if body is None:
        return Response(payload, status, headers, session.content_type)
    if client_status != status or truncated:
        logger.warning("engine error answer rewritten request_id=%s endpoint=%s status=%d client_status=%d truncated=%s",
                       session.meta.request_id, session.endpoint.id, status, client_status, truncated)
    return OpenAIJSONResponse(body, status_code=client_status, headers=headers)


def _is_openai_error(payload: bytes) -> bool:
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]


def _retry_after(engine_value: str | None, default_seconds: int) -> str:
    """The engine's ``retry-after`` when it is delta-seconds (RFC 9110 10.2.3; short), else ours."""
    if engine_value and engine_value.isascii() and engine_value.isdigit() and len(engine_value) <= 9:
        return engine_value
    return str(default_seconds)


def _error_event(exc: EngineFailed) -> bytes:
    """The in-stream error (vLLM's convention): ``data: {"error": {...}}`` then ``data: [DONE]``."""
    if isinstance(exc, EngineStalled | ShuttingDown):  # its own words: a hung engine, the router stopping
        err = http_error(exc)
    else:
        err = http_error(errors.NoEndpointsAvailable(f"{exc}; the answer is incomplete"))
    return sse_event(render_json(err.body)) + DONE_EVENT


class RouterHttpApi:
    """Route handlers over a :class:`RequestFlow` and the live model catalog."""

    def __init__(
        self,
        config: RouterConfig,
        flow: RequestFlow,
        catalog: Callable[[], ModelCatalog],
        readiness: ReadinessProbe | None = None,
        passthrough: Passthrough | None = None,
    ) -> None:
        self._config = config
        self._flow = flow
        self._catalog = catalog
        self._readiness = readiness
        self._passthrough = passthrough
        self._tenants = TenantDirectory(config.tenants, config.default_flow_id, config.require_api_key,
                                        config.anonymous_max_priority)
        self.affinity = ResponseAffinity(config.response_affinity_entries, config.response_affinity_ttl_seconds)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve_response, methods=["GET"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception, Exception: self._unhandled},
        )

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404 (unknown path) / 405 (wrong method) as OpenAI error bodies."""
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 404:
            message, etype = f"unknown path {request.url.path[:200]!r}", "not_found_error"
        elif status == 405:
            message, etype = f"method {request.method} not allowed on {request.url.path[:200]!r}", "invalid_request_error"
        else:
            message, etype = str(exc.detail), "invalid_request_error" if status < 500 else "internal_error"
        metrics.record_outcome(metrics.outcome_for_status(status))
        return OpenAIJSONResponse(error_body(message, etype, status), status_code=status, headers=dict(exc.headers or {}))

    async def _unhandled(self, request: Request, exc: Exception) -> Response:
        """Last resort (Starlette's ServerErrorMiddleware): a 500 OpenAI body instead of plain text
        (a client gone mid-request is logged as such instead)."""
        request_id = _valid_request_id(request.headers.get(REQUEST_ID_HEADER))
        if isinstance(exc, ClientDisconnect):
            return self._client_disconnected(request_id)
        return self.error_response(exc, request_id)

    def _client_disconnected(self, request_id: str | None) -> Response:
        """The client went away while sending its request: one log line, outcome ``cancelled``, a 499 nobody reads."""
        logger.info("client disconnected request_id=%s while sending the request", request_id)
        metrics.record_outcome(metrics.RequestOutcome.CANCELLED)
        return Response(status_code=499)

    def error_response(self, exc: BaseException, request_id: str | None = None) -> Response:
        """The OpenAI error response for ``exc`` (one table), its outcome counted; a 500 logs the traceback."""
        err = http_error(exc, self._config.retry_after_seconds)
        if err.status == 500:
            logger.error("unhandled error request_id=%s", request_id, exc_info=exc)
        metrics.record_outcome(metrics.outcome_for_status(err.status))
        headers = dict(err.headers)
        if err.status == 429 and isinstance(exc, errors.Saturated):
            headers[DROPPED_REASON_HEADER] = exc.dropped_reason
            hint = getattr(exc, "retry_after_seconds", 0.0)
            if hint > 0:
                headers["retry-after"] = str(max(self._config.retry_after_seconds, math.ceil(hint)))
        if isinstance(exc, UnsupportedMediaType):  # RFC 7694: the codings this server accepts
            headers["accept-encoding"] = "gzip, deflate, identity"
        if isinstance(exc, RequestTimedOut):  # the rest of the body may still come: this connection is done
            headers["connection"] = "close"
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return OpenAIJSONResponse(err.body, status_code=err.status, headers=headers)

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.CHAT)

    async def embeddings(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.EMBEDDINGS)

    async def responses(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.RESPONSES)

    async def retrieve_response(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``: from the endpoint that stored it (``response_affinity``); an id this
        router did not see answered is a 404 in vLLM's words."""
        return await self._stored_response(request, "GET", "")

    async def cancel_response(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: to the endpoint that stored it, as ``GET``."""
        return await self._stored_response(request, "POST", "/cancel")

    async def _stored_response(self, request: Request, method: str, suffix: str) -> Response:
        response_id = str(request.path_params["response_id"])
        request_id = _valid_request_id(request.headers.get(REQUEST_ID_HEADER))
        try:
            meta = request_meta(request.headers, self._config, None, self._tenants)
            request_id = meta.request_id
            holder = self.affinity.holder(response_id)
            if holder is None or self._passthrough is None:
                raise StoredResponseGone(f"Response with id '{response_id}' not found. (no endpoint behind this "
                                         "router is known to hold it)")
            answer = await self._passthrough.to_endpoint(method, f"/v1/responses/{response_id}{suffix}", holder[1],
                                                         holder[0], request_id, meta.forward_headers)
        except Exception as exc:
            return self.error_response(exc, request_id)
        return self._passed_answer(answer, request_id, client_credentials_reach_engine(
            meta.forward_headers, self._config.engine_key_for(holder[1])))

    async def tokenize(self, request: Request) -> Response:
        return await self._pass(request, "/tokenize")

    async def detokenize(self, request: Request) -> Response:
        return await self._pass(request, "/detokenize")

    async def _pass(self, request: Request, path: str) -> Response:
        """``/tokenize`` / ``/detokenize``: the body to one live endpoint of its model (no admission, no pick).

        ``model`` may be left out when exactly one model is served (vLLM's field is optional); with
        none live it is ``NoEndpointsAvailable`` (503 + ``retry-after``) whether given or not, as for a completion.
        """
        request_id = _valid_request_id(request.headers.get(REQUEST_ID_HEADER))
        try:
            meta = request_meta(request.headers, self._config, None, self._tenants)
            request_id = meta.request_id
            raw = decode_body(await read_body(request, self._config.max_request_body_bytes,
                                              self._config.request_body_timeout_seconds),
                              request.headers.get("content-encoding"), self._config.max_request_body_bytes)
            check_content_type(request.headers.get("content-type"), raw)
            body = parse_json_body(raw)
            catalog = self._catalog()
            name = body.get("model")
            if name is None and len(catalog.models) == 1:
                name = catalog.names()[0]
            elif name is None and catalog.models:
                raise errors.InvalidRequest(f"'model' is required: {len(catalog.models)} models are served")
            elif name is None:  # nothing live: retryable, as a completion is then (503 + retry-after), not a 400
                raise errors.NoEndpointsAvailable("no model endpoints are live; retry later")
            model, _ = resolve_model(name, catalog)
            if self._passthrough is None:
                raise errors.NoEndpointsAvailable(f"{path} is not passed through by this router")
            answer = await self._passthrough.forward(path, model, body, request_id, meta.forward_headers)
        except ClientDisconnect:
            return self._client_disconnected(request_id)
        except Exception as exc:
            return self.error_response(exc, request_id)
        return self._passed_answer(answer, request_id, client_credentials_reach_engine(
            meta.forward_headers, self._config.engine_key_for(model)))

    def _passed_answer(self, answer: PassedAnswer, request_id: str, client_credentials: bool = False) -> Response:
        """A passed-through engine answer: a success unchanged; an error as an OpenAI error body (the engine's
        own when it is one, else rewritten with a bounded message: the rule of :func:`engine_error_response`),
        counted by :func:`metrics.engine_outcome` (``client_credentials``: the engine saw the client's key)."""
        status = answer.status_code
        metrics.record_outcome(metrics.engine_outcome(engine_error_status(status), client_credentials) if status >= 400
                               else metrics.RequestOutcome.SUCCESS)
        headers = {REQUEST_ID_HEADER: request_id, ENDPOINT_HEADER: answer.endpoint_id}
        if status < 400:
            return Response(answer.content, status, headers, answer.content_type)
        if engine_error_status(status) in (429, 503):
            headers["retry-after"] = str(self._config.retry_after_seconds)
        snippet = body_snippet(answer.content)
        fallback = f"engine {answer.endpoint_id} answered HTTP {status}" + (f": {snippet}" if snippet else "")
        body = normalize_engine_error(status, answer.content, fallback)
        if body is None:
            return Response(answer.content, status, headers, answer.content_type)
        return OpenAIJSONResponse(body, status_code=engine_error_status(status), headers=headers)

    async def _proxy(self, request: Request, kind: RequestKind) -> Response:
        """Check the request here; its answer (admission to close) is a :class:`_ProxiedAnswer`."""
        request_id = _valid_request_id(request.headers.get(REQUEST_ID_HEADER))
        try:
            meta = request_meta(request.headers, self._config, extract_http_context(request.headers), self._tenants)
            request_id = meta.request_id
            raw = decode_body(await read_body(request, self._config.max_request_body_bytes,
                                              self._config.request_body_timeout_seconds),
                              request.headers.get("content-encoding"), self._config.max_request_body_bytes)
            if meta.admit_options is not None:
                meta = replace(meta, admit_options=replace(meta.admit_options, byte_size=len(raw)))
            check_content_type(request.headers.get("content-type"), raw)
            body = parse_json_body(raw)
            routed = validate_request(kind, body, self._catalog(), self._config.max_tokens_limit,
                                      self._config.max_n, self._config.max_batch_prompts)
            if routed.previous_response_id is not None:  # a stored response's follow-up goes to its holder
                routed = replace(routed, pinned_endpoint_id=self.affinity.endpoint_for(routed.previous_response_id))
        except ClientDisconnect:
            return self._client_disconnected(request_id)
        except Exception as exc:
            return self.error_response(exc, request_id)
        return _ProxiedAnswer(self._flow, self.error_response, routed, meta, self._config.retry_after_seconds,
                              self.affinity)

    async def models(self, request: Request) -> Response:
        """vLLM's model list, aggregated over the pool: one card per served model (its smallest
        ``max_model_len``, its live endpoint count) and one per LoRA adapter (``parent`` its base
        model). With ``require_api_key`` it needs a tenant's key, as the generation routes do."""
        refused = self._models_refused(request)
        if refused is not None:
            return refused
        return OpenAIJSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): the card :meth:`models` lists
        for that id (a model or a LoRA adapter; ids may hold ``/``), else 404 (the error body of an unknown model in a request)."""
        refused = self._models_refused(request)
        if refused is not None:
            return refused
        wanted = request.path_params["model"]
        for card in self._model_cards():
            if card["id"] == wanted:
                return OpenAIJSONResponse(card)
        return self.error_response(errors.UnknownModel(f"The model '{errors.quoted(wanted)}' does not exist"),
                                   _valid_request_id(request.headers.get(REQUEST_ID_HEADER)))

    def _models_refused(self, request: Request) -> Response | None:
        """With ``require_api_key``, the error answer for a request without a tenant's key; else None."""
        try:
            if self._tenants.enabled:
                self._tenants.bind(api_key_from_headers(request.headers), None, None)
        except Exception as exc:
            return self.error_response(exc, _valid_request_id(request.headers.get(REQUEST_ID_HEADER)))
        return None

    def _model_cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        catalog = self._catalog()
        data: list[dict[str, Any]] = [
            {"id": info.name, "object": "model", "created": created, "owned_by": "kvmesh", "root": info.name,
             "parent": None, "max_model_len": info.max_model_len, "endpoints": info.endpoints}
            for info in catalog.models.values()
        ]
        for adapter, base in sorted(catalog.lora_adapters.items()):
            info = catalog.get(base)
            data.append({"id": adapter, "object": "model", "created": created, "owned_by": "kvmesh", "root": adapter,
                         "parent": base, "max_model_len": info.max_model_len if info else None,
                         "endpoints": info.endpoints if info else 0})
        return data

    def endpoint_count(self) -> int:
        return sum(info.endpoints for info in self._catalog().models.values())

    async def health(self, request: Request) -> Response:
        """200 ``"ok"``, or ``"degraded"`` when a failing dependency is served around; 503 naming what is
        not served (the rule: :mod:`services.router.readiness`)."""
        if self._readiness is None:
            return OpenAIJSONResponse({"status": "ok", "endpoints": self.endpoint_count()})
        state = await self._readiness.readiness()
        if state.ready:
            return OpenAIJSONResponse(state.body())
        return OpenAIJSONResponse(state.body(), status_code=503, headers={"retry-after": str(self._config.retry_after_seconds)})


