"""The datastore: live endpoints (from etcd) and each one's last scraped vLLM metrics.

Pure state, no I/O: :class:`~services.epp.scraper.MetricsScraper` feeds it scrapes, the membership
watcher feeds it joins and leaves, the scheduler reads :class:`Candidate` snapshots. An endpoint that
leaves etcd is forgotten at once (with its metrics); a scrape that arrives for an unknown endpoint is
ignored.

Pending picks (``pending_picks``: picks sent to an endpoint that its metrics do not show yet) let a
burst of picks see its own effect on the queue. They are reconciled against the engine's own count of
requests it has received, ``vllm:request_success_total`` (all finish reasons, aborts included) +
``vllm:num_requests_running`` + ``vllm:num_requests_waiting``: ``pending = picks - seen`` where
``seen`` is how far that count grew since the first scrape. So a scrape whose text was rendered before
a picked request reached the engine (the router's hop takes tens of ms on a busy host) does not wipe
that pick (otherwise a burst piles onto the endpoint just scraped). ``pending`` is clamped to
[0, picks of the last ``pending_pick_ttl_seconds``] (a request picked but never delivered, or one the
engine got from elsewhere, cannot skew it for longer). Without ``vllm:request_success_total`` a scrape
resets ``pending`` to 0.

Queued prefill (``unprefilled_requests``, ``queued_prefill_tokens``): each pick is noted with the prompt
tokens the target still has to compute (``uncached_prompt_tokens``: the prompt minus its cached prefix,
from the scheduler). The engine's
``vllm:time_to_first_token_seconds_count`` says how many requests finished their prefill; reconciled
the same way (clamped to the picks of the last ``prefill_ttl_seconds``), ``picks - first tokens`` is the
number of epp's requests still waiting for their first token there, and as engines admit FCFS these are
the latest picks, whose noted tokens sum to ``queued_prefill_tokens``. Without that counter,
``unprefilled_requests`` falls back to ``waiting + pending``.

Completions (:meth:`Datastore.note_completed`, fed by the router through epp's ``Completed`` RPC, issue 9):
the router says when a request it sent ended, so its load leaves at once instead of at the next scrape
(before this, on closed-loop agent sessions the session's own just-finished call still counted as
queue load when its next call was picked, and about one call in five left the engine holding its
history). A completion of request ``r`` picked to ``e`` means ``r`` was delivered and prefilled, and
(engines admit FCFS) so were the picks to ``e`` before it: ``pending`` and ``unprefilled`` become at
most the number of picks to ``e`` after ``r``. It also means ``r`` is no longer running on the
endpoint that served it: ``num_requests_running`` is the scrape's figure minus the completions the
engine had not counted yet (reconciled against ``vllm:request_success_total`` as picks are, clamped to
the completions of the last ``pending_pick_ttl_seconds``, so a completion the engine never counts
cannot hide load for longer). Every count above is also clamped when read, not only at a scrape:
a pick older than its TTL stops counting even if no scrape or completion arrives (a lost completion
does not leak load). A pick the router received but never had an engine answer (admission refused the
request after its early pick, every attempt failed before a first byte, the client left first) is
reported ``NOT_DISPATCHED``: that pick alone is dropped (``picks``, ``picks_total``, pending,
unprefilled, active tokens), the picks before it are not taken as delivered and no running count
changes. A re-pick of a request (the router's retry after a failed attempt, or its pick at dispatch
after the request queued) supersedes its earlier pick the same way.

Active prompt tokens (``active_prompt_tokens``, Dynamo's "active blocks" in tokens, issue 9): the whole
prompts of epp's picks to an endpoint that the router has not yet reported completed. vLLM 0.32 admits a
request only when KV blocks for its whole prompt are free (``scheduler_reserve_full_isl``), so these
tokens, not only the uncached ones, are what a new request competes with for the endpoint's KV pool.
As in Dynamo (which counts the requests its own router sent, unless its replicas sync), requests that
epp did not pick are not counted. Only picks with a request id count (a completion must be able to free them); one older than
``active_ttl_seconds`` (600 s, the router's request timeout) stops counting, and at most the newest
``ceil(running + waiting) + pending`` of them count, so a lost completion cannot hold load for long
while the engine shows fewer requests.

Routed prefill (``routed_prefill_tokens``, issue 9): the uncached prompt tokens of epp's picks to an
endpoint, each decaying with a half-life of ``routed_half_life_seconds`` (300 s) from its pick:
``routed(e, t) = sum_i tokens_i * 2 ** (-(t - t_i) / half_life)``. It is the content epp has placed on an
endpoint lately, the counterpart of the tree size by which SGLang's and vLLM's router ``cache_aware``
place a request that matches no worker (``smallest tree``): an engine's agent sessions between calls
(thinking, running tools) leave its queue empty but will come back to it, so the queue alone says
nothing of them. Kept as one decayed sum per endpoint (O(1) per pick and read); a pick dropped as
never delivered or superseded by a re-pick takes its tokens back (decayed as they were).

Freshness net of epp's own lag (``age_seconds``): an endpoint's metrics age is the time since its last
good scrape *minus the time epp's own event loop could not run* since then, so metrics that are old only
because epp could not run its scrapes (a long synchronous stretch such as tokenizing big prompts, a GC
pause, a slow call on the loop, the process starved of CPU or stopped) do not make a healthy endpoint
stale, while an engine that stops answering (scrapes failing or timing out, hung, partitioned) still
ages at the wall-clock rate whenever epp runs, and so becomes stale within ``max_metrics_age_seconds``
of epp's running time as before. The lag comes from the scraper's loop-lag monitor
(:meth:`Datastore.note_loop_tick`): a tick due at ``d`` that runs at ``t > d + LOOP_LAG_SLACK_SECONDS``
credits ``t - d`` seconds; a tick overdue right now counts as lag already (the pick that runs first after
a stall sees it). ``age = max(0, (now - scraped_at) - (lag(now) - lag(scraped_at)))``. Without a monitor
(no tick yet, or stopped) nothing is credited: the plain wall-clock age. Picks served on an endpoint whose
wall-clock age exceeds the max age are counted (``kvmesh_epp_picks_on_lagged_metrics_total``,
:meth:`Datastore.note_lagged_candidates`). Bounds: a stall is credited from the tick's due time, so up
to one tick period of it counts as running (idle, half the idle scrape interval: an idle endpoint reads
at most 1.5 idle intervals old right after any stall). A loop that is not stalled but saturated (every
round of ready callbacks longer than the tick) accrues running time at about tick/round, so engines are
judged by the scraper's own progress: a hung engine then takes about round/tick times longer in wall
time to drop (as many scrape rounds as an idle loop would give it).

:func:`parse_vllm_metrics` reads the Prometheus text of vLLM's ``/metrics`` (names as in vLLM 0.32,
``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (summed / averaged over the ``engine`` label of data-parallel ranks) and
the ``block_size`` and ``num_gpu_blocks`` labels of ``vllm:cache_config_info``.
"""

