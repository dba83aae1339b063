"""BlockStore placement over real tiers: demote on eviction, promote on hit, write-through, degraded tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.types import Medium
from services.kv_store.errors import KeyNotFound, TierUnavailable
from services.kv_store.metrics import register_metrics
from services.kv_store.store import BlockStore
from services.kv_store.tiers.base import StoreTier
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier


def three_tiers(tmp_path: Path, **kwargs: object) -> BlockStore:
    (tmp_path / "shared").mkdir(exist_ok=True)
    return BlockStore(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 40), SharedFsTier(tmp_path / "shared", 1000)],
        **kwargs,  # type: ignore[arg-type]
    )


async def test_eviction_demotes_down_the_tiers(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    for key in "abcdefg":
        await store.put(key, key.encode() * 10)
    cpu, disk, shared = store.tiers
    assert await cpu.contains(list("abcdefg")) == [False] * 5 + [True] * 2
    assert await disk.contains(list("abcdefg")) == [False] * 1 + [True] * 4 + [False] * 2
    assert await shared.contains(list("abcdefg")) == [True] + [False] * 6
    for key in "abcdefg":  # every value still served, none lost
        assert (await store.get(key)).value == key.encode() * 10
    assert store.metrics.moved_bytes[("disk", "demote")] >= 50


async def test_a_hit_in_a_slower_tier_is_promoted_and_leaves_private_tiers(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    for key in "abcd":
        await store.put(key, key.encode() * 10)
    cpu, disk, _ = store.tiers
    stored = await store.get("a")
    assert (stored.medium, stored.tier) == (Medium.DISK, "disk")
    assert await cpu.contains(["a"]) == [True]
    assert await disk.contains(["a"]) == [False]  # exclusive: moved, not copied
    assert (await store.get("a")).medium is Medium.CPU
    assert store.metrics.moved_bytes[("cpu", "promote")] == 10


async def test_a_shared_hit_keeps_its_shared_copy(tmp_path: Path) -> None:
    store = three_tiers(tmp_path, write_through=["sharedfs"])
    await store.put("k", b"k" * 10)
    shared = store.tiers[2]
    assert await shared.contains(["k"]) == [True]
    await store.tiers[0].evict("k")
    assert (await store.get("k")).tier == "sharedfs"
    assert await shared.contains(["k"]) == [True]
    assert store.metrics.moved_bytes[("sharedfs", "write_through")] == 10


async def test_two_instances_see_each_other_through_the_shared_tier(tmp_path: Path) -> None:
    (tmp_path / "lustre").mkdir()
    a = BlockStore([CpuTier(100), SharedFsTier(tmp_path / "lustre", 1000)], write_through=["sharedfs"])
    b = BlockStore([CpuTier(100), SharedFsTier(tmp_path / "lustre", 1000)])
    await a.put("prefix-block", b"p" * 50)
    assert await b.media(["prefix-block", "nope"]) == [Medium.SHARED, None]
    assert (await b.get("prefix-block")).medium is Medium.SHARED


async def test_put_replaces_stale_copies_in_slower_tiers(tmp_path: Path) -> None:
    store = three_tiers(tmp_path)
    await store.put("k", b"1" * 15)
    await store.put("x", b"x" * 15)  # demotes k to disk
    await store.put("k", b"2" * 5)
    assert await store.tiers[1].contains(["k"]) == [False]
    assert (await store.get("k")).value == b"2" * 5


async def test_an_unavailable_shared_tier_degrades_the_store_but_it_stays_up(tmp_path: Path) -> None:
    missing = tmp_path / "lustre-not-mounted"
    store = BlockStore([CpuTier(20), SharedFsTier(missing, 1000)], write_through=["sharedfs"])
    registry = CollectorRegistry()
    register_metrics(store, registry)
    await store.put("a", b"a" * 10)  # write-through dropped, put succeeds
    await store.put("b", b"b" * 15)  # demotion of a dropped
    assert (await store.get("b")).value == b"b" * 15
    with pytest.raises(KeyNotFound):
        await store.get("a")
    assert await store.contains(["a", "b"]) == [False, True]
    assert await store.delete("b") is True
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "sharedfs"}) >= 4
    assert value("kvmesh_kv_store_dropped_total", {"tier": "sharedfs", "reason": "unavailable"}) == 3  # 2 write-throughs, 1 demotion
    assert value("kvmesh_kv_store_lost_total", {"tier": "cpu"}) == 1  # a: no tier below the CPU took it


async def test_the_first_tier_failing_reaches_the_caller(tmp_path: Path) -> None:
    store = BlockStore([SharedFsTier(tmp_path / "missing", 100)])
    with pytest.raises(TierUnavailable):
        await store.put("k", b"v")


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="unique"):
        BlockStore([CpuTier(1), CpuTier(1)])
    with pytest.raises(ValueError, match="write_through"):
        BlockStore([CpuTier(1)], write_through=["cpu"])


async def test_keys_lists_every_tier_once_by_prefix_and_survives_a_restart(tmp_path: Path) -> None:
    """``BlockStore.keys(prefix)`` (what ``lm://`` LIST answers): the union of the tiers' views, sorted,
    each key once (a key in two tiers, a demoted key, a rescanned key)."""
    def tiers() -> list[StoreTier]:
        return [CpuTier(20), DiskTier(tmp_path / "nvme", 100), SharedFsTier(tmp_path / "shared", 1000)]

    (tmp_path / "shared").mkdir()
    store = BlockStore(tiers(), write_through=["sharedfs"])
    for key in ("lmcache/b", "lmcache/a", "grpc/x"):
        await store.put(key, b"v" * 10)  # 20-byte CPU tier: the first put is demoted to disk
    assert store.keys("lmcache/") == ["lmcache/a", "lmcache/b"]
    assert store.keys() == ["grpc/x", "lmcache/a", "lmcache/b"]
    assert store.keys("none/") == []
    restarted = BlockStore(tiers(), write_through=["sharedfs"])  # CPU empty; disk and shared rescanned
    assert restarted.keys("lmcache/") == ["lmcache/a", "lmcache/b"]
