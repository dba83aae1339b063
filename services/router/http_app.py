"""The OpenAI-compatible HTTP front door (Starlette on uvicorn, inside the service's event loop).

| route | answer |
| --- | --- |
| ``POST /v1/completions`` | proxied engine answer (JSON, or SSE passthrough ending ``data: [DONE]``) |
| ``POST /v1/chat/completions`` | same, chat |
| ``GET /v1/models`` | OpenAI model list from the live etcd endpoints (with ``max_model_len``) |
| ``GET /health`` | 200 ``{"status": "ok", ...}`` when ready, else 503 naming what fails (:mod:`services.router.readiness`) |

Request headers: ``x-request-id`` (kept, truncated to 128 characters, else generated; one with a
character outside printable ASCII is a 400, since it is forwarded to the engine),
``x-llm-d-inference-fairness-id`` (flow, default ``default``), priority from ``x-kvmesh-priority``
(an integer; wins when both are sent) or ``x-llm-d-inference-objective`` (an integer, or a name in
``objective_priorities``: critical 10, standard 0, sheddable -10; unknown names are a 400). Integers
are plain decimal (``[+-]?[0-9]+``: no spaces, no ``_``) within int32, else 400. W3C ``traceparent``.
Response headers: ``x-request-id`` and ``x-kvmesh-endpoint`` (the endpoint id that served it).

Bodies: a ``content-type`` other than JSON (``application/json`` or ``*/*+json``), when sent with a
body, is a 400 (as vLLM/OpenAI reject non-JSON bodies with a 4xx JSON error); no content-type is read as
JSON. Bodies over ``max_request_body_bytes`` are a 413, from ``content-length`` before reading and
counted while reading a chunked body.

Errors are OpenAI error bodies everywhere, status from the one error table
(:mod:`services.router.http_errors`): including unknown paths (404), wrong methods (405, with
``allow``) and unhandled exceptions (500, traceback logged). When an engine fails after a streamed
answer has started, the client gets an SSE ``data: {"error": {...}}`` event (503
``service_unavailable``) followed by ``data: [DONE]`` (vLLM's convention for in-stream errors) and a
cleanly ended body; the outcome counts as ``upstream_error``. Only whole SSE events are passed on,
so the error event never lands inside a half-sent one.

Client disconnects: a streamed answer races the body against ``http.disconnect``; a non-streamed one
races the engine read against it. Either way the engine response is closed (the engine sees its
request cancelled) and the admission stream is closed, releasing the flow-control slot.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvmesh import errors
from kvmesh.tracing import extract_http_context
from services.router import metrics
from services.router.catalog import ModelCatalog
from services.router.config import RouterConfig
from services.router.http_errors import RequestTooLarge, error_body, http_error, render_json
from services.router.readiness import ReadinessProbe
from services.router.request_flow import (
    ENDPOINT_HEADER,
    REQUEST_ID_HEADER,
    FlowSession,
    RequestFlow,
    RequestMeta,
)
from services.router.validation import RequestKind, RouterRequest, parse_json_body, validate_request

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
PRIORITY_HEADER = "x-kvmesh-priority"

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_LOOSE_INT = re.compile(r"\s*[+-]?[0-9][0-9_]*\s*")
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")
MAX_REQUEST_ID_CHARS = 128
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


def request_meta(headers: dict[str, str] | Any, config: RouterConfig, trace_context: Any = None) -> RequestMeta:
    """Flow, priority and request id from request headers (see the module docstring).

    Raises:
        InvalidRequest: a priority header that is neither an int32 nor a known objective name, or an
            ``x-request-id`` with characters outside printable ASCII.
    """
    raw_id = headers.get(REQUEST_ID_HEADER)
    if raw_id and not _REQUEST_ID.fullmatch(raw_id):
        raise errors.InvalidRequest(f"'{REQUEST_ID_HEADER}' header must be printable ASCII without spaces")
    request_id = raw_id or uuid.uuid4().hex
    flow_id = headers.get(FAIRNESS_HEADER) or config.default_flow_id
    priority = 0
    raw_priority = headers.get(PRIORITY_HEADER)
    objective = headers.get(OBJECTIVE_HEADER)
    if raw_priority is not None:
        value = _int32_header(PRIORITY_HEADER, raw_priority)
        if value is None:
            raise errors.InvalidRequest(f"'{PRIORITY_HEADER}' header must be an integer, got {raw_priority[:40]!r}")
        priority = value
    elif objective:
        value = _int32_header(OBJECTIVE_HEADER, objective)
        if value is not None:
            priority = value
        elif objective.lower() in config.objective_priorities:
            priority = config.objective_priorities[objective.lower()]
        else:
            known = ", ".join(sorted(config.objective_priorities))
            raise errors.InvalidRequest(f"unknown inference objective {objective[:40]!r} (known: {known})")
    return RequestMeta(
        request_id=request_id[:MAX_REQUEST_ID_CHARS], flow_id=flow_id[:256], priority=priority,
        trace_context=trace_context, server_span=True,
    )


def _valid_request_id(raw: str | None) -> str | None:
    """The client's request id when it may be echoed in a response header, else None."""
    return raw[:MAX_REQUEST_ID_CHARS] if raw and _REQUEST_ID.fullmatch(raw) else None


