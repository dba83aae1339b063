"""Server interceptors shared by every service: request ids, domain error -> status, tracing.

This is the one place a failure inside an RPC becomes a status, for every service:

| what happened | status |
| --- | --- |
| a domain error (:mod:`kvmesh.errors`) | its row of ``ERROR_TABLE`` (``INVALID_ARGUMENT``, ``NOT_FOUND``, ...) |
| request bytes that do not decode as the method's message | ``INVALID_ARGUMENT`` (one warning line, no traceback) |
| a call to another service failed (``grpc.aio.AioRpcError``) | its status when the table reads it back (``REMOTE_ERRORS``), else ``UNAVAILABLE`` (:class:`~kvmesh.errors.DependencyUnavailable`) |
| an engine HTTP call failed (``httpx.TransportError``, ``httpx.TimeoutException``) | ``UNAVAILABLE`` |
| anything else (a bug) | ``INTERNAL``, generic message, traceback logged |

Every status from a domain error carries the trailer ``kvmesh-error-class`` (the class name), so
a client tells "the service answered UNAVAILABLE" (e.g. epp: no endpoint) from "the service could
not be reached" (:func:`kvmesh.channels.answered`).

Undecodable bytes: grpcio decodes requests before any interceptor or servicer code runs and
answers a decode error with ``UNKNOWN``/``INTERNAL`` plus a logged traceback. So the interceptor
wraps each method's ``request_deserializer``: a decode failure returns an :class:`Undecodable`
marker instead of raising; a unary handler sees it and aborts with ``INVALID_ARGUMENT``; a request
stream raises :class:`~kvmesh.errors.InvalidRequest` when the marker comes out of the iterator;
and a servicer that reads with ``context.read()`` gets the marker, whose every attribute access
raises the same ``InvalidRequest``.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from kvmesh.channels import ERROR_CLASS_TRAILER
from kvmesh.errors import INTERNAL, REMOTE_ERRORS, DependencyUnavailable, InvalidRequest, KvmeshError, mapping_for

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    """The request id of the RPC being handled ("" outside one)."""
    return request_id_var.get()


class Undecodable:
    """Stands for request bytes that did not decode as ``method``'s message (see the module docstring).

    Any attribute access raises :class:`~kvmesh.errors.InvalidRequest`, so a servicer that reads it
    (``request.field``, ``request.WhichOneof``) fails with ``INVALID_ARGUMENT``, never ``INTERNAL``.
    """

    __slots__ = ("_method", "_reason")

    def __init__(self, method: str, reason: str) -> None:
        object.__setattr__(self, "_method", method)
        object.__setattr__(self, "_reason", reason)

    def error(self) -> InvalidRequest:
        method = object.__getattribute__(self, "_method")
        reason = object.__getattribute__(self, "_reason")
        return InvalidRequest(f"request bytes do not decode as the message {method} takes: {reason}")

    def __getattr__(self, name: str) -> Any:
        raise self.error()


def _tolerant(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a custom deserializer raises
            logger.warning("undecodable request method=%s bytes=%d error=%s", method, len(raw), str(exc)[:200])
            return Undecodable(method, str(exc)[:200] or type(exc).__name__)

    return decode


def translate(exc: BaseException) -> KvmeshError | None:
    """The domain error a failure inside an RPC stands for (module table), None for a bug."""
    if isinstance(exc, KvmeshError):
        return None if mapping_for(exc) is INTERNAL and type(exc) is KvmeshError else exc
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        cls = REMOTE_ERRORS.get(code.name)
        if cls is not None:
            return cls(exc.details() or code.name)
        return DependencyUnavailable(f"a dependency failed: {code.name}: {(exc.details() or '')[:200]}")
    if isinstance(exc, httpx.TimeoutException | httpx.TransportError):
        return DependencyUnavailable(f"an engine call failed: {type(exc).__name__}: {str(exc)[:200]}")
    return None


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    domain = translate(exc)
    if domain is None:
        logger.exception("unhandled error method=%s request_id=%s", method, request_id_var.get())
        await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    assert domain is not None
    if not isinstance(exc, KvmeshError):
        logger.warning("dependency failure method=%s request_id=%s error=%s", method, request_id_var.get(), domain)
    await context.abort(
        grpc.StatusCode[mapping_for(domain).grpc_status], str(domain),
        trailing_metadata=((ERROR_CLASS_TRAILER, type(domain).__name__),),
    )


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, Undecodable):
            raise item.error()
        yield item


def _checked(request_or_iterator: Any) -> Any:
    """The request, or the request stream with undecodable messages raising ``InvalidRequest``."""
    if isinstance(request_or_iterator, Undecodable):
        raise request_or_iterator.error()
    if hasattr(request_or_iterator, "__aiter__"):
        return _checked_stream(request_or_iterator)
    return request_or_iterator


def _set_request_id(context: grpc.aio.ServicerContext) -> None:
    metadata = dict(context.invocation_metadata() or ())
    request_id_var.set(str(metadata.get(REQUEST_ID_HEADER) or uuid.uuid4().hex[:16]))


class DomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request-id contextvar and maps exceptions to gRPC status codes (one table)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                _set_request_id(context)
                try:
                    return await inner(_checked(request_or_iterator), context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, method, exc)

            return behaviour

        def wrap_stream(inner: Callable[..., Any]) -> Callable[..., Any]:
            if not inspect.isasyncgenfunction(inner):
                return wrap_unary(inner)  # a coroutine that streams with context.write()

            async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                _set_request_id(context)
                try:
                    async for item in inner(_checked(request_or_iterator), context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, method, exc)

            return behaviour

        kwargs = {
            "request_deserializer": _tolerant(handler.request_deserializer, method),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **kwargs)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **kwargs)


class _SkipInfrastructure(grpc.aio.ServerInterceptor):
    """Applies ``inner`` except to health and reflection RPCs and the multiplexed admission stream.

    OpenTelemetry's aio interceptor assumes streaming handlers are async generators, while
    grpcio's health ``Watch`` streams with ``context.write``; infrastructure RPCs need no spans.
    """

    _SKIP = ("/grpc.health.", "/grpc.reflection.",
             # long-lived multiplexed streams: one span for the stream's whole life says nothing; the
             # servicer opens one span per admission / pick itself (flow_control's, epp's servicer)
             "/kvmesh.flow_control.v1.FlowControl/AdmitMany", "/kvmesh.epp.v1.EndpointPicker/PickMany")

    def __init__(self, inner: grpc.aio.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(self._SKIP):
            return await continuation(handler_call_details)
        return closed_in_task(await self._inner.intercept_service(continuation, handler_call_details))


def _written(stream: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., Awaitable[None]]:
    """``stream`` (an async-generator behaviour) as a coroutine that sends with ``context.write`` and closes the
    generator in its own task however the RPC ends (:func:`closed_in_task`)."""

    async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        responses = stream(request_or_iterator, context)
        try:
            async for response in responses:
                await context.write(response)
        finally:
            await responses.aclose()  # the RPC's own task and Context: the span's context detaches cleanly

    return behaviour


def closed_in_task(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with each response-streaming behaviour closed in the RPC's own task.

    OpenTelemetry's aio server interceptor (opentelemetry-instrumentation-grpc 0.66b2) wraps a response stream in an
    async generator that attaches the caller's trace context and detaches it when the generator ends. grpcio
    iterates the generator in the RPC's task; when the client cancels (or the server stops) while the generator
    waits at ``yield``, grpcio cancels that task outside the generator and leaves it unclosed, so Python's
    async-generator finalizer closes it later in a new task, whose ``Context`` is not the one the token was made in:
    ``detach`` fails and ``opentelemetry.context`` logs "Failed to detach context" with a traceback (a CI run:
    kv_indexer's ``Watch`` at mesh stop). Sending with ``context.write`` from a coroutine instead keeps the
    cancellation inside this code, which closes the generator at once, in the same task and Context.
    """
    if handler is None or not handler.response_streaming:
        return handler
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
        return grpc.unary_stream_rpc_method_handler(_written(handler.unary_stream), **kwargs)
    if handler.stream_stream and inspect.isasyncgenfunction(handler.stream_stream):
        return grpc.stream_stream_rpc_method_handler(_written(handler.stream_stream), **kwargs)
    return handler


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The standard chain: OpenTelemetry span per RPC (outermost), then the error table."""
    return [_SkipInfrastructure(aio_server_interceptor()), DomainErrorInterceptor()]
