"""Saturation from the pool: the engines' waiting queues, running batches and KV-cache use, plus what was dispatched since.

The signal is the same scrape epp's scheduler reads (vLLM's ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc``, via epp's ``ListEndpoints``; see
:mod:`services.flow_control.pool`).

**What "saturated" means** is GIE's ``utilization-detector`` (gateway-api-inference-extension /
llm-d-router ``pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization``, defaults
``queueDepthThreshold`` 5, ``kvCacheUtilThreshold`` 0.8): an endpoint has room while its waiting
queue is below ``queue_depth_threshold`` and its KV use below ``kv_cache_util_threshold``; the pool
is saturated when no endpoint has room. The saturation gradient is GIE's roofline mean,
``mean(max(waiting / queue_depth_threshold, kv_use / kv_cache_util_threshold))``. The one
refinement: the queue compared with the threshold is what the engine cannot start at its next step,
``waiting - free_running`` (below); at ``max_num_seqs`` that is GIE's observed queue, while a queue of
arrivals between two steps of an engine with free slots (most samples of a busy stepping engine) is
not taken for saturation. The gradient is taken on that same next-step picture.

**What kvmesh adds** (GIE's utilization detector has no pending-dispatch accounting; its
``concurrency-detector`` reserves pending dispatches against a configured ``maxConcurrency``):
requests dispatched after the sample was taken (minus a ``dispatch_visibility_seconds`` grace for
the router hop) count against each endpoint's *real* headroom, which is what the engine can still
start plus the queue allowance::

    free_running = min(max_num_seqs - running, (kv_threshold - kv_use) / kv_share)
    room         = queue_depth_threshold + free_running - waiting        (0 when GIE says no room)

A dispatch first takes a free running slot (vLLM's scheduler admits waiting requests at its next
step while ``running < max_num_seqs`` and blocks are free), and only what exceeds the free slots
grows the waiting queue; the room runs out exactly when the projected waiting queue of requests the
engine cannot start reaches the threshold. Requests the sample already shows as running are not
counted again (a dispatch stops counting once a sample taken after it arrives), one that
finished before any sample showed it stops counting when released, and one the sample showed that
finished after it frees its room at once (:meth:`SaturationDetector.note_done`).

``max_num_seqs``: vLLM 0.32 exposes no metric for it (``vllm:cache_config_info`` carries the KV
cache's sizes, ``kv_cache_max_concurrency`` is the KV bound at ``max_model_len``, not the
scheduler's), so it is either configured (``engine_max_num_seqs``, the engines' ``--max-num-seqs``)
or learned per endpoint: the highest ``num_requests_running`` it reported is a lower bound of it.
Until an endpoint shows its ceiling (``CEILING_SAMPLES``, 3, successive samples with requests waiting
while running stays at that high-water mark: a request that merely arrived between two engine steps is admitted
at the next step, so it does not hold the engine still), the probe allows up to twice the
high-water mark (a slow start: the room doubles per sample, within the KV bound); once it has,
the high-water mark is ``max_num_seqs`` (it still grows by up to the queue allowance per sample
if the engine admits more, so a too-early ceiling costs a slower ramp, never throughput).

Stale metrics fail open: no snapshot, a snapshot older than ``metrics_staleness_seconds`` (epp
unreachable) or no endpoint scraped within it makes :meth:`SaturationDetector.state` answer
``stale=True, saturated=False``; the controller then dispatches up to ``max_in_flight`` and the
``kvmesh_flow_control_saturation_stale`` gauge says so. Pure: the clock is the caller's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

CEILING_SAMPLES = 3
"""Successive samples with requests waiting while running stays at the same high-water mark that make
it the endpoint's learned ``max_num_seqs`` (arrivals between two engine steps wait too, but running
moves from sample to sample while the engine still admits)."""


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
        saturation: GIE's roofline mean over fresh endpoints, ``max(waiting / queue_depth_threshold,
            kv_use / kv_cache_util_threshold)``; with unseen dispatches, at least the roofline of the
            pool's mean ratios once they are in: those that fit in free running slots as KV (each
            the KV share of one running request, ``kv_use / running``), the rest as waiting
            requests. 1.0 = full (reached when ``headroom`` is for one endpoint).
        headroom: requests that may still be dispatched before the pool is full (inf when stale).
        unseen_dispatches: dispatches the last sample cannot show yet.
        metrics_age_seconds: age of the oldest fresh endpoint sample, or of the snapshot (inf when none).
        running_capacity: the fresh endpoints' ``max_num_seqs`` (configured or learned; 0 when stale
            or none is known yet).
    """

    saturated: bool
    stale: bool
    saturation: float
    headroom: float
    unseen_dispatches: int
    metrics_age_seconds: float
    running_capacity: float = 0.0


