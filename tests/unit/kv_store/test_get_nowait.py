"""A first-tier (CPU) hit served without suspending: ``BlockStore.get_nowait`` and the ``lm://`` GET that
uses it (no task per hit). Slower tiers, misses and bad keys still take ``get``'s path: promotion, the miss
counted once, the same replies (frames as lmcache 0.5.6, see test_lmcache_server.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvmesh.errors import InvalidRequest
from kvmesh.types import Medium
from services.kv_store.errors import KeyNotFound
from services.kv_store.lmcache_protocol import (
    REPLY_BYTES,
    LmCacheKey,
    LmCommand,
    LmRequest,
    LmReturnCode,
    MemoryFormat,
    ValueMeta,
    decode_reply,
    encode_request,
)
from services.kv_store.lmcache_server import LmcacheServer
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier


def lm_key(chunk: int) -> LmCacheKey:
    return LmCacheKey("tiny", 1, 0, chunk, "bfloat16")


def two_tiers(tmp_path: Path) -> tuple[BlockStore, CpuTier]:
    cpu = CpuTier(2500)  # two values of 900-1,000 bytes fit (envelope included), a third demotes the oldest
    return BlockStore([cpu, DiskTier(tmp_path / "disk", 1 << 20)]), cpu


async def test_get_nowait_answers_first_tier_hits_only(tmp_path: Path) -> None:
    store, cpu = two_tiers(tmp_path)
    for name in ("a", "b", "c"):
        await store.put(name, name.encode() * 1000)
    # "a" was demoted to disk by "c": only "b" and "c" are CPU hits
    hit = store.get_nowait("c")
    assert hit is not None and hit.value == b"c" * 1000 and hit.medium is Medium.CPU and hit.tier == "cpu"
    assert store.get_nowait("a") is None  # on disk: get() must promote it
    assert store.get_nowait("absent") is None
    stats = cpu.stats()
    assert (stats.hits, stats.misses) == (1, 0)  # a None from get_nowait is no miss: get() counts it
    with pytest.raises(KeyNotFound):
        await store.get("absent")
    assert cpu.stats().misses == 1
    assert sum(store.metrics.latency[("cpu", "get")].counts) >= 1  # timed as get's hits are
    promoted = await store.get("a")
    assert promoted.medium is Medium.DISK and promoted.value == b"a" * 1000
    assert store.get_nowait("a") is not None  # now on CPU
    with pytest.raises(InvalidRequest):
        store.get_nowait("")


async def test_lm_get_fast_and_slow_paths_keep_reply_order(tmp_path: Path) -> None:
    store, _ = two_tiers(tmp_path)
    server = LmcacheServer(store)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payloads = {chunk: bytes([chunk]) * 900 for chunk in (1, 2, 3)}
        meta = {chunk: ValueMeta(900, MemoryFormat.KV_2LTD, 3, (2, 1, 2, 225)) for chunk in payloads}
        for chunk, payload in payloads.items():
            writer.write(encode_request(LmRequest(LmCommand.PUT, lm_key(chunk), meta[chunk])) + payload)
        writer.write(encode_request(LmRequest(LmCommand.EXIST, lm_key(3), ValueMeta(0))))
        await writer.drain()
        assert decode_reply(await reader.readexactly(REPLY_BYTES)).code is LmReturnCode.SUCCESS
        assert store.get_nowait(lm_key(1).store_key()) is None  # chunk 1 was demoted to disk
        # pipelined: a disk hit (task, promotion), a CPU hit (answered at once), a miss, a CPU hit
        order = [1, 3, 9, 2]
        for chunk in order:
            writer.write(encode_request(LmRequest(LmCommand.GET, lm_key(chunk), ValueMeta(0))))
        await writer.drain()
        for chunk in order:
            head = decode_reply(await reader.readexactly(REPLY_BYTES))
            if chunk == 9:
                assert head.code is LmReturnCode.FAIL
                continue
            assert head.code is LmReturnCode.SUCCESS and head.meta == meta[chunk]
            assert await reader.readexactly(head.meta.length) == payloads[chunk]
        writer.close()
    finally:
        await server.stop()
    assert server.stats.requests[("get", "hit")] == 3
    assert server.stats.requests[("get", "miss")] == 1
