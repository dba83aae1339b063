"""Moves down racing puts, deletes, promotions, cancellations and hung tiers (review R2 of issue 8).

Each test builds the race on the real tiers (CPU, the disk and shared-filesystem file tiers under
``tmp_path``), holding a tier's lock or a test tier's gate to order the steps; what is asserted is
where each key ends up, what was published and what was counted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from services.kv_store.store import BlockStore
from services.kv_store.tiers import files
from services.kv_store.tiers.base import PutResult, ReleaseFailed
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier


def where(store: BlockStore, key: str) -> list[str]:
    return [tier.name for tier in store.tiers if key in tier.held_keys()]


def block(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[100 + i], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
        medium="CPU",
    )


def media_by_hash(events: list[KVEvent]) -> dict[int | bytes, set[str]]:
    """Replay published events: block hash -> media holding it."""
    held: dict[int | bytes, set[str]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                held.setdefault(h, set()).add(str(event.medium))
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                held.setdefault(h, set()).discard(str(event.medium))
    return held


# -- 6: a put's sweep never removes its own value, and no stale copy lands below it -------------


async def test_a_put_whose_own_value_moves_down_during_the_put_keeps_it(tmp_path: Path) -> None:
    """put(k) waits on the disk (its victim a moves there); two other puts evict k's new value from
    CPU meanwhile, its move lands on the disk after put(k)'s own: put(k)'s sweep keeps that copy."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    await store.put("a", b"a" * 10)
    await store.put("b", b"b" * 10)
    async with disk._lock:
        put_k = asyncio.create_task(store.put("k", b"K" * 10))  # evicts a: its move waits for the disk
        await asyncio.sleep(0.05)
        others = [asyncio.create_task(store.put("c", b"c" * 10))]  # evicts b
        await asyncio.sleep(0.05)
        others.append(asyncio.create_task(store.put("d", b"d" * 10)))  # evicts k's new value
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(put_k, *others), 5)
    assert where(store, "k") == ["disk"]
    assert (await store.get("k")).value == b"K" * 10
    assert store.metrics.lost == {}


async def test_an_older_copy_moving_down_during_a_put_does_not_stay_below_it(tmp_path: Path) -> None:
    """k's old value sits on the disk; put(k, new) evicts a from CPU, a's move evicts k's old value
    from the disk and it moves to the shared tier (a move begun after the new value was stored),
    which is held: the put waits for that move and sweeps the stale copy where it landed."""
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), shared])
    for key in ("k", "x", "a", "b"):
        await store.put(key, key.encode() * 10)  # CPU a, b; disk k, x
    assert where(store, "k") == ["disk"]
    async with shared._lock:
        put = asyncio.create_task(store.put("k", b"N" * 10))  # evicts a -> disk evicts k (old) -> shared
        await asyncio.sleep(0.1)
        assert not put.done()
    await asyncio.wait_for(put, 5)
    assert where(store, "k") == ["cpu"]
    assert (await store.get("k")).value == b"N" * 10
    assert await store.contains(["a", "b", "x"]) == [True, True, True]


# -- 7: write-through evictions are published and demoted ------------------------------------


async def test_write_through_evictions_publish_block_removed(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 20)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(1000), shared], write_through=["sharedfs"], on_events=events.extend)
    for i, key in enumerate("abc"):
        await store.put(key, key.encode() * 10, block(i))
    held = media_by_hash(events)
    assert shared.held_keys() == ["b", "c"]
    assert held[100] == {"CPU"}  # a left the shared tier: BlockRemoved on SHARED
    assert held[101] == held[102] == {"CPU", "SHARED"}
    assert shared.stats().evictions == 1


async def test_write_through_victims_move_down_to_a_slower_tier(tmp_path: Path) -> None:
    """A write-through tier that is not the last demotes its victims like any tier."""
    (tmp_path / "shared").mkdir()
    events: list[KVEvent] = []
    store = BlockStore(
        [CpuTier(1000), DiskTier(tmp_path / "nvme", 20), SharedFsTier(tmp_path / "shared", 1000)],
        write_through=["disk"], on_events=events.extend,
    )
    for i, key in enumerate("abc"):
        await store.put(key, key.encode() * 10, block(i))
    assert where(store, "a") == ["cpu", "sharedfs"]
    assert media_by_hash(events)[100] == {"CPU", "SHARED"}
    assert store.metrics.moved_bytes[("sharedfs", "demote")] == 10
    assert store.metrics.lost == {}


