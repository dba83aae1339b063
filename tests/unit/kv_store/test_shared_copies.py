"""A promotion leaves the shared and written-through copies in place (shared tiers are for sharing).

A promotion copies a hit up to CPU and removes the *private* copies below (one copy per instance);
a copy in a shared tier (another kv_store instance may be reading it) or in a write-through tier
(it holds every put's value by design) stays, and the published residency says the block is on
both media. Real tiers: CPU, the disk and shared-filesystem file tiers under ``tmp_path``; a
tier's lock held by the test orders the steps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier


class SecondDisk(DiskTier):
    """A second private file tier (another local disk) below the first."""

    name = "nvme2"


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


async def promote_pending_victim(store: BlockStore, held: asyncio.Lock) -> None:
    """CPU c, d; disk a, b. put(e) evicts c, whose move evicts a from the disk: a is pending on the disk,
    its move to the tier below waits on ``held``; get(a) meanwhile promotes a (its disk copy removed)."""
    for i, key in enumerate("abcd"):
        await store.put(key, key.encode() * 10, block(i))
    assert where(store, "a") == ["disk"]
    async with held:
        put = asyncio.create_task(store.put("e", b"e" * 10, block(4)))
        await asyncio.sleep(0.05)
        get = asyncio.create_task(store.get("a"))
        await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(put, get), 5)


async def test_the_copy_a_promoted_victims_move_lands_in_a_shared_tier_stays(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), shared], on_events=events.extend)
    await promote_pending_victim(store, shared._lock)
    assert where(store, "a") == ["cpu", "sharedfs"]
    assert media_by_hash(events)[100] == {"CPU", "SHARED"}  # published on both media, never removed from SHARED
    assert not any(isinstance(e, BlockRemoved) and e.medium == "SHARED" for e in events)
    other = SharedFsTier(tmp_path / "shared", 1000)  # another instance on the same namespace reads it
    assert await other.get("a") == b"a" * 10
    assert store.metrics.lost == {}
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * 10


async def test_the_copy_a_promoted_victims_move_lands_in_a_private_tier_is_removed(tmp_path: Path) -> None:
    """The same race over two private tiers: one copy per instance, the landed copy is removed."""
    second = SecondDisk(tmp_path / "nvme2", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), second], on_events=events.extend)
    await promote_pending_victim(store, second._lock)
    assert where(store, "a") == ["cpu"]
    assert media_by_hash(events)[100] == {"CPU"}
    assert store.metrics.lost == {}
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * 10


async def test_a_put_after_the_promotion_sweeps_the_kept_shared_copy(tmp_path: Path) -> None:
    """The kept shared copy is the old value once the key is put again: the put's sweep removes it."""
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), shared], on_events=events.extend)
    await promote_pending_victim(store, shared._lock)
    await store.put("a", b"A" * 10, block(0))
    assert where(store, "a") == ["cpu"]
    assert media_by_hash(events)[100] == {"CPU"}
    assert (await store.get("a")).value == b"A" * 10


async def test_a_promotion_out_of_a_write_through_tier_keeps_its_copy(tmp_path: Path) -> None:
    """disk is written through: a hit there is copied to CPU and stays on the disk (both published);
    before, the promotion removed it and the disk no longer held every put's value."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(20), disk], write_through=["disk"], on_events=events.extend)
    for i, key in enumerate("abc"):
        await store.put(key, key.encode() * 10, block(i))  # a evicted from CPU: already on the disk
    assert where(store, "a") == ["disk"]
    assert (await store.get("a")).value == b"a" * 10
    assert where(store, "a") == ["cpu", "disk"]
    assert where(store, "b") == ["disk"]  # promotion's victim: already on the disk, not copied again
    held = media_by_hash(events)
    assert held[100] == {"CPU", "DISK"}
    assert held[101] == {"DISK"} and held[102] == {"CPU", "DISK"}
    assert store.metrics.lost == {} and store.metrics.promotions_undone == 0
    assert sorted(disk.held_keys()) == ["a", "b", "c"]
