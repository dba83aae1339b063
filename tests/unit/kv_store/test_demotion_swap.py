"""A demotion keeps the value reachable the whole time, and Contains / Lookup take a second look.

Review of wave 10 (issue 8): a tier's eviction victim was in no tier while it moved down (the
faster tier dropped it before the slower one stored it), so a concurrent Get or Contains of the
key missed; a Contains racing a promotion reported a stored key absent. Now a victim stays
readable in the tier that evicted it (*pending*) until the store releases it after a slower tier
took it (or none could: then it is an eviction, counted lost), and Contains / Lookup rescan the
keys they missed when a promotion moved keys up past their scan.

Real tiers throughout (CPU, disk and shared-FS tiers on real directories); the slower tier's own
lock is held to stop a demotion exactly between "evicted above" and "stored below".
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.index import InMemoryIndex
from services.kv_store.metrics import register_metrics
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, FileTier, SharedFsTier


class NvmeTier(DiskTier):
    """A second local disk tier (a real file tier under another name) behind a disk first tier."""

    name = "nvme"


def _slower(tmp_path: Path, kind: str, capacity: int) -> FileTier:
    if kind == "disk":
        return DiskTier(tmp_path / "nvme", capacity)
    (tmp_path / "shared").mkdir(exist_ok=True)
    return SharedFsTier(tmp_path / "shared", capacity)


@pytest.mark.parametrize("slower", ["disk", "sharedfs"])
async def test_a_victim_moving_down_from_cpu_stays_readable(tmp_path: Path, slower: str) -> None:
    """CPU -> disk (and CPU -> shared FS): with the slower tier's lock held, the put that evicted x
    waits to store it there; meanwhile x is still found by get, contains and media (in CPU)."""
    below = _slower(tmp_path, slower, 1000)
    store = BlockStore([CpuTier(20), below])
    await store.put("x", b"x" * 10)
    await store.put("y", b"y" * 10)
    async with below._lock:
        put = asyncio.create_task(store.put("z", b"z" * 10))  # evicts x; its demotion waits here
        await asyncio.sleep(0.05)
        assert not put.done()
        assert await store.contains(["x", "y", "z"]) == [True, True, True]
        assert await store.media(["x"]) == [Medium.CPU]
        hit = await store.get("x")
        assert (hit.value, hit.tier) == (b"x" * 10, "cpu")
        assert store.tiers[0].stats().used_bytes == 20  # the pending victim is outside the budget
        registry = CollectorRegistry()
        register_metrics(store, registry)
        assert registry.get_sample_value("kvmesh_kv_store_pending", {"tier": "cpu", "medium": "CPU"}) == 1
    outcome = await put
    assert (outcome.evicted, outcome.lost) == (1, 0)
    assert await below.contains(["x"]) == [True]
    assert await store.tiers[0].contains(["x"]) == [False]  # released once the slower tier took it
    assert store.tiers[0].stats().pending == 0
    assert store.metrics.lost == {}


async def test_a_victim_moving_down_from_disk_to_the_shared_tier_stays_readable(tmp_path: Path) -> None:
    """Second level of the cascade: a disk victim waits for the shared tier and is still on disk."""
    (tmp_path / "shared").mkdir()
    shared = SharedFsTier(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 20), shared], promote_on_hit=False)
    for key in "abcd":
        await store.put(key, key.encode() * 10)  # CPU: c, d; disk: a, b
    async with shared._lock:
        put = asyncio.create_task(store.put("e", b"e" * 10))  # c -> disk evicts a -> shared waits
        await asyncio.sleep(0.05)
        assert not put.done()
        assert await store.contains(list("abcde")) == [True] * 5
        # c is stored on disk already; CPU releases it once the cascade below it (a -> shared) ends
        assert await store.media(["a", "c"]) == [Medium.DISK, Medium.CPU]
        hit = await store.get("a")
        assert (hit.value, hit.tier) == (b"a" * 10, "disk")
    await put
    assert await shared.contains(["a"]) == [True]
    assert await store.tiers[1].contains(["a", "b", "c"]) == [False, True, True]
    assert store.tiers[1].stats().pending == 0
    assert not (tmp_path / "nvme" / "x").exists()
    assert store.metrics.lost == {}


async def test_a_victim_moving_down_from_a_file_first_tier_stays_readable(tmp_path: Path) -> None:
    """File tier first: its victim's file stays until the next tier took the value."""
    first = DiskTier(tmp_path / "first", 20)
    nvme = NvmeTier(tmp_path / "second", 1000)
    store = BlockStore([first, nvme])
    await store.put("x", b"x" * 10)
    await store.put("y", b"y" * 10)
    async with nvme._lock:
        put = asyncio.create_task(store.put("z", b"z" * 10))
        await asyncio.sleep(0.05)
        assert not put.done()
        assert first.path_of("x").exists()
        assert await store.contains(["x"]) == [True]
        assert (await store.get("x")).value == b"x" * 10
    await put
    assert not first.path_of("x").exists()
    assert (await store.get("x")).value == b"x" * 10


