"""A hung tier under a put's own cascade, and a move of the put's own value racing its sweep.

The hung medium is the real file tier whose file write blocks in its worker thread (a filesystem
that stops answering) until the test lets it go; the store bounds every slower-tier operation
(``tier_timeout_s``), counts the tier unavailable while the write still runs, and settles what the
write did once it ends. Steps are ordered by gates (events the tiers wait on or set), never by
sleeping for a race to happen.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from services.kv_store import store as store_module
from services.kv_store.errors import KeyNotFound
from services.kv_store.flow import Detached
from services.kv_store.store import BlockStore
from services.kv_store.tiers import files
from services.kv_store.tiers.base import PutResult
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier

GATE_WAIT_S = 10.0
"""Longest a gated write blocks (a failing test never hangs the run)."""


class _WriteGates:
    """Gates on the file writes of chosen keys, in the tier's worker thread (a hung filesystem)."""

    def __init__(self) -> None:
        self.gates: dict[str, tuple[threading.Event, asyncio.Event]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def hang(self, key: str) -> asyncio.Event:
        """Block the next writes of ``key`` until :meth:`free`; the returned event is set once one blocks."""
        self.loop = asyncio.get_running_loop()
        started = asyncio.Event()
        self.gates[key] = (threading.Event(), started)
        return started

    def free(self, key: str) -> None:
        self.gates[key][0].set()

    def free_all(self) -> None:
        for gate, _ in self.gates.values():
            gate.set()

    def wait(self, key: str) -> None:
        gated = self.gates.get(key)
        if gated is None:
            return
        gate, started = gated
        assert self.loop is not None
        self.loop.call_soon_threadsafe(started.set)
        gate.wait(GATE_WAIT_S)


class HangingDisk(DiskTier):
    """The real disk tier; :attr:`writes` can make a key's file write block (a hung mount)."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        super().__init__(root, capacity_bytes)
        self.writes = _WriteGates()

    def _write(
        self, key: str, value: bytes, victims: list[str], keep_victims: bool, meta: bytes = b""
    ) -> list[tuple[str, bytes]]:
        self.writes.wait(key)
        return super()._write(key, value, victims, keep_victims, meta)


class HangingShared(SharedFsTier):
    """The real shared-filesystem tier, with :class:`HangingDisk`'s gates."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        super().__init__(root, capacity_bytes)
        self.writes = _WriteGates()

    def _write(
        self, key: str, value: bytes, victims: list[str], keep_victims: bool, meta: bytes = b""
    ) -> list[tuple[str, bytes]]:
        self.writes.wait(key)
        return super()._write(key, value, victims, keep_victims, meta)


def where(store: BlockStore, key: str) -> list[str]:
    return [tier.name for tier in store.tiers if key in tier.held_keys()]


def files_of(root: Path) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_file()}


def block(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[100 + i], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
        medium="CPU",
    )


def media_by_hash(events: list[KVEvent]) -> dict[int | bytes, set[str]]:
    held: dict[int | bytes, set[str]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                held.setdefault(h, set()).add(str(event.medium))
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                held.setdefault(h, set()).discard(str(event.medium))
    return held


# -- a put whose own cascade must demote into a hung tier returns ---------------------------------


async def test_a_put_whose_victim_must_move_into_a_hung_disk_returns_and_counts_it_lost(tmp_path: Path) -> None:
    disk = HangingDisk(tmp_path / "nvme", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(20), disk], tier_timeout_s=1.0, on_events=events.extend)
    try:
        await store.put("a", b"a" * 10, block(0))
        await store.put("b", b"b" * 10, block(1))
        hung = disk.writes.hang("a")
        started = time.monotonic()
        outcome = await asyncio.wait_for(store.put("c", b"c" * 10, block(2)), 5)  # a -> the hung disk
        assert hung.is_set()
        assert time.monotonic() - started < 4  # one tier bound (1 s), not the hung write
        assert (outcome.evicted, outcome.lost) == (1, 1)  # no slower tier took a: lost, counted
        assert store.metrics.timeouts == {"disk": 1}
        assert store.metrics.dropped == {("disk", "unavailable"): 1}
        assert store.metrics.lost == {"cpu": 1}
        assert store.abandoned >= 1  # the write still runs (the sweep's eviction queued behind it)

        outcome = await asyncio.wait_for(store.put("d", b"d" * 10, block(3)), 5)  # b -> refused
        assert outcome.lost == 1
        assert store.metrics.timeouts == {"disk": 1}  # while hung the disk refuses at once: no second wait
        assert store.metrics.dropped == {("disk", "unavailable"): 2}
        assert store.metrics.lost == {"cpu": 2}
        assert await store.contains(["a", "b", "c", "d"]) == [False, False, True, True]
    finally:
        disk.writes.free_all()
    # the write of a ends: its late copy is removed (a was counted lost), nothing counted twice
    assert await store.drain(5) == 0
    assert where(store, "a") == []
    assert files_of(tmp_path / "nvme") == set()
    assert disk.stats().used_bytes == 0 and disk.stats().pending == 0
    assert store.metrics.lost == {"cpu": 2}
    assert "DISK" not in media_by_hash(events).get(100, set())
    await store.put("e", b"e" * 10, block(4))  # the disk works again: c moves there
    assert where(store, "c") == ["disk"]
    assert (await store.get("c")).value == b"c" * 10


