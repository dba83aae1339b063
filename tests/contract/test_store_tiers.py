"""The StoreTier contract, run against every tier implementation (add new tiers to TIER_NAMES).

Tiers: ``cpu`` (process memory), ``disk`` (a directory per instance), ``sharedfs`` (one shared
namespace directory), ``mooncake`` (the real Mooncake 0.3.13.post1 master and client). Mooncake's
client binds 0.0.0.0, so it runs only inside a private network namespace: the mooncake cases run
when ``KVMESH_MOONCAKE_MASTER`` names a master (set by ``tests/integration/test_kv_store_mooncake.py``,
which re-runs this file under ``unshare -n`` with a fresh ``mooncake_master``) and are skipped
otherwise with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.errors import InvalidRequest
from services.kv_store.errors import TierUnavailable
from services.kv_store.tiers.base import StoreTier
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier
from services.kv_store.tiers.mooncake import MooncakeTier

TierFactory = Callable[[int], StoreTier]

TIER_NAMES = ["cpu", "disk", "sharedfs", "mooncake"]
MOONCAKE_MASTER_ENV = "KVMESH_MOONCAKE_MASTER"


def mooncake_client() -> Any:
    """A set-up ``MooncakeDistributedStore`` against ``$KVMESH_MOONCAKE_MASTER`` (P2P handshake, TCP)."""
    from mooncake.store import MooncakeDistributedStore  # the real client; only inside the netns

    client = MooncakeDistributedStore()
    code = client.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", os.environ[MOONCAKE_MASTER_ENV])
    assert code == 0, f"mooncake setup returned {code}"
    return client


@pytest.fixture(scope="module")
def shared_mooncake_client() -> Iterator[Any]:
    """One client for the module (a setup and close cost seconds); tiers differ by namespace."""
    client = mooncake_client()
    yield client
    client.close()


@pytest.fixture(params=TIER_NAMES, ids=TIER_NAMES)
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    name = request.param
    if name == "cpu":
        yield CpuTier
    elif name == "disk":
        yield lambda capacity: DiskTier(tmp_path / "nvme" / "instance-a", capacity)
    elif name == "sharedfs":
        (tmp_path / "lustre").mkdir()
        yield lambda capacity: SharedFsTier(tmp_path / "lustre", capacity)
    else:
        if not os.environ.get(MOONCAKE_MASTER_ENV):
            pytest.skip(
                "mooncake: its client binds 0.0.0.0, so it runs only in a private network namespace;"
                " tests/integration/test_kv_store_mooncake.py runs these cases there"
            )
        client = request.getfixturevalue("shared_mooncake_client")
        yield lambda capacity: MooncakeTier(client, capacity, namespace=f"contract-{uuid.uuid4().hex}/")


async def test_put_get_roundtrip(make_tier: TierFactory) -> None:
    tier = make_tier(1000)
    assert (await tier.put("a", b"x" * 10)).evicted == ()
    assert await tier.get("a") == b"x" * 10
    assert await tier.get("missing") is None
    stats = tier.stats()
    assert (stats.medium, stats.capacity_bytes, stats.used_bytes, stats.keys) == (tier.medium, 1000, 10, 1)
    assert (stats.hits, stats.misses, stats.evictions) == (1, 1, 0)


async def test_empty_value_is_a_value(make_tier: TierFactory) -> None:
    tier = make_tier(10)
    await tier.put("empty", b"")
    assert await tier.get("empty") == b""
    assert await tier.contains(["empty"]) == [True]


async def test_overwrite_replaces_size(make_tier: TierFactory) -> None:
    tier = make_tier(100)
    await tier.put("a", b"1" * 60)
    await tier.put("a", b"2" * 30)
    assert await tier.get("a") == b"2" * 30
    assert tier.stats().used_bytes == 30
    assert tier.stats().keys == 1


async def test_lru_eviction_order(make_tier: TierFactory) -> None:
    tier = make_tier(30)
    for key in "abc":
        await tier.put(key, key.encode() * 10)
    await tier.get("a")  # a becomes most recently used; b is now the oldest
    result = await tier.put("d", b"d" * 15)
    assert result.evicted == ("b", "c")
    assert await tier.contains(["a", "b", "c", "d"]) == [True, False, False, True]
    stats = tier.stats()
    assert stats.used_bytes == 25 and stats.evictions == 2


async def test_contains_does_not_refresh(make_tier: TierFactory) -> None:
    tier = make_tier(20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    assert await tier.contains(["a"]) == [True]
    assert (await tier.put("c", b"c" * 10)).evicted == ("a",)


async def test_value_larger_than_capacity_is_refused(make_tier: TierFactory) -> None:
    tier = make_tier(10)
    await tier.put("keep", b"k" * 5)
    with pytest.raises(InvalidRequest):
        await tier.put("big", b"x" * 11)
    assert await tier.contains(["keep", "big"]) == [True, False]
    assert tier.stats().used_bytes == 5


async def test_value_of_exactly_capacity_fits(make_tier: TierFactory) -> None:
    tier = make_tier(10)
    await tier.put("a", b"a" * 4)
    assert (await tier.put("full", b"f" * 10)).evicted == ("a",)
    assert tier.stats().used_bytes == 10


async def test_evict_is_idempotent(make_tier: TierFactory) -> None:
    tier = make_tier(100)
    await tier.put("a", b"a" * 10)
    assert await tier.evict("a") is True
    assert await tier.evict("a") is False
    stats = tier.stats()
    assert (stats.used_bytes, stats.keys, stats.evictions) == (0, 0, 0)


async def test_contains_batch_keeps_order(make_tier: TierFactory) -> None:
    tier = make_tier(100)
    await tier.put("b", b"1")
    assert await tier.contains(["a", "b", "c", "b"]) == [False, True, False, True]
    assert await tier.contains([]) == []


async def test_values_are_exact_bytes(make_tier: TierFactory) -> None:
    tier = make_tier(4 << 20)
    value = os.urandom(2 << 20)
    await tier.put("blob", value)
    assert await tier.get("blob") == value
    assert await tier.evict("blob") is True
    assert await tier.get("blob") is None


async def test_delete_then_put_again(make_tier: TierFactory) -> None:
    tier = make_tier(100)
    await tier.put("a", b"1" * 10)
    await tier.evict("a")
    await tier.put("a", b"2" * 20)
    assert await tier.get("a") == b"2" * 20
    assert tier.stats().used_bytes == 20


async def test_keep_victims_returns_evicted_values(make_tier: TierFactory) -> None:
    tier = make_tier(20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    result = await tier.put("c", b"c" * 15, keep_victims=True)
    assert result.evicted == ("a", "b")
    assert result.victims == (("a", b"a" * 10), ("b", b"b" * 10))


async def test_tier_names_itself(make_tier: TierFactory) -> None:
    tier = make_tier(10)
    assert tier.stats().name == tier.name and tier.name in TIER_NAMES
    assert isinstance(tier.shared, bool)


async def test_held_keys_in_lru_order(make_tier: TierFactory) -> None:
    """``held_keys``: the tier's view, least recently used first (what ``BlockStore.keys`` and ``lm://`` LIST read)."""
    tier = make_tier(100)
    assert tier.held_keys() == []
    for key in "abc":
        await tier.put(key, key.encode() * 10)
    await tier.get("a")
    assert tier.held_keys() == ["b", "c", "a"]
    await tier.evict("b")
    assert tier.held_keys() == ["c", "a"]