# -- 8: file tiers are cancellation-safe ------------------------------------------------------


class SlowDisk(DiskTier):
    """The real disk tier whose file writes take 0.3 s in their worker thread."""

    def _write(
        self, key: str, value: bytes, victims: list[str], keep_victims: bool, meta: bytes = b""
    ) -> list[tuple[str, bytes]]:
        time.sleep(0.3)
        return super()._write(key, value, victims, keep_victims, meta)


def files_under(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


async def test_a_cancelled_file_put_keeps_index_and_files_in_step(tmp_path: Path) -> None:
    disk = SlowDisk(tmp_path / "nvme", 20)
    await disk.put("v1", b"1" * 10)
    await disk.put("v2", b"2" * 10)
    task = asyncio.create_task(disk.put("n", b"n" * 10))  # evicts v1 once n is written
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert disk.held_keys() == ["v2", "n"]  # the cancellation waited for the thread and its bookkeeping
    assert disk.stats().used_bytes == 20
    assert files_under(tmp_path / "nvme") == sorted(files.file_name(k) for k in ("v2", "n"))
    assert await disk.contains(["v1", "n"]) == [False, True]
    assert await disk.get("n") == b"n" * 10


async def test_cancelled_file_evict_and_release_keep_index_and_files_in_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path / "nvme", 20)
    await disk.put("a", b"a" * 10)
    await disk.put("b", b"b" * 10)
    result = await disk.put("c", b"c" * 10, keep_victims=True)  # a pending
    real_unlink = files._unlink

    def slow_unlink(path: Path) -> bool:
        time.sleep(0.3)
        return real_unlink(path)

    monkeypatch.setattr(files, "_unlink", slow_unlink)
    for op in (disk.evict("b"), disk.release(result.victims)):
        task = asyncio.ensure_future(op)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert disk.held_keys() == ["c"]
    assert disk.stats().pending == 0 and disk.stats().used_bytes == 10
    assert files_under(tmp_path / "nvme") == [files.file_name("c")]


# -- 9: an interrupted cascade loses nothing it can keep, and counts what it drops ----------


