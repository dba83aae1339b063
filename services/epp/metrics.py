"""epp's Prometheus metrics, declared once and written only through the ``record_*`` helpers.

| metric | type | labels |
| --- | --- | --- |
| ``kvmesh_epp_scheduler_e2e_duration_seconds`` | histogram | none |
| ``kvmesh_epp_plugin_duration_seconds`` | histogram | ``extension_point`` (filter, prepare, scorer, picker), ``plugin_type`` |
| ``kvmesh_epp_pick_total`` | counter | ``outcome`` (:class:`PickOutcome`) |
| ``kvmesh_epp_metrics_scrape_total`` | counter | ``result`` (ok, error) |
| ``kvmesh_epp_prefix_match_degraded_total`` | counter | ``reason`` (too_large, busy, error, kv_indexer_busy, kv_indexer_error): picks scored without a prefix match |
| ``kvmesh_epp_completions_total`` | counter | ``result`` (matched: an in-flight pick of epp's; unmatched: unknown or forgotten id) |
| ``kvmesh_epp_prefix_index_scores_total`` | counter | ``path`` (:class:`PrefixIndexPath`): where kv_indexer prefix scores were computed |
| ``kvmesh_epp_loop_lag_seconds`` | histogram | none: each lateness of the scraper's loop-lag tick credited as epp's own lag (``_sum``: lag in all) |
| ``kvmesh_epp_picks_on_lagged_metrics_total`` | counter | none: picks whose candidates included endpoints scraped longer ago than ``max_metrics_age_seconds``, kept because epp's own loop lagged |
| ``kvmesh_epp_scrape_deadlines_extended_total`` | counter | none: scrapes whose timeout was pushed back by epp's own loop lag (not counted as the engine's failure) |
"""

from __future__ import annotations

import enum
from typing import Any

from prometheus_client import Counter, Histogram

from kvmesh.metrics import FAST_BUCKETS_SECONDS
from services.epp.framework.interfaces import ExtensionPoint


class PickOutcome(enum.StrEnum):
    """How a Pick ended; a closed set, used as a metric label (detail goes to the error message)."""

    PICKED = "picked"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    NO_ENDPOINTS = "no_endpoints"
    ERROR = "error"


class PrefixIndexPath(enum.StrEnum):
    """Where a prefix score was computed (``services/epp/kv_indexer_client.py`` decides); a metric label."""

    REPLICA = "replica"
    """``replica`` mode, in process on the ``Watch``-fed replica (no kv_indexer call)."""
    RPC_FALLBACK = "rpc_fallback"
    """``replica`` mode, through ``KVIndexer/Score``: stream down, resyncing or stale, or a model with kv_store sources."""
    RPC = "rpc"
    """``rpc`` mode: ``KVIndexer/Score`` on every pick."""


SCHEDULER_E2E = Histogram(
    "kvmesh_epp_scheduler_e2e_duration_seconds",
    "Time of one Pick inside epp, from request to decision (seconds).",
    buckets=FAST_BUCKETS_SECONDS,
)
PLUGIN_DURATION = Histogram(
    "kvmesh_epp_plugin_duration_seconds",
    "Time of one plugin call (seconds).",
    ["extension_point", "plugin_type"],
    buckets=FAST_BUCKETS_SECONDS,
)
PICK_TOTAL = Counter("kvmesh_epp_pick_total", "Picks by outcome.", ["outcome"])
SCRAPE_TOTAL = Counter("kvmesh_epp_metrics_scrape_total", "Engine /metrics scrapes by result.", ["result"])
PREFIX_MATCH_DEGRADED = Counter(
    "kvmesh_epp_prefix_match_degraded_total",
    "Picks the prefix-match step left without a match (scored by load), by reason.",
    ["reason"],
)

COMPLETIONS_TOTAL = Counter(
    "kvmesh_epp_completions_total",
    "Request completions the router reported (Completed RPC), by whether they matched an in-flight pick.",
    ["result"],
)

PREFIX_INDEX_SCORES = Counter(
    "kvmesh_epp_prefix_index_scores_total",
    "Prefix scores asked of the kv_indexer client, by where they were computed (replica, rpc_fallback, rpc); "
    "an RPC that then fails is also counted in kvmesh_epp_prefix_match_degraded_total.",
    ["path"],
)
for _path in PrefixIndexPath:  # a closed set: every series exists from the start (0), so ratios need no absent()
    PREFIX_INDEX_SCORES.labels(str(_path))


PICKS_WITHOUT_METRICS = Counter(
    "kvmesh_epp_picks_without_metrics_total",
    "Picks made before any endpoint of the model was scraped (epp starting, or a new pool): the "
    "not-yet-scraped endpoints were candidates, scored on empty metrics.",
)


def record_unscraped_pick() -> None:
    PICKS_WITHOUT_METRICS.inc()


_PLUGIN_CHILDREN: dict[tuple[ExtensionPoint, str], Any] = {}
_PICK_CHILDREN: dict[PickOutcome, Any] = {}
"""Labelled children, looked up once (``labels()`` costs more than the observation; several per pick)."""


def record_plugin(extension_point: ExtensionPoint, plugin_type: str, seconds: float) -> None:
    child = _PLUGIN_CHILDREN.get((extension_point, plugin_type))
    if child is None:
        child = _PLUGIN_CHILDREN[(extension_point, plugin_type)] = PLUGIN_DURATION.labels(
            str(extension_point), plugin_type or "unknown")
    child.observe(seconds)


def record_pick(outcome: PickOutcome, seconds: float) -> None:
    child = _PICK_CHILDREN.get(outcome)
    if child is None:
        child = _PICK_CHILDREN[outcome] = PICK_TOTAL.labels(str(outcome))
    child.inc()
    SCHEDULER_E2E.observe(seconds)


def record_scrape(result: str) -> None:
    SCRAPE_TOTAL.labels(result).inc()


def record_prefix_match_degraded(reason: str) -> None:
    PREFIX_MATCH_DEGRADED.labels(reason).inc()


def record_completions(matched: int, unmatched: int) -> None:
    if matched:
        COMPLETIONS_TOTAL.labels("matched").inc(matched)
    if unmatched:
        COMPLETIONS_TOTAL.labels("unmatched").inc(unmatched)


def record_prefix_index_score(path: PrefixIndexPath) -> None:
    PREFIX_INDEX_SCORES.labels(str(path)).inc()


LOOP_LAG = Histogram(
    "kvmesh_epp_loop_lag_seconds",
    "Lateness of the scraper's loop-lag tick credited as epp's own event-loop lag (seconds): metrics ages "
    "and scrape deadlines do not count this time against the engines.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
)
PICKS_ON_LAGGED_METRICS = Counter(
    "kvmesh_epp_picks_on_lagged_metrics_total",
    "Picks whose candidates included endpoints whose last good scrape was older than max_metrics_age_seconds "
    "in wall-clock time, kept as candidates because the excess was epp's own event-loop lag (degraded).",
)
SCRAPE_DEADLINES_EXTENDED = Counter(
    "kvmesh_epp_scrape_deadlines_extended_total",
    "Engine /metrics scrapes whose timeout was pushed back because epp's own event loop lagged while they ran.",
)


def record_loop_lag(seconds: float) -> None:
    LOOP_LAG.observe(seconds)


def record_lagged_pick() -> None:
    PICKS_ON_LAGGED_METRICS.inc()


def record_scrape_deadline_extended() -> None:
    SCRAPE_DEADLINES_EXTENDED.inc()
