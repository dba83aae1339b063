"""The OpenAI-compatible HTTP front door (Starlette on uvicorn, inside the service's event loop).

| route | answer |
| --- | --- |
| ``POST /v1/completions`` | proxied engine answer (JSON, or SSE passthrough ending ``data: [DONE]``) |
| ``POST /v1/chat/completions`` | same, chat |
| ``GET /v1/models`` | OpenAI model list from the live etcd endpoints (with ``max_model_len``) |
| ``GET /health`` | 200 ``{"status": "ok", "endpoints": n}`` while the process serves |

Request headers: ``x-request-id`` (kept, else generated), ``x-llm-d-inference-fairness-id`` (flow,
default ``default``), priority from ``x-kvmesh-priority`` (an integer; wins when both are sent) or
``x-llm-d-inference-objective`` (an integer, or a name in ``objective_priorities``: critical 10,
standard 0, sheddable -10; unknown names are a 400), W3C ``traceparent``. Response headers:
``x-request-id`` and ``x-kvmesh-endpoint`` (the endpoint id that served it). Errors are OpenAI
error bodies, status from the one error table (:mod:`services.router.http_errors`).

Client disconnects: a streamed answer races the body against ``http.disconnect``; a non-streamed one
races the engine read against it. Either way the engine response is closed (the engine sees its
request cancelled) and the admission stream is closed, releasing the flow-control slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvmesh import errors
from kvmesh.tracing import extract_http_context
from services.router import metrics
from services.router.catalog import ModelCatalog
from services.router.config import RouterConfig
from services.router.http_errors import http_error
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


def request_meta(headers: dict[str, str] | Any, config: RouterConfig, trace_context: Any = None) -> RequestMeta:
    """Flow, priority and request id from request headers (see the module docstring).

    Raises:
        InvalidRequest: a priority header that is neither an integer nor a known objective name.
    """
    request_id = headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    flow_id = headers.get(FAIRNESS_HEADER) or config.default_flow_id
    priority = 0
    raw_priority = headers.get(PRIORITY_HEADER)
    objective = headers.get(OBJECTIVE_HEADER)
    if raw_priority is not None:
        try:
            priority = int(raw_priority)
        except ValueError as exc:
            raise errors.InvalidRequest(f"'{PRIORITY_HEADER}' header must be an integer, got {raw_priority!r}") from exc
    elif objective:
        try:
            priority = int(objective)
        except ValueError:
            if objective.lower() not in config.objective_priorities:
                known = ", ".join(sorted(config.objective_priorities))
                raise errors.InvalidRequest(f"unknown inference objective {objective!r} (known: {known})") from None
            priority = config.objective_priorities[objective.lower()]
    return RequestMeta(
        request_id=request_id[:128], flow_id=flow_id[:256], priority=priority, trace_context=trace_context, server_span=True
    )


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
        self.init_headers({**_response_headers(session), "cache-control": "no-cache", "content-type": session.content_type})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_gone = False
        error: BaseException | None = None
        stream_task = asyncio.ensure_future(self._stream(send))
        disconnect_task = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
            if stream_task in done:
                error = stream_task.exception()
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
        async for chunk in self.session.iter_bytes():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class RouterHttpApi:
    """Route handlers over a :class:`RequestFlow` and the live model catalog."""

    def __init__(self, config: RouterConfig, flow: RequestFlow, catalog: Callable[[], ModelCatalog]) -> None:
        self._config = config
        self._flow = flow
        self._catalog = catalog

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    def _error(self, exc: BaseException, request_id: str | None = None) -> JSONResponse:
        err = http_error(exc, self._config.retry_after_seconds)
        if err.status == 500:
            logger.error("unhandled error request_id=%s", request_id, exc_info=exc)
        metrics.record_outcome(metrics.outcome_for_status(err.status))
        headers = dict(err.headers)
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return JSONResponse(err.body, status_code=err.status, headers=headers)

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, RequestKind.CHAT)

    async def _proxy(self, request: Request, kind: RequestKind) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        try:
            meta = request_meta(request.headers, self._config, extract_http_context(request.headers))
            request_id = meta.request_id
            body = parse_json_body(await request.body())
            routed = validate_request(kind, body, self._catalog(), self._config.max_tokens_limit)
            if routed.stream:
                session = await _unless_disconnected(self._flow.start(routed, meta), request.receive)
                return ProxiedStream(session)
            session, payload = await _unless_disconnected(self._complete(routed, meta), request.receive)
        except _ClientGone:
            logger.info("client disconnected request_id=%s", request_id)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - mapped by the one table
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
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        endpoints = sum(info.endpoints for info in self._catalog().models.values())
        return JSONResponse({"status": "ok", "endpoints": endpoints})