async def test_an_interrupted_cascade_counts_the_cpu_victim_lost(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    await store.put("x", b"x" * 10)
    await store.put("y", b"y" * 10)
    async with disk._lock:
        put = asyncio.create_task(store.put("z", b"z" * 10))  # x pending in CPU, waiting for the disk
        await asyncio.sleep(0.05)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
    assert store.metrics.lost == {"cpu": 1}
    assert where(store, "x") == []


async def test_an_interrupted_cascade_from_a_file_tier_keeps_its_victims(tmp_path: Path) -> None:
    """A disk victim whose move to the shared tier is interrupted goes back into the disk tier's
    index (its file is there; a restart would serve it): not unlinked, not lost; the CPU victim
    that had landed on the disk stays there."""
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    disk = DiskTier(tmp_path / "nvme", 20)
    store = BlockStore([CpuTier(20), disk, shared])
    for key in "abcd":
        await store.put(key, key.encode() * 10)  # CPU c, d; disk a, b
    async with shared._lock:
        put = asyncio.create_task(store.put("e", b"e" * 10))  # c -> disk evicts a -> shared (held)
        await asyncio.sleep(0.1)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
    assert store.metrics.lost == {}
    assert disk.stats().pending == 0 and store.tiers[0].stats().pending == 0
    assert set(disk.held_keys()) == {"a", "b", "c"}
    assert (tmp_path / "nvme" / files.file_name("a")[:2] / files.file_name("a")).exists()
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * 10
    reopened = DiskTier(tmp_path / "nvme", 1000)  # what a restart would find: the same keys
    assert {key for key, _ in reopened.take_rescanned()} >= {"b", "c"}


# -- 10: a hung tier never blocks a put or delete forever -------------------------------------


class GatedTier(CpuTier):
    """A slower in-memory tier whose put of ``gated`` keys waits for ``gate`` (a hung medium)."""

    name = "gated"

    def __init__(self, capacity_bytes: int, gated: set[str]) -> None:
        super().__init__(capacity_bytes)
        self.gate = asyncio.Event()
        self.gated = gated

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        if key in self.gated:
            await self.gate.wait()
        return await super().put(key, value, keep_victims=keep_victims, meta=meta)


async def test_a_put_behind_a_hung_move_of_its_key_goes_on_and_the_stale_copy_is_dropped() -> None:
    gated = GatedTier(1000, {"x"})
    store = BlockStore([CpuTier(20), gated], settle_timeout_s=0.2)
    await store.put("x", b"1" * 10)
    await store.put("y", b"y" * 10)
    hung = asyncio.create_task(store.put("z", b"z" * 10))  # x (old) moves to the hung tier
    await asyncio.sleep(0.05)
    started = time.monotonic()
    await asyncio.wait_for(store.put("x", b"2" * 5), 5)
    assert time.monotonic() - started < 2
    assert store.metrics.settle_timeouts == 1
    gated.gate.set()  # the old value lands late: removed where it lands
    await asyncio.wait_for(hung, 5)
    assert "x" not in gated.held_keys()
    assert (await store.get("x")).value == b"2" * 5


async def test_a_delete_behind_a_hung_move_of_its_key_goes_on_and_the_key_never_returns() -> None:
    gated = GatedTier(1000, {"x"})
    store = BlockStore([CpuTier(20), gated], settle_timeout_s=0.2)
    await store.put("x", b"1" * 10)
    await store.put("y", b"y" * 10)
    hung = asyncio.create_task(store.put("z", b"z" * 10))
    await asyncio.sleep(0.05)
    assert await asyncio.wait_for(store.delete("x"), 5) is True
    assert store.metrics.settle_timeouts == 1
    gated.gate.set()
    await asyncio.wait_for(hung, 5)
    assert await store.contains(["x", "y", "z"]) == [False, True, True]


# -- 11: release failures and promotions of pending victims ----------------------------------


async def test_a_failed_release_marks_removed_only_the_victims_still_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing the victims' files fails: the victim a put replaced meanwhile is still on the disk
    (no BlockRemoved for it), the one that was still pending is gone from the view (BlockRemoved)."""
    disk = DiskTier(tmp_path / "nvme", 30)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(1000), disk], on_events=events.extend)
    store.residency.describe("a", block(0))
    store.residency.describe("b", block(1))
    await store._store(1, "a", b"a" * 10, "demote")
    await store._store(1, "b", b"b" * 10, "demote")
    result = await disk.put("c", b"c" * 30, keep_victims=True)  # a and b pending
    assert [victim for victim, _ in result.victims] == ["a", "b"]
    await store._store(1, "a", b"A" * 10, "put")  # a replaced meanwhile: no longer pending

    def failing_unlink(path: Path) -> bool:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files, "_unlink", failing_unlink)
    with pytest.raises(ReleaseFailed) as failed:
        await disk.release([(victim, value) for victim, value in result.victims])
    assert failed.value.released == [False, True]
    disk._pending["b"] = result.victims[1][1]  # pending again, for the store's release below
    await store._release(disk, result.victims)
    store._flush()
    held = media_by_hash(events)
    assert held[100] == {"DISK"}  # a, replaced and still on the disk, is not reported removed
    assert held[101] == set()
    assert store.metrics.failures["disk"] == 1
    assert (await store.get("a")).value == b"A" * 10


async def test_a_promoted_pending_victim_keeps_the_copy_its_move_lands_in_a_shared_tier(tmp_path: Path) -> None:
    """a, pending on the disk on its way to the shared tier, is promoted (its disk copy removed); the
    copy its move lands in the shared tier stays (another instance may read it: shared tiers are
    for sharing), so a is on CPU and SHARED. The private-tier case (the landed copy removed, one
    copy per instance) is in test_shared_copies.py."""
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), shared])
    for key in "abcd":
        await store.put(key, key.encode() * 10)  # CPU c, d; disk a, b
    async with shared._lock:
        put = asyncio.create_task(store.put("e", b"e" * 10))  # c -> disk evicts a: a pending on disk
        await asyncio.sleep(0.05)
        get = asyncio.create_task(store.get("a"))  # promotes a, removing its pending disk copy
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(put, get), 5)
    assert where(store, "a") == ["cpu", "sharedfs"]
    assert store.metrics.lost == {}
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * 10
