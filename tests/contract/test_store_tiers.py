"""The StoreTier contract, run against every tier implementation (add new tiers to TIERS)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.errors import InvalidRequest
from services.kv_store.tiers.base import StoreTier
from services.kv_store.tiers.cpu import CpuTier

TierFactory = Callable[[int], StoreTier]

TIERS: dict[str, TierFactory] = {
    "cpu": CpuTier,
}


@pytest.fixture(params=list(TIERS), ids=list(TIERS))
def make_tier(request: pytest.FixtureRequest) -> TierFactory:
    return TIERS[request.param]


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
