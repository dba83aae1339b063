"""KVStore gRPC servicer: chunk streams <-> whole values, protobuf <-> the :class:`BlockStore` core.

``Put`` is a client stream: the first message carries ``key`` and ``total_bytes``, every message
a chunk of ``data``; the sizes must add up exactly. ``Get`` streams the value back in chunks of
``get_chunk_bytes``, the first message carrying ``total_bytes`` and ``medium``. Every size or key
problem is ``INVALID_ARGUMENT``; a missing key is ``NOT_FOUND`` (both via the shared interceptor).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2, kv_store_pb2_grpc
from kvmesh.errors import InvalidRequest
from kvmesh.wire import medium_to_proto
from services.kv_store.store import BlockStore

SERVICE_NAME = kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


class KVStoreServicer(kv_store_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, get_chunk_bytes: int) -> None:
        self._store = store
        self._chunk = get_chunk_bytes

    async def Put(
        self, request_iterator: AsyncIterator[kv_store_pb2.PutRequest], context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.PutResponse:
        key: str | None = None
        total = 0
        received = 0
        chunks: list[bytes] = []
        async for message in request_iterator:
            if key is None:
                key, total = message.key, message.total_bytes
                self._store.check_value_size(key, total)
            elif (message.key and message.key != key) or (message.total_bytes and message.total_bytes != total):
                raise InvalidRequest("key and total_bytes belong on the first Put message only")
            received += len(message.data)
            if received > total:
                raise InvalidRequest(f"Put for key {key!r} sent more than total_bytes={total} bytes")
            if message.data:
                chunks.append(message.data)
        if key is None:
            raise InvalidRequest("Put stream closed before its first message")
        if received != total:
            raise InvalidRequest(f"Put for key {key!r} sent {received} bytes, total_bytes={total}")
        outcome = await self._store.put(key, b"".join(chunks))
        return kv_store_pb2.PutResponse(medium=medium_to_proto(outcome.medium), evicted=outcome.evicted)

    async def Get(
        self, request: kv_store_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_store_pb2.GetResponse]:
        stored = await self._store.get(request.key)
        view = memoryview(stored.value)
        medium = medium_to_proto(stored.medium)
        yield kv_store_pb2.GetResponse(total_bytes=len(view), data=bytes(view[: self._chunk]), medium=medium)
        for offset in range(self._chunk, len(view), self._chunk):
            yield kv_store_pb2.GetResponse(data=bytes(view[offset : offset + self._chunk]))

    async def Contains(
        self, request: kv_store_pb2.ContainsRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.ContainsResponse:
        return kv_store_pb2.ContainsResponse(present=await self._store.contains(list(request.keys)))

    async def Delete(
        self, request: kv_store_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.DeleteResponse:
        return kv_store_pb2.DeleteResponse(deleted=await self._store.delete(request.key))

    async def Stats(
        self, request: kv_store_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.StatsResponse:
        return kv_store_pb2.StatsResponse(
            tiers=[
                kv_store_pb2.TierStats(
                    medium=medium_to_proto(t.medium),
                    capacity_bytes=t.capacity_bytes,
                    used_bytes=t.used_bytes,
                    keys=t.keys,
                    hits=t.hits,
                    misses=t.misses,
                    evictions=t.evictions,
                )
                for t in self._store.stats()
            ]
        )
