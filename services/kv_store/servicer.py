"""KVStore gRPC servicer: chunk streams <-> whole values, protobuf <-> the :class:`BlockStore` core.

``Put`` is a client stream: the first message carries ``key`` and ``total_bytes``, every message
a chunk of ``data``; the sizes must add up exactly. ``Get`` streams the value back in chunks of
``get_chunk_bytes``, the first message carrying ``total_bytes`` and ``medium``; ``BatchGet`` does
the same for a list of keys (a prefix of KV blocks), tagging each chunk with the key's index.
Every size or key problem is ``INVALID_ARGUMENT``, the same for a key in every call (an empty or
over-long key is refused by ``Put``, ``Get``, ``Delete``, ``Contains``, ``Lookup`` and ``BatchGet``
alike; a many-key call checks all its keys before it answers anything); a missing key is ``NOT_FOUND``; a failed first
tier is ``UNAVAILABLE`` or ``RESOURCE_EXHAUSTED`` (all via the shared interceptor).

**Copies.** A value is assembled once from its Put chunks: ``parse_put_request`` reads each
message's ``data`` as a view into the received bytes and one ``b"".join`` builds the value
(protobuf's parser would copy each chunk twice: into its arena, then into a ``bytes`` attribute). Get and BatchGet
responses are encoded here (:func:`encode_get_chunk`): the protobuf wire form of a data chunk is a
few header bytes plus the bytes themselves, so one ``join`` over a ``memoryview`` slice of the
stored value builds each message, instead of slicing into a new ``bytes`` and serialising it
again (protobuf's ``bytes`` fields take no ``memoryview``). ``add_to_server`` registers the
methods with a serializer that passes such pre-encoded messages through.

**Flow control.** gRPC's HTTP/2 windows pace a single stream (a Get yields one chunk at a time and
awaits the transport; a Put reads the next chunk only when it has taken the last). Across streams,
the bytes buffered by Puts in flight (these and the ``lm://`` listener's, one
:class:`~services.kv_store.flow.ByteBudget` of ``max_inflight_put_bytes``) are charged chunk by
chunk as they arrive, never as ``total_bytes`` announces them, so a client that announces 1 GiB
and sends nothing holds nothing. A chunk that does not fit waits, first come first served, before
the next message is read (at most one received chunk per waiting stream sits outside the budget);
a wait longer than ``put_budget_wait_s`` ends the Put with ``RESOURCE_EXHAUSTED`` (two large Puts
each holding part of the budget cannot wait on each other for ever). A Put whose client sends no
message for ``put_idle_timeout_s`` ends with ``INVALID_ARGUMENT`` (a stream abandoned mid-value is
a truncated one) and gives back what it held.

**Cancellation.** A call cancelled or past its deadline ends as such for its caller, but the store
operation under it (a Put's cascade of victims down the tiers, a Get's promotion and the victims
it moves down) runs to its end in its own task (:class:`~services.kv_store.flow.Detached`): a move
cut in half would drop a value no slower tier took yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2, kv_store_pb2_grpc
from kvmesh.errors import InvalidRequest, Saturated
from kvmesh.wire import medium_to_proto
from services.kv_store.errors import KeyNotFound
from services.kv_store.flow import ByteBudget, Detached
from services.kv_store.residency import BadBlockEvent, parse_block_event
from services.kv_store.store import BlockStore, validate_keys

SERVICE_NAME = kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
_GET_DATA_FIELD = kv_store_pb2.GetResponse.DESCRIPTOR.fields_by_name["data"].number
_BATCH_DATA_FIELD = kv_store_pb2.BatchGetResponse.DESCRIPTOR.fields_by_name["data"].number
_BATCH_INDEX_FIELD = kv_store_pb2.BatchGetResponse.DESCRIPTOR.fields_by_name["index"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def encode_get_chunk(head: bytes, field: int, chunk: memoryview) -> bytes:
    """``head`` (already-encoded leading fields) + field ``field`` = ``chunk`` in protobuf wire form, one copy."""
    return b"".join((head, _varint(field << 3 | 2), _varint(len(chunk)), chunk))


_PUT_DATA_FIELD = kv_store_pb2.PutRequest.DESCRIPTOR.fields_by_name["data"].number


def encode_put_requests(key: str, value: bytes, chunk_bytes: int, block_stored_event: bytes = b"") -> list[bytes]:
    """The wire form of a whole Put stream, one copy per chunk (a client's request serializer passes them through).

    ``PutRequest(key, total_bytes, block_stored_event)`` heads the first message, every message
    carries ``data`` = the next ``chunk_bytes`` of ``value`` (a ``memoryview`` slice: protobuf's
    own client path copies each chunk twice, into a ``bytes`` field and then into the serialized
    message, and costs the client ~3x the CPU, ``bench/kv_store_bench.py``).
    """
    view = memoryview(value)
    head = kv_store_pb2.PutRequest(
        key=key, total_bytes=len(value), block_stored_event=block_stored_event
    ).SerializeToString()
    out = [encode_get_chunk(head, _PUT_DATA_FIELD, view[:chunk_bytes])]
    for offset in range(chunk_bytes, len(view), chunk_bytes):
        out.append(encode_get_chunk(b"", _PUT_DATA_FIELD, view[offset : offset + chunk_bytes]))
    return out


class PutChunk:
    """A parsed ``PutRequest`` whose ``data`` is a view into the received message (no copy)."""

    __slots__ = ("block_stored_event", "data", "key", "total_bytes")

    def __init__(self, key: str, total_bytes: int, data: memoryview, block_stored_event: bytes = b"") -> None:
        self.key = key
        self.total_bytes = total_bytes
        self.data = data
        self.block_stored_event = block_stored_event


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def parse_put_request(raw: bytes) -> PutChunk:
    """``PutRequest`` from its wire form, ``data`` as a ``memoryview`` of ``raw`` (protobuf would copy it twice).

    Field numbers and types are the proto's (1 key string, 2 total_bytes uint64, 3 data bytes,
    4 block_stored_event bytes);
    unknown fields are skipped as protobuf does. Raises ValueError on malformed input, which the
    shared interceptor (:mod:`kvmesh.interceptors`) reports as ``INVALID_ARGUMENT``.
    """
    buf = memoryview(raw)
    key, total, data, event = "", 0, memoryview(b""), b""
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 2:
                total = value
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated length-delimited field")
            if field == 1:
                key = bytes(buf[pos : pos + size]).decode()
            elif field == 3:
                data = buf[pos : pos + size]
            elif field == 4:
                event = bytes(buf[pos : pos + size])
            pos += size
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != len(buf):
        raise ValueError("truncated fixed-width field")
    return PutChunk(key, total, data, event)


class KVStoreServicer(kv_store_pb2_grpc.KVStoreServicer):
    def __init__(
        self,
        store: BlockStore,
        get_chunk_bytes: int,
        max_inflight_put_bytes: int = 1 << 30,
        block_size_tokens: int | None = None,
        *,
        put_budget: ByteBudget | None = None,
        put_budget_wait_s: float | None = None,
        put_idle_timeout_s: float | None = None,
    ) -> None:
        self._store = store
        self._block_size = block_size_tokens
        self._chunk = get_chunk_bytes
        self.put_budget = put_budget or ByteBudget(max_inflight_put_bytes)
        """Bytes of Puts in flight (shared with the ``lm://`` listener), charged as chunks arrive."""
        self._budget_wait = put_budget_wait_s
        self._idle_timeout = put_idle_timeout_s
        self.detached = Detached("grpc")
        """Store operations that finish after a cancelled call (a deadline, a client gone)."""

    async def _next_put(self, stream: AsyncIterator[PutChunk], key: str) -> PutChunk | None:
        """The next Put message, None at the end; InvalidRequest when the client sent nothing for the idle timeout."""
        try:
            async with asyncio.timeout(self._idle_timeout):
                return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise InvalidRequest(
                f"Put for key {key!r} sent nothing for {self._idle_timeout} s (put_idle_timeout_s): stream abandoned"
            ) from None

    async def Put(
        self, request_iterator: AsyncIterator[PutChunk], context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.PutResponse:
        stream = request_iterator.__aiter__()
        first = await self._next_put(stream, "")
        if first is None:
            raise InvalidRequest("Put stream closed before its first message")
        key, total = first.key, first.total_bytes
        self._store.check_value_size(key, total)
        block = None
        if first.block_stored_event:
            try:
                block = parse_block_event(first.block_stored_event, self._block_size)
            except BadBlockEvent as exc:
                raise InvalidRequest(f"Put for key {key!r}: {exc}") from None
        budget, held = self.put_budget, 0
        try:
            received = 0
            chunks: list[memoryview] = []
            message: PutChunk | None = first
            while message is not None:
                if message is not first and (
                    (message.key and message.key != key)
                    or (message.total_bytes and message.total_bytes != total)
                    or message.block_stored_event
                ):
                    raise InvalidRequest("key, total_bytes and block_stored_event belong on the first Put message only")
                size = len(message.data)
                received += size
                if received > total:
                    raise InvalidRequest(f"Put for key {key!r} sent more than total_bytes={total} bytes")
                if size:
                    charge = min(size, budget.limit - held)  # bytes as they arrive, never what total_bytes announces
                    if charge and not budget.try_acquire(charge):
                        try:
                            await budget.acquire(charge, self._budget_wait)
                        except TimeoutError:
                            raise Saturated(
                                f"Put for key {key!r}: no room for its bytes in max_inflight_put_bytes="
                                f"{budget.limit} within {self._budget_wait} s"
                            ) from None
                    held += charge
                    chunks.append(message.data)
                message = await self._next_put(stream, key)
            if received != total:
                raise InvalidRequest(f"Put for key {key!r} sent {received} bytes, total_bytes={total} (truncated)")
            value = b"".join(chunks)  # the one copy: views into the received messages -> one value
            del chunks
            outcome = await self.detached.run(self._store.put(key, value, block))  # a deadline never cuts a move short
        finally:
            budget.release_now(held)
        return kv_store_pb2.PutResponse(medium=medium_to_proto(outcome.medium), evicted=outcome.evicted,
                                        lost=outcome.lost)

    def _chunks(self, value: bytes, first_head: bytes, field: int, later_head: bytes) -> list[bytes]:
        view = memoryview(value)
        out = [encode_get_chunk(first_head, field, view[: self._chunk])]
        for offset in range(self._chunk, len(view), self._chunk):
            out.append(encode_get_chunk(later_head, field, view[offset : offset + self._chunk]))
        return out

    async def Get(self, request: kv_store_pb2.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        stored = await self.detached.run(self._store.get(request.key))  # a promotion's moves finish
        head = kv_store_pb2.GetResponse(total_bytes=len(stored.value), medium=medium_to_proto(stored.medium))
        view = memoryview(stored.value)
        yield encode_get_chunk(head.SerializeToString(), _GET_DATA_FIELD, view[: self._chunk])
        for offset in range(self._chunk, len(view), self._chunk):
            yield encode_get_chunk(b"", _GET_DATA_FIELD, view[offset : offset + self._chunk])

    async def BatchGet(
        self, request: kv_store_pb2.BatchGetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        validate_keys(request.keys, "BatchGet")  # every key before the first byte: the call fails whole or not at all
        for index, key in enumerate(request.keys):
            try:
                stored = await self.detached.run(self._store.get(key))
            except KeyNotFound:
                yield kv_store_pb2.BatchGetResponse(index=index, found=False)
                if request.stop_at_first_miss:
                    return
                continue
            head = kv_store_pb2.BatchGetResponse(
                index=index, found=True, total_bytes=len(stored.value), medium=medium_to_proto(stored.medium)
            ).SerializeToString()
            later = _varint(_BATCH_INDEX_FIELD << 3) + _varint(index) if index else b""
            view = memoryview(stored.value)
            yield encode_get_chunk(head, _BATCH_DATA_FIELD, view[: self._chunk])
            for offset in range(self._chunk, len(view), self._chunk):
                yield encode_get_chunk(later, _BATCH_DATA_FIELD, view[offset : offset + self._chunk])

    async def Contains(
        self, request: kv_store_pb2.ContainsRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.ContainsResponse:
        return kv_store_pb2.ContainsResponse(present=await self._store.contains(list(request.keys)))

    async def Lookup(
        self, request: kv_store_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.LookupResponse:
        media = await self._store.media(list(request.keys))
        prefix = next((i for i, m in enumerate(media) if m is None), len(media))
        return kv_store_pb2.LookupResponse(
            present=[m is not None for m in media],
            medium=[medium_to_proto(m) if m is not None else common_pb2.MEDIUM_UNSPECIFIED for m in media],
            prefix_hits=prefix,
        )

    async def Delete(
        self, request: kv_store_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kv_store_pb2.DeleteResponse:
        # a deadline never leaves a delete half done (a key swept from some tiers only)
        return kv_store_pb2.DeleteResponse(deleted=await self.detached.run(self._store.delete(request.key)))

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
                    name=t.name,
                    corrupted=t.corrupted,
                    errors=t.errors,
                )
                for t in self._store.stats()
            ]
        )


def _pass_encoded(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serializer(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return serializer


def add_to_server(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """Register the KVStore service; Get and BatchGet accept pre-encoded response messages."""
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(
            servicer.Put,
            request_deserializer=parse_put_request,
            response_serializer=kv_store_pb2.PutResponse.SerializeToString,
        ),
        "Get": grpc.unary_stream_rpc_method_handler(
            servicer.Get,
            request_deserializer=kv_store_pb2.GetRequest.FromString,
            response_serializer=_pass_encoded(kv_store_pb2.GetResponse.SerializeToString),
        ),
        "BatchGet": grpc.unary_stream_rpc_method_handler(
            servicer.BatchGet,
            request_deserializer=kv_store_pb2.BatchGetRequest.FromString,
            response_serializer=_pass_encoded(kv_store_pb2.BatchGetResponse.SerializeToString),
        ),
    }
    for name, request_type, response_type in (
        ("Contains", kv_store_pb2.ContainsRequest, kv_store_pb2.ContainsResponse),
        ("Lookup", kv_store_pb2.LookupRequest, kv_store_pb2.LookupResponse),
        ("Delete", kv_store_pb2.DeleteRequest, kv_store_pb2.DeleteResponse),
        ("Stats", kv_store_pb2.StatsRequest, kv_store_pb2.StatsResponse),
    ):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
