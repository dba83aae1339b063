"""Mooncake tier cases that need a cluster; run inside a private netns by test_kv_store_mooncake.py.

Matches Mooncake 0.3.13.post1 (``mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from kvmesh.types import Medium
from services.kv_store.errors import TierUnavailable
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.mooncake import MooncakeTier
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
    assert store.metrics.dropped.get("mooncake", 0) >= 1
    assert await store.contains(["b", "zzz"]) == [True, False]
    print(f"master-down detection took {time.monotonic() - start:.1f}s")
