"""Scrapes every live endpoint's ``<url>/metrics`` into the datastore, one task per endpoint.

Cadence (docs/BENCHMARKS.md §3, idle cost, issue 10): an endpoint is scraped every
``interval_seconds`` (``--metrics-scrape-interval-seconds``, default 0.1) while it is busy (its last
sample showed requests running or waiting) or failing. An idle endpoint is scraped every
``idle_interval_seconds`` (``--metrics-idle-scrape-interval-seconds``, default 1.0, capped at half of
``max_metrics_age_seconds`` so it stays a candidate), and a pick for it wakes its task at once (the
datastore's activity listener: no polling), so the next scrape comes within ``interval_seconds`` of
the previous one. Between scrapes an idle endpoint's task sleeps on an event, so an idle mesh costs
one scrape per engine per ``idle_interval_seconds`` and nothing else; a busy one is scraped as before.

The HTTP client is aiohttp (a keep-alive connection per engine, no proxies from the environment):
one scrape of the simulator's 34 KB exposition costs ~0.36 ms of epp CPU with it against ~1.07 ms
with httpx (measured in process on this machine, issue 10). A failure (connection refused, timeout,
non-200, undecodable or unparsable text) increments the endpoint's consecutive-failure count, which the
live-endpoint filter reads; a failing endpoint is retried at the busy cadence, so it drops out after
``max_consecutive_scrape_failures`` × ``interval_seconds``. The endpoint tasks follow membership
(started on join, cancelled on leave), reconciled when the datastore reports a change and at least
every ``idle_interval_seconds``; ``run()`` is the one background coroutine and cancelling it stops
every task and closes the HTTP session.

epp's own lateness is not the engines' (issue: picks refused "without fresh metrics" while epp's loop was
busy). ``run()`` also runs a loop-lag monitor: a tick every ``lag_tick_seconds`` (default 0.05; while idle,
every half idle interval, woken by a pick) that tells the datastore how late it ran
(:meth:`Datastore.note_loop_tick`); the lateness (a long synchronous stretch on the loop, a GC pause,
CPU starvation, a stopped process) is credited as epp's own lag, so

* an endpoint's metrics age counts only the time epp was running (the datastore's rule), and
* a scrape's timeout is ``timeout_seconds`` of epp's *running* time: when its deadline comes and epp
  lagged meanwhile, the deadline moves back by the lag (``kvmesh_epp_scrape_deadlines_extended_total``)
  instead of counting a failure against an engine whose reply may already sit in the socket.

An engine that stops answering (hung, SIGSTOPped, partitioned, refusing) still times out or fails after
``timeout_seconds`` of epp's running time and still ages while epp runs, so it drops out within
``max_consecutive_scrape_failures`` scrapes or ``max_metrics_age_seconds`` as before. Each credited
lateness is observed in ``kvmesh_epp_loop_lag_seconds``; a stall of ``STALL_LOG_SECONDS`` or more is
logged (WARNING) at most once per ``STALL_LOG_INTERVAL_SECONDS``, with the lag summed since the last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from types import TracebackType

import aiohttp

from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, parse_vllm_metrics
from services.epp.metrics import record_loop_lag, record_scrape, record_scrape_deadline_extended

logger = logging.getLogger(__name__)

DEFAULT_LAG_TICK_SECONDS = 0.05
"""Period of the loop-lag monitor's tick while picks come (idle: half the idle scrape interval)."""
STALL_LOG_SECONDS = 0.25
"""A tick at least this late is a stall worth a log line."""
STALL_LOG_INTERVAL_SECONDS = 10.0
"""At most one stall log line per this many seconds."""
_DEADLINE_TOLERANCE_SECONDS = 0.005
"""A deadline timer that fires with less running time than this left expires (timer granularity)."""


class LagAwareTimeout:
    """``async with LagAwareTimeout(datastore, seconds):`` — a deadline of ``seconds`` of epp's running time.

    Like ``asyncio.timeout(seconds)`` (raises :class:`TimeoutError` out of the block), except that when
    the timer fires and epp's own loop lagged since the block began (the datastore's lag ledger), the
    deadline moves back by that lag: the block gets ``seconds`` during which epp could actually run.
    """

    def __init__(self, datastore: Datastore, seconds: float) -> None:
        self._datastore = datastore
        self._seconds = seconds
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self._started = 0.0
        self._lag_at_start = 0.0
        self.extended = False
        """Whether the deadline was moved back at least once."""

    async def __aenter__(self) -> LagAwareTimeout:
        await self._timeout.__aenter__()
        self._started = self._datastore.clock.now()
        self._lag_at_start = self._datastore.loop_lag_seconds(self._started)
        self._handle = asyncio.get_running_loop().call_later(self._seconds, self._check)
        return self

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        left = self._seconds - self._datastore.running_seconds_since(self._started, self._lag_at_start)
        if left > _DEADLINE_TOLERANCE_SECONDS:  # epp lagged meanwhile: the engine gets its running time
            if not self.extended:
                self.extended = True
                record_scrape_deadline_extended()
            self._handle = loop.call_later(left, self._check)
        else:
            self._timeout.reschedule(loop.time())

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired


class MetricsScraper:
    """Args: ``interval_seconds`` (busy cadence), ``timeout_seconds`` (one scrape's deadline),
    ``idle_interval_seconds`` (idle cadence; None or smaller than the busy one: the busy one),
    ``lag_tick_seconds`` (period of the loop-lag monitor; None: no monitor, so no lag is credited)."""

    def __init__(self, datastore: Datastore, interval_seconds: float, timeout_seconds: float,
                 idle_interval_seconds: float | None = None,
                 lag_tick_seconds: float | None = DEFAULT_LAG_TICK_SECONDS) -> None:
        self._datastore = datastore
        self._lag_tick = lag_tick_seconds
        self._lag_activity = asyncio.Event()
        """Set by every pick: the loop-lag monitor ticks at ``lag_tick_seconds`` while picks come."""
        self._interval = interval_seconds
        self._idle_interval = max(interval_seconds, idle_interval_seconds or interval_seconds)
        self._timeout = timeout_seconds
        self._tasks: dict[EndpointId, tuple[Endpoint, asyncio.Task[None], asyncio.Event]] = {}
        self._membership_changed = asyncio.Event()
        datastore.add_activity_listener(self._on_activity)

    def _on_activity(self, endpoint_id: EndpointId | None) -> None:
        """The datastore's listener: a pick for ``endpoint_id`` wakes its task; None = membership changed."""
        if endpoint_id is None:
            self._membership_changed.set()
            return
        self._lag_activity.set()
        entry = self._tasks.get(endpoint_id)
        if entry is not None:
            entry[2].set()

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=256, limit_per_host=0, keepalive_timeout=60.0)
        timeout = aiohttp.ClientTimeout(total=None)  # each scrape runs under a LagAwareTimeout
        monitor = asyncio.create_task(self._watch_loop_lag(), name="loop-lag") if self._lag_tick else None
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            try:
                while True:
                    self._membership_changed.clear()
                    self._reconcile(session)
                    with contextlib.suppress(TimeoutError):  # a change wakes at once; the timeout is a backstop
                        async with asyncio.timeout(self._idle_interval):
                            await self._membership_changed.wait()
            finally:
                tasks = [task for _, task, _ in self._tasks.values()] + ([monitor] if monitor is not None else [])
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self._tasks.clear()

    async def _watch_loop_lag(self) -> None:
        """Tick and tell the datastore how late each tick ran (module docstring): every ``lag_tick_seconds``
        while picks come (one in the last ``idle_interval_seconds``), else every half idle interval, woken
        at once by a pick. (An idle 20 Hz tick would cost ~2 ms of CPU a second, 0.2 % of a core; the idle
        mesh's whole budget is 2 %.) Idle, a stall is credited from the slow tick's due time: an idle
        endpoint, scraped every idle interval, then reads at most 1.5 idle intervals old right after a
        stall, within ``max_metrics_age_seconds`` since the idle interval is capped at half of it."""
        assert self._lag_tick is not None
        fast = self._lag_tick
        slow = max(fast, self._idle_interval / 2)
        datastore, activity = self._datastore, self._lag_activity
        unlogged, late_ticks, logged_at = 0.0, 0, -math.inf
        active_at = -math.inf
        period = slow
        try:
            datastore.note_loop_tick(period)
            while True:
                if period == fast:
                    await asyncio.sleep(fast)
                else:
                    with contextlib.suppress(TimeoutError):  # a pick wakes the slow tick at once
                        async with asyncio.timeout(slow):
                            await activity.wait()
                now = datastore.clock.now()
                if activity.is_set():
                    activity.clear()
                    active_at = now
                period = fast if now - active_at < self._idle_interval else slow
                late = datastore.note_loop_tick(period)
                if not late:
                    continue
                record_loop_lag(late)
                unlogged += late
                late_ticks += 1
                if late >= STALL_LOG_SECONDS and now - logged_at >= STALL_LOG_INTERVAL_SECONDS:
                    logger.warning(
                        "epp event loop stalled %.3f s (%.3f s of lag over %d late ticks since the last line); "
                        "engines' metrics ages and scrape deadlines do not count epp's own lag",
                        late, unlogged, late_ticks)
                    unlogged, late_ticks, logged_at = 0.0, 0, now
        finally:
            datastore.note_loop_tick(None)

    def _reconcile(self, session: aiohttp.ClientSession) -> None:
        current = {ep.id: ep for ep in self._datastore.endpoints()}
        for endpoint_id, (endpoint, task, _) in list(self._tasks.items()):
            if current.get(endpoint_id) != endpoint:
                task.cancel()
                del self._tasks[endpoint_id]
        for endpoint_id, endpoint in current.items():
            if endpoint_id not in self._tasks:
                wake = asyncio.Event()
                task = asyncio.create_task(self._scrape_loop(session, endpoint, wake), name=f"scrape:{endpoint_id}")
                self._tasks[endpoint_id] = (endpoint, task, wake)

    async def _scrape_loop(self, session: aiohttp.ClientSession, endpoint: Endpoint, wake: asyncio.Event) -> None:
        url = endpoint.url.rstrip("/") + "/metrics"
        loop = asyncio.get_running_loop()
        failing = False
        idle = False
        while True:
            started = loop.time()
            wake.clear()  # a pick from here on wakes the idle wait below
            try:
                async with LagAwareTimeout(self._datastore, self._timeout), session.get(url) as reply:
                    reply.raise_for_status()
                    body = await reply.read()
                sample = parse_vllm_metrics(body.decode("utf-8"))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self._datastore.record_scrape_failure(endpoint.id, repr(exc))
                record_scrape("error")
                if not failing:
                    logger.warning("metrics scrape failed endpoint=%s url=%s error=%r", endpoint.id, url, exc)
                failing = True
            else:
                self._datastore.record_scrape(endpoint.id, sample)
                record_scrape("ok")
                idle = sample.num_requests_running == 0 and sample.num_requests_waiting == 0
                if failing:
                    logger.info("metrics scrape recovered endpoint=%s", endpoint.id)
                failing = False
            if idle and not failing:  # sleep up to the idle interval; a pick wakes it
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(started + self._idle_interval):
                        await wake.wait()
            await asyncio.sleep(max(0.0, started + self._interval - loop.time()))