async def test_a_late_write_into_a_middle_tier_is_removed_and_its_victims_move_on(tmp_path: Path) -> None:
    """c's write to the disk hangs: c goes on to the shared tier. When the write ends it had
    evicted a from the disk (pending there): the late copy of c is removed (one copy), a moves on
    down to the shared tier, and nothing stays pending."""
    (tmp_path / "shared").mkdir()
    disk = HangingDisk(tmp_path / "nvme", 20)
    shared = SharedFsTier(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(20), disk, shared], tier_timeout_s=1.0)
    try:
        for key in "abcd":
            await store.put(key, key.encode() * 10)  # CPU c, d; disk a, b
        disk.writes.hang("c")
        outcome = await asyncio.wait_for(store.put("e", b"e" * 10), 5)
        assert outcome.lost == 0
        assert where(store, "c") == ["sharedfs"]
        assert store.metrics.timeouts == {"disk": 1}
    finally:
        disk.writes.free_all()
    assert await store.drain(5) == 0
    assert where(store, "c") == ["sharedfs"]
    assert where(store, "a") == ["sharedfs"]
    assert where(store, "b") == ["disk"]
    assert disk.stats().pending == 0 and store.tiers[0].stats().pending == 0
    assert files_of(tmp_path / "nvme") == {files.file_name("b")}
    assert store.metrics.lost == {}
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * 10


async def test_a_late_write_through_is_kept_and_published(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    shared = HangingShared(tmp_path / "shared", 1000)
    events: list[KVEvent] = []
    store = BlockStore([CpuTier(1000), shared], write_through=["sharedfs"], tier_timeout_s=1.0,
                       on_events=events.extend)
    try:
        shared.writes.hang("a")
        outcome = await asyncio.wait_for(store.put("a", b"a" * 10, block(0)), 5)
        assert outcome.medium == "CPU"
        assert store.metrics.dropped == {("sharedfs", "unavailable"): 1}
        assert media_by_hash(events)[100] == {"CPU"}
    finally:
        shared.writes.free_all()
    assert await store.drain(5) == 0
    assert where(store, "a") == ["cpu", "sharedfs"]
    assert media_by_hash(events)[100] == {"CPU", "SHARED"}
    assert await SharedFsTier(tmp_path / "shared", 1000).get("a") == b"a" * 10  # another instance reads it


async def test_a_hung_tier_never_serves_a_read_and_a_delete_returns(tmp_path: Path) -> None:
    """While the disk is hung a get misses there at once and a delete returns; the delete's
    eviction, issued behind the hung write, removes the key when the write ends."""
    disk = HangingDisk(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk], tier_timeout_s=1.0)
    try:
        await store.put("x", b"x" * 10)
        await store.put("y", b"y" * 10)
        await store.put("z", b"z" * 10)  # x on the disk
        disk.writes.hang("y")
        await asyncio.wait_for(store.put("w", b"w" * 10), 5)  # y -> the hung disk: lost
        assert await store.contains(["x"]) == [False]  # the disk is hung: not asked
        with pytest.raises(KeyNotFound):
            await store.get("x")
        assert await asyncio.wait_for(store.delete("x"), 5) is False
        assert store.metrics.timeouts == {"disk": 1}  # none of these waited for the hung disk
    finally:
        disk.writes.free_all()
    assert await store.drain(5) == 0
    assert await store.contains(["x", "y", "z", "w"]) == [False, False, True, True]
    assert files_of(tmp_path / "nvme") == set()


