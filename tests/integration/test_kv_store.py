"""kv_store as a process: chunked put/get of large values, LRU under the budget, errors, reflection."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


async def chunks(key: str, value: bytes, chunk: int = MIB, total: int | None = None) -> AsyncIterator[pb.PutRequest]:
    total = len(value) if total is None else total
    yield pb.PutRequest(key=key, total_bytes=total, data=value[:chunk])
    for offset in range(chunk, len(value), chunk):
        yield pb.PutRequest(data=value[offset : offset + chunk])


async def get(stub: pb_grpc.KVStoreStub, key: str) -> tuple[bytes, list[pb.GetResponse]]:
    replies = [reply async for reply in stub.Get(pb.GetRequest(key=key))]
    return b"".join(r.data for r in replies), replies


async def test_large_values_lru_and_not_found(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(24 * MIB))
    a, b, c = (os.urandom(10 * MIB) for _ in range(3))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        put = await stub.Put(chunks("a", a))
        assert (put.medium, put.evicted) == (common_pb2.MEDIUM_CPU, 0)
        value, replies = await get(stub, "a")
        assert value == a
        assert len(replies) == 10  # 1 MiB chunks
        assert (replies[0].total_bytes, replies[0].medium) == (10 * MIB, common_pb2.MEDIUM_CPU)

        assert (await stub.Put(chunks("b", b, chunk=3 * MIB))).evicted == 0
        await get(stub, "a")  # a is now more recently used than b
        assert (await stub.Put(chunks("c", c))).evicted == 1
        assert list((await stub.Contains(pb.ContainsRequest(keys=["a", "b", "c"]))).present) == [True, False, True]

        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await get(stub, "b")
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND

        assert (await stub.Delete(pb.DeleteRequest(key="a"))).deleted is True
        assert (await stub.Delete(pb.DeleteRequest(key="a"))).deleted is False

        (tier,) = (await stub.Stats(pb.StatsRequest())).tiers
        assert (tier.medium, tier.capacity_bytes, tier.used_bytes, tier.keys) == (
            common_pb2.MEDIUM_CPU, 24 * MIB, 10 * MIB, 1,
        )
        assert (tier.hits, tier.misses, tier.evictions) == (2, 1, 1)


async def test_bad_puts_are_invalid_argument(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(4 * MIB))

    async def no_message() -> AsyncIterator[pb.PutRequest]:
        return
        yield

    bad_puts = {
        "empty-key": chunks("", b"x"),
        "too-few-bytes": chunks("k", b"x" * 10, total=11),
        "too-many-bytes": chunks("k", b"x" * 10, total=9),
        "larger-than-capacity": chunks("k", b"x" * 10, total=5 * MIB),
        "no-message": no_message(),
    }
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for name, stream in bad_puts.items():
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await stub.Put(stream)
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        # The service keeps serving and stored nothing.
        await stub.Put(chunks("ok", b"fine"))
        assert (await get(stub, "ok"))[0] == b"fine"
        assert (await stub.Stats(pb.StatsRequest())).tiers[0].keys == 1


def test_reflection_lists_methods(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(MIB))
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "kvmesh.kv_store.v1.KVStore" in database.get_services()
        service = DescriptorPool(database).FindServiceByName("kvmesh.kv_store.v1.KVStore")
        assert {m.name for m in service.methods} == {"Put", "Get", "Contains", "Delete", "Stats"}
