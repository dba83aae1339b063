"""Mooncake tier cases that need a cluster; run inside a private netns by test_kv_store_mooncake.py.

Matches Mooncake 0.3.13.post1 (``mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
import zlib

import pytest

from kvmesh.kv_events import BlockStored, KVEvent
from kvmesh.types import Medium
from services.kv_store.app import mooncake_key_lister, rescan_mooncake
from services.kv_store.errors import TierUnavailable
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.mooncake import FRAME, MAGIC, MooncakeTier
from tests.contract.test_store_tiers import mooncake_client

pytestmark = pytest.mark.skipif(not os.environ.get("KVMESH_MOONCAKE_MASTER"), reason="needs a mooncake master")


async def test_two_instances_share_values_through_one_cluster() -> None:
    namespace = f"share-{uuid.uuid4().hex}/"
    a_client, b_client = mooncake_client(), mooncake_client()
    try:
        a = BlockStore([CpuTier(1 << 20), MooncakeTier(a_client, 16 << 20, namespace)], write_through=["mooncake"])
        b = BlockStore([CpuTier(1 << 20), MooncakeTier(b_client, 16 << 20, namespace)])
        value = os.urandom(512 << 10)
        await a.put("block-1", value)
        assert await b.contains(["block-1", "block-2"]) == [True, False]
        stored = await b.get("block-1")
        assert (stored.value, stored.medium, stored.tier) == (value, Medium.SHARED, "mooncake")
        assert (await b.get("block-1")).medium is Medium.CPU  # promoted into b's CPU tier
        assert b.tiers[1].stats().hits == 1
    finally:
        a_client.close()
        b_client.close()


async def test_a_foreign_or_corrupt_object_is_a_miss_never_wrong_bytes() -> None:
    namespace = f"corrupt-{uuid.uuid4().hex}/"
    client = mooncake_client()
    try:
        tier = MooncakeTier(client, 1 << 20, namespace)
        assert client.put(namespace + "raw", b"not a kvmesh frame at all") == 0
        await asyncio.sleep(0.1)
        assert await tier.get("raw") is None
        stats = tier.stats()
        assert (stats.corrupted, stats.misses) == (1, 1)
        assert client.batch_is_exist([namespace + "raw"]) == [0]  # removed
    finally:
        client.close()


def _block(block_hash: int) -> BlockStored:
    return BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=list(range(16)), block_size=16)


@pytest.mark.skipif(not os.environ.get("KVMESH_MOONCAKE_MASTER_HTTP"), reason="needs the master's HTTP port")
async def test_a_restarted_instance_republishes_the_namespace_values() -> None:
    """Instance a writes described values through to Mooncake; a fresh instance b (a restart: empty
    view) lists the cluster through the master's HTTP ``/get_all_keys``, adopts the namespace's values
    and publishes one ``BlockStored(SHARED)`` per described value, with a's description."""
    namespace = f"rescan-{uuid.uuid4().hex}/"
    a_client, b_client = mooncake_client(), mooncake_client()
    try:
        a = BlockStore([CpuTier(1 << 20), MooncakeTier(a_client, 16 << 20, namespace)], write_through=["mooncake"])
        values = {f"block-{i}": os.urandom(64 << 10) for i in range(3)}
        for i, (key, value) in enumerate(values.items()):
            await a.put(key, value, _block(1000 + i))
        await a.put("undescribed", b"served, never published")
        # an object of the previous frame layout (no description): adopted and served, not published
        old = b"old frame value"
        assert a_client.put(namespace + "old-frame", FRAME.pack(MAGIC, zlib.crc32(old), len(old)) + old) == 0
        await asyncio.sleep(0.2)

        published: list[KVEvent] = []
        lister = mooncake_key_lister(os.environ["KVMESH_MOONCAKE_MASTER_HTTP"])
        b_tier = MooncakeTier(b_client, 16 << 20, namespace, lister)
        b = BlockStore([CpuTier(1 << 20), b_tier], on_events=published.extend)
        assert published == []  # nothing known before the rescan
        assert await rescan_mooncake(b) == 3
        stored = sorted((e.block_hashes[0], e.medium) for e in published if isinstance(e, BlockStored))
        assert stored == [(1000, "SHARED"), (1001, "SHARED"), (1002, "SHARED")]
        assert b.republished == 3
        assert sorted(b_tier.held_keys()) == sorted([*values, "undescribed", "old-frame"])
        assert b.keys("block-") == sorted(values)
        assert (await b.get("block-1")).value == values["block-1"]
        assert (await b.get("old-frame")).value == old
        assert b_tier.take_rescanned() == []  # handed over once
        assert await b_tier.rescan() == 0  # everything already in the view
    finally:
        a_client.close()
        b_client.close()


async def test_the_rescan_of_an_unreachable_cluster_is_skipped() -> None:
    """A listing that fails (master's HTTP port closed) leaves the store up and publishes nothing."""
    client = mooncake_client()
    try:
        tier = MooncakeTier(client, 1 << 20, f"nolist-{uuid.uuid4().hex}/", mooncake_key_lister("127.0.0.1:9"))
        published: list[KVEvent] = []
        store = BlockStore([CpuTier(1 << 20), tier], on_events=published.extend)
        assert await rescan_mooncake(store) == 0
        assert tier.stats().errors == 1 and published == []
        await store.put("still-works", b"x")
        assert (await store.get("still-works")).value == b"x"
    finally:
        client.close()


async def test_master_down_is_a_degraded_tier_and_the_store_stays_up() -> None:
    """Last: it stops the master this session started."""
    namespace = f"down-{uuid.uuid4().hex}/"
    client = mooncake_client()
    tier = MooncakeTier(client, 1 << 20, namespace)
    store = BlockStore([CpuTier(100), tier])
    await store.put("cpu-only", b"c" * 10)
    os.kill(int(os.environ["KVMESH_MOONCAKE_MASTER_PID"]), signal.SIGKILL)
    await asyncio.sleep(0.5)
    start = time.monotonic()
    with pytest.raises(TierUnavailable):
        await tier.put("x", b"x" * 10)
    assert tier.stats().errors >= 1
    assert (await store.get("cpu-only")).value == b"c" * 10
    await store.put("a", b"a" * 60)
    await store.put("b", b"b" * 60)  # demoting "cpu-only"/"a" to mooncake fails: dropped, counted
    assert store.dropped("mooncake") >= 1
    assert await store.contains(["b", "zzz"]) == [True, False]
    print(f"master-down detection took {time.monotonic() - start:.1f}s")