from __future__ import annotations

import logging
import math
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.clock import Clock, SystemClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.interfaces import Candidate, EndpointMetrics
from services.epp.metrics import record_lagged_pick

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
FINISHED = "vllm:request_success"
"""Family name as ``prometheus_client`` parses it; the sample is ``vllm:request_success_total``."""
FIRST_TOKENS = "vllm:time_to_first_token_seconds"
"""Histogram; its ``_count`` sample is the number of requests that got their first token."""
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"
"""A fraction in [0, 1], as ``vllm:kv_cache_usage_perc``."""
SGLANG_PAGE_SIZE = "sglang:page_size"
SGLANG_MAX_TOKENS = "sglang:max_total_num_tokens"
"""SGLang's KV pool size in tokens (the counterpart of vLLM's ``num_gpu_blocks`` label)."""
SGLANG_FINISHED = "sglang:num_requests"
"""Family name as parsed; the sample is ``sglang:num_requests_total`` (requests finished, by ``is_streaming``)."""
SGLANG_FIRST_TOKENS = "sglang:time_to_first_token_seconds"
SGLANG_NAMES = {
    SGLANG_WAITING: WAITING,
    SGLANG_RUNNING: RUNNING,
    SGLANG_KV_USAGE: KV_USAGE,
    SGLANG_FINISHED + "_total": FINISHED + "_total",
    SGLANG_FIRST_TOKENS + "_count": FIRST_TOKENS + "_count",
}
"""SGLang 0.5.23's sample names (``sglang/srt/observability/metrics_collector.py``) -> the vLLM ones they stand for."""
_WANTED = (
    WAITING, RUNNING, KV_USAGE, CACHE_CONFIG, FINISHED + "_total", FIRST_TOKENS + "_count",
    SGLANG_WAITING, SGLANG_RUNNING, SGLANG_KV_USAGE, SGLANG_PAGE_SIZE, SGLANG_MAX_TOKENS, SGLANG_FINISHED + "_total",
    SGLANG_FIRST_TOKENS + "_count",
)
DEFAULT_PENDING_PICK_TTL_SECONDS = 5.0
DEFAULT_PREFILL_TTL_SECONDS = 120.0
DEFAULT_ACTIVE_TTL_SECONDS = 600.0
"""An in-flight pick whose completion never came stops counting as active after this long (the router's
default ``request_timeout_seconds``: no request it sends lives longer)."""
DEFAULT_ROUTED_HALF_LIFE_SECONDS = 300.0
"""``EppConfig.routed_half_life_seconds``' default: the half-life of a pick's tokens in ``routed_prefill_tokens``
(module docstring, "Routed prefill"), a few times an agent session's think time, so the sessions placed on an
endpoint over the last minutes count."""
_PICK_HISTORY = 4096
"""Most picks remembered per endpoint (for their prefill tokens)."""
_IN_FLIGHT_IDS = 65536
"""Most request ids remembered (request id -> picked endpoint) for completions; oldest forgotten first."""
_WANTED_SAMPLES = tuple(_WANTED)
_SAMPLE_LINE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)'  # metric name
    r'(?:\{(?:\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\\n]|\\.)*"\s*,?)*\s*\})?'  # labels, quoted values with escapes
    r'[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*\Z'  # value, optional timestamp
)
"""One sample line of the Prometheus text exposition format 0.0.4 (name, value). The few wanted lines
are matched with this instead of ``prometheus_client``'s parser: ~0.10 ms against ~0.39 ms per scrape
of the simulator's 34 KB exposition (idle cost, issue 10); HELP/TYPE lines are not needed."""
_BLOCK_SIZE_LABEL = re.compile(r'[{,]block_size="([0-9]+)"')
_NUM_GPU_BLOCKS_LABEL = re.compile(r'[{,]num_gpu_blocks="([0-9]+)"')
_SKIPPED_PREFIXES = tuple(f"{n}{suffix}" for n in (FIRST_TOKENS, SGLANG_FIRST_TOKENS) for suffix in ("_bucket", "_sum", "_created"))
"""Of the TTFT histogram only ``_count`` is read: its bucket lines are most of the text to parse (idle cost, issue 10)."""


