"""Prometheus metrics of kv_store, read from the tiers' and the store's own counters at scrape time.

| name | type | labels |
|---|---|---|
| ``kvmesh_kv_store_capacity_bytes`` | gauge | ``tier``, ``medium`` |
| ``kvmesh_kv_store_used_bytes`` | gauge | ``tier``, ``medium`` |
| ``kvmesh_kv_store_keys`` | gauge | ``tier``, ``medium`` |
| ``kvmesh_kv_store_pending`` | gauge | ``tier``, ``medium`` (victims still readable while they move down) |
| ``kvmesh_kv_store_hits_total`` | counter | ``tier``, ``medium`` |
| ``kvmesh_kv_store_misses_total`` | counter | ``tier``, ``medium`` |
| ``kvmesh_kv_store_evictions_total`` | counter | ``tier``, ``medium`` |
| ``kvmesh_kv_store_corrupted_total`` | counter | ``tier``, ``medium`` (checksum mismatches served as misses) |
| ``kvmesh_kv_store_moved_bytes_total`` | counter | ``tier``, ``reason`` (put, demote, promote, write_through, restore) |
| ``kvmesh_kv_store_degraded_operations_total`` | counter | ``tier`` (the tier was unavailable or full and skipped) |
| ``kvmesh_kv_store_dropped_total`` | counter | ``tier``, ``reason`` (demotions / write-throughs the tier did not take: ``unavailable``, ``full``, ``too_large``) |
| ``kvmesh_kv_store_lost_total`` | counter | ``tier`` (values it evicted that no slower tier could take) |
| ``kvmesh_kv_store_promotions_undone_total`` | counter | (promotions rolled back: a value they evicted found no tier) |
| ``kvmesh_kv_store_promotions_superseded_total`` | counter | (promotions dropped: a put or delete of the key ran meanwhile) |
| ``kvmesh_kv_store_settle_timeouts_total`` | counter | (puts / deletes that stopped waiting for a move of their key: a hung tier) |
| ``kvmesh_kv_store_tier_timeouts_total`` | counter | ``tier`` (operations not done within ``tier_timeout_s``: the tier counted unavailable) |
| ``kvmesh_kv_store_operation_seconds`` | histogram | ``tier``, ``op`` (put, get, contains, evict) |

``tier`` is the tier's kind (``cpu``, ``disk``, ``sharedfs``, ``mooncake``); ``medium`` is vLLM's
medium string (``CPU``, ``DISK``, ``SHARED``; two shared tiers share a medium). A collector (rather
than metrics updated on every operation) keeps the numbers exactly equal to the tiers' state and
adds no work to the data path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.kv_store.store import DROP_REASONS, LATENCY_BUCKETS_S, BlockStore

_GAUGES = (
    ("capacity_bytes", "Budget of the tier for value bytes."),
    ("used_bytes", "Value bytes stored in the tier."),
    ("keys", "Keys stored in the tier."),
    ("pending", "Values the tier evicted that are still readable there while they move to a slower tier."),
)
_COUNTERS = (
    ("hits", "Gets answered by the tier."),
    ("misses", "Gets the tier could not answer."),
    ("evictions", "Keys the tier evicted to make room."),
    ("corrupted", "Values that failed their checksum on read (served as misses and removed)."),
)


class KvStoreCollector(Collector):
    """Exports each tier's :class:`~services.kv_store.tiers.base.TierStats` and the store's movement."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()
        for field, doc in _GAUGES:
            gauge = GaugeMetricFamily(f"kvmesh_kv_store_{field}", doc, labels=["tier", "medium"])
            for tier in stats:
                gauge.add_metric([tier.name, tier.medium.value], getattr(tier, field))
            yield gauge
        for field, doc in _COUNTERS:
            counter = CounterMetricFamily(f"kvmesh_kv_store_{field}", doc, labels=["tier", "medium"])
            for tier in stats:
                counter.add_metric([tier.name, tier.medium.value], getattr(tier, field))
            yield counter
        metrics = self._store.metrics
        moved = CounterMetricFamily(
            "kvmesh_kv_store_moved_bytes", "Value bytes written into a tier, by reason.", labels=["tier", "reason"]
        )
        for (tier_name, reason), size in sorted(metrics.moved_bytes.items()):
            moved.add_metric([tier_name, reason], size)
        yield moved
        degraded = CounterMetricFamily(
            "kvmesh_kv_store_degraded_operations",
            "Operations skipped because the tier was unavailable or full.",
            labels=["tier"],
        )
        dropped = CounterMetricFamily(
            "kvmesh_kv_store_dropped",
            "Demotions or write-throughs the tier did not take, by reason (unavailable and full: the tier failed;"
            " too_large: the value exceeds the tier's capacity).",
            labels=["tier", "reason"],
        )
        lost = CounterMetricFamily(
            "kvmesh_kv_store_lost",
            "Values the tier evicted that no slower tier could take (every tier below failed or was too small).",
            labels=["tier"],
        )
        for tier in stats:
            degraded.add_metric([tier.name], metrics.failures.get(tier.name, 0))
            for reason in DROP_REASONS:
                dropped.add_metric([tier.name, reason], metrics.dropped.get((tier.name, reason), 0))
            lost.add_metric([tier.name], metrics.lost.get(tier.name, 0))
        yield degraded
        yield dropped
        yield lost
        undone = CounterMetricFamily(
            "kvmesh_kv_store_promotions_undone",
            "Promotions rolled back because a value they evicted found no tier (the read lost nothing).",
        )
        undone.add_metric([], metrics.promotions_undone)
        yield undone
        superseded = CounterMetricFamily(
            "kvmesh_kv_store_promotions_superseded",
            "Promotions dropped because a put or delete of the key ran meanwhile (the read value was stale).",
        )
        superseded.add_metric([], metrics.promotions_superseded)
        yield superseded
        settle = CounterMetricFamily(
            "kvmesh_kv_store_settle_timeouts",
            "Puts and deletes that stopped waiting for a move down of their key (a hung tier; the move's"
            " copy is removed where it lands).",
        )
        settle.add_metric([], metrics.settle_timeouts)
        yield settle
        timeouts = CounterMetricFamily(
            "kvmesh_kv_store_tier_timeouts",
            "Tier operations not done within tier_timeout_s (the tier counted unavailable while they ran).",
            labels=["tier"],
        )
        for tier in stats:
            timeouts.add_metric([tier.name], metrics.timeouts.get(tier.name, 0))
        yield timeouts
        latency = HistogramMetricFamily(
            "kvmesh_kv_store_operation_seconds", "Latency of tier operations in seconds.", labels=["tier", "op"]
        )
        for (tier_name, op), hist in sorted(metrics.latency.items()):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), hist.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([tier_name, op], buckets, hist.total)
        yield latency


def register_metrics(store: BlockStore, registry: CollectorRegistry = REGISTRY) -> KvStoreCollector:
    collector = KvStoreCollector(store)
    registry.register(collector)
    return collector
