"""The ``lm://`` adapter in process over loopback TCP: framing across reads, pipelining, both protocols'
view of one store, bad frames closing only their connection, metrics. Frames follow lmcache 0.5.6
(the real client is exercised in tests/integration/test_kv_store_lmcache.py)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from services.kv_store.lmcache_protocol import (
    REPLY_BYTES,
    REQUEST,
    LmCacheKey,
    LmCommand,
    LmRequest,
    LmReturnCode,
    MemoryFormat,
    ValueMeta,
    decode_list_payload,
    decode_reply,
    encode_envelope,
    encode_request,
)
from services.kv_store.lmcache_server import LmcacheServer, register_lmcache_metrics
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier

KEY = LmCacheKey("tiny", 1, 0, 0xBEEF, "bfloat16")


def request(command: LmCommand, key: LmCacheKey = KEY, meta: ValueMeta | None = None) -> bytes:
    return encode_request(LmRequest(command, key, meta or ValueMeta(0)))


async def reply(reader: asyncio.StreamReader) -> tuple[LmReturnCode, ValueMeta, bytes]:
    head = decode_reply(await reader.readexactly(REPLY_BYTES))
    payload = await reader.readexactly(head.meta.length) if head.code is LmReturnCode.SUCCESS else b""
    return head.code, head.meta, payload


async def started(capacity: int = 8 << 20) -> tuple[BlockStore, LmcacheServer, int]:
    store = BlockStore([CpuTier(capacity)])
    server = LmcacheServer(store)
    return store, server, await server.start("127.0.0.1", 0)


async def test_put_get_exist_byte_by_byte_and_pipelined() -> None:
    store, server, port = await started()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = bytes(range(256)) * 1024  # 256 KiB
        meta = ValueMeta(len(payload), MemoryFormat.KV_2LTD, 3, (2, 1, 512, 128))
        frame = request(LmCommand.PUT, meta=meta) + payload
        for i in range(400):  # the header and the payload's start split across many reads
            writer.write(frame[i : i + 1])
            await writer.drain()
        writer.write(frame[400:])
        other = LmCacheKey("tiny", 1, 0, 0xCAFE, "bfloat16")
        # pipelined: a GET, an EXIST of an absent key, a GET miss, a HEALTH, without waiting for replies
        writer.write(request(LmCommand.GET) + request(LmCommand.EXIST, other) + request(LmCommand.GET, other))
        writer.write(request(LmCommand.HEALTH))
        await writer.drain()
        assert await reply(reader) == (LmReturnCode.SUCCESS, meta, payload)
        assert (await reply(reader))[0] is LmReturnCode.FAIL
        assert (await reply(reader))[0] is LmReturnCode.FAIL
        assert (await reply(reader))[0] is LmReturnCode.SUCCESS
        # the same value through the store's API (what gRPC reads): envelope + payload under lmcache/<key>
        stored = await store.get("lmcache/tiny@1@0@beef@bfloat16")
        assert stored.value == encode_envelope(meta) + payload
        # and a value put through the store's API is served to lm:// clients as raw bytes
        await store.put(other.store_key(), b"raw bytes")
        writer.write(request(LmCommand.GET, other))
        assert await reply(reader) == (
            LmReturnCode.SUCCESS, ValueMeta(9, MemoryFormat.BINARY_BUFFER, 6, (9, 0, 0, 0)), b"raw bytes",
        )  # fmt: skip
        writer.close()
    finally:
        await server.stop()
    assert server.stats.requests[("put", "stored")] == 1
    assert server.stats.requests[("get", "hit")] == 2
    assert server.stats.requests[("get", "miss")] == 1


async def test_bad_frame_closes_only_its_connection() -> None:
    _, server, port = await started(capacity=1 << 20)
    try:
        good_reader, good_writer = await asyncio.open_connection("127.0.0.1", port)
        bad_reader, bad_writer = await asyncio.open_connection("127.0.0.1", port)
        bad_writer.write(REQUEST.pack(9, 0, 1, 2, 0, 0, 0, 0, 0, b"tiny@1@0@beef@bfloat16".ljust(150)))  # no such command
        assert await asyncio.wait_for(bad_reader.read(), 5) == b""  # framing lost: closed
        good_writer.write(request(LmCommand.HEALTH))
        assert (await reply(good_reader))[0] is LmReturnCode.SUCCESS
        good_writer.close()
        bad_writer.close()
    finally:
        await server.stop()
    assert server.stats.protocol_errors == {"bad_command": 1}

    registry = CollectorRegistry()
    register_lmcache_metrics(server.stats, registry)
    text = generate_latest(registry).decode()
    assert 'kvmesh_kv_store_lmcache_protocol_errors_total{reason="bad_command"} 1.0' in text
    assert 'kvmesh_kv_store_lmcache_requests_total{command="health",result="ok"} 1.0' in text


async def test_stop_closes_open_connections() -> None:
    _, server, port = await started()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request(LmCommand.HEALTH))
    await reply(reader)
    await server.stop()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert server.stats.connections_open == 0
    writer.close()


async def test_large_put_into_growing_segments_and_an_announced_put_that_never_comes() -> None:
    store, server, port = await started(capacity=64 << 20)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = bytes(range(251)) * (9 * 1024 * 1024 // 251)  # ~9 MiB: received into segments of 64 KiB .. 4 MiB
        meta = ValueMeta(len(payload), MemoryFormat.BINARY_BUFFER, 6, (len(payload), 0, 0, 0))
        writer.write(request(LmCommand.PUT, meta=meta) + payload + request(LmCommand.GET))
        assert await reply(reader) == (LmReturnCode.SUCCESS, meta, payload)
        # a header announcing 48 MiB, then silence: one 64 KiB segment is committed for it, and closing counts it
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(request(LmCommand.PUT, KEY, ValueMeta(48 << 20)) + b"x" * 100)
        await idle_writer.drain()
        writer.write(request(LmCommand.HEALTH))  # the other connection is served meanwhile
        assert (await reply(reader))[0] is LmReturnCode.SUCCESS
        idle_writer.close()
        await asyncio.wait_for(idle_reader.read(), 5)
        for _ in range(100):
            if server.stats.protocol_errors:
                break
            await asyncio.sleep(0.01)
        assert server.stats.protocol_errors == {"truncated": 1}
        writer.close()
    finally:
        await server.stop()
    assert (await store.get("lmcache/tiny@1@0@beef@bfloat16")).value == encode_envelope(meta) + payload


async def test_list_answers_the_lmcache_keys_the_tiers_hold() -> None:
    """LIST (lmcache 0.5.6 command 4): SUCCESS, length = bytes of the "\\n"-joined CacheEngineKey strings
    (the reply in upstream's commented-out server TODO; its server sends nothing, its client never asks)."""
    store = BlockStore([CpuTier(1 << 20)])
    server = LmcacheServer(store)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request(LmCommand.LIST))  # nothing stored yet: SUCCESS with an empty payload
        await writer.drain()
        code, meta, payload = await reply(reader)
        assert (code, meta.length, payload) == (LmReturnCode.SUCCESS, 0, b"")
        assert decode_list_payload(payload) == []
        second = LmCacheKey("tiny", 1, 0, 0xCAFE, "bfloat16", layer_id=3)
        for key in (KEY, second):
            writer.write(request(LmCommand.PUT, key, ValueMeta.binary(4)) + b"abcd")
        await store.put("not-lmcache/block-1", b"grpc value")  # a gRPC key: not an LMCache key, not listed
        writer.write(request(LmCommand.LIST) + request(LmCommand.HEALTH))  # pipelined: LIST's payload is framed
        await writer.drain()
        code, meta, payload = await reply(reader)
        assert code is LmReturnCode.SUCCESS and meta.length == len(payload)
        assert payload == b"tiny@1@0@beef@bfloat16\ntiny@1@0@cafe@bfloat16@3"
        assert decode_list_payload(payload) == [KEY, second]
        assert (await reply(reader))[0] is LmReturnCode.SUCCESS  # the next reply starts right after
        writer.close()
    finally:
        await server.stop()
    assert server.stats.requests[("list", "ok")] == 2
