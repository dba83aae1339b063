"""Prometheus metrics of kv_store, read from the tiers' own counters at scrape time.

| name | type | labels |
|---|---|---|
| ``kvmesh_kv_store_capacity_bytes`` | gauge | ``medium`` |
| ``kvmesh_kv_store_used_bytes`` | gauge | ``medium`` |
| ``kvmesh_kv_store_keys`` | gauge | ``medium`` |
| ``kvmesh_kv_store_hits_total`` | counter | ``medium`` |
| ``kvmesh_kv_store_misses_total`` | counter | ``medium`` |
| ``kvmesh_kv_store_evictions_total`` | counter | ``medium`` |

A collector (rather than gauges set on every operation) keeps the numbers exactly equal to the
tiers' state and adds no work to the data path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.kv_store.store import BlockStore

_GAUGES = (
    ("capacity_bytes", "Budget of the tier for value bytes."),
    ("used_bytes", "Value bytes stored in the tier."),
    ("keys", "Keys stored in the tier."),
)
_COUNTERS = (
    ("hits", "Gets answered by the tier."),
    ("misses", "Gets the tier could not answer."),
    ("evictions", "Keys the tier evicted to make room."),
)


class KvStoreCollector(Collector):
    """Exports each tier's :class:`~services.kv_store.tiers.base.TierStats`."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = self._store.stats()
        for field, doc in _GAUGES:
            gauge = GaugeMetricFamily(f"kvmesh_kv_store_{field}", doc, labels=["medium"])
            for tier in stats:
                gauge.add_metric([tier.medium.value], getattr(tier, field))
            yield gauge
        for field, doc in _COUNTERS:
            counter = CounterMetricFamily(f"kvmesh_kv_store_{field}", doc, labels=["medium"])
            for tier in stats:
                counter.add_metric([tier.medium.value], getattr(tier, field))
            yield counter


def register_metrics(store: BlockStore, registry: CollectorRegistry = REGISTRY) -> KvStoreCollector:
    collector = KvStoreCollector(store)
    registry.register(collector)
    return collector