async def test_a_victim_no_slower_tier_takes_is_an_eviction_once_every_tier_refused(tmp_path: Path) -> None:
    """Every slower tier refuses (the disk too small, the shared path gone): the value stayed
    readable while they were tried, then it is lost (counted, dropped by reason) and released."""
    store = BlockStore([CpuTier(20), DiskTier(tmp_path / "nvme", 5), SharedFsTier(tmp_path / "missing", 1000)])
    await store.put("a", b"a" * 15)
    outcome = await store.put("b", b"b" * 15)
    assert (outcome.evicted, outcome.lost) == (1, 1)
    assert store.metrics.lost == {"cpu": 1}
    assert store.metrics.dropped == {("disk", "too_large"): 1, ("sharedfs", "unavailable"): 1}
    assert await store.contains(["a", "b"]) == [False, True]
    assert store.tiers[0].stats().pending == 0


class Recorder:
    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, events: list[KVEvent]) -> None:
        self.events.extend(events)

    def flat(self) -> list[tuple[str, int, str]]:
        return [
            (type(e).__name__, int(e.block_hashes[0]), str(e.medium))
            for e in self.events
            if isinstance(e, BlockStored | BlockRemoved)
        ]


def block(i: int) -> BlockStored:
    return BlockStored(block_hashes=[100 + i], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=4)


async def test_a_pending_demotion_publishes_nothing_until_it_moved(tmp_path: Path) -> None:
    """Events (issue 8 item 3): while the victim is pending nothing about it is published; once the
    disk took it, a store on DISK then a removal on CPU; never a removal first."""
    rec = Recorder()
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk], on_events=rec)
    await store.put("x", b"x" * 10, block(0))
    await store.put("y", b"y" * 10, block(1))
    rec.events.clear()
    async with disk._lock:
        put = asyncio.create_task(store.put("z", b"z" * 10, block(2)))
        await asyncio.sleep(0.05)
        await store.contains(["x"])  # another operation flushes what is pending so far
        assert ("BlockRemoved", 100, "CPU") not in rec.flat()
    await put
    assert rec.flat() == [("BlockStored", 102, "CPU"), ("BlockStored", 100, "DISK"), ("BlockRemoved", 100, "CPU")]


async def test_an_undone_promotion_publishes_no_removal_of_its_victims(tmp_path: Path) -> None:
    """The victim of an undone promotion never left the first tier: no removal (and no store) of it
    is published; the promoted key moves up and back, each move a store then a removal."""
    rec = Recorder()
    store = BlockStore([CpuTier(40), DiskTier(tmp_path / "nvme", 20)], on_events=rec)
    await store.put("x", b"x" * 15, block(0))
    await store.put("y", b"y" * 25, block(1))
    await store.put("z", b"z" * 15, block(2))  # x -> disk; CPU: y, z (y too large for the disk)
    rec.events.clear()
    assert (await store.get("x")).value == b"x" * 15
    assert store.metrics.promotions_undone == 1
    assert [e for e in rec.flat() if e[1] == 101] == []
    moves = rec.flat()
    assert moves.index(("BlockStored", 100, "CPU")) < moves.index(("BlockRemoved", 100, "DISK"))
    assert moves.index(("BlockStored", 100, "DISK")) < moves.index(("BlockRemoved", 100, "CPU"))
    assert await store.contains(["x", "y", "z"]) == [True, True, True]
    assert store.tiers[0].stats().pending == 0


class GatedDiskTier(DiskTier):
    """The real disk tier; a contains begun while ``gate`` is set waits for it (to put a scan of
    this tier exactly after another get's promotion)."""

    gate: asyncio.Event | None = None

    async def contains(self, keys: list[str]) -> list[bool]:  # type: ignore[override]
        gate = self.gate
        if gate is not None:
            await gate.wait()
        return await super().contains(keys)


@pytest.mark.parametrize("call", ["contains", "media"])
async def test_a_contains_whose_scan_the_promoted_key_passed_looks_again(tmp_path: Path, call: str) -> None:
    """Contains (and Lookup's media) checked CPU (miss) before a get promoted x, and checks the disk
    after the promotion removed x there: it looks again and finds x in CPU instead of answering absent."""
    disk = GatedDiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    for key in "xyz":
        await store.put(key, key.encode() * 10)  # x -> disk
    disk.gate = gate = asyncio.Event()
    late = asyncio.create_task(getattr(store, call)(["x", "y", "nope"]))
    await asyncio.sleep(0.02)
    disk.gate = None
    assert (await store.get("x")).tier == "disk"  # promoted: CPU now, the disk copy removed
    assert await disk.contains(["x"]) == [False]
    gate.set()
    answer = await late
    if call == "contains":
        assert answer == [True, True, False]
    else:
        assert answer[0] is Medium.CPU and answer[2] is None