# -- after a settle timeout, a move of the put's own value lands during the put's sweep --------------


class GatedShared(SharedFsTier):
    """The shared tier whose put of a chosen (key, value) waits for a gate, before taking its lock."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        super().__init__(root, capacity_bytes)
        self.gates: dict[tuple[str, bytes], tuple[asyncio.Event, asyncio.Event]] = {}

    def hold(self, key: str, value: bytes) -> asyncio.Event:
        """Hold puts of ``key`` with ``value``; the returned event is set once one waits."""
        entered = asyncio.Event()
        self.gates[(key, value)] = (asyncio.Event(), entered)
        return entered

    def let_go(self, key: str, value: bytes) -> None:
        self.gates[(key, value)][0].set()

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        gated = self.gates.get((key, value))
        if gated is not None:
            gated[1].set()
            await gated[0].wait()
        return await super().put(key, value, keep_victims=keep_victims, meta=meta)


async def sweeping(store: BlockStore, key: str) -> None:
    """Return once a put of ``key`` is sweeping the slower tiers (p's write to the shared tier runs in a
    worker thread first, so this polls the condition, never a fixed delay)."""
    while True:
        watch = store._watched.get(key)
        if watch is not None and watch.sweep is not None:
            return
        await asyncio.sleep(0.001)


async def test_a_move_of_the_puts_own_value_landing_during_its_sweep_is_kept(tmp_path: Path) -> None:
    """put(x, X2) stops waiting for the hung move of x's old value (a settle timeout), so it waits
    for no move of x any more. Meanwhile put(w) evicts X2 from CPU and its move's disk write is in
    flight when put(x, X2)'s sweep reaches the disk. The sweep used to clear the disk right after
    that write (the landed copy was not yet recorded when it chose what to keep) and the CPU
    copy was then released: X2 was gone from every tier, counted nowhere. Now the sweep waits for a
    move's put into the tier it clears, and keeps the put's own value."""
    (tmp_path / "shared").mkdir()
    disk = HangingDisk(tmp_path / "nvme", 15)  # the 16-byte values skip it (too large), X2 fits
    shared = GatedShared(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(32), disk, shared], settle_timeout_s=0.2, tier_timeout_s=5)
    x1, p, q, x2, w = b"1" * 16, b"p" * 16, b"q" * 16, b"2" * 10, b"w" * 10
    try:
        await store.put("x", x1)
        await store.put("p", p)  # CPU x, p (full)
        x1_held = shared.hold("x", x1)
        put_q = asyncio.create_task(store.put("q", q))  # x1 -> (disk: too large) -> shared, held
        await asyncio.wait_for(x1_held.wait(), 5)

        p_held = shared.hold("p", p)
        put_x2 = asyncio.create_task(store.put("x", x2))  # settle timeout, then evicts p -> shared, held
        await asyncio.wait_for(p_held.wait(), 5)
        assert store.metrics.settle_timeouts == 1
        shared.let_go("x", x1)  # the stale move lands: removed where it lands (superseded)
        await asyncio.wait_for(put_q, 5)
        assert where(store, "x") == ["cpu"]
        await store.get("q")  # CPU LRU: x2, q

        x2_writing = disk.writes.hang("x")
        put_w = asyncio.create_task(store.put("w", w))  # evicts x2: its move writes it to the disk (held)
        await asyncio.wait_for(x2_writing.wait(), 5)

        shared.let_go("p", p)  # put(x, X2)'s cascade ends: its sweep begins, x2's disk write in flight
        await asyncio.wait_for(sweeping(store, "x"), 5)
        for _ in range(10):  # let the sweep issue what it issues on the disk before the write ends
            await asyncio.sleep(0)
        disk.writes.free("x")
        await asyncio.wait_for(asyncio.gather(put_x2, put_w), 5)
    finally:
        disk.writes.free_all()
        for gate, _ in shared.gates.values():
            gate.set()
    assert where(store, "x") == ["disk"]
    assert store.metrics.lost == {}
    assert (await store.get("x")).value == x2
    for key, value in (("p", p), ("q", q), ("w", w)):
        assert (await store.get(key)).value == value


async def test_a_detached_put_whose_caller_left_ends_after_the_bound_and_settles(tmp_path: Path) -> None:
    """The gRPC path runs a put through ``Detached`` (its caller's deadline never cuts a move short):
    the caller gives up, the put itself returns after the tier bound, and the late write is settled."""
    disk = HangingDisk(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(20), disk], tier_timeout_s=1.0)
    detached = Detached("test")
    try:
        await store.put("a", b"a" * 10)
        await store.put("b", b"b" * 10)
        disk.writes.hang("a")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(detached.run(store.put("c", b"c" * 10)), 0.05)  # the caller leaves
        assert await detached.drain(5) == 0  # the put ended on its own, bounded
        assert store.metrics.lost == {"cpu": 1} and store.metrics.timeouts == {"disk": 1}
    finally:
        disk.writes.free_all()
    assert await store.drain(5) == 0
    assert where(store, "a") == [] and files_of(tmp_path / "nvme") == set()
    assert await store.contains(["b", "c"]) == [True, True]


async def test_a_stale_move_landing_after_a_newer_move_of_its_key_is_still_removed(tmp_path: Path) -> None:
    """x's old value X1 is on its way to the shared tier (held) when put(x, X2) stops waiting for it
    (superseded); X2 then moves down to the disk (a newer move of x, begun and landed meanwhile).
    When X1 lands it is removed: it used to stay (any newer move of the key cancelled the removal),
    a stale value below X2 that the shared tier served to every instance."""
    (tmp_path / "shared").mkdir()
    disk = DiskTier(tmp_path / "nvme", 15)  # the 16-byte values skip it (too large), X2 fits
    shared = GatedShared(tmp_path / "shared", 1000)
    store = BlockStore([CpuTier(32), disk, shared], settle_timeout_s=0.2)
    x1, p, q, x2, w = b"1" * 16, b"p" * 16, b"q" * 16, b"2" * 10, b"w" * 10
    try:
        await store.put("x", x1)
        await store.put("p", p)
        x1_held = shared.hold("x", x1)
        put_q = asyncio.create_task(store.put("q", q))  # x1 -> shared, held
        await asyncio.wait_for(x1_held.wait(), 5)
        await asyncio.wait_for(store.put("x", x2), 5)  # settle timeout: x1's move superseded
        assert store.metrics.settle_timeouts == 1
        await store.get("q")  # CPU LRU: x2, q
        await store.put("w", w)  # evicts x2: a newer move of x lands on the disk
        assert where(store, "x") == ["disk"]
        shared.let_go("x", x1)
        await asyncio.wait_for(put_q, 5)
    finally:
        for gate, _ in shared.gates.values():
            gate.set()
    assert where(store, "x") == ["disk"]
    assert await SharedFsTier(tmp_path / "shared", 1000).get("x") is None  # no instance reads X1 there
    assert (await store.get("x")).value == x2
    assert store.metrics.lost == {}


async def test_the_work_queued_behind_a_hung_tier_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each put's sweep issues an eviction to the hung disk (queued behind the hung write); at most
    MAX_HUNG_QUEUE of them run at once, later ones are refused (counted degraded), none is lost."""
    monkeypatch.setattr(store_module, "MAX_HUNG_QUEUE", 3)
    disk = HangingDisk(tmp_path / "nvme", 1000)
    store = BlockStore([CpuTier(1000), disk], tier_timeout_s=1.0, write_through=["disk"])
    try:
        disk.writes.hang("a")
        await asyncio.wait_for(store.put("a", b"a" * 10), 5)  # the write-through hangs: 1 running
        failures = store.metrics.failures["disk"]
        for key in "bcdef":
            await store.delete(key)  # each sweep's disk eviction: queued while room, then refused
        assert store.abandoned == 3
        assert store.metrics.failures["disk"] == failures + 5
    finally:
        disk.writes.free_all()
    assert await store.drain(5) == 0
    assert where(store, "a") == ["cpu", "disk"]  # the late write-through is kept
