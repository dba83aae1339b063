"""A promotion is a swap that loses no value to a failed demotion and never overwrites a newer one
(issues: a Get destroyed another value when the disk tier was full; concurrent gets missed a key
being promoted; a promotion raced a put on a slow first tier).

Real tiers throughout: a real tmpfs that runs out of space (ENOSPC), tier budgets
(``capacity_bytes``), a shared FS tier, and the disk tier's own lock held where a promotion must
race a put or delete at an exact point.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from services.kv_store.errors import StorageFull
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
async def test_a_write_after_the_promotion_stored_the_key_wins(tmp_path: Path, writer: str) -> None:
    """A get reads x from disk and stores it in CPU; its removal of the disk copy waits on the disk's
    lock while a put (or delete) of x runs: the write lands after the promotion in CPU, so the new
    value stays (or the key stays deleted), and nothing is lost."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    await store.put("x", b"1" * 10)
    await store.put("y", b"y" * 10)
    await store.put("z", b"z" * 10)  # x -> disk
    async with disk._lock:  # the promotion's removal of the disk copy and the writer's wait here
        get = asyncio.create_task(store.get("x"))
        await asyncio.sleep(0.05)
        assert await store.tiers[0].contains(["x"]) == [True]  # stored in CPU before the disk copy goes
        write = asyncio.create_task(store.put("x", b"2" * 10) if writer == "put" else store.delete("x"))
        await asyncio.sleep(0.05)
        assert not get.done()
    hit, _ = await asyncio.gather(get, write)
    assert hit.value == b"1" * 10  # what was there when it read
    if writer == "put":
        assert (await store.get("x")).value == b"2" * 10
    else:
        assert await store.contains(["x"]) == [False]
    assert store.metrics.lost == {}
    assert await readable(store, ["y", "z"]) == {"y", "z"}


async def test_concurrent_gets_of_a_key_being_promoted_never_miss(tmp_path: Path) -> None:
    """The reviewer's case: engines fetch one popular prefix block at once. Every get of a key held
    only on disk answers while one of them swaps it into CPU (it is stored there before the disk copy
    is removed; a get whose scan it passed looks again)."""
    for trial in range(200):
        store = BlockStore([CpuTier(10_000), DiskTier(tmp_path / f"kv{trial}", 10_000_000)])
        await store.put("x", b"x" * 1000)
        await store.put("y", b"y" * 9500)  # x -> disk
        assert await store.tiers[1].contains(["x"]) == [True]
        results = await asyncio.gather(*(store.get("x") for _ in range(4)), store.contains(["x"]))
        assert all(hit.value == b"x" * 1000 for hit in results[:4])  # type: ignore[union-attr]
        assert results[4] == [True]
        assert await readable(store, ["x", "y"]) == {"x", "y"}
        assert store.metrics.lost == {}


async def test_the_key_is_readable_at_every_step_of_a_swap(tmp_path: Path) -> None:
    """Deterministic sibling: with the disk's removal of the hit held, the key is already in CPU,
    and a second get and a contains find it there."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    for key in "xyz":
        await store.put(key, key.encode() * 10)  # x -> disk
    async with disk._lock:
        first = asyncio.create_task(store.get("x"))
        await asyncio.sleep(0.05)
        assert not first.done()
        assert await store.contains(["x"]) == [True]
        second = await store.get("x")
        assert (second.value, second.tier) == (b"x" * 10, "cpu")
    assert (await first).value == b"x" * 10
    assert await store.tiers[0].contains(["x"]) == [True]
    assert await store.tiers[1].contains(["x"]) == [False]  # one copy per instance
    assert await readable(store, list("xyz")) == set("xyz")


class NvmeTier(DiskTier):
    """A second local disk tier (a real file tier under another name) behind a disk first tier."""

    name = "nvme"


async def _slow_first_store(tmp_path: Path, first_root: Path) -> tuple[BlockStore, DiskTier]:
    """A file tier first (its puts yield and queue on its lock), x = V1 only in the second tier."""
    first = DiskTier(first_root, 10_000)
    store = BlockStore([first, NvmeTier(tmp_path / "nvme", 10_000)])
    await store.put("x", b"1" * 100)
    await store.tiers[1].put("x", b"1" * 100)
    await first.evict("x")
    return store, first


async def test_a_put_in_flight_before_the_get_is_not_overwritten_by_the_promotion(tmp_path: Path) -> None:
    """The put of V2 began before the get (its first-tier write queued on the slow first tier); the
    get reads V1 from the second tier. Its promotion would queue behind the put and overwrite V2:
    it is dropped (superseded) and V2 stays."""
    store, first = await _slow_first_store(tmp_path, tmp_path / "first")
    async with first._lock:
        put = asyncio.create_task(store.put("x", b"2" * 100))
        await asyncio.sleep(0.02)
        get = asyncio.create_task(store.get("x"))  # the first tier has no x yet: read from nvme
        await asyncio.sleep(0.05)
    hit, _ = await asyncio.gather(get, put)
    assert hit.value == b"1" * 100
    assert store.metrics.promotions_superseded == 1
    assert await first.get("x") == b"2" * 100
    assert (await store.get("x")).value == b"2" * 100
    assert await store.tiers[1].contains(["x"]) == [False]  # the put removed the stale copy


async def test_a_put_begun_while_the_promotion_is_queued_replaces_it(tmp_path: Path) -> None:
    """Sibling: the promotion's first-tier write is queued first, the put's behind it; the promotion
    sees it was superseded once stored, leaves the slower copy to the put, and V2 ends on top."""
    store, first = await _slow_first_store(tmp_path, tmp_path / "first")
    async with first._lock:
        get = asyncio.create_task(store.get("x"))
        await asyncio.sleep(0.05)  # read V1 from nvme, promotion queued on the first tier
        put = asyncio.create_task(store.put("x", b"2" * 100))
        await asyncio.sleep(0.02)
    hit, _ = await asyncio.gather(get, put)
    assert hit.value == b"1" * 100
    assert store.metrics.promotions_superseded == 1
    assert await first.get("x") == b"2" * 100
    assert await store.tiers[1].contains(["x"]) == [False]
    assert (await store.get("x")).value == b"2" * 100


@pytest.mark.parametrize("order", ["put_first", "get_first", "put_during_removal"])
async def test_a_put_that_fails_while_a_promotion_runs_loses_nothing(small_tmpfs: Path, order: str) -> None:
    """The first tier is a disk on a small tmpfs: a put of a value larger than the space left fails
    with StorageFull (nothing stored). A concurrent promotion of the old value must not lose it,
    whichever reached the first tier first, also when the put begins and fails while the promotion
    removes the second tier's copy (it used to take the superseded path then: the value was gone)."""
    store, first = await _slow_first_store(small_tmpfs.parent, small_tmpfs / "first")
    big = b"2" * 9000  # three 4 KiB pages with its header; V1 takes one
    space = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(b"f" * (space.f_bavail * space.f_frsize - 2 * 4096))  # 2 pages left
    held = store.tiers[1] if order == "put_during_removal" else first
    assert isinstance(held, DiskTier)
    async with held._lock:
        if order == "put_first":
            put = asyncio.create_task(store.put("x", big))
            await asyncio.sleep(0.02)
            get = asyncio.create_task(store.get("x"))
        else:
            get = asyncio.create_task(store.get("x"))
            await asyncio.sleep(0.05)
            put = asyncio.create_task(store.put("x", big))
        await asyncio.sleep(0.05)
    hit, failed = await asyncio.gather(get, put, return_exceptions=True)
    assert isinstance(failed, StorageFull), failed
    assert hit.value == b"1" * 100  # type: ignore[union-attr]
    assert (await store.get("x")).value == b"1" * 100  # still somewhere
    assert store.metrics.lost == {}
    assert first.stats().errors >= 1  # the put's ENOSPC


