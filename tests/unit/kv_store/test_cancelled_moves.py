"""A call that is cancelled or runs past its deadline never drops a value moving down the tiers:
the caller gets its status (``DEADLINE_EXCEEDED``, ``CANCELLED``), the store finishes the move in
its own task. Over a real gRPC server (the shared interceptors) and a real ``lm://`` listener; the
slower tier is a CPU tier whose puts take 0.4 s (the stand-in for NVMe, a shared FS or Mooncake)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh.interceptors import server_interceptors
from services.kv_store.lmcache_protocol import LmCacheKey, LmCommand, LmRequest, ValueMeta, encode_request
from services.kv_store.lmcache_server import LmcacheServer
from services.kv_store.servicer import KVStoreServicer, add_to_server
from services.kv_store.store import BlockStore
from services.kv_store.tiers.base import PutResult
from services.kv_store.tiers.cpu import CpuTier

MIB = 1 << 20
SLOW_PUT_S = 0.4


class SlowTier(CpuTier):
    """A slower tier: every put takes :data:`SLOW_PUT_S`."""

    name = "slow"

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        await asyncio.sleep(SLOW_PUT_S)
        return await super().put(key, value, keep_victims=keep_victims, meta=meta)


def value_of(key: str) -> bytes:
    return key.encode()[:1] * MIB


async def settled(store: BlockStore, keys: list[str]) -> None:
    """Wait for the moves in flight, then every key must be reachable with its bytes and none lost."""
    for _ in range(int(4 * SLOW_PUT_S / 0.05)):
        if all(await store.contains(keys)):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(SLOW_PUT_S)  # and whatever was still on its way
    assert await store.contains(keys) == [True] * len(keys)
    for key in keys:
        assert (await store.get(key)).value == value_of(key)
    assert store.metrics.lost == {}


@pytest.fixture
async def grpc_store() -> AsyncIterator[tuple[BlockStore, pb_grpc.KVStoreStub, KVStoreServicer]]:
    store = BlockStore([CpuTier(3 * MIB), SlowTier(100 * MIB)])
    servicer = KVStoreServicer(store, 2 * MIB)
    server = grpc.aio.server(interceptors=server_interceptors())
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield store, pb_grpc.KVStoreStub(channel), servicer
    finally:
        await channel.close()
        await servicer.detached.drain(5)
        await server.stop(None)


async def put(stub: pb_grpc.KVStoreStub, key: str, timeout: float | None = None) -> None:
    async def one() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(key=key, total_bytes=MIB, data=value_of(key))

    await stub.Put(one(), timeout=timeout)


async def test_put_past_its_deadline_still_moves_its_victim_down(grpc_store) -> None:  # type: ignore[no-untyped-def]
    store, stub, _ = grpc_store
    for key in "abc":
        await put(stub, key)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(stub, "d", timeout=0.15)  # evicts "a"; its move to the slow tier outlives the deadline
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await settled(store, list("abcd"))


async def test_cancelled_put_still_moves_its_victim_down(grpc_store) -> None:  # type: ignore[no-untyped-def]
    store, stub, _ = grpc_store
    for key in "abc":
        await put(stub, key)

    async def one() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(key="d", total_bytes=MIB, data=value_of("d"))

    call = stub.Put(one())
    await asyncio.sleep(0.15)  # the cascade is under way
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await settled(store, list("abcd"))


async def test_get_past_its_deadline_still_finishes_its_promotion(grpc_store) -> None:  # type: ignore[no-untyped-def]
    store, stub, _ = grpc_store
    for key in "abcd":
        await store.put(key, value_of(key))  # "a" demoted to the slow tier
    await asyncio.sleep(0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Get(pb.GetRequest(key="a"), timeout=0.15):  # promoting "a" evicts "b" (slow move)
            pass
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await settled(store, list("abcd"))


async def test_batch_get_past_its_deadline_still_finishes_its_promotions(grpc_store) -> None:  # type: ignore[no-untyped-def]
    store, stub, _ = grpc_store
    for key in "abcde":
        await store.put(key, value_of(key))  # "a", "b" demoted
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.BatchGet(pb.BatchGetRequest(keys=["a", "b"]), timeout=0.15):
            pass
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await settled(store, list("abcde"))


async def test_delete_past_its_deadline_still_removes_the_key_everywhere(grpc_store) -> None:  # type: ignore[no-untyped-def]
    """A Delete whose key is moving down waits for the move; its deadline passes meanwhile: the
    delete still runs to its end (the key is in no tier once the move landed), the others stay."""
    store, stub, _ = grpc_store
    for key in "abc":
        await put(stub, key)
    moving = asyncio.create_task(store.put("d", value_of("d")))  # evicts "a": its move takes SLOW_PUT_S
    await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Delete(pb.DeleteRequest(key="a"), timeout=0.1)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await moving
    for _ in range(int(4 * SLOW_PUT_S / 0.05)):
        if not (await store.contains(["a"]))[0]:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(SLOW_PUT_S)
    assert await store.contains(list("abcd")) == [False, True, True, True]
    assert [tier.name for tier in store.tiers if "a" in tier.held_keys()] == []


async def test_lm_requests_cancelled_mid_move_still_land() -> None:
    """The lm:// listener's request tasks are cancelled at shutdown (or by the loop): a PUT whose
    victim is moving down, and a GET whose promotion is, still land."""
    store = BlockStore([CpuTier(3 * MIB + 200), SlowTier(100 * MIB)])
    server = LmcacheServer(store)
    port = await server.start("127.0.0.1", 0)
    keys = [LmCacheKey("m", 1, 0, i, "half") for i in range(5)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for key in keys[:3]:
            writer.write(encode_request(LmRequest(LmCommand.PUT, key, ValueMeta.binary(MIB))) + bytes(MIB))
        writer.write(encode_request(LmRequest(LmCommand.HEALTH, keys[0], ValueMeta(0))))
        await asyncio.wait_for(reader.readexactly(36), 5)
        writer.close()
        for command, key in ((LmCommand.PUT, keys[3]), (LmCommand.GET, keys[0])):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = bytes(MIB) if command is LmCommand.PUT else b""
            meta = ValueMeta.binary(len(payload)) if payload else ValueMeta(0)
            writer.write(encode_request(LmRequest(command, key, meta)) + payload)
            await asyncio.sleep(0.15)  # its store operation is moving a victim to the slow tier
            (connection,) = server.connections
            task = connection._task
            assert task is not None
            task.cancel()  # what asyncio.run's shutdown does to the tasks still running
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the client sees its connection go
            assert task.cancelled()
            writer.close()
            assert server.detached.pending == 1  # its move is still under way
            assert await server.detached.drain(5) == 0
    finally:
        await server.stop()
    store_keys = [key.store_key() for key in keys[:4]]
    assert await store.contains(store_keys) == [True] * 4
    assert store.metrics.lost == {}
