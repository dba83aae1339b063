"""The datastore: live endpoints (from etcd) and each one's last scraped vLLM metrics.

Pure state, no I/O: :class:`~services.epp.scraper.MetricsScraper` feeds it scrapes, the membership
watcher feeds it joins and leaves, the scheduler reads :class:`Candidate` snapshots. An endpoint that
leaves etcd is forgotten at once (with its metrics); a scrape that arrives for an unknown endpoint is
ignored. Picks sent to an endpoint since its last scrape are counted (``pending_picks``) so a burst of
picks between two scrapes sees its own effect on the queue.

:func:`parse_vllm_metrics` reads the Prometheus text of vLLM's ``/metrics`` (names as in vLLM 0.32,
``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (summed / averaged over the ``engine`` label of data-parallel ranks) and
the ``block_size`` label of ``vllm:cache_config_info``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.clock import Clock, SystemClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.interfaces import Candidate, EndpointMetrics

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
_WANTED = (WAITING, RUNNING, KV_USAGE, CACHE_CONFIG)
_WANTED_PREFIXES = tuple(_WANTED) + tuple(f"# HELP {n} " for n in _WANTED) + tuple(f"# TYPE {n} " for n in _WANTED)


@dataclass(frozen=True, slots=True)
class ScrapeSample:
    """One successful scrape's values (units as in :class:`EndpointMetrics`)."""

    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage_perc: float
    block_size_tokens: int | None = None


def parse_vllm_metrics(text: str) -> ScrapeSample:
    """Parse vLLM's Prometheus exposition.

    Only the lines of the four metrics above are handed to ``prometheus_client``'s parser (the full
    exposition is ~50 KB of histograms; parsing all of it every 100 ms per engine would cost a core).

    Raises:
        ValueError: a required gauge is missing, not finite, negative, or usage outside [0, 1].
    """
    lines = [line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES)]
    values: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_USAGE: []}
    block_size: int | None = None
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name].append(float(sample.value))
            elif sample.name == CACHE_CONFIG and block_size is None:
                raw = sample.labels.get("block_size")
                if raw is not None and raw.isdigit():
                    block_size = int(raw)
    for name, found in values.items():
        if not found:
            raise ValueError(f"{name} missing from /metrics")
        if any(not math.isfinite(v) or v < 0 for v in found):
            raise ValueError(f"{name} has a negative or non-finite value: {found}")
    usage = sum(values[KV_USAGE]) / len(values[KV_USAGE])
    if usage > 1.0:
        raise ValueError(f"{KV_USAGE}={usage} outside [0, 1]")
    return ScrapeSample(sum(values[WAITING]), sum(values[RUNNING]), usage, block_size)


@dataclass(slots=True)
class _EndpointState:
    endpoint: Endpoint
    sample: ScrapeSample | None = None
    scraped_at: float | None = None
    consecutive_failures: int = 0
    pending_picks: int = 0
    last_error: str = ""


class Datastore:
    """Endpoints by id with their metrics; every method is O(endpoints) at most and never blocks."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._states: dict[EndpointId, _EndpointState] = {}

    # -- membership -------------------------------------------------------------------------
    def apply_membership(self, joined: Mapping[EndpointId, Endpoint], left: Mapping[EndpointId, Endpoint]) -> None:
        """Apply a watcher change: ``left`` first (a changed registration is a leave then a join)."""
        for endpoint_id in left:
            self._states.pop(endpoint_id, None)
        for endpoint_id, endpoint in joined.items():
            self._states[endpoint_id] = _EndpointState(endpoint)

    def set_endpoints(self, endpoints: Mapping[EndpointId, Endpoint]) -> None:
        """Replace the endpoint set, keeping the metrics of endpoints that stay unchanged."""
        left = {i: s.endpoint for i, s in self._states.items() if endpoints.get(i) != s.endpoint}
        joined = {i: e for i, e in endpoints.items() if i not in self._states or i in left}
        self.apply_membership(joined, left)

    # -- scrapes ----------------------------------------------------------------------------
    def record_scrape(self, endpoint_id: EndpointId, sample: ScrapeSample) -> None:
        state = self._states.get(endpoint_id)
        if state is None:
            return
        state.sample = sample
        state.scraped_at = self._clock.now()
        state.consecutive_failures = 0
        state.pending_picks = 0
        state.last_error = ""

    def record_scrape_failure(self, endpoint_id: EndpointId, error: str) -> None:
        state = self._states.get(endpoint_id)
        if state is None:
            return
        state.consecutive_failures += 1
        state.last_error = error

    def note_pick(self, endpoint_id: EndpointId) -> None:
        state = self._states.get(endpoint_id)
        if state is not None:
            state.pending_picks += 1

    # -- reads ------------------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        return [s.endpoint for s in self._states.values()]

    def serves(self, model: str) -> bool:
        return any(s.endpoint.model == model for s in self._states.values())

    def _candidate(self, state: _EndpointState, now: float) -> Candidate:
        sample = state.sample
        metrics = EndpointMetrics(
            consecutive_failures=state.consecutive_failures,
            pending_picks=state.pending_picks,
            age_seconds=None if state.scraped_at is None else max(0.0, now - state.scraped_at),
        )
        if sample is not None:
            metrics = replace(
                metrics,
                num_requests_waiting=sample.num_requests_waiting,
                num_requests_running=sample.num_requests_running,
                kv_cache_usage_perc=sample.kv_cache_usage_perc,
                block_size_tokens=sample.block_size_tokens,
            )
        return Candidate(state.endpoint, metrics)

    def candidates(self, model: str | None = None) -> list[Candidate]:
        """Snapshots of every endpoint (of ``model`` when given), sorted by id."""
        now = self._clock.now()
        return [
            self._candidate(s, now)
            for _, s in sorted(self._states.items())
            if model is None or s.endpoint.model == model
        ]