async def test_victims_stay_readable_until_released(make_tier: TierFactory) -> None:
    """``keep_victims``: the victims leave the budget and the LRU view at once but stay readable
    (get, contains) until ``release`` (the store releases them once a slower tier took them), so a
    value moving down is never in no tier."""
    tier = make_tier(20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    result = await tier.put("c", b"c" * 15, keep_victims=True)
    assert result.victims == (("a", b"a" * 10), ("b", b"b" * 10))
    stats = tier.stats()
    assert (stats.used_bytes, stats.keys, stats.evictions, stats.pending) == (15, 1, 2, 2)
    assert tier.held_keys() == ["a", "b", "c"]  # pending first: a key moving down is still listed
    assert await tier.contains(["a", "b", "c"]) == [True, True, True]
    assert await tier.get("a") == b"a" * 10
    assert await tier.release([("a", b"a" * 10)]) == [True]
    assert await tier.contains(["a", "b"]) == [False, True]
    assert await tier.get("a") is None
    assert await tier.release([("a", b"a" * 10), ("b", b"b" * 10)]) == [False, True]
    assert await tier.contains(["a", "b", "c"]) == [False, False, True]
    assert tier.stats().pending == 0


async def test_a_pending_victim_replaced_or_deleted_is_not_released(make_tier: TierFactory) -> None:
    """A put of a pending victim's key stores the new value (the release of the old one is then a
    no-op); an explicit evict of a pending victim removes it."""
    tier = make_tier(20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    await tier.put("c", b"c" * 20, keep_victims=True)  # a, b pending
    await tier.evict("c")
    await tier.put("a", b"A" * 5)
    assert await tier.evict("b") is True
    assert await tier.release([("a", b"a" * 10), ("b", b"b" * 10)]) == [False, False]
    assert await tier.get("a") == b"A" * 5
    assert await tier.contains(["a", "b"]) == [True, False]
    stats = tier.stats()
    assert (stats.used_bytes, stats.keys, stats.pending) == (5, 1, 0)


async def _consistent(tier: StoreTier, values: dict[str, bytes]) -> None:
    """Every key the tier lists is readable with its bytes, every other key is absent (a shared
    tier looks on its medium: no stored value outside the listing), and the budget counts exactly
    what it lists (pending victims aside)."""
    held = tier.held_keys()
    assert await tier.contains(list(values)) == [key in held for key in values]
    for key in held:
        assert await tier.get(key) == values[key]
    stats = tier.stats()
    assert stats.keys + stats.pending == len(held)
    listed = held[stats.pending :]  # pending victims first, outside the budget
    assert stats.used_bytes == sum(len(values[key]) for key in listed) <= tier.capacity_bytes


@pytest.mark.parametrize("steps", [0, 1, 3])
async def test_a_cancelled_put_evict_or_release_leaves_the_tier_consistent(
    make_tier: TierFactory, steps: int
) -> None:
    """A caller cancelled while a put, evict or release runs (a gRPC deadline on the put whose
    cascade reaches this tier) gets ``CancelledError`` only once the operation ended: what the tier
    lists matches what its medium holds (no listed key whose value was removed, no stored value
    outside the listing and the budget). ``steps``: event-loop turns before the cancellation."""
    tier = make_tier(20)
    values = {"a": b"a" * 10, "b": b"b" * 10, "c": b"c" * 10}
    await tier.put("a", values["a"])
    await tier.put("b", values["b"])

    async def cancelled(op: Any) -> None:
        task = asyncio.ensure_future(op)
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    await cancelled(tier.put("c", values["c"]))  # evicts a once c is stored
    await _consistent(tier, values)
    await cancelled(tier.evict("b"))
    await _consistent(tier, values)
    await tier.put("a", values["a"])
    await tier.put("b", values["b"])
    result = await tier.put("c", values["c"] * 2, keep_victims=True)
    values["c"] = values["c"] * 2
    await cancelled(tier.release(result.victims))
    await _consistent(tier, values)


class _FailingWrites:
    """The real Mooncake client whose ``upsert_parts`` returns an error code (a failed transfer)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def upsert_parts(self, key: str, *parts: bytes) -> int:
        return -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


async def test_a_put_whose_write_fails_keeps_the_victims(
    make_tier: TierFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new value is written before the victims are removed: a write that fails (an I/O error
    on a file tier's rename, a failed Mooncake transfer) leaves every victim in place."""
    tier = make_tier(20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    if isinstance(tier, CpuTier):
        pytest.skip("a write to process memory cannot fail")
    if isinstance(tier, DiskTier | SharedFsTier):
        root = tier.root
        real = os.replace

        def replace(src: Any, dst: Any) -> None:
            if Path(dst).is_relative_to(root):
                raise OSError(5, "Input/output error", str(dst))
            real(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    else:
        assert isinstance(tier, MooncakeTier)
        monkeypatch.setattr(tier, "_client", _FailingWrites(tier._client))
    with pytest.raises(TierUnavailable):
        await tier.put("c", b"c" * 15, keep_victims=True)
    monkeypatch.undo()
    assert await tier.contains(["a", "b", "c"]) == [True, True, False]
    assert await tier.get("a") == b"a" * 10 and await tier.get("b") == b"b" * 10
    stats = tier.stats()
    assert (stats.used_bytes, stats.keys, stats.evictions, stats.pending) == (20, 2, 0, 0)