class OpenAIJSONResponse(Response):
    """JSON response rendered by :func:`render_json` (ASCII-escaped: request text can never break it)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return render_json(content)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes.

    Raises:
        RequestTooLarge: ``content-length`` says more than ``limit``, or the bytes read exceed it.
        InvalidRequest: a ``content-length`` that is not a number.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise errors.InvalidRequest("'content-length' header must be a non-negative integer")
        if int(declared) > limit:
            raise RequestTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


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


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer started."""


async def _unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it (it cleans up) and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


def _response_headers(session: FlowSession) -> dict[str, str]:
    return {REQUEST_ID_HEADER: session.meta.request_id, ENDPOINT_HEADER: session.endpoint.id}


class _ClosingResponse(Response):
    """A fully read engine answer; the session (admission slot) is closed once it is sent, or failed to send."""

    def __init__(self, session: FlowSession, payload: bytes) -> None:
        super().__init__(payload, status_code=session.status_code, headers=_response_headers(session), media_type=session.content_type)
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.session.close()


class ProxiedStream(Response):
    """Streams a FlowSession's bytes, closing the session (and the engine request) on client disconnect."""

    def __init__(self, session: FlowSession) -> None:
        self.session = session
        self.status_code = session.status_code
        self.background = None
        self.upstream_error: Exception | None = None
        self.init_headers({**_response_headers(session), "cache-control": "no-cache", "content-type": session.content_type})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = False
        error: BaseException | None = None
        stream_task = asyncio.ensure_future(self._stream(send))
        disconnect_task = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
            if stream_task in done:
                error = stream_task.exception() or self.upstream_error
            else:
                client_gone = True
        except asyncio.CancelledError:
            client_gone = True
            raise
        finally:
            for task in (stream_task, disconnect_task):
                task.cancel()
            await asyncio.gather(stream_task, disconnect_task, return_exceptions=True)
            if isinstance(error, OSError):
                client_gone, error = True, None
            await self.session.close(client_gone=client_gone, error=error)
        if error is not None:
            logger.warning("stream failed request_id=%s error=%r", self.session.meta.request_id, error)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks = self.session.iter_bytes()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except httpx.HTTPError as exc:  # the engine failed after the answer started
                self.upstream_error = exc
                if self.session.content_type.startswith("text/event-stream"):
                    await send({"type": "http.response.body", "body": self._error_event(exc), "more_body": True})
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _error_event(self, exc: Exception) -> bytes:
        """The in-stream error (vLLM's convention): ``data: {"error": {...}}`` then ``data: [DONE]``."""
        err = http_error(errors.NoEndpointsAvailable(
            f"engine {self.session.endpoint.id} failed mid-stream ({type(exc).__name__}); the answer is incomplete"
        ))
        return b"data: " + render_json(err.body) + b"\n\ndata: [DONE]\n\n"


