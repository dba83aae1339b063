"""Saturation from the pool: the engines' waiting queues and KV-cache use, plus what was dispatched since.

The signal is the same scrape epp's scheduler reads (vLLM's ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, via epp's ``ListEndpoints``; see :mod:`services.flow_control.pool`).
The rule is GIE's ``utilization-detector``: an endpoint has room while its waiting queue is below
``queue_depth_threshold`` and its KV use below ``kv_cache_util_threshold``; the pool is saturated
when no endpoint has room. kvmesh counts room in requests, ``spare = sum(queue_depth_threshold -
waiting)`` over endpoints under the KV threshold, and subtracts every request it dispatched that
the metrics cannot show yet (dispatched after the sample was taken, minus a
``dispatch_visibility_seconds`` grace for the router hop), so a burst never overshoots between scrapes.
A request that finished before any sample showed it stops counting when it is released
(:meth:`SaturationDetector.note_done`): no later sample will show it either.

Stale metrics fail open: no snapshot, a snapshot older than ``metrics_staleness_seconds`` (epp
unreachable) or no endpoint scraped within it makes :meth:`SaturationDetector.state` answer
``stale=True, saturated=False``; the controller then dispatches up to ``max_in_flight`` and the
``kvmesh_flow_control_saturation_stale`` gauge says so. Pure: the clock is the caller's.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One endpoint's last scraped load (units as vLLM: requests, fraction in [0, 1]).

    ``metrics_age_seconds`` is None when the endpoint was never scraped.
    """

    endpoint_id: str
    model: str
    num_requests_waiting: float
    kv_cache_usage_perc: float
    metrics_age_seconds: float | None
    num_requests_running: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Every endpoint of the pool as received at ``received_at`` (the controller's clock seconds)."""

    endpoints: tuple[EndpointLoad, ...]
    received_at: float


@dataclass(frozen=True, slots=True)
class SaturationState:
    """What the detector concludes now.

    Attributes:
        saturated: no room left in the pool (never True when ``stale``).
        stale: no fresh metrics: failing open.
        saturation: mean over fresh endpoints of ``max(waiting / queue_depth_threshold,
            kv_use / kv_cache_util_threshold)``, plus the unseen dispatches spread over them, each
            weighted by the KV share of one running request (``kv_use / running``; one queue slot
            when no engine reports running requests). 1.0 = full.
        headroom: requests that may still be dispatched before the pool is full (inf when stale).
        unseen_dispatches: dispatches the last sample cannot show yet.
        metrics_age_seconds: age of the oldest fresh endpoint sample, or of the snapshot (inf when none).
    """

    saturated: bool
    stale: bool
    saturation: float
    headroom: float
    unseen_dispatches: int
    metrics_age_seconds: float


class SaturationDetector:
    """Utilization detector with in-flight accounting (see the module docstring).

    Raises:
        ValueError: a threshold out of range.
    """

    def __init__(
        self,
        queue_depth_threshold: float = 5.0,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_seconds: float = 1.0,
        dispatch_visibility_seconds: float = 0.05,
    ) -> None:
        if not queue_depth_threshold > 0:
            raise ValueError(f"queue_depth_threshold must be > 0, got {queue_depth_threshold}")
        if not 0 < kv_cache_util_threshold <= 1:
            raise ValueError(f"kv_cache_util_threshold must be in (0, 1], got {kv_cache_util_threshold}")
        if not metrics_staleness_seconds > 0:
            raise ValueError(f"metrics_staleness_seconds must be > 0, got {metrics_staleness_seconds}")
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold
        self.metrics_staleness_seconds = metrics_staleness_seconds
        self.dispatch_visibility_seconds = max(0.0, dispatch_visibility_seconds)
        self._snapshot: PoolSnapshot | None = None
        self._models: frozenset[str] = frozenset()
        self._fresh: tuple[EndpointLoad, ...] = ()
        self._sample_at = float("-inf")
        self._spare = 0.0
        self._load_sum = 0.0
        self._unit = 1.0 / queue_depth_threshold
        self._dispatches: deque[float] = deque()

    @property
    def snapshot(self) -> PoolSnapshot | None:
        return self._snapshot

    def update(self, snapshot: PoolSnapshot) -> None:
        """Take a new pool snapshot; dispatches the new sample already shows stop counting."""
        limit = self.metrics_staleness_seconds
        fresh = tuple(
            e for e in snapshot.endpoints if e.metrics_age_seconds is not None and 0 <= e.metrics_age_seconds <= limit
        )
        self._snapshot = snapshot
        self._models = frozenset(e.model for e in snapshot.endpoints)
        self._fresh = fresh
        if fresh:
            oldest = max(e.metrics_age_seconds or 0.0 for e in fresh)
            self._sample_at = snapshot.received_at - oldest
        q, kv = self.queue_depth_threshold, self.kv_cache_util_threshold
        # KV share of one running request (vllm:kv_cache_usage_perc / vllm:num_requests_running), per
        # endpoint where it reports running requests; the pool's mean stands in for idle endpoints.
        shares = {e.endpoint_id: e.kv_cache_usage_perc / e.num_requests_running
                  for e in fresh if e.num_requests_running > 0 and e.kv_cache_usage_perc > 0}
        mean_share = statistics.fmean(shares.values()) if shares else 0.0
        spare = 0.0
        for e in fresh:
            if e.kv_cache_usage_perc >= kv:
                continue
            spare += max(0.0, q - e.num_requests_waiting)  # the queue allowance (GIE's QueueDepthThreshold)
            share = shares.get(e.endpoint_id, mean_share)
            if e.num_requests_waiting == 0 and share > 0:  # free sequences before the KV threshold
                spare += (kv - e.kv_cache_usage_perc) / share
        self._spare = spare
        self._load_sum = sum(max(e.num_requests_waiting / q, e.kv_cache_usage_perc / kv) for e in fresh)
        # What one more request adds to an endpoint's load (in saturation units): its KV share, else one queue slot.
        self._unit = max(mean_share / kv, 1e-3) if shares else 1.0 / q
        seen_before = self._sample_at - self.dispatch_visibility_seconds
        while self._dispatches and self._dispatches[0] <= seen_before:
            self._dispatches.popleft()

    def note_dispatch(self, now: float) -> None:
        """A request was dispatched at ``now`` (the engines' metrics will show it later)."""
        if self._snapshot is not None:
            self._dispatches.append(now)

    def note_done(self, dispatched_at: float) -> None:
        """The request dispatched at ``dispatched_at`` finished: no later sample will show it, so it
        stops counting against the room (otherwise a fast pool looks saturated by requests that are
        already gone until the next scrape; docs/BENCHMARKS.md §3). O(unseen dispatches)."""
        with contextlib.suppress(ValueError):  # already cleared by a sample taken after it
            self._dispatches.remove(dispatched_at)

    def has_endpoints(self, model: str, now: float) -> bool | None:
        """Whether a fresh snapshot lists an endpoint for ``model`` (any, when ``""``); None when stale."""
        snap = self._snapshot
        if snap is None or now - snap.received_at > self.metrics_staleness_seconds:
            return None
        return model in self._models if model else bool(self._models)

    def state(self, now: float) -> SaturationState:
        snap = self._snapshot
        if snap is None or now - snap.received_at > self.metrics_staleness_seconds or not self._fresh:
            age = float("inf") if snap is None else now - snap.received_at
            return SaturationState(False, True, 0.0, float("inf"), 0, age)
        unseen = len(self._dispatches)
        headroom = self._spare - unseen
        n = len(self._fresh)
        saturation = (self._load_sum + unseen * self._unit) / n
        age = now - self._sample_at
        return SaturationState(headroom <= 0, False, saturation, max(headroom, 0.0), unseen, age)
