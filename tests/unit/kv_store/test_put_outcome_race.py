"""Per-call figures of a put (``PutOutcome.evicted``, ``PutOutcome.lost``, so ``PutResponse``'s) are
this call's own while other calls run: counted along the call's placement and cascade, never read
off the store's shared counters across an await (a concurrent put's or promotion's losses were
counted in this put's answer too).

Real tiers throughout; the disk tier's own put lock is held by a test where the interleaving must be
exact (a file tier serialises puts and evictions on it).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier


def break_directory(root: Path) -> None:
    """Every write under ``root`` fails from now on (a file takes the directory's name)."""
    shutil.rmtree(root)
    root.write_text("not a directory any more")


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_two_concurrent_puts_each_losing_one_value_say_one_each(tmp_path: Path) -> None:
    """The reviewer's case: both puts' victims are in flight to a broken disk tier at once."""
    store = BlockStore([CpuTier(30), DiskTier(tmp_path / "nvme", 1000)])
    await store.put("a", b"a" * 15)
    await store.put("b", b"b" * 15)
    break_directory(tmp_path / "nvme")
    outcomes = await asyncio.gather(store.put("c", b"c" * 15), store.put("d", b"d" * 15))
    assert [(o.evicted, o.lost) for o in outcomes] == [(1, 1), (1, 1)]
    assert store.metrics.lost == {"cpu": 2}


async def test_a_concurrent_put_that_loses_nothing_says_zero(tmp_path: Path) -> None:
    """c's victim (25 bytes) is lost (the disk fails, the 20-byte shared tier is too small) while d's
    victim (15 bytes) is in flight and then lands in the shared tier: c says 1, d says 0."""
    (tmp_path / "shared").mkdir()
    store = BlockStore([CpuTier(40), DiskTier(tmp_path / "nvme", 1000), SharedFsTier(tmp_path / "shared", 20)])
    await store.put("a", b"a" * 25)
    await store.put("b", b"b" * 15)
    break_directory(tmp_path / "nvme")
    c, d = await asyncio.gather(store.put("c", b"c" * 25), store.put("d", b"d" * 15))
    assert (c.evicted, c.lost) == (1, 1)
    assert (d.evicted, d.lost) == (1, 0)
    assert store.metrics.lost == {"cpu": 1}
    assert (await store.get("b")).value == b"b" * 15


async def test_a_loss_deep_in_the_cascade_is_counted_once_by_its_put(tmp_path: Path) -> None:
    """A loss below the first demotion (the CPU tier's victim lands on disk, whose own victim no
    shared tier takes) is the put's; a concurrent put with no loss still says 0."""
    store = BlockStore(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 20), SharedFsTier(tmp_path / "not-mounted", 1000)]
    )
    await store.put("a", b"a" * 15)
    await store.put("b", b"b" * 15)  # a -> disk
    first, second = await asyncio.gather(store.put("c", b"c" * 15), store.put("x", b"x" * 5))
    # c: CPU evicts b -> disk, which evicts a -> the shared path is missing: a is lost (by disk)
    assert (first.evicted, first.lost) == (1, 1)
    assert (second.evicted, second.lost) == (0, 0)  # x fits beside c in the CPU tier
    assert store.metrics.lost == {"disk": 1}
    assert store.dropped("sharedfs") == 1


async def test_a_promotion_undone_meanwhile_is_not_a_concurrent_puts_loss(tmp_path: Path) -> None:
    """A get's promotion would evict y from the CPU tier with no slower tier to take it (too large
    for the 20-byte disk): it is undone (a read loses nothing, tests/unit/kv_store/
    test_promotion_swap.py) while a put of z is in flight; the put says lost=0 and nothing is lost."""
    disk = DiskTier(tmp_path / "nvme", 20)
    store = BlockStore([CpuTier(40), disk])
    await store.put("x", b"x" * 15)
    await store.put("y", b"y" * 25)
    await store.put("z", b"z" * 15)  # x -> disk; the CPU tier holds y, z (40 bytes)
    async with disk._lock:  # the disk's puts and evictions wait here
        put = asyncio.create_task(store.put("z", b"Z" * 15))  # replaces z: no eviction, then waits
        await asyncio.sleep(0)
        get = asyncio.create_task(store.get("x"))  # reads x; its swap waits on the disk's lock
        await asyncio.sleep(0.05)
        assert not put.done() and not get.done()
    outcome, hit = await asyncio.gather(put, get)
    assert (outcome.evicted, outcome.lost) == (0, 0)
    assert hit.value == b"x" * 15
    assert store.metrics.lost == {}
    assert store.metrics.promotions_undone == 1
    assert await store.contains(["x", "y", "z"]) == [True, True, True]


async def test_many_concurrent_outcomes_add_up_to_the_metric(tmp_path: Path) -> None:
    """Many puts in flight over a failing disk: the per-call figures sum to the shared counters."""
    store = BlockStore([CpuTier(50), DiskTier(tmp_path / "nvme", 1000)])
    for key in "abcde":
        await store.put(key, key.encode() * 10)
    break_directory(tmp_path / "nvme")
    outcomes = await asyncio.gather(*(store.put(f"k{i}", b"v" * 10) for i in range(8)))
    assert [(o.evicted, o.lost) for o in outcomes] == [(1, 1)] * 8
    assert sum(o.lost for o in outcomes) == sum(store.metrics.lost.values()) == 8
