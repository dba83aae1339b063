"""The shared interceptor is the one place failures become statuses: undecodable bytes, domain
errors, dependency failures and bugs, over a real in-process grpc.aio server."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.channels import ERROR_CLASS_TRAILER, answered
from kvmesh.interceptors import server_interceptors


class Servicer(flow_control_pb2_grpc.FlowControlServicer):
    """``Stats`` raises what ``self.raise_`` holds; ``Admit`` reads with ``context.read()``."""

    def __init__(self) -> None:
        self.raise_: BaseException | None = None

    async def Stats(self, request: flow_control_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> flow_control_pb2.StatsResponse:
        if self.raise_ is not None:
            raise self.raise_
        return flow_control_pb2.StatsResponse()

    async def Admit(self, request_iterator: AsyncIterator[flow_control_pb2.AdmitRequest], context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def,override]
        message = await context.read()
        yield flow_control_pb2.AdmitResponse(reason=message.enqueue.request_id)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Servicer]]:
    servicer = Servicer()
    srv = grpc.aio.server(interceptors=server_interceptors())
    flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", servicer
    await srv.stop(0)


@pytest.mark.parametrize("method", ["/kvmesh.flow_control.v1.FlowControl/Stats", "/kvmesh.flow_control.v1.FlowControl/Admit"])
async def test_undecodable_bytes_are_invalid_argument_without_traceback(server, method: str, caplog) -> None:  # type: ignore[no-untyped-def]
    address, _ = server
    async with grpc.aio.insecure_channel(address) as channel:
        with caplog.at_level(logging.WARNING), pytest.raises(grpc.aio.AioRpcError) as info:
            if method.endswith("Admit"):  # bidi, read by the servicer with context.read()
                call = channel.stream_stream(method)()
                await call.write(b"\x0f\xff\xff")
                await call.read()
            else:
                await channel.unary_unary(method)(b"\x0f\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "do not decode" in (info.value.details() or "")
    assert not any(r.exc_info for r in caplog.records)
    assert any("undecodable request" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("exc", "code", "is_answer"), [
    (errors.InvalidRequest("bad"), grpc.StatusCode.INVALID_ARGUMENT, True),
    (errors.NoEndpointsAvailable("none"), grpc.StatusCode.UNAVAILABLE, True),
    (httpx.ConnectError("refused"), grpc.StatusCode.UNAVAILABLE, True),  # a dependency failed: named, 503
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL, False),
], ids=["domain", "unavailable", "dependency", "bug"])
async def test_failures_map_through_one_table(server, exc: BaseException, code: grpc.StatusCode, is_answer: bool) -> None:
    address, servicer = server
    servicer.raise_ = exc
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest())
    assert info.value.code() == code
    assert answered(info.value) is is_answer
    if is_answer:
        assert dict(info.value.trailing_metadata() or ())[ERROR_CLASS_TRAILER]
