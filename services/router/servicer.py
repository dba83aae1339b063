"""The gRPC ``kvmesh.router.v1.Inference`` servicer: protobuf in, the shared request flow, protobuf out.

A ``CompletionRequest`` becomes the equivalent OpenAI body (``prompt`` text or token ids for
``/v1/completions``, ``messages`` for ``/v1/chat/completions``) and goes through the same
validation and :class:`~services.router.request_flow.RequestFlow` as HTTP, each RPC inside one
``flow.session``. Every field of the message has a place: :data:`BODY_FIELDS` go into the engine's body
with their HTTP meaning (a float's value as written: 0.7, not its float32 expansion), :data:`METADATA_FIELDS`
stand for headers; a set field in neither (the proto grew one this module does not know) is refused with
``INVALID_ARGUMENT`` naming it, never dropped. Domain errors propagate to the shared interceptor (one table). An engine error
answer becomes the matching domain error (an in-stream error event too: vLLM streams refused sampling
parameters as 200 + ``data: {"error": ...}``); an engine failing mid-answer is ``UNAVAILABLE``.
A cancelled RPC (or a stream its client closed) ends the session as cancelled: the engine
request is cancelled and the flow-control slot released. ``CompleteStream`` reads the parsed
chunks the session already has (:meth:`~services.router.request_flow.FlowSession.iter_events`); it
asks the engine for ``stream_options.include_usage`` and folds the usage-only chunk into the last
``CompletionChunk`` (finish reason and usage: the engine's prompt, completion and cached tokens).

Shutdown (the router's drain, ``services/router/app.py``; docs/degraded-modes.md, "the router
itself"): the calls in flight run on for the grace; those still running near its end end with
``UNAVAILABLE`` "the server is shutting down; retry the request" (a stream after the chunks it
already sent), as the HTTP front door's 503 / in-stream error: the ones waiting on an engine through
:meth:`RequestFlow.end_all`, every other one (admission, pick) through :meth:`InferenceServicer.drain`.

Who is asking comes from the call's metadata, read by the HTTP front door's own
:func:`~services.router.http_app.request_meta` (one implementation): an API key
(``authorization: Bearer <key>`` or ``x-api-key``) binds the call to its tenant's fairness id,
maximum priority and quotas (:mod:`services.router.tenants`); ``x-gateway-inference-fairness-id`` /
``x-llm-d-inference-fairness-id``, ``x-kvmesh-priority``, ``x-gateway-inference-objective`` /
``x-llm-d-inference-objective``, ``x-slo-ttft-ms`` and ``x-kvmesh-queue-ttl-ms`` mean what the HTTP
headers mean, and the SLO, TTL and quotas go to flow_control in the ``Enqueue``. The message's
``flow_id`` and (non-zero) ``priority`` stand for the fairness and priority headers when the
metadata names none. Outcomes through the one error table: a malformed or unknown key (or none
while ``require_api_key``) is ``UNAUTHENTICATED``, bad metadata ``INVALID_ARGUMENT``, an admission
rejection ``RESOURCE_EXHAUSTED`` (its class in the ``kvmesh-error-class`` trailer). ``ListModels``
needs a key exactly when ``GET /v1/models`` does. No client metadata is forwarded to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import grpc
from opentelemetry import context as otel_context

from kvmesh import errors
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.interceptors import current_request_id
from kvmesh.openai_stream import Usage, parse_completion
from services.router.catalog import ModelCatalog
from services.router.config import RouterConfig
from services.router.http_app import (
    FAIRNESS_HEADER,
    GIE_FAIRNESS_HEADER,
    GIE_OBJECTIVE_HEADER,
    MAX_FLOW_ID_CHARS,
    OBJECTIVE_HEADER,
    PRIORITY_HEADER,
    request_meta,
)
from services.router.http_errors import MAX_ENGINE_ERROR_BYTES, error_from_engine, error_from_stream_event
from services.router.request_flow import REQUEST_ID_HEADER, SHUTDOWN_MESSAGE, RequestFlow, RequestMeta, ShuttingDown
from services.router.tenants import TenantDirectory, api_key_from_headers
from services.router.validation import RequestKind, RouterRequest, validate_request

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
"""``optional float`` fields passed as the decimal their sender wrote (:func:`_float32`) when set."""
INT_SAMPLING_FIELDS = ("top_k", "seed", "min_tokens")
"""``optional`` integer fields passed as they are when set."""
BODY_FIELDS = frozenset({"model", "prompt", "prompt_token_ids", "messages", "max_tokens", "stop", "ignore_eos",
                         *FLOAT_SAMPLING_FIELDS, *INT_SAMPLING_FIELDS})
"""``CompletionRequest`` fields :func:`openai_body` writes into the engine's OpenAI body, each with the meaning the
HTTP front door's body field of the same name has (``max_tokens`` 0: not sent, the engine's default)."""
METADATA_FIELDS = frozenset({"flow_id", "priority"})
"""``CompletionRequest`` fields that stand for request headers (:func:`metadata_headers`), not body fields."""


def _refuse_unforwarded(request: router_pb2.CompletionRequest) -> None:
    """Refuse a set field this servicer does not carry to the engine (the proto gained one, the servicer did
    not learn it): never dropped silently. ``tests/unit/router/test_grpc_fields.py`` holds the two tables to
    the proto's field list.

    Raises:
        InvalidRequest: naming the field (``INVALID_ARGUMENT``).
    """
    for field, _ in request.ListFields():
        if field.name not in BODY_FIELDS and field.name not in METADATA_FIELDS:
            raise errors.InvalidRequest(
                f"'{field.name}' is not supported by the router's gRPC front door (it cannot be passed to the "
                "engine); leave it unset or use the HTTP front door")


def _float32(value: float) -> float:
    """A proto ``float`` as the decimal its sender wrote (0.7, not 0.699999988079071): the shortest decimal that
    is the same 32-bit float, as the HTTP front door reads the JSON number."""
    if not math.isfinite(value):
        return value
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


def openai_body(request: router_pb2.CompletionRequest, stream: bool) -> tuple[RequestKind, dict[str, Any]]:
    """The OpenAI body equivalent to ``request`` (:data:`BODY_FIELDS`); a stream asks for
    ``stream_options.include_usage`` (the engine's usage-only chunk before ``[DONE]``, folded into the last
    ``CompletionChunk``).

    Raises:
        InvalidRequest: unless exactly one of prompt, prompt_token_ids, messages is set; a set field the
            servicer cannot carry to the engine (:func:`_refuse_unforwarded`).
    """
    _refuse_unforwarded(request)
    forms = sum((bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)))
    if forms != 1:
        raise errors.InvalidRequest("exactly one of 'prompt', 'prompt_token_ids', 'messages' must be set")
    body: dict[str, Any] = {"model": request.model, "stream": stream}
    if stream:  # the engine's token counts for the last chunk's usage (vLLM sends them only when asked)
        body["stream_options"] = {"include_usage": True}
    if request.messages:
        kind = RequestKind.CHAT
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    else:
        kind = RequestKind.COMPLETION
        body["prompt"] = request.prompt or list(request.prompt_token_ids)
    if request.max_tokens:
        body["max_tokens"] = request.max_tokens
    for name in FLOAT_SAMPLING_FIELDS:
        if request.HasField(name):
            body[name] = _float32(getattr(request, name))
    for name in INT_SAMPLING_FIELDS:
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    return kind, body


def metadata_headers(
    metadata: Any, request: router_pb2.CompletionRequest | None = None, request_id: str = "",
) -> dict[str, str]:
    """gRPC invocation metadata as the header mapping :func:`request_meta` reads.

    ``metadata``: ``(key, value)`` pairs (keys arrive lowercase); the first value of a key wins (as
    an HTTP header lookup), binary (``-bin``) keys are left out. ``request``'s ``flow_id`` becomes
    ``x-gateway-inference-fairness-id`` unless a fairness key is sent, its non-zero ``priority``
    ``x-kvmesh-priority`` unless a priority or objective key is sent (proto3 cannot tell 0 from
    unset: ask for 0 through metadata). ``request_id`` (the interceptor's) fills ``x-request-id``.
    """
    headers: dict[str, str] = {}
    for key, value in metadata or ():
        name = str(key).lower()
        if not name.endswith("-bin") and isinstance(value, str):
            headers.setdefault(name, value)
    if request is not None:
        if request.flow_id and not any(n in headers for n in (GIE_FAIRNESS_HEADER, FAIRNESS_HEADER)):
            if len(request.flow_id) > MAX_FLOW_ID_CHARS:  # named as the caller sent it, not as the header it becomes
                raise errors.InvalidRequest(
                    f"'flow_id' is {len(request.flow_id)} characters (at most {MAX_FLOW_ID_CHARS})")
            if not request.flow_id.isprintable():  # the same rule as the header's, in the field's name
                raise errors.InvalidRequest("'flow_id' must be printable text (no control characters)")
            headers[GIE_FAIRNESS_HEADER] = request.flow_id
        if request.priority and not any(n in headers for n in (PRIORITY_HEADER, GIE_OBJECTIVE_HEADER, OBJECTIVE_HEADER)):
            headers[PRIORITY_HEADER] = str(request.priority)
    if request_id:
        headers.setdefault(REQUEST_ID_HEADER, request_id)
    return headers


def _usage_pb(usage: Usage | None, fallback_completion: int = 0) -> router_pb2.Usage:
    usage = usage or Usage(completion_tokens=fallback_completion)
    return router_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens
    )


class InferenceServicer(router_pb2_grpc.InferenceServicer):
    """Thin adapter over :class:`RequestFlow`."""

    def __init__(self, config: RouterConfig, flow: RequestFlow, catalog: Callable[[], ModelCatalog]) -> None:
        self._config = config
        self._flow = flow
        self._catalog = catalog
        self._tenants = TenantDirectory(config.tenants, config.default_flow_id, config.require_api_key,
                                        config.anonymous_max_priority)
        self._calls: set[asyncio.Task[Any]] = set()
        """The tasks of the ``Complete`` / ``CompleteStream`` calls in flight (one set add per call)."""
        self._drained: set[asyncio.Task[Any]] = set()

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        """Count the current call as in flight; a call cancelled by :meth:`drain` ends as
        :class:`ShuttingDown` (``UNAVAILABLE``, :data:`SHUTDOWN_MESSAGE`) instead of a cancellation."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._calls.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._drained:
                raise
            task.uncancel()
            raise ShuttingDown(SHUTDOWN_MESSAGE) from None
        finally:
            self._calls.discard(task)
            self._drained.discard(task)

    @property
    def in_flight(self) -> int:
        """``Complete`` / ``CompleteStream`` calls running now."""
        return len(self._calls)

    async def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no ``Complete`` / ``CompleteStream`` call runs (at most ``timeout_seconds``);
        whether none does. The calls themselves are not touched."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_seconds)
        while self._calls:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.wait(list(self._calls), timeout=left)
        return True

    def drain(self) -> int:
        """The router is stopping and the grace is nearly over: every call still running ends now
        with ``UNAVAILABLE`` :data:`SHUTDOWN_MESSAGE` (its task cancelled where it waits: admission,
        pick, the client), except those already being ended (:meth:`RequestFlow.end_all` cancelled
        their wait on the engine: they end with the same status). Their count."""
        count = 0
        for task in list(self._calls):
            if task.done() or task.cancelling():
                continue
            self._drained.add(task)
            task.cancel(SHUTDOWN_MESSAGE)  # the request flow reads it as the router's shutdown, not the client leaving
            count += 1
        return count

    def _prepare(
        self, request: router_pb2.CompletionRequest, context: grpc.aio.ServicerContext, stream: bool,
    ) -> tuple[RouterRequest, RequestMeta]:
        """The validated request and who is asking (the module docstring), the key checked first as over HTTP.

        Raises:
            Unauthenticated: a malformed or unknown API key, or none while ``require_api_key``.
            InvalidRequest: bad metadata (as the HTTP 400s) or a bad request message.
        """
        headers = metadata_headers(context.invocation_metadata(), request, current_request_id())
        meta = request_meta(headers, self._config, otel_context.get_current(), self._tenants)
        options = meta.admit_options
        meta = replace(meta, server_span=False, forward_headers=(),
                       admit_options=replace(options, byte_size=request.ByteSize()) if options is not None else None)
        kind, body = openai_body(request, stream)
        routed = validate_request(kind, body, self._catalog(), self._config.max_tokens_limit)
        return routed, meta

    async def Complete(self, request: router_pb2.CompletionRequest, context: grpc.aio.ServicerContext) -> router_pb2.CompletionResponse:
        routed, meta = self._prepare(request, context, stream=False)
        with self._tracked():
            async with self._flow.session(routed, meta) as session:
                if session.status_code >= 400:
                    body, _ = await session.read_error(MAX_ENGINE_ERROR_BYTES)
                else:
                    body = await session.read_all()
        if session.status_code >= 400:
            raise error_from_engine(session.status_code, body)
        answer = parse_completion(body)
        return router_pb2.CompletionResponse(
            id=answer.id or meta.request_id,
            model=routed.model,
            text=answer.text,
            finish_reason=answer.finish_reason or "",
            usage=_usage_pb(answer.usage),
            endpoint_id=session.endpoint.id,
        )

    async def CompleteStream(
        self, request: router_pb2.CompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.CompletionChunk]:
        routed, meta = self._prepare(request, context, stream=True)
        with self._tracked():
            async with self._flow.session(routed, meta) as session:
                if session.status_code >= 400:
                    raise error_from_engine(session.status_code, (await session.read_error(MAX_ENGINE_ERROR_BYTES))[0])
                pieces = 0
                # the chunk with the finish reason, held until the engine's usage chunk after it (include_usage)
                finishing: router_pb2.CompletionChunk | None = None
                async for chunk in session.iter_events():
                    for piece in chunk.pieces:
                        if piece.error is not None:  # the engine's in-stream error: its status and message
                            raise error_from_stream_event(piece.error)
                        if not (piece.text or piece.finish_reason):
                            if piece.usage is not None and finishing is not None:  # the usage-only chunk: folded in
                                finishing.usage.CopyFrom(_usage_pb(piece.usage))
                                yield finishing
                                finishing = None
                            continue  # a chat role delta, a usage chunk: no text chunk of its own
                        pieces += 1
                        if finishing is not None:  # more text after a finish reason: it was not the last
                            finishing.usage.CopyFrom(_usage_pb(session.usage, pieces - 1))
                            yield finishing
                            finishing = None
                        out = router_pb2.CompletionChunk(
                            id=piece.id or meta.request_id,
                            text=piece.text,
                            finish_reason=piece.finish_reason or "",
                            endpoint_id=session.endpoint.id,
                        )
                        if piece.usage is not None:  # an engine that puts usage on the finishing chunk itself
                            out.usage.CopyFrom(_usage_pb(piece.usage))
                        elif piece.finish_reason:
                            finishing = out
                            continue
                        yield out
                if finishing is not None:  # no usage chunk came: the router's own count
                    finishing.usage.CopyFrom(_usage_pb(session.usage, pieces))
                    yield finishing

    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        if self._tenants.enabled:  # as GET /v1/models: a key is checked, and needed with require_api_key
            self._tenants.bind(api_key_from_headers(metadata_headers(context.invocation_metadata())), None, None)
        return router_pb2.ListModelsResponse(models=self._catalog().names())