@dataclass(frozen=True, slots=True)
class ScrapeSample:
    """One successful scrape's values (units as in :class:`EndpointMetrics`)."""

    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage_perc: float
    block_size_tokens: int | None = None
    num_requests_finished: float | None = None
    """``vllm:request_success_total`` summed over labels (requests); None when absent."""
    num_first_tokens: float | None = None
    """``vllm:time_to_first_token_seconds_count`` summed over labels (requests); None when absent."""
    kv_capacity_tokens: int | None = None
    """Tokens the KV pool holds: vLLM's ``(num_gpu_blocks - 1) * block_size`` (its block 0 is the null block,
    ``vllm/v1/core/block_pool.py``), or SGLang's ``sglang:max_total_num_tokens``; None when absent."""


def parse_vllm_metrics(text: str) -> ScrapeSample:
    """Parse an engine's Prometheus exposition: vLLM 0.32's ``vllm:*`` names, or SGLang 0.5.23's
    (``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``,
    ``sglang:page_size``, ``sglang:num_requests_total``, ``sglang:time_to_first_token_seconds_count``;
    summed / averaged over their ``dp_rank`` and other labels as vLLM's over ``engine``).

    Only the sample lines of the metrics above (and ``vllm:request_success_total``, optional) are read,
    each matched by ``_SAMPLE_LINE`` (the text format's sample grammar: labels with escaped quotes,
    optional timestamp); the full exposition is ~35-50 KB of histograms, and parsing it all with
    ``prometheus_client`` every 100 ms per engine would cost a core.

    Raises:
        ValueError: a required gauge is missing, not finite, negative, or usage outside [0, 1].
    """
    block_size: int | None = None
    gpu_pools: int | None = None
    capacity: int | None = None
    values: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_USAGE: []}
    finished: float | None = None
    first_tokens: float | None = None
    for line in text.splitlines():
        if not line.startswith(_WANTED_SAMPLES) or line.startswith(_SKIPPED_PREFIXES):
            continue
        if line.startswith(CACHE_CONFIG):  # ~40 labels; only block_size and num_gpu_blocks are read
            size = _BLOCK_SIZE_LABEL.search(line)
            if block_size is None and size is not None:
                block_size = int(size.group(1))
            if size is not None and (blocks := _NUM_GPU_BLOCKS_LABEL.search(line)) is not None:
                pool = max(0, int(blocks.group(1)) - 1) * int(size.group(1))  # one rank's pool, less its null block
                gpu_pools = (gpu_pools or 0) + pool  # summed over data-parallel ranks
            continue
        if (parsed := _SAMPLE_LINE.match(line)) is None:
            raise ValueError(f"unparsable /metrics line: {line[:200]!r}")
        name, value = parsed.group(1), float(parsed.group(2))
        name = SGLANG_NAMES.get(name, name)
        if name == SGLANG_PAGE_SIZE and block_size is None and math.isfinite(value) and value > 0:
            block_size = int(value)
        elif name == SGLANG_MAX_TOKENS and math.isfinite(value) and value > 0:
            capacity = (capacity or 0) + int(value)
        elif name in values:
            values[name].append(value)
        elif name == FINISHED + "_total" and math.isfinite(value) and value >= 0:
            finished = (finished or 0.0) + value
        elif name == FIRST_TOKENS + "_count" and math.isfinite(value) and value >= 0:
            first_tokens = (first_tokens or 0.0) + value
    for name, found in values.items():
        if not found:
            raise ValueError(f"{name} missing from /metrics")
        if any(not math.isfinite(v) or v < 0 for v in found):
            raise ValueError(f"{name} has a negative or non-finite value: {found}")
    usage = sum(values[KV_USAGE]) / len(values[KV_USAGE])
    if usage > 1.0:
        raise ValueError(f"{KV_USAGE}={usage} outside [0, 1]")
    if capacity is None:
        capacity = gpu_pools
    return ScrapeSample(sum(values[WAITING]), sum(values[RUNNING]), usage, block_size, finished, first_tokens,
                        capacity)