class SaturationDetector:
    """GIE utilization detector with in-flight accounting against the engines' running capacity
    (see the module docstring).

    Args:
        queue_depth_threshold: requests (GIE ``queueDepthThreshold``), > 0.
        kv_cache_util_threshold: fraction in (0, 1] (``kvCacheUtilThreshold``).
        metrics_staleness_seconds: > 0; older samples fail open.
        dispatch_visibility_seconds: >= 0; a dispatch counts until a sample taken this long after it.
        max_num_seqs: the engines' ``--max-num-seqs`` (>= 0); 0 learns each endpoint's from its
            reported ``num_requests_running`` (vLLM 0.32 exposes no metric for it).

    Raises:
        ValueError: a threshold out of range.
    """

    def __init__(
        self,
        queue_depth_threshold: float = 5.0,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_seconds: float = 1.0,
        dispatch_visibility_seconds: float = 0.05,
        max_num_seqs: int = 0,
    ) -> None:
        if not queue_depth_threshold > 0:
            raise ValueError(f"queue_depth_threshold must be > 0, got {queue_depth_threshold}")
        if not 0 < kv_cache_util_threshold <= 1:
            raise ValueError(f"kv_cache_util_threshold must be in (0, 1], got {kv_cache_util_threshold}")
        if not metrics_staleness_seconds > 0:
            raise ValueError(f"metrics_staleness_seconds must be > 0, got {metrics_staleness_seconds}")
        if max_num_seqs < 0:
            raise ValueError(f"max_num_seqs must be >= 0, got {max_num_seqs}")
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold
        self.metrics_staleness_seconds = metrics_staleness_seconds
        self.dispatch_visibility_seconds = max(0.0, dispatch_visibility_seconds)
        self.max_num_seqs = max_num_seqs
        self._snapshot: PoolSnapshot | None = None
        self._models: frozenset[str] = frozenset()
        self._fresh: tuple[EndpointLoad, ...] = ()
        self._sample_at = float("-inf")
        self._spare = 0.0
        self._run_room = 0.0
        self._load_sum = 0.0
        self._kv_ratio_sum = 0.0
        self._queue_ratio_sum = 0.0
        self._run_unit = 0.0
        self._capacity = 0.0
        self._peak_running: dict[str, float] = {}
        self._ceiling_seen: set[str] = set()
        self._held: dict[str, tuple[float, float, int]] = {}  # endpoint -> (sample time, running, samples) held
        self._dispatches: deque[float] = deque()
        self._freed: deque[float] = deque()  # release times of requests the last sample showed
        self._sampled_load = 0.0
        self._deficit = 0.0

    @property
    def snapshot(self) -> PoolSnapshot | None:
        return self._snapshot

    def running_capacity(self, endpoint_id: str) -> float | None:
        """The ``max_num_seqs`` used for ``endpoint_id``: configured, or its learned high-water mark
        once it showed its ceiling; None while only the KV bound limits it."""
        peak = self._peak_running.get(endpoint_id, 0.0)
        if self.max_num_seqs:
            return max(float(self.max_num_seqs), peak)
        return peak if endpoint_id in self._ceiling_seen else None

    def update(self, snapshot: PoolSnapshot) -> None:
        """Take a new pool snapshot; dispatches the new sample already shows stop counting. O(endpoints)."""
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
        peaks, ceilings, held = self._peak_running, self._ceiling_seen, self._held
        listed = {e.endpoint_id for e in snapshot.endpoints}
        for gone in [k for k in peaks if k not in listed]:  # an endpoint that left: a new one starts afresh
            del peaks[gone]
            ceilings.discard(gone)
            held.pop(gone, None)
        # KV share of one running request (vllm:kv_cache_usage_perc / vllm:num_requests_running), per
        # endpoint where it reports running requests; the pool's mean stands in for idle endpoints.
        shares = {e.endpoint_id: e.kv_cache_usage_perc / e.num_requests_running
                  for e in fresh if e.num_requests_running > 0 and e.kv_cache_usage_perc > 0}
        mean_share = statistics.fmean(shares.values()) if shares else 0.0
        spare = run_room = capacity = kv_after = queue_after = load = deficit = 0.0
        for e in fresh:
            eid, running, waiting = e.endpoint_id, e.num_requests_running, e.num_requests_waiting
            peak = peaks.get(eid, 0.0)
            if eid not in ceilings:
                sampled = snapshot.received_at - (e.metrics_age_seconds or 0.0)
                last = held.get(eid)
                new_sample = last is None or sampled - last[0] > 1e-3  # not epp's same scrape read again
                if waiting >= 1 and running >= peak > 0:  # requests wait at the high-water mark
                    if new_sample:
                        count = last[2] + 1 if last is not None and last[1] == running else 1
                        held[eid] = (sampled, running, count)
                        if count >= CEILING_SAMPLES:  # ... and running stays pinned there: its ceiling
                            ceilings.add(eid)
                            del held[eid]
                elif last is not None and new_sample:
                    del held[eid]
            if running > peak:
                peaks[eid] = peak = running
            seqs = self.running_capacity(eid)
            capacity += seqs or 0.0
            share = shares.get(eid, mean_share)
            kv_use = e.kv_cache_usage_perc
            kv_free = (kv - kv_use) / share if share > 0 else math.inf
            if seqs is None:  # ceiling unknown: slow start, up to twice the high-water mark
                seqs = 2 * peak
            free = max(0.0, min(seqs - running, kv_free))
            # the engine after its next step: what waits and fits has started (KV), the rest still waits
            queued = max(0.0, waiting - free)
            kv_next = (kv_use + min(waiting, free) * share) / kv
            kv_after += kv_next
            queue_after += queued / q
            load += max(queued / q, kv_next)
            if kv_use >= kv or queued >= q:  # GIE: no room on this endpoint
                deficit += max(0.0, queued - q)  # requests that must finish before it has room again
                continue
            spare += q + free - waiting
            run_room += max(0.0, free - waiting)
        self._spare = spare
        self._deficit = deficit
        self._run_room = run_room
        self._capacity = capacity
        self._load_sum = load
        self._kv_ratio_sum = kv_after
        self._queue_ratio_sum = queue_after
        # What one more running request adds to an endpoint's KV ratio (0 while no engine reports one).
        self._run_unit = mean_share / kv
        self._sampled_load = sum(e.num_requests_running + e.num_requests_waiting for e in fresh)
        seen_before = self._sample_at - self.dispatch_visibility_seconds
        while self._dispatches and self._dispatches[0] <= seen_before:
            self._dispatches.popleft()
        while self._freed and self._freed[0] <= self._sample_at:  # gone before the sample: not in it
            self._freed.popleft()

    def note_dispatch(self, now: float) -> None:
        """A request was dispatched at ``now`` (the engines' metrics will show it later)."""
        if self._snapshot is not None:
            self._dispatches.append(now)

    def note_done(self, dispatched_at: float, now: float | None = None) -> None:
        """The request dispatched at ``dispatched_at`` finished at ``now``.

        Unseen by any sample: it stops counting against the room (otherwise a fast pool looks
        saturated by requests that are already gone until the next scrape; docs/BENCHMARKS.md §3).
        Shown by the last sample (running or waiting there) and finished after it was taken: the
        sample's load overstates the engines by one until the next sample, so it frees one unit of
        room (at most the sample's running + waiting in all); without ``now`` only the first applies.
        O(unseen dispatches)."""
        try:
            self._dispatches.remove(dispatched_at)
        except ValueError:  # already cleared by a sample taken after it: the sample counts it
            if now is not None and now > self._sample_at and len(self._freed) < self._sampled_load:
                self._freed.append(now)

    def has_endpoints(self, model: str, now: float) -> bool | None:
        """Whether a fresh snapshot lists an endpoint for ``model`` (any, when ``""``); None when stale."""
        snap = self._snapshot
        if snap is None or now - snap.received_at > self.metrics_staleness_seconds:
            return None
        return model in self._models if model else bool(self._models)

    def state(self, now: float) -> SaturationState:
        """The pool now (O(1)): see :class:`SaturationState`."""
        snap = self._snapshot
        if snap is None or now - snap.received_at > self.metrics_staleness_seconds or not self._fresh:
            age = float("inf") if snap is None else now - snap.received_at
            return SaturationState(False, True, 0.0, float("inf"), 0, age)
        unseen = len(self._dispatches)
        # dispatched since the sample, less what it shows that is gone (beyond what over-full endpoints need)
        net = unseen - max(0.0, len(self._freed) - self._deficit)
        headroom = self._spare - net
        n = len(self._fresh)
        # GIE's roofline mean of the sample, or of the pool once it has taken the unseen dispatches
        # (those that fit in free running slots add KV, the rest wait), whichever is higher; the
        # projection is the roofline of the pool's mean ratios (exact for one endpoint).
        to_run = min(float(net), self._run_room)
        kv_mean = (self._kv_ratio_sum + to_run * self._run_unit) / n
        queue_mean = (self._queue_ratio_sum + (net - to_run) / self.queue_depth_threshold) / n
        saturation = max(self._load_sum / n, kv_mean, queue_mean) if net > 0 else self._load_sum / n
        age = now - self._sample_at
        return SaturationState(headroom <= 0, False, saturation, max(headroom, 0.0), unseen, age, self._capacity)
