"""The gRPC front door at shutdown: calls still running when the router's drain ends them get
``UNAVAILABLE`` "the server is shutting down; retry the request" (a stream after the chunks it already
sent), as the HTTP front door's 503 / in-stream error event; not the gRPC server's own cut at the end
of its grace (``UNAVAILABLE`` "Cancelling all calls").

A real in-process grpc.aio server with the shared interceptors serves ``InferenceServicer`` over a
:class:`RequestFlow` whose engine is an ``httpx.MockTransport`` answer that stalls mid-stream. The
real router process under SIGTERM is ``tests/integration/test_router_hung_engine.py``
(``test_sigterm_grpc_*``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import httpx
import pytest

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.interceptors import server_interceptors
from services.router.config import RouterConfig
from services.router.request_flow import SHUTDOWN_MESSAGE, RequestFlow
from services.router.servicer import InferenceServicer
from tests.support import wait_until_async
from tests.unit.router.fakes import CATALOG, MODEL, SSE, A, FakeAdmission, FakePicker, outcome_count

CONFIG = RouterConfig(etcd_endpoints=[], engine_first_byte_timeout_seconds=300, engine_stream_idle_timeout_seconds=300)
PROMPT = router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=2)


def _stalling(go: asyncio.Event) -> httpx.MockTransport:
    """The engine: the first SSE event at once, the rest once ``go`` is set."""
    pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]

    def answer(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                if i == 1:
                    await go.wait()
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return httpx.MockTransport(answer)


@dataclass
class Door:
    stub: router_pb2_grpc.InferenceStub
    servicer: InferenceServicer
    flow: RequestFlow
    go: asyncio.Event


@asynccontextmanager
async def _serve(admission: FakeAdmission) -> AsyncIterator[Door]:
    go = asyncio.Event()
    flow = RequestFlow(CONFIG, lambda: CATALOG, admission, FakePicker((A,)), httpx.AsyncClient(transport=_stalling(go)))
    servicer = InferenceServicer(CONFIG, flow, lambda: CATALOG)
    server = grpc.aio.server(interceptors=server_interceptors())
    router_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Door(router_pb2_grpc.InferenceStub(channel), servicer, flow, go)
    finally:
        go.set()
        await server.stop(0)
        await flow.aclose()


async def _in_flight(door: Door, count: int) -> None:
    await wait_until_async(lambda: door.servicer.in_flight >= count, 5, f"{count} call(s) in flight", interval=0.01)


async def test_a_stream_on_its_engine_ends_unavailable_after_its_chunks() -> None:
    """The drain's end: ``flow.end_all()`` ends the stream waiting on its engine, then ``drain()`` finds
    nothing else to end; the client got the first chunk, then UNAVAILABLE with the shutdown message."""
    async with _serve(FakeAdmission()) as door:
        call = door.stub.CompleteStream(PROMPT, timeout=10)
        chunks = [await call.read()]
        assert chunks[0].text == "he"
        await _in_flight(door, 1)
        assert not await door.servicer.wait_idle(0.05)
        assert door.flow.end_all() == 1
        assert door.servicer.drain() == 0  # already being ended by end_all: not cancelled twice
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and info.value.details() == SHUTDOWN_MESSAGE
        assert len(chunks) == 1
        assert await door.servicer.wait_idle(5)


@pytest.mark.parametrize("stream", [False, True], ids=["Complete", "CompleteStream"])
async def test_a_call_still_in_admission_ends_unavailable(stream: bool) -> None:
    """Not bound to an engine yet (queued in flow_control): ``drain()`` cancels it where it waits and it
    ends UNAVAILABLE with the shutdown message (HTTP: the 503 with the same words), counted unavailable
    (the router ended it, not its client: not ``cancelled``)."""
    async with _serve(FakeAdmission(delay=60)) as door:
        cancelled, unavailable = outcome_count("cancelled"), outcome_count("unavailable")
        if stream:
            call = door.stub.CompleteStream(PROMPT, timeout=10)
            pending = asyncio.ensure_future(call.read())
        else:
            pending = asyncio.ensure_future(door.stub.Complete(PROMPT, timeout=10))
        await _in_flight(door, 1)
        assert door.flow.end_all() == 0  # nothing waits on an engine
        assert door.servicer.drain() == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pending
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and info.value.details() == SHUTDOWN_MESSAGE
        assert await door.servicer.wait_idle(5) and door.servicer.in_flight == 0
        assert (outcome_count("cancelled"), outcome_count("unavailable")) == (cancelled, unavailable + 1)


async def test_a_call_that_finishes_within_the_grace_is_untouched() -> None:
    async with _serve(FakeAdmission()) as door:
        call = door.stub.CompleteStream(PROMPT, timeout=10)
        await _in_flight(door, 1)
        waiting = asyncio.ensure_future(door.servicer.wait_idle(5))
        door.go.set()
        chunks = [chunk async for chunk in call]
        assert [c.text for c in chunks] == ["he", "llo"] and await call.code() == grpc.StatusCode.OK
        assert await waiting
        assert door.servicer.drain() == 0