@dataclass(slots=True)
class _EndpointState:
    endpoint: Endpoint
    sample: ScrapeSample | None = None
    scraped_at: float | None = None
    lag_at_scrape: float = 0.0
    """epp's cumulative loop lag (``Datastore.loop_lag_seconds``) when ``scraped_at`` was recorded."""
    consecutive_failures: int = 0
    pending_picks: int = 0
    last_error: str = ""
    picks_total: int = 0
    seen_offset: float | None = None
    """Engine received-count at which ``picks_total`` was 0 (None until a scrape carried the counter)."""
    first_token_offset: float | None = None
    """Engine first-token count at which ``picks_total`` was 0 (None until a scrape carried it)."""
    unprefilled: int = 0
    picks: deque[tuple[float, int, str]] = field(default_factory=lambda: deque(maxlen=_PICK_HISTORY))
    """(clock time, prefill tokens, request id) of the latest picks, oldest first."""
    completed_total: int = 0
    """Completions the router reported for requests this endpoint served."""
    finished_offset: float | None = None
    """Engine finished-count at which ``completed_total`` was 0 (None until a scrape carried it)."""
    unseen_completions: int = 0
    """Reported completions the last scrape did not count as finished (still in its running figure)."""
    completions: deque[float] = field(default_factory=lambda: deque(maxlen=_PICK_HISTORY))
    """Clock times of the latest reported completions, oldest first."""
    active: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    """Request id -> (clock time, whole prompt tokens) of epp's picks here not yet reported completed, oldest first."""
    active_tokens: int = 0
    """Sum of ``active``'s prompt tokens."""
    routed: float = 0.0
    """Decayed uncached prompt tokens of the picks here, as of ``routed_at`` (module docstring, "Routed prefill")."""
    routed_at: float = 0.0
    snapshot: Candidate | None = None
    """The last :class:`Candidate` built; dropped by every change of this state (scrape, pick)."""
    snapshot_at: float = 0.0


SNAPSHOT_REUSE_SECONDS = 0.005
"""A candidate snapshot is reused until its state changes or it is this old: only ``age_seconds``
can be stale, by at most this much (against ``max_metrics_age_seconds`` of 2 s). Building 100
snapshots per pick was half of a pick's decision time at 100 endpoints (issue 10)."""


OUTPUT_TOKENS_EWMA_ALPHA = 0.05
"""Weight of the newest completion in a model's mean output tokens (``mean_output_tokens``): about the last
20 requests' worth, so the mean follows a change of traffic within a few dozen requests."""
LOOP_LAG_SLACK_SECONDS = 0.01
"""A loop-lag tick later than this past its due time credits its whole lateness as epp's own lag;
within it (timer resolution, ordinary scheduling) nothing is credited."""
LAGGED_PICK_LOG_INTERVAL_SECONDS = 10.0
"""At most one log line per this many seconds about picks served on lag-credited metrics."""


