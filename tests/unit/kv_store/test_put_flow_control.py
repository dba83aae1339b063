"""The put byte budget (``max_inflight_put_bytes``) over a real gRPC server: charged chunk by chunk as
bytes arrive (a stalled client holds only what it sent), FIFO waiters, a bounded wait
(``RESOURCE_EXHAUSTED``), an idle-stream timeout (``INVALID_ARGUMENT``, its bytes given back)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh.interceptors import server_interceptors
from services.kv_store.flow import ByteBudget
from services.kv_store.servicer import KVStoreServicer, add_to_server
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier

MIB = 1 << 20


async def until(check: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_budget_waiters_are_served_first_come_first_served() -> None:
    budget = ByteBudget(100)
    assert budget.try_acquire(90)
    large = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.acquire(5))  # would fit now, but queues behind the large one
    await asyncio.sleep(0.01)
    assert not large.done() and not small.done()
    assert not budget.try_acquire(1)  # nobody jumps the queue
    budget.release_now(90)
    await asyncio.wait_for(asyncio.gather(large, small), 1)
    assert budget.in_use == 55
    late = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await budget.acquire(10, timeout=0.05)  # queued behind "late"; gives up, nothing taken
    assert budget.in_use == 55 and budget.waiting == 1
    budget.release_now(55)
    await asyncio.wait_for(late, 1)
    assert budget.in_use == 50 and budget.waiting == 0


class Server:
    def __init__(self, budget_bytes: int, **options: float) -> None:
        self.store = BlockStore([CpuTier(2 << 30)])  # a dict with a byte budget: nothing is allocated up front
        self.servicer = KVStoreServicer(self.store, 2 * MIB, budget_bytes, **options)  # type: ignore[arg-type]
        self.server = grpc.aio.server(interceptors=server_interceptors())
        add_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def __aenter__(self) -> pb_grpc.KVStoreStub:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        return pb_grpc.KVStoreStub(self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)


def stalled(key: str, announced: int, sent: int, release: asyncio.Event) -> AsyncIterator[pb.PutRequest]:
    async def messages() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(key=key, total_bytes=announced, data=b"s" * sent)
        await release.wait()

    return messages()


async def whole(key: str, size: int) -> AsyncIterator[pb.PutRequest]:
    chunk = 2 * MIB
    yield pb.PutRequest(key=key, total_bytes=size, data=b"w" * min(size, chunk))
    for offset in range(chunk, size, chunk):
        yield pb.PutRequest(data=b"w" * min(size - offset, chunk))


async def test_a_stalled_put_announcing_1_gib_does_not_block_other_puts() -> None:
    server = Server(64 * MIB)
    async with server as stub:
        release = asyncio.Event()
        call = stub.Put(stalled("big", 1 << 30, MIB, release))
        await until(lambda: server.servicer.put_budget.in_use == MIB)  # what it sent, not what it announced
        response = await stub.Put(whole("small", 10), timeout=5)
        assert response.evicted == 0
        for i in range(8):  # and values up to the budget's size, one after another
            await stub.Put(whole(f"v{i}", 8 * MIB), timeout=5)
        assert server.servicer.put_budget.in_use == MIB
        call.cancel()
        await until(lambda: server.servicer.put_budget.in_use == 0)
        release.set()


async def test_a_put_that_stops_sending_ends_after_the_idle_timeout_and_frees_its_bytes() -> None:
    server = Server(64 * MIB, put_idle_timeout_s=0.3)
    async with server as stub:
        release = asyncio.Event()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(stalled("idle", 4 * MIB, MIB, release), timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "put_idle_timeout_s" in (err.value.details() or "")
        assert 0.25 < time.monotonic() - started < 5
        assert server.servicer.put_budget.in_use == 0
        assert await server.store.contains(["idle"]) == [False]
        await stub.Put(whole("after", 1000), timeout=5)  # the service carries on
        release.set()


async def test_a_put_that_waits_too_long_for_the_budget_is_resource_exhausted() -> None:
    server = Server(2 * MIB, put_budget_wait_s=0.3)
    async with server as stub:
        release = asyncio.Event()
        holder = stub.Put(stalled("holder", 4 * MIB, 2 * MIB, release))  # holds the whole budget
        await until(lambda: server.servicer.put_budget.in_use == 2 * MIB)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(whole("late", MIB), timeout=10)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.servicer.put_budget.in_use == 2 * MIB and server.servicer.put_budget.waiting == 0
        holder.cancel()
        await until(lambda: server.servicer.put_budget.in_use == 0)
        await stub.Put(whole("late", MIB), timeout=5)
        assert await server.store.contains(["late", "holder"]) == [True, False]
        release.set()