async def test_concurrent_contains_and_moves_never_report_a_stored_key_absent(tmp_path: Path) -> None:
    """Puts that demote and gets that promote run while Contains of every key runs: every key put
    stays reported present (nothing is lost: the disk is large enough for everything)."""
    store = BlockStore([CpuTier(3000), DiskTier(tmp_path / "nvme", 10_000_000)])
    keys = [f"k{i:02d}" for i in range(20)]
    for key in keys:
        await store.put(key, key.encode() * 300)
    for round_ in range(20):
        work = [store.get(keys[(round_ * 7 + j) % 20]) for j in range(3)]
        work.append(store.put(keys[round_ % 20], keys[round_ % 20].encode() * 300))
        results = await asyncio.gather(store.contains(keys), *work, store.contains(keys))
        assert results[0] == [True] * 20 and results[-1] == [True] * 20
    assert store.metrics.lost == {}


async def test_an_undone_promotion_whose_deeper_victim_found_no_tier_leaves_nothing_pending(tmp_path: Path) -> None:
    """The promotion's CPU victim c goes to the disk, whose own victim b finds no tier (too large
    for the shared tier): the promotion is undone, b returns to CPU, c stays on disk, and no tier
    keeps a victim pending (c is released from CPU although only b, a level deeper, found no tier)."""
    (tmp_path / "shared").mkdir()
    store = BlockStore([CpuTier(30), DiskTier(tmp_path / "nvme", 25), SharedFsTier(tmp_path / "shared", 5)])
    await store.put("a", b"a" * 10)
    await store.put("b", b"b" * 15)
    await store.put("c", b"c" * 15)  # a -> disk
    await store.put("d", b"d" * 15)  # b -> disk (full: 25)
    assert (await store.get("a")).value == b"a" * 10
    assert store.metrics.promotions_undone == 1
    assert store.metrics.lost == {}
    assert [tier.stats().pending for tier in store.tiers] == [0, 0, 0]
    assert await store.tiers[0].contains(list("abcd")) == [False, True, False, True]
    assert await store.tiers[1].contains(list("abcd")) == [True, False, True, False]
    for key, size in zip("abcd", (10, 15, 15, 15), strict=True):
        assert (await store.get(key)).value == key.encode() * size


@pytest.mark.parametrize("writer", ["put", "delete"])
async def test_a_write_of_a_key_moving_down_is_not_undone_by_the_move(tmp_path: Path, writer: str) -> None:
    """A put (or delete) of y while y's old value V1 waits to move down: the move must not land V1
    on the disk after the write swept the slower tiers (a stale V1 there, or a deleted key back).
    The write waits for the move of its key, then sweeps."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(40), disk])
    await store.put("x", b"x" * 10)
    await store.put("y", b"y" * 10)
    await store.put("w", b"w" * 10)
    async with disk._lock:
        put = asyncio.create_task(store.put("z", b"z" * 21))  # evicts x then y: x's move waits here
        await asyncio.sleep(0.05)
        write = asyncio.create_task(store.put("y", b"Y" * 9) if writer == "put" else store.delete("y"))
        await asyncio.sleep(0.05)
        assert await store.contains(["y"]) == [True]
    await asyncio.gather(put, write)
    assert await disk.contains(["y"]) == [False]  # no stale copy below
    if writer == "put":
        assert (await store.get("y")).value == b"Y" * 9
    else:
        assert await store.contains(["y"]) == [False]
    assert [tier.stats().pending for tier in store.tiers] == [0, 0]
    assert store.metrics.lost == {}


async def test_a_demotion_the_next_tier_refuses_is_a_store_below_it_then_a_removal(tmp_path: Path) -> None:
    """Events of the refused kind: the disk is too small for a, the shared tier takes it: a store on
    SHARED, then the removal from CPU (never a removal with no store); replayed into kv_indexer's
    index the block is on SHARED only."""
    rec = Recorder()
    (tmp_path / "shared").mkdir()
    store = BlockStore(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 5), SharedFsTier(tmp_path / "shared", 1000)], on_events=rec
    )
    await store.put("a", b"a" * 15, block(0))
    await store.put("b", b"b" * 15, block(1))
    assert rec.flat() == [
        ("BlockStored", 100, "CPU"),
        ("BlockStored", 101, "CPU"),
        ("BlockStored", 100, "SHARED"),
        ("BlockRemoved", 100, "CPU"),
    ]
    index = InMemoryIndex()
    source = EndpointId("127.0.0.1:7000")
    index.register_endpoint(Endpoint(id=source, url="grpc://x", model="m", block_size_tokens=4))
    for event in rec.events:
        index.apply(source, event)
    assert index.held_blocks(source) == {100: {Medium.SHARED}, 101: {Medium.CPU}}


async def test_a_put_cancelled_while_its_victim_moves_leaves_nothing_pending(tmp_path: Path) -> None:
    """A put cancelled (its gRPC call cancelled) while its victim waits for the disk: the victim is
    not left pending forever, and a later put of that key does not wait for a move that never ends."""
    disk = DiskTier(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk])
    await store.put("x", b"x" * 10)
    await store.put("y", b"y" * 10)
    async with disk._lock:
        put = asyncio.create_task(store.put("z", b"z" * 10))
        await asyncio.sleep(0.05)
        assert await store.contains(["x"]) == [True]
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
    assert store.tiers[0].stats().pending == 0
    await asyncio.wait_for(store.put("x", b"X" * 10), timeout=5)
    assert (await store.get("x")).value == b"X" * 10
