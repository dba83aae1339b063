"""kv_store's hand-written wire codec agrees with protobuf's (PutRequest parse, Get/BatchGet chunk encode)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from services.kv_store.servicer import ByteBudget, encode_get_chunk, parse_put_request


@given(key=st.text(max_size=50), total=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000))
def test_put_request_parse_matches_protobuf(key: str, total: int, data: bytes) -> None:
    raw = pb.PutRequest(key=key, total_bytes=total, data=data).SerializeToString()
    chunk = parse_put_request(raw)
    assert (chunk.key, chunk.total_bytes, bytes(chunk.data)) == (key, total, data)


def test_unknown_fields_are_skipped_and_garbage_is_refused() -> None:
    # field 9 varint, field 10 fixed64, field 11 fixed32, field 12 bytes, then data
    raw = bytes([9 << 3 | 0, 5, 10 << 3 | 1, *[0] * 8, 11 << 3 | 5, *[0] * 4, 12 << 3 | 2, 1, 7, 3 << 3 | 2, 2]) + b"ok"
    assert bytes(parse_put_request(raw).data) == b"ok"
    for bad in (bytes([3 << 3 | 2, 5]) + b"ab", bytes([0x80]), bytes([3 << 3 | 3]), bytes([10 << 3 | 1, 0])):
        with pytest.raises(ValueError):
            parse_put_request(bad)


@given(data=st.binary(max_size=5000), total=st.integers(0, 10**9), index=st.integers(0, 10**6))
def test_encoded_chunks_parse_as_protobuf(data: bytes, total: int, index: int) -> None:
    head = pb.GetResponse(total_bytes=total, medium=2).SerializeToString()
    assert pb.GetResponse.FromString(encode_get_chunk(head, 2, memoryview(data))) == pb.GetResponse(
        total_bytes=total, medium=2, data=data
    )
    batch_head = pb.BatchGetResponse(index=index, found=True).SerializeToString()
    decoded = pb.BatchGetResponse.FromString(encode_get_chunk(batch_head, 5, memoryview(data)))
    assert (decoded.index, decoded.found, decoded.data) == (index, True, data)


async def test_byte_budget_makes_a_put_wait_until_bytes_are_released() -> None:
    budget = ByteBudget(100)
    await budget.acquire(80)
    waiter = asyncio.ensure_future(budget.acquire(30))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await budget.release(80)
    await asyncio.wait_for(waiter, 1)
    assert budget.in_use == 30
    big = asyncio.ensure_future(budget.acquire(500))  # larger than the budget: waits for an idle server
    await asyncio.sleep(0.01)
    assert not big.done()
    await budget.release(30)
    await asyncio.wait_for(big, 1)
    assert budget.in_use == 100
    await budget.release(500)
    assert budget.in_use == 0


def test_pre_encoded_put_requests_parse_as_protobuf_messages() -> None:
    from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2
    from services.kv_store.servicer import encode_put_requests, parse_put_request

    value = bytes(range(256)) * 40
    raw = encode_put_requests("k", value, 4096, block_stored_event=b"\x01ev")
    assert len(raw) == 3
    first = kv_store_pb2.PutRequest.FromString(raw[0])
    assert (first.key, first.total_bytes, first.block_stored_event, first.data) == ("k", len(value), b"\x01ev", value[:4096])
    assert b"".join(kv_store_pb2.PutRequest.FromString(r).data for r in raw) == value
    assert not kv_store_pb2.PutRequest.FromString(raw[1]).key
    assert b"".join(bytes(parse_put_request(r).data) for r in raw) == value