async def test_a_promotion_into_a_full_last_tier_still_evicts_its_lru_value(tmp_path: Path) -> None:
    """What "loses no value" does not cover (documented): the CPU victim demoted into a full last
    tier evicts that tier's least recently used value, as any demotion does; nothing is undone."""
    store = BlockStore([CpuTier(80), DiskTier(tmp_path / "kv", 100)])
    await store.put("k", b"k" * 45)
    await store.put("b", b"b" * 55)  # k -> disk
    await store.put("a", b"a" * 70)  # b -> disk; disk full: k 45 + b 55
    assert (await store.get("k")).value == b"k" * 45
    assert store.metrics.promotions_undone == 0
    assert await store.tiers[0].contains(["k"]) == [True]
    assert await readable(store, ["k", "b", "a"]) == {"k", "a"}  # b: the disk's LRU, dropped by the last tier


async def test_two_gets_promoting_a_key_whose_victim_finds_no_tier_keep_it_readable(tmp_path: Path) -> None:
    """Undo sibling: two gets promote x at once and the first one's victim finds no tier, so it is
    undone while the second also stored x in CPU and finds the disk copy gone: x is readable
    throughout and afterwards, and nothing is lost."""
    disk = DiskTier(tmp_path / "nvme", 20)
    store = BlockStore([CpuTier(40), disk])
    await store.put("x", b"x" * 15)
    await store.put("y", b"y" * 25)
    await store.put("z", b"z" * 15)  # x -> disk; CPU: y, z (y too large for the disk)
    async with disk._lock:  # both promotions store x in CPU, then queue to remove the disk copy
        gets = [asyncio.create_task(store.get("x")) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert await store.contains(["x"]) == [True]
    hits = await asyncio.gather(*gets)
    assert all(hit.value == b"x" * 15 for hit in hits)
    assert store.metrics.promotions_undone == 1
    assert store.metrics.lost == {}
    assert await readable(store, ["x", "y", "z"]) == {"x", "y", "z"}
    assert (await store.get("x")).value == b"x" * 15


class GatedDiskTier(DiskTier):
    """The real disk tier; a get begun while ``gate`` is set waits for it before reading (to put a
    read exactly after another get's promotion)."""

    gate: asyncio.Event | None = None

    async def get(self, key: str) -> bytes | None:
        gate = self.gate
        if gate is not None:
            await gate.wait()
        return await super().get(key)


async def test_a_get_whose_scan_the_promoted_key_passed_looks_again(tmp_path: Path) -> None:
    """Deterministic case of the concurrent-get miss: a get checked CPU (miss) before another get
    promoted the key, and reads the disk after the promotion removed the copy there: it looks again
    and finds the key in CPU instead of answering KeyNotFound."""
    disk = GatedDiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    for key in "xyz":
        await store.put(key, key.encode() * 10)  # x -> disk
    disk.gate = gate = asyncio.Event()
    late = asyncio.create_task(store.get("x"))  # CPU miss, then waits before the disk read
    await asyncio.sleep(0.02)
    disk.gate = None
    assert (await store.get("x")).tier == "disk"  # promoted: CPU now, the disk copy removed
    assert await disk.contains(["x"]) == [False]
    gate.set()
    hit = await late
    assert (hit.value, hit.tier) == (b"x" * 10, "cpu")
