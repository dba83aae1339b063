"""A promotion is a swap and a read never loses a value (issue: a Get destroyed another value when
the disk tier was full).

Real tiers throughout: a real tmpfs that runs out of space (ENOSPC), tier budgets
(``capacity_bytes``), a shared FS tier, and the disk tier's own lock held where a promotion must
race a put or delete at an exact point.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier


async def readable(store: BlockStore, keys: list[str]) -> set[str]:
    found = await store.contains(keys)
    return {key for key, hit in zip(keys, found, strict=True) if hit}


async def test_gets_on_a_full_disk_lose_nothing(small_tmpfs: Path) -> None:
    """The reported case: the disk's filesystem is full (ENOSPC) long before its budget; reading
    every key once used to lose one more value (the CPU victim found no room: the hit's own copy
    was removed only afterwards)."""
    size = 3000  # one 4 KiB tmpfs page per file with its header
    store = BlockStore([CpuTier(4 * size), DiskTier(small_tmpfs / "kv", 100 * 1024 * 1024)])
    keys = [f"k{i:02d}" for i in range(30)]
    for key in keys:
        await store.put(key, key.encode() * (size // 3))
    lost_after_puts = sum(store.metrics.lost.values())
    assert lost_after_puts > 0, "the tmpfs must fill up for this test to mean anything"
    present = await readable(store, keys)
    for key in sorted(present):
        assert (await store.get(key)).value == key.encode() * (size // 3)
    assert sum(store.metrics.lost.values()) == lost_after_puts
    assert await readable(store, keys) == present
    for key in sorted(present):  # and a second round, now that CPU and disk have swapped
        assert (await store.get(key)).value == key.encode() * (size // 3)
    assert sum(store.metrics.lost.values()) == lost_after_puts


async def test_a_promotion_into_a_disk_full_by_its_budget_evicts_nothing_there(tmp_path: Path) -> None:
    """Capacity sibling: the disk is the last tier and full by ``capacity_bytes``; the CPU victim
    takes the room the hit leaves, so the disk drops none of its other values."""
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20)])
    for key in "abcd":
        await store.put(key, key.encode() * 10)  # CPU: c, d; disk: a, b
    assert (await store.get("a")).value == b"a" * 10
    assert await store.tiers[0].contains(list("abcd")) == [True, False, False, True]
    assert await store.tiers[1].contains(list("abcd")) == [False, True, True, False]
    assert await readable(store, list("abcd")) == set("abcd")


async def test_a_victim_that_finds_no_tier_undoes_the_promotion(tmp_path: Path) -> None:
    """The CPU victim is too large for the disk: promoting would lose it, so the promotion is undone
    (the hit stays on disk, the victim in CPU) and the get still answers."""
    store = BlockStore([CpuTier(40), DiskTier(tmp_path / "nvme", 20)])
    await store.put("x", b"x" * 15)
    await store.put("y", b"y" * 25)
    await store.put("z", b"z" * 15)  # x -> disk; CPU: y, z
    hit = await store.get("x")
    assert hit.value == b"x" * 15
    assert store.metrics.lost == {}
    assert store.metrics.promotions_undone == 1
    assert await readable(store, ["x", "y", "z"]) == {"x", "y", "z"}
    assert await store.tiers[1].contains(["x"]) == [True]  # back where it was


async def test_a_shared_hit_whose_victim_finds_no_tier_is_not_promoted(tmp_path: Path) -> None:
    """Shared-tier sibling: the hit keeps its shared copy (nothing is freed); the CPU victim is too
    large for the shared tier and the disk is gone: undone, nothing lost, the hit still served."""
    (tmp_path / "shared").mkdir()
    disk_root = tmp_path / "nvme"
    store = BlockStore(
        [CpuTier(30), DiskTier(disk_root, 1000), SharedFsTier(tmp_path / "shared", 20)],
        write_through=["sharedfs"],
    )
    await store.put("s", b"s" * 10)  # written through to the shared tier
    await store.tiers[0].evict("s")
    await store.put("big", b"b" * 25)  # CPU: big (too large for the shared tier)
    disk_root.rename(tmp_path / "gone")
    disk_root.write_text("not a directory")  # every disk write fails now
    hit = await store.get("s")
    assert (hit.value, hit.tier) == (b"s" * 10, "sharedfs")
    assert store.metrics.lost == {}
    assert store.metrics.promotions_undone == 1
    assert await store.tiers[0].contains(["big", "s"]) == [True, False]
    assert await store.tiers[2].contains(["s"]) == [True]


@pytest.mark.parametrize("writer", ["put", "delete"])
async def test_a_promotion_racing_a_put_or_delete_never_restores_the_stale_value(
    tmp_path: Path, writer: str
) -> None:
    """A get reads x from disk; a put (or delete) of x begins before the promotion lands: the stale
    value must not overwrite the new one (or resurrect the deleted key)."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    await store.put("x", b"1" * 10)
    await store.put("y", b"y" * 10)
    await store.put("z", b"z" * 10)  # x -> disk
    async with disk._lock:  # the promotion's removal of the disk copy and the writer's wait here
        get = asyncio.create_task(store.get("x"))
        await asyncio.sleep(0.05)
        write = asyncio.create_task(store.put("x", b"2" * 10) if writer == "put" else store.delete("x"))
        await asyncio.sleep(0.05)
        assert not get.done()
    hit, _ = await asyncio.gather(get, write)
    assert hit.value == b"1" * 10  # what was there when it read
    assert store.metrics.promotions_superseded == 1
    if writer == "put":
        assert (await store.get("x")).value == b"2" * 10
    else:
        assert await store.contains(["x"]) == [False]
    assert store.metrics.lost == {}