class Datastore:
    """Endpoints by id with their metrics; every method is O(endpoints) at most and never blocks."""

    def __init__(self, clock: Clock | None = None,
                 pending_pick_ttl_seconds: float = DEFAULT_PENDING_PICK_TTL_SECONDS,
                 prefill_ttl_seconds: float = DEFAULT_PREFILL_TTL_SECONDS,
                 active_ttl_seconds: float = DEFAULT_ACTIVE_TTL_SECONDS,
                 routed_half_life_seconds: float = DEFAULT_ROUTED_HALF_LIFE_SECONDS) -> None:
        if not routed_half_life_seconds > 0:
            raise ValueError(f"routed_half_life_seconds must be > 0, got {routed_half_life_seconds}")
        self._clock = clock or SystemClock()
        self._routed_half_life = routed_half_life_seconds
        self._pending_ttl = pending_pick_ttl_seconds
        self._prefill_ttl = prefill_ttl_seconds
        self._active_ttl = active_ttl_seconds
        self._states: dict[EndpointId, _EndpointState] = {}
        self._ordered: dict[str | None, list[_EndpointState]] = {}
        """Per model (None: all), the states sorted by id; rebuilt after a membership change."""
        self._in_flight: OrderedDict[str, EndpointId] = OrderedDict()
        """Request id -> the endpoint it was picked to, until its completion (bounded, oldest dropped)."""
        self._output_mean: dict[str, float] = {}
        """Per model, the exponentially weighted mean output tokens of successful completions the router reported."""
        self._activity: list[Callable[[EndpointId | None], None]] = []
        """Called with the endpoint on every pick, with None after a membership change (the scraper's wake-up)."""
        self._lag_total = 0.0
        """Seconds of epp's own loop lag credited by past ticks (module docstring)."""
        self._lag_due: float | None = None
        """Clock time the loop-lag monitor's next tick is due; None: no monitor running (nothing credited)."""
        self._lag_last_at = -math.inf
        """Clock time lag was last credited (gates :meth:`note_lagged_candidates`)."""
        self._lagged_picks = 0
        self._lagged_log_at = -math.inf

    def add_activity_listener(self, listener: Callable[[EndpointId | None], None]) -> None:
        """``listener(endpoint_id)`` after every pick for it, ``listener(None)`` after a membership
        change; it must be cheap and never raise (it runs inside ``note_pick``)."""
        self._activity.append(listener)

    # -- membership -------------------------------------------------------------------------
    def apply_membership(self, joined: Mapping[EndpointId, Endpoint], left: Mapping[EndpointId, Endpoint]) -> None:
        """Apply a watcher change: ``left`` first (a changed registration is a leave then a join)."""
        for endpoint_id in left:
            self._states.pop(endpoint_id, None)
        for endpoint_id, endpoint in joined.items():
            self._states[endpoint_id] = _EndpointState(endpoint)
        self._ordered.clear()
        for listener in self._activity:
            listener(None)

    def set_endpoints(self, endpoints: Mapping[EndpointId, Endpoint]) -> None:
        """Replace the endpoint set, keeping the metrics of endpoints that stay unchanged."""
        left = {i: s.endpoint for i, s in self._states.items() if endpoints.get(i) != s.endpoint}
        joined = {i: e for i, e in endpoints.items() if i not in self._states or i in left}
        self.apply_membership(joined, left)

    # -- epp's own loop lag ------------------------------------------------------------------
    @property
    def clock(self) -> Clock:
        return self._clock

    def note_loop_tick(self, next_in_seconds: float | None) -> float:
        """The loop-lag monitor ran now; its next tick is due ``next_in_seconds`` from now (None: the
        monitor stops, so nothing more is credited). Returns the lateness of this tick credited as
        epp's own lag (seconds; 0 when it ran within ``LOOP_LAG_SLACK_SECONDS`` of its due time)."""
        now = self._clock.now()
        late = 0.0
        if self._lag_due is not None and now - self._lag_due > LOOP_LAG_SLACK_SECONDS:
            late = now - self._lag_due
            self._lag_total += late
            self._lag_last_at = now
        self._lag_due = None if next_in_seconds is None else now + next_in_seconds
        return late

    def loop_lag_seconds(self, now: float | None = None) -> float:
        """epp's cumulative loop lag up to ``now`` (clock seconds): the lateness of past ticks plus how
        far an overdue tick is late right now (a stall still going on, or just ended). O(1)."""
        if now is None:
            now = self._clock.now()
        total = self._lag_total
        if self._lag_due is not None and now - self._lag_due > LOOP_LAG_SLACK_SECONDS:
            total += now - self._lag_due
        return total

    def running_seconds_since(self, started: float, lag_at_start: float) -> float:
        """Seconds since clock time ``started`` during which epp's loop was not lagging: wall time minus
        the lag credited since (``lag_at_start``: :meth:`loop_lag_seconds` at ``started``); >= 0."""
        now = self._clock.now()
        return max(0.0, (now - started) - (self.loop_lag_seconds(now) - lag_at_start))

    def note_lagged_candidates(self, candidates: Iterable[Candidate], max_age_seconds: float) -> int:
        """Count a pick served with candidates whose last good scrape is older than ``max_age_seconds``
        in wall-clock time, kept only because epp's own loop lag was credited (module docstring).

        Returns how many of ``candidates`` are such; when any, ``kvmesh_epp_picks_on_lagged_metrics_total``
        grows by one and a WARNING is logged at most once per ``LAGGED_PICK_LOG_INTERVAL_SECONDS``.
        O(1) unless lag was credited within the last ``max_age_seconds`` (no candidate can be one
        otherwise: its lag-net age would exceed the time since then); O(candidates) then."""
        now = self._clock.now()
        if now - self._lag_last_at > max_age_seconds and self.loop_lag_seconds(now) == self._lag_total:
            return 0
        lagged = 0
        oldest = 0.0
        for candidate in candidates:
            state = self._states.get(candidate.id)
            if state is not None and state.scraped_at is not None and now - state.scraped_at > max_age_seconds:
                lagged += 1
                oldest = max(oldest, now - state.scraped_at)
        if lagged:
            record_lagged_pick()
            self._lagged_picks += 1
            if now - self._lagged_log_at >= LAGGED_PICK_LOG_INTERVAL_SECONDS:
                logger.warning(
                    "%d pick(s) served on metrics older than max_metrics_age_seconds=%.3g s (oldest %.3f s) "
                    "because epp's own event loop lagged (%.3f s credited in all); engines were not marked stale",
                    self._lagged_picks, max_age_seconds, oldest, self.loop_lag_seconds(now))
                self._lagged_picks = 0
                self._lagged_log_at = now
        return lagged

    # -- scrapes ----------------------------------------------------------------------------
    def record_scrape(self, endpoint_id: EndpointId, sample: ScrapeSample) -> None:
        state = self._states.get(endpoint_id)
        if state is None:
            return
        now = self._clock.now()
        state.snapshot = None
        state.sample = sample
        state.scraped_at = now
        state.lag_at_scrape = self.loop_lag_seconds(now)
        state.consecutive_failures = 0
        state.last_error = ""
        if sample.num_requests_finished is None:
            state.pending_picks = 0
            state.unseen_completions = 0
        else:
            received = sample.num_requests_finished + sample.num_requests_running + sample.num_requests_waiting
            state.seen_offset, state.pending_picks = self._reconcile(
                state.picks_total, (p[0] for p in reversed(state.picks)), received, state.seen_offset, now,
                self._pending_ttl)
            state.finished_offset, state.unseen_completions = self._reconcile(
                state.completed_total, reversed(state.completions), sample.num_requests_finished,
                state.finished_offset, now, self._pending_ttl)
        if sample.num_first_tokens is None:
            state.unprefilled = int(sample.num_requests_waiting + state.pending_picks)
        else:
            state.first_token_offset, state.unprefilled = self._reconcile(
                state.picks_total, (p[0] for p in reversed(state.picks)), sample.num_first_tokens,
                state.first_token_offset, now, self._prefill_ttl)

    @staticmethod
    def _reconcile(
        total: int, newest_first: Iterable[float], count: float, offset: float | None, now: float, ttl: float
    ) -> tuple[float, int]:
        """``total - (count - offset)`` clamped to [0, events of the last ``ttl`` s], moving the offset when clamped.

        ``total``: epp's count of the events (picks, completions); ``newest_first``: their clock times,
        newest first; ``count``: the engine's count of the same kind. Returns (offset, unseen).
        """
        if offset is None:
            offset = count - total
        unseen = int(total - (count - offset))
        if unseen < 0:  # the engine counted requests epp did not send (or a counter restarted)
            return count - total, 0
        recent = 0  # events of the last ttl seconds, counted only as far as needed
        for at in newest_first:
            if recent >= unseen or now - at > ttl:
                break
            recent += 1
        if unseen > recent:  # picks that never arrived (router fell back, request refused) or expired
            return count - total + recent, recent
        return offset, unseen

    def record_scrape_failure(self, endpoint_id: EndpointId, error: str) -> None:
        state = self._states.get(endpoint_id)
        if state is None:
            return
        state.snapshot = None
        state.consecutive_failures += 1
        state.last_error = error

    def note_pick(self, endpoint_id: EndpointId, prefill_tokens: int = 0, request_id: str = "",
                  prompt_tokens: int = 0) -> None:
        """Count a pick; ``prefill_tokens``: prompt tokens the target must compute (not cached there);
        ``request_id`` (non-empty) lets :meth:`note_completed` find it; ``prompt_tokens``: the whole
        prompt, counted in the target's ``active_prompt_tokens`` until the completion (request id needed)."""
        state = self._states.get(endpoint_id)
        if state is not None:
            now = self._clock.now()
            state.snapshot = None
            state.pending_picks += 1
            state.unprefilled += 1
            state.picks_total += 1
            if request_id and (before := self._in_flight.get(request_id)) is not None:
                # a re-pick (the router re-dispatching it after a failed attempt, or picking it again at
                # dispatch after it queued): the earlier pick no longer holds KV, nor waits, where it went
                earlier = self._states.get(before)
                if earlier is not None:
                    self._drop_pick(earlier, request_id)
            state.picks.append((now, max(0, prefill_tokens), request_id))
            self._add_routed(state, now, max(0, prefill_tokens), now)
            if request_id and prompt_tokens > 0:
                active = state.active
                previous = active.pop(request_id, None)
                if previous is not None:
                    state.active_tokens -= previous[1]
                active[request_id] = (now, prompt_tokens)
                state.active_tokens += prompt_tokens
                if len(active) > _PICK_HISTORY:
                    state.active_tokens -= active.popitem(last=False)[1][1]
            if request_id:
                self._in_flight[request_id] = endpoint_id
                self._in_flight.move_to_end(request_id)
                if len(self._in_flight) > _IN_FLIGHT_IDS:
                    self._in_flight.popitem(last=False)
            for listener in self._activity:
                listener(endpoint_id)

    def note_completed(self, request_id: str, endpoint_id: str = "", dispatched: bool = True,
                       output_tokens: int = 0) -> bool:
        """The router says request ``request_id`` ended on ``endpoint_id`` (any outcome); O(picks after it).

        Frees the pick where epp counted it (its pending and unprefilled counts, and those of the
        picks to that endpoint before it) and takes the request out of the serving endpoint's
        running count until a scrape shows it finished (module docstring). ``endpoint_id`` empty:
        the endpoint it was picked to. Returns whether epp had picked the request (a completion for
        an unknown or forgotten id still counts on ``endpoint_id``).

        ``dispatched=False`` (``COMPLETION_OUTCOME_NOT_DISPATCHED``: the router received the pick but
        no engine answered the request: admission refused it after an early pick, every attempt
        failed before its first byte, the client left first): only that pick is dropped (its active
        prompt tokens, its pending and unprefilled counts, and from ``picks_total``, so the engine's
        received count is reconciled without it); the picks before it are not taken as delivered
        and no engine's running count changes (no engine counted it finished).

        ``output_tokens`` > 0 (a success's generated tokens) enters the served endpoint's model's mean output
        tokens (``EndpointMetrics.mean_output_tokens``, weight ``OUTPUT_TOKENS_EWMA_ALPHA``).
        """
        if not dispatched:
            picked_to = self._in_flight.pop(request_id, None) if request_id else None
            picked = self._states.get(picked_to) if picked_to is not None else None
            return picked is not None and self._drop_pick(picked, request_id)
        picked_to = self._in_flight.pop(request_id, None) if request_id else None
        found = False
        picked = self._states.get(picked_to) if picked_to is not None else None
        if picked is not None:
            after = 0
            for _, _, rid in reversed(picked.picks):
                if rid == request_id:
                    found = True
                    break
                after += 1
            if found:
                picked.snapshot = None
                picked.pending_picks = min(picked.pending_picks, after)
                picked.unprefilled = min(picked.unprefilled, after)
            entry = picked.active.pop(request_id, None)
            if entry is not None:
                picked.snapshot = None
                picked.active_tokens -= entry[1]
        served_id = EndpointId(endpoint_id) if endpoint_id else picked_to
        served = self._states.get(served_id) if served_id is not None else None
        if served is not None:
            if output_tokens > 0:
                model = served.endpoint.model
                mean = self._output_mean.get(model)
                self._output_mean[model] = float(output_tokens) if mean is None else (
                    mean + OUTPUT_TOKENS_EWMA_ALPHA * (output_tokens - mean))
            served.snapshot = None
            served.completed_total += 1
            served.unseen_completions += 1
            served.completions.append(self._clock.now())
        return found

    def _add_routed(self, state: _EndpointState, at: float, tokens: float, now: float) -> None:
        """Add ``tokens`` picked at ``at`` (negative: take them back) to ``state``'s decayed routed prefill,
        decaying what it held to ``now`` first; never below 0 (rounding)."""
        if tokens == 0:
            return
        state.routed = max(0.0, self._routed_now(state, now)
                           + tokens * 2.0 ** (-(now - at) / self._routed_half_life))
        state.routed_at = now

    def _routed_now(self, state: _EndpointState, now: float) -> float:
        """``state``'s routed prefill tokens decayed to ``now``."""
        return state.routed * 2.0 ** (-(now - state.routed_at) / self._routed_half_life) if state.routed else 0.0

    def _drop_pick(self, state: _EndpointState, request_id: str) -> bool:
        """Forget ``request_id``'s latest pick to ``state``'s endpoint as one the engine never held:
        out of ``picks`` and ``picks_total`` (a scrape then reconciles the engine's counts without it;
        should the engine have received it after all, the reconcile clamps at 0), out of the pending
        and unprefilled counts when it was among them, and its active prompt tokens freed. O(picks
        after it), plus the deque's removal. Returns whether a pick was found."""
        picks = state.picks
        found = -1
        for after, (_, _, rid) in enumerate(reversed(picks)):
            if rid == request_id:
                found = after
                break
        if found >= 0:
            at, tokens, _ = picks[len(picks) - 1 - found]
            self._add_routed(state, at, -tokens, self._clock.now())
            del picks[len(picks) - 1 - found]
            state.picks_total -= 1
            if state.pending_picks > found:
                state.pending_picks -= 1
            if state.unprefilled > found:
                state.unprefilled -= 1
        entry = state.active.pop(request_id, None)
        if entry is not None:
            state.active_tokens -= entry[1]
        if found >= 0 or entry is not None:
            state.snapshot = None
        return found >= 0

    # -- reads ------------------------------------------------------------------------------
    def picks_total(self, endpoint_id: EndpointId) -> int:
        """Picks counted for ``endpoint_id`` since it joined (0 when unknown); O(1)."""
        state = self._states.get(endpoint_id)
        return state.picks_total if state is not None else 0

    def endpoints(self) -> list[Endpoint]:
        return [s.endpoint for s in self._states.values()]

    def serves(self, model: str) -> bool:
        return any(s.endpoint.model == model for s in self._states.values())

    def _candidate(self, state: _EndpointState, now: float, lag: float) -> Candidate:
        """``lag``: :meth:`loop_lag_seconds` at ``now`` (computed once per :meth:`candidates`)."""
        cached = state.snapshot
        if cached is not None and now - state.snapshot_at <= SNAPSHOT_REUSE_SECONDS:
            return cached
        sample = state.sample
        # The latest picks, clamped by their TTLs now (not only at a scrape): pending = the picks of
        # the last pending TTL among the ``pending_picks`` latest; unprefilled likewise.
        pending = unprefilled = queued_tokens = 0
        want = max(state.pending_picks, state.unprefilled)
        if want:
            pending_ttl, prefill_ttl = self._pending_ttl, self._prefill_ttl
            for i, (at, tokens, _) in enumerate(reversed(state.picks)):
                if i >= want:
                    break
                age = now - at
                if i < state.pending_picks and age <= pending_ttl:
                    pending += 1
                if i < state.unprefilled and age <= prefill_ttl:
                    unprefilled += 1
                    queued_tokens += tokens
        known = unprefilled
        unknown = max(0, state.unprefilled - len(state.picks))  # requests epp did not pick (tokens unknown)
        running = sample.num_requests_running if sample is not None else 0.0
        if state.unseen_completions:  # completions the engine has not counted yet, within their TTL
            done = 0
            for at in reversed(state.completions):
                if done >= state.unseen_completions or now - at > self._pending_ttl:
                    break
                done += 1
            running -= done
        active_tokens = self._active_prompt_tokens(state, now, running, sample)
        metrics = EndpointMetrics(
            num_requests_waiting=sample.num_requests_waiting if sample is not None else 0.0,
            num_requests_running=max(0.0, running),
            kv_cache_usage_perc=sample.kv_cache_usage_perc if sample is not None else 0.0,
            block_size_tokens=sample.block_size_tokens if sample is not None else None,
            kv_capacity_tokens=sample.kv_capacity_tokens if sample is not None else None,
            age_seconds=None if state.scraped_at is None else max(
                0.0, now - state.scraped_at - (lag - state.lag_at_scrape)),
            pending_picks=pending,
            consecutive_failures=state.consecutive_failures,
            unprefilled_requests=known + unknown,
            known_unprefilled_requests=known,
            queued_prefill_tokens=queued_tokens,
            active_prompt_tokens=active_tokens,
            routed_prefill_tokens=self._routed_now(state, now),
            mean_output_tokens=self._output_mean.get(state.endpoint.model),
        )
        candidate = state.snapshot = Candidate(state.endpoint, metrics)
        state.snapshot_at = now
        return candidate

    def _active_prompt_tokens(self, state: _EndpointState, now: float, running: float,
                              sample: ScrapeSample | None) -> int:
        """Prompt tokens of epp's in-flight picks on ``state``'s endpoint (module docstring, "Active").

        Entries older than the active TTL are dropped (a lost completion); with a scrape, only the newest
        ``ceil(running + waiting) + pending`` count (the engine cannot hold more requests than that)."""
        active = state.active
        if not active:
            return 0
        ttl = self._active_ttl
        while active:
            request_id, (at, tokens) = next(iter(active.items()))
            if now - at <= ttl:
                break
            del active[request_id]
            state.active_tokens -= tokens
        if sample is None:
            return state.active_tokens
        most = math.ceil(max(0.0, running) + sample.num_requests_waiting) + state.pending_picks
        if len(active) <= most:
            return state.active_tokens
        total = 0
        for i, (_, tokens) in enumerate(reversed(active.values())):
            if i >= most:
                break
            total += tokens
        return total

    def candidates(self, model: str | None = None) -> list[Candidate]:
        """Snapshots of every endpoint (of ``model`` when given), sorted by id (O(endpoints); a
        snapshot is rebuilt only for endpoints that changed or after ``SNAPSHOT_REUSE_SECONDS``)."""
        now = self._clock.now()
        ordered = self._ordered.get(model)
        if ordered is None:
            ordered = self._ordered[model] = [
                s for _, s in sorted(self._states.items()) if model is None or s.endpoint.model == model
            ]
            if len(self._ordered) > 64:  # bounded: models asked for that nobody serves
                self._ordered.clear()
                self._ordered[model] = ordered
        candidate = self._candidate
        lag = self.loop_lag_seconds(now)
        return [candidate(s, now, lag) for s in ordered]
