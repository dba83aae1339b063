"""BlockStore core: key validation, placement, errors; CpuTier invariants under random operations."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvmesh.errors import InvalidRequest, mapping_for
from kvmesh.types import Medium
from services.kv_store.errors import KeyNotFound, ValueTooLarge
from services.kv_store.metrics import register_metrics
from services.kv_store.store import MAX_KEY_BYTES, BlockStore
from services.kv_store.tiers.cpu import CpuTier

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never suspends (the CPU tier's) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("coroutine suspended")


async def test_put_get_delete() -> None:
    store = BlockStore([CpuTier(100)])
    outcome = await store.put("k", b"value")
    assert (outcome.medium, outcome.evicted) == (Medium.CPU, 0)
    stored = await store.get("k")
    assert (stored.value, stored.medium) == (b"value", Medium.CPU)
    assert await store.contains(["k", "x"]) == [True, False]
    assert await store.delete("k") is True
    assert await store.delete("k") is False
    with pytest.raises(KeyNotFound):
        await store.get("k")


@pytest.mark.parametrize(
    ("key", "size", "error"),
    [
        ("", 1, InvalidRequest),
        ("k" * (MAX_KEY_BYTES + 1), 1, InvalidRequest),
        ("k", 101, ValueTooLarge),
    ],
    ids=["empty-key", "long-key", "too-large"],
)
async def test_put_rejects(key: str, size: int, error: type[Exception]) -> None:
    store = BlockStore([CpuTier(100)])
    with pytest.raises(error):
        await store.put(key, b"x" * size)
    with pytest.raises(error):
        store.check_value_size(key, size)
    assert store.stats()[0].used_bytes == 0


@pytest.mark.parametrize(
    ("error", "status"),
    [(KeyNotFound("k"), "NOT_FOUND"), (ValueTooLarge("v"), "INVALID_ARGUMENT")],
    ids=["key-not-found", "value-too-large"],
)
def test_errors_map_through_the_shared_table(error: Exception, status: str) -> None:
    assert mapping_for(error).grpc_status == status


async def test_empty_key_on_get_and_delete() -> None:
    store = BlockStore([CpuTier(10)])
    for call in (store.get(""), store.delete("")):
        with pytest.raises(InvalidRequest):
            await call


async def test_metrics_collector_reports_tiers() -> None:
    registry = CollectorRegistry()
    store = BlockStore([CpuTier(10)])
    register_metrics(store, registry)
    await store.put("a", b"a" * 6)
    await store.put("b", b"b" * 6)  # evicts a
    await store.get("b")
    with pytest.raises(KeyNotFound):
        await store.get("a")
    value = registry.get_sample_value
    labels = {"tier": "cpu", "medium": "CPU"}
    assert value("kvmesh_kv_store_capacity_bytes", labels) == 10
    assert value("kvmesh_kv_store_used_bytes", labels) == 6
    assert value("kvmesh_kv_store_keys", labels) == 1
    assert value("kvmesh_kv_store_hits_total", labels) == 1
    assert value("kvmesh_kv_store_misses_total", labels) == 1
    assert value("kvmesh_kv_store_evictions_total", labels) == 1
    assert value("kvmesh_kv_store_moved_bytes_total", {"tier": "cpu", "reason": "put"}) == 12
    assert value("kvmesh_kv_store_operation_seconds_count", {"tier": "cpu", "op": "get"}) == 2
    assert value("kvmesh_kv_store_operation_seconds_bucket", {"tier": "cpu", "op": "put", "le": "+Inf"}) == 2


KEYS = st.sampled_from([f"k{i}" for i in range(6)])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.integers(0, 70)),
        st.tuples(st.just("get"), KEYS, st.just(0)),
        st.tuples(st.just("evict"), KEYS, st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 64), ops=OPS)
def test_cpu_tier_matches_lru_model(capacity: int, ops: list[tuple[str, str, int]]) -> None:
    """used_bytes never exceeds capacity and the tier behaves exactly like a reference LRU."""
    tier = CpuTier(capacity)
    model: OrderedDict[str, bytes] = OrderedDict()
    evictions = 0
    for op, key, size in ops:
        if op == "put":
            value = key.encode()[:1] * size
            if size > capacity:
                with pytest.raises(ValueTooLarge):
                    run_now(tier.put(key, value))
            else:
                model.pop(key, None)
                expected: list[str] = []
                while sum(map(len, model.values())) + size > capacity:
                    expected.append(model.popitem(last=False)[0])
                model[key] = value
                evictions += len(expected)
                assert run_now(tier.put(key, value)).evicted == tuple(expected)
        elif op == "get":
            got = run_now(tier.get(key))
            assert got == model.get(key)
            if key in model:
                model.move_to_end(key)
        else:
            assert run_now(tier.evict(key)) is (model.pop(key, None) is not None)
        stats = tier.stats()
        assert stats.used_bytes <= capacity
        assert stats.used_bytes == sum(map(len, model.values()))
        assert tier.lru_order() == list(model)
        assert stats.evictions == evictions
