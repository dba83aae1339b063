"""Server interceptors shared by every service: request ids, domain error -> status, tracing.

The error mapping is the table in :mod:`kvmesh.errors`; servicers raise domain errors and
never call ``context.abort`` for them. Unknown exceptions become ``INTERNAL`` with a generic
message while the traceback is logged.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry.instrumentation.grpc import aio_server_interceptor

from kvmesh.errors import INTERNAL, KvmeshError, mapping_for

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    """The request id of the RPC being handled ("" outside one)."""
    return request_id_var.get()


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    row = mapping_for(exc)
    if row is INTERNAL or not isinstance(exc, KvmeshError):
        logger.exception("unhandled error method=%s request_id=%s", method, request_id_var.get())
        await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    await context.abort(grpc.StatusCode[row.grpc_status], str(exc))


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
                    return await inner(request_or_iterator, context)
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
                    async for item in inner(request_or_iterator, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort(context, method, exc)

            return behaviour

        kwargs = {
            "request_deserializer": handler.request_deserializer,
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
    """Applies ``inner`` except to health and reflection RPCs.

    OpenTelemetry's aio interceptor assumes streaming handlers are async generators, while
    grpcio's health ``Watch`` streams with ``context.write``; infrastructure RPCs need no spans.
    """

    _SKIP = ("/grpc.health.", "/grpc.reflection.")

    def __init__(self, inner: grpc.aio.ServerInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(self._SKIP):
            return await continuation(handler_call_details)
        return await self._inner.intercept_service(continuation, handler_call_details)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The standard chain: OpenTelemetry span per RPC (outermost), then the error table."""
    return [_SkipInfrastructure(aio_server_interceptor()), DomainErrorInterceptor()]
