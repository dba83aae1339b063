"""kv_indexer's Prometheus metrics (default registry), written only through the ``record_*`` helpers.

| metric | type | labels | meaning |
| --- | --- | --- | --- |
| ``kvmesh_kv_indexer_events_applied_total`` | counter | ``event_type`` | events applied to the index |
| ``kvmesh_kv_indexer_events_skipped_total`` | counter | ``reason`` | events not applied (:class:`ApplyOutcome`) |
| ``kvmesh_kv_indexer_batches_dropped_total`` | counter | ``reason`` | ZMQ messages dropped before the index |
| ``kvmesh_kv_indexer_sequence_gaps_total`` | counter | | messages missed per the publisher's seq |
| ``kvmesh_kv_indexer_blocks`` | gauge | | distinct block keys in the index |
| ``kvmesh_kv_indexer_endpoints`` | gauge | | endpoints whose events are applied |
| ``kvmesh_kv_indexer_lookup_hit_blocks_total`` | counter | ``medium`` | matched blocks returned by Score |
| ``kvmesh_kv_indexer_score_duration_seconds`` | histogram | | Score time in the index (keys + walk) |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.metrics import FAST_BUCKETS_SECONDS

EVENTS_APPLIED = Counter(
    "kvmesh_kv_indexer_events_applied_total", "KV events applied to the index.", ["event_type"]
)
EVENTS_SKIPPED = Counter(
    "kvmesh_kv_indexer_events_skipped_total",
    "KV events not applied: unregistered endpoint, unknown parent, invalid content.",
    ["reason"],
)
BATCHES_DROPPED = Counter(
    "kvmesh_kv_indexer_batches_dropped_total",
    "ZMQ event messages dropped: bad frame count, bad topic, bad sequence frame, bad msgpack, queue full.",
    ["reason"],
)
SEQUENCE_GAPS = Counter(
    "kvmesh_kv_indexer_sequence_gaps_total", "Event messages missed, per the publishers' sequence numbers."
)
BLOCKS = Gauge("kvmesh_kv_indexer_blocks", "Distinct block keys held by any endpoint.")
ENDPOINTS = Gauge("kvmesh_kv_indexer_endpoints", "Endpoints whose KV events are applied.")
LOOKUP_HIT_BLOCKS = Counter(
    "kvmesh_kv_indexer_lookup_hit_blocks_total", "Matched prefix blocks returned by Score.", ["medium"]
)
SCORE_DURATION = Histogram(
    "kvmesh_kv_indexer_score_duration_seconds",
    "Time to score one prompt in the index (block keys and prefix walk).",
    buckets=FAST_BUCKETS_SECONDS,
)


def record_event(event_type: str, outcome: str) -> None:
    if outcome == "applied":
        EVENTS_APPLIED.labels(event_type=event_type).inc()
    else:
        EVENTS_SKIPPED.labels(reason=outcome).inc()


def record_batch_dropped(reason: str) -> None:
    BATCHES_DROPPED.labels(reason=reason or "unknown").inc()


def record_sequence_gap(missed: int) -> None:
    SEQUENCE_GAPS.inc(missed)


def record_score(duration_seconds: float, hit_blocks_by_medium: Mapping[str, int]) -> None:
    SCORE_DURATION.observe(duration_seconds)
    for medium, count in hit_blocks_by_medium.items():
        if count:
            LOOKUP_HIT_BLOCKS.labels(medium=medium or "unknown").inc(count)


def track_index_size(blocks: Callable[[], float], endpoints: Callable[[], float]) -> None:
    """Read the gauges from the index at scrape time."""
    BLOCKS.set_function(blocks)
    ENDPOINTS.set_function(endpoints)