class RouterHttpApi:
    """Route handlers over a :class:`RequestFlow` and the live model catalog."""

    def __init__(
        self,
        config: RouterConfig,
        flow: RequestFlow,
        catalog: Callable[[], ModelCatalog],
        readiness: ReadinessProbe | None = None,
    ) -> None:
        self._config = config
        self._flow = flow
        self._catalog = catalog
        self._readiness = readiness

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
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
        """Last resort (Starlette's ServerErrorMiddleware): a 500 OpenAI body instead of plain text."""
        return self._error(exc, _valid_request_id(request.headers.get(REQUEST_ID_HEADER)))

    def _error(self, exc: BaseException, request_id: str | None = None) -> Response:
        err = http_error(exc, self._config.retry_after_seconds)
        if err.status == 500:
            logger.error("unhandled error request_id=%s", request_id, exc_info=exc)
        metrics.record_outcome(metrics.outcome_for_status(err.status))
        headers = dict(err.headers)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return OpenAIJSONResponse(err.body, status_code=err.status, headers=headers)

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.CHAT)

    async def _proxy(self, request: Request, kind: RequestKind) -> Response:
        request_id = _valid_request_id(request.headers.get(REQUEST_ID_HEADER))
        try:
            meta = request_meta(request.headers, self._config, extract_http_context(request.headers))
            request_id = meta.request_id
            raw = await read_body(request, self._config.max_request_body_bytes)
            check_content_type(request.headers.get("content-type"), raw)
            body = parse_json_body(raw)
            routed = validate_request(kind, body, self._catalog(), self._config.max_tokens_limit)
            if routed.stream:
                session = await _unless_disconnected(self._flow.start(routed, meta), request.receive)
                return ProxiedStream(session)
            session, payload = await _unless_disconnected(self._complete(routed, meta), request.receive)
        except _ClientGone:
            logger.info("client disconnected request_id=%s", request_id)
            return Response(status_code=499)
        except Exception as exc:
            return self._error(exc, request_id)
        return _ClosingResponse(session, payload)

    async def _complete(self, routed: RouterRequest, meta: RequestMeta) -> tuple[FlowSession, bytes]:
        """A non-streamed request up to its full body; on failure the session is closed here, on
        success by :class:`_ClosingResponse` after the answer is sent (the flow_control round trip
        stays off the client's critical path)."""
        session = await self._flow.start(routed, meta)
        try:
            payload = await session.read_all()
        except asyncio.CancelledError:
            await session.close(client_gone=True)
            raise
        except Exception as exc:
            await session.close(error=exc)
            logger.warning("engine read failed request_id=%s endpoint=%s error=%r", meta.request_id, session.endpoint.id, exc)
            raise errors.NoEndpointsAvailable(f"engine {session.endpoint.id} failed mid-response") from exc
        return session, payload

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        data = [
            {"id": info.name, "object": "model", "created": created, "owned_by": "kvmesh", "root": info.name,
             "max_model_len": info.max_model_len}
            for info in self._catalog().models.values()
        ]
        return OpenAIJSONResponse({"object": "list", "data": data})

    def endpoint_count(self) -> int:
        return sum(info.endpoints for info in self._catalog().models.values())

    async def health(self, request: Request) -> Response:
        """200 when flow_control and epp are SERVING and some endpoint is live, else 503 naming what fails."""
        if self._readiness is None:
            return OpenAIJSONResponse({"status": "ok", "endpoints": self.endpoint_count()})
        state = await self._readiness.readiness()
        return OpenAIJSONResponse(state.body(), status_code=200 if state.ready else 503)


