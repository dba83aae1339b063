"""epp's own lateness is not its engines': the metrics-age rule net of epp's loop lag (issue: picks refused
"without fresh metrics" while epp's loop was held).

Part 1, the rule in the core (``Datastore``, a manual clock, no I/O): an endpoint's age counts only the
time epp could run; a stall (a tick overdue now, or one that ran late) is credited; an engine whose
scrapes fail or time out is still dropped; nothing is credited without a monitor or within the slack.
Part 2, the scraper on a real loop against real HTTP engines served from another thread (so a stall of
the test's loop is epp's alone): a long synchronous stretch on the loop (a GC pause, a slow kv_indexer
call, tokenizing a huge prompt on the loop all look alike to it: ``time.sleep``) past the max age leaves
healthy engines live, the scrape in flight across it is not a timeout, while a hung engine still
becomes stale and a failing one stays excluded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from kvmesh.clock import ManualClock
from kvmesh.errors import NoEndpointsAvailable
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import LOOP_LAG_SLACK_SECONDS, Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import PluginHandle, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.scheduler import Scheduler
from services.epp.scraper import LagAwareTimeout, MetricsScraper
from tests.unit.epp.test_datastore_scheduler import vllm_metrics

A = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
B = Endpoint(id=EndpointId("127.0.0.1:2"), url="http://127.0.0.1:2", model="m")
SAMPLE = ScrapeSample(num_requests_waiting=0.0, num_requests_running=1.0, kv_cache_usage_perc=0.1)
MAX_AGE = 2.0
LIVE = LiveEndpointFilter("live", LiveEndpointFilterParams(max_metrics_age_seconds=MAX_AGE,
                                                           max_consecutive_scrape_failures=3))
TICK = 0.05


def _live(ds: Datastore, live: LiveEndpointFilter = LIVE) -> set[str]:
    return {c.id for c in live.filter(CycleState(), SchedulingRequest(model="m"), ds.candidates("m"))}


def _ages(ds: Datastore) -> dict[str, float | None]:
    return {c.id: c.metrics.age_seconds for c in ds.candidates("m")}


def _lagged_picks() -> float:
    return REGISTRY.get_sample_value("kvmesh_epp_picks_on_lagged_metrics_total") or 0.0


def _store() -> tuple[ManualClock, Datastore]:
    clock = ManualClock(100.0)
    ds = Datastore(clock)
    ds.set_endpoints({A.id: A, B.id: B})
    return clock, ds


def _run(clock: ManualClock, ds: Datastore, seconds: float, scrape: tuple[Endpoint, ...] = (A, B)) -> None:
    """epp runs normally for ``seconds``: the monitor ticks on time, ``scrape`` endpoints answer each tick."""
    steps = round(seconds / TICK)
    for _ in range(steps):
        clock.advance(TICK)
        ds.note_loop_tick(TICK)
        for endpoint in scrape:
            ds.record_scrape(endpoint.id, SAMPLE)


# -- part 1: the rule --------------------------------------------------------------------------------------

def test_without_a_monitor_the_age_is_wall_clock_as_before() -> None:
    clock, ds = _store()
    ds.record_scrape(A.id, SAMPLE)
    ds.record_scrape(B.id, SAMPLE)
    clock.advance(2.5)
    assert _ages(ds) == {A.id: 2.5, B.id: 2.5}
    assert _live(ds) == set()


def test_a_stall_still_going_on_is_credited_so_the_pick_after_it_sees_live_engines() -> None:
    """The pick that runs first after a stall (before the monitor's late tick) must not refuse."""
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    _run(clock, ds, 0.5)
    clock.advance(3.0)  # epp held for 3 s: no tick, no scrape; the next tick is overdue
    assert _live(ds) == {A.id, B.id}
    ages = _ages(ds)
    assert all(age is not None and age <= TICK + 1e-9 for age in ages.values()), ages
    assert ds.loop_lag_seconds() == pytest.approx(3.0 - TICK)


def test_a_late_tick_credits_its_lateness_and_ages_grow_again_while_epp_runs() -> None:
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    _run(clock, ds, 0.5)
    clock.advance(5.0)
    assert ds.note_loop_tick(TICK) == pytest.approx(5.0 - TICK)  # the late tick: credited, and returned
    assert _live(ds) == {A.id, B.id}
    # Neither engine answers any more (no scrape lands): they age at the wall rate while epp runs ...
    _run(clock, ds, 1.9, scrape=())
    assert _live(ds) == {A.id, B.id}
    _run(clock, ds, 0.2, scrape=())
    assert _live(ds) == set()  # ... and are stale after the max age of epp's running time
    assert _ages(ds)[A.id] == pytest.approx(2.1 + TICK)


def test_lateness_within_the_slack_is_not_credited() -> None:
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    ds.record_scrape(A.id, SAMPLE)
    for _ in range(50):  # 50 ticks each a little late (ordinary scheduling noise)
        clock.advance(TICK + LOOP_LAG_SLACK_SECONDS * 0.9)
        assert ds.note_loop_tick(TICK) == 0.0
    assert ds.loop_lag_seconds() == 0.0
    assert _ages(ds)[A.id] == pytest.approx(50 * (TICK + LOOP_LAG_SLACK_SECONDS * 0.9))


def test_a_stopped_monitor_credits_nothing_more() -> None:
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    ds.record_scrape(A.id, SAMPLE)
    ds.note_loop_tick(None)  # the scraper stopped
    clock.advance(3.0)
    assert ds.loop_lag_seconds() == 0.0
    assert _ages(ds)[A.id] == 3.0


def test_an_engine_failing_its_scrapes_is_dropped_whatever_the_lag() -> None:
    """Scrape failures (refused, HTTP 500, a timeout of epp's running time) are the engine's: no lag credit
    brings it back, while its healthy neighbour is kept through the same stall."""
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    _run(clock, ds, 0.5)
    for _ in range(3):
        ds.record_scrape_failure(B.id, "TimeoutError()")
    clock.advance(4.0)
    assert _live(ds) == {A.id}
    ds.note_loop_tick(TICK)
    assert _live(ds) == {A.id}


def test_only_lag_after_the_scrape_counts() -> None:
    """A scrape taken after a stall gets no credit from it: its age is plain time since."""
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    clock.advance(3.0)
    ds.note_loop_tick(TICK)  # the stall is over (credited 2.95 s)
    ds.record_scrape(A.id, SAMPLE)
    _run(clock, ds, 2.1, scrape=())
    assert _ages(ds)[A.id] == pytest.approx(2.1)
    assert A.id not in _live(ds)


def test_running_seconds_since_nets_out_the_lag() -> None:
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    started, lag0 = clock.now(), ds.loop_lag_seconds()
    clock.advance(0.2)
    ds.note_loop_tick(TICK)  # late by 0.15
    clock.advance(0.04)  # the next tick is not due yet
    assert ds.running_seconds_since(started, lag0) == pytest.approx(0.09)
    clock.advance(0.5)  # now it is 0.45 s overdue: a stall going on, credited already
    assert ds.running_seconds_since(started, lag0) == pytest.approx(0.10)


def test_picks_on_lag_credited_metrics_are_counted_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, ds = _store()
    ds.note_loop_tick(TICK)
    _run(clock, ds, 0.5)
    assert ds.note_lagged_candidates(ds.candidates("m"), MAX_AGE) == 0  # no lag: O(1), nothing counted
    before = _lagged_picks()
    clock.advance(3.0)
    with caplog.at_level(logging.WARNING, logger="services.epp.datastore"):
        assert ds.note_lagged_candidates(ds.candidates("m"), MAX_AGE) == 2
        clock.advance(0.01)
        assert ds.note_lagged_candidates(ds.candidates("m"), MAX_AGE) == 2
    assert _lagged_picks() == before + 2
    lines = [r for r in caplog.records if "because epp's own event loop lagged" in r.getMessage()]
    assert len(lines) == 1, lines  # at most once per interval
    # Once scrapes land again nothing is counted (the metrics are fresh in wall time too).
    _run(clock, ds, 0.2)
    assert ds.note_lagged_candidates(ds.candidates("m"), MAX_AGE) == 0
    assert _lagged_picks() == before + 2


async def test_the_scheduler_serves_a_pick_after_a_stall_and_counts_it() -> None:
    """Through the real Scheduler (load-only profile): before the fix this pick raised NoEndpointsAvailable
    "2 registered, 0 excluded, 2 without fresh metrics"; an engine stale for its own reasons still refuses."""
    clock, ds = _store()
    source, data = resolve_scheduling_config("load-only")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0)), source)
    scheduler = Scheduler(ds, profile, LIVE)
    ds.note_loop_tick(TICK)
    _run(clock, ds, 0.5)
    before = _lagged_picks()
    clock.advance(3.0)
    decision = await scheduler.pick(SchedulingRequest(model="m", request_id="r1"))
    assert decision.target.id in {A.id, B.id}
    assert _lagged_picks() == before + 1
    ds.note_loop_tick(TICK)
    _run(clock, ds, 2.1, scrape=())  # the engines stop answering: stale after the max age of running time
    with pytest.raises(NoEndpointsAvailable, match="2 without fresh metrics"):
        await scheduler.pick(SchedulingRequest(model="m", request_id="r2"))


# -- part 2: the scraper on a real loop --------------------------------------------------------------------

class _ThreadEngine:
    """vLLM-format /metrics served by aiohttp on its own loop in another thread: it keeps answering while the
    test's loop (epp's) is held. ``mode``: ok, slow (answers in 0.1 s), hang (accepts, never answers),
    error (HTTP 500)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.scrapes = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._ready = threading.Event()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        while self.mode == "hang":  # noqa: ASYNC110 - set from the test's thread (no shared loop for an Event)
            await asyncio.sleep(0.01)
        if self.mode == "error":
            return web.Response(status=500, text="engine error")
        if self.mode == "slow":
            await asyncio.sleep(0.1)
        return web.Response(text=vllm_metrics(0, 1, 0.1))

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> _ThreadEngine:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode = "ok"
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(id=EndpointId(self.url.removeprefix("http://")), url=self.url, model="m")


@contextlib.contextmanager
def _engines(n: int) -> Iterator[list[_ThreadEngine]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_ThreadEngine()) for _ in range(n)]


@contextlib.asynccontextmanager
async def _scraping(engines: list[_ThreadEngine], timeout: float = 0.5) -> AsyncIterator[Datastore]:
    ds = Datastore()
    ds.set_endpoints({e.endpoint.id: e.endpoint for e in engines})
    task = asyncio.create_task(MetricsScraper(ds, interval_seconds=0.05, timeout_seconds=timeout).run())
    try:
        deadline = time.monotonic() + 10
        while any(c.metrics.age_seconds is None for c in ds.candidates("m")):
            assert time.monotonic() < deadline, "the engines were never scraped"
            await asyncio.sleep(0.02)
        yield ds
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


FAST_AGE = 0.8
"""Part 2's max metrics age (short, so the held loops stay short); each hold outlasts it."""
HOLD = 1.1
LIVE_FAST = LiveEndpointFilter("live", LiveEndpointFilterParams(max_metrics_age_seconds=FAST_AGE,
                                                                max_consecutive_scrape_failures=3))


def _live_fast(ds: Datastore) -> set[str]:
    return _live(ds, LIVE_FAST)


def _hold_the_loop(seconds: float) -> None:
    """A long synchronous stretch on epp's loop: a GC pause, a slow kv_indexer call or a tokenization run on
    the loop look the same to the scraper."""
    time.sleep(seconds)


async def test_a_synchronous_stretch_past_the_max_age_leaves_healthy_engines_live() -> None:
    with _engines(2) as engines:
        async with _scraping(engines) as ds:
            await asyncio.sleep(0.3)
            _hold_the_loop(HOLD)
            assert _live_fast(ds) == {e.endpoint.id for e in engines}  # the first thing run after the stall
            await asyncio.sleep(0.3)
            assert _live_fast(ds) == {e.endpoint.id for e in engines}
            assert all(c.metrics.consecutive_failures == 0 for c in ds.candidates("m"))
            assert ds.loop_lag_seconds() >= HOLD - 0.2


async def test_a_real_gc_pause_is_credited_like_any_stall() -> None:
    """A collection of a large cyclic heap runs on the loop (measured here, and credited as measured)."""
    with _engines(1) as engines:
        async with _scraping(engines) as ds:
            await asyncio.sleep(0.2)
            garbage = []
            for i in range(300_000):
                node: list[object] = [i]
                node.append(node)
                garbage.append(node)
            del garbage, node
            lag_before = ds.loop_lag_seconds()
            started = time.monotonic()
            gc.collect()
            paused = time.monotonic() - started
            credited = ds.loop_lag_seconds() - lag_before
            if paused > 2 * TICK:  # the pause outlasted a tick: it is credited, less at most one tick
                assert credited >= paused - 2 * TICK, (paused, credited)
            await asyncio.sleep(0.2)
            assert _live_fast(ds) == {engines[0].endpoint.id}


async def test_a_reply_that_arrived_during_the_stall_is_not_a_timeout() -> None:
    """The scrape in flight across a stall longer than its timeout: its deadline moves back by epp's lag."""
    with _engines(1) as engines:
        async with _scraping(engines, timeout=0.3) as ds:
            extended = REGISTRY.get_sample_value("kvmesh_epp_scrape_deadlines_extended_total") or 0.0
            engines[0].mode = "slow"  # answers in 0.1 s: the reply lands while the loop is held
            for _ in range(3):
                seen = engines[0].scrapes
                while engines[0].scrapes == seen:  # noqa: ASYNC110 - counted on the engine's thread
                    await asyncio.sleep(0.002)
                _hold_the_loop(0.6)  # twice its timeout
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            assert all(c.metrics.consecutive_failures == 0 for c in ds.candidates("m"))
            assert (REGISTRY.get_sample_value("kvmesh_epp_scrape_deadlines_extended_total") or 0.0) > extended


async def test_a_hung_engine_during_a_stall_still_becomes_stale() -> None:
    """The engine hangs, then epp is held past the max age: afterwards it is dropped within the max age
    of epp's running time (timeouts of running time count against it), the healthy one never is."""
    with _engines(2) as (healthy, hung):
        async with _scraping([healthy, hung]) as ds:
            await asyncio.sleep(0.2)
            hung.mode = "hang"
            _hold_the_loop(HOLD)
            resumed = time.monotonic()
            dropped = None
            while time.monotonic() - resumed < FAST_AGE + 1.0:
                live = _live_fast(ds)
                assert healthy.endpoint.id in live
                if dropped is None and hung.endpoint.id not in live:
                    dropped = time.monotonic() - resumed
                await asyncio.sleep(0.02)
            assert dropped is not None and dropped <= FAST_AGE + 0.3, dropped
            assert hung.endpoint.id not in _live_fast(ds)


async def test_a_failing_engine_stays_excluded_through_a_stall() -> None:
    with _engines(2) as (healthy, failing):
        async with _scraping([healthy, failing]) as ds:
            failing.mode = "error"
            deadline = time.monotonic() + 5
            while failing.endpoint.id in _live_fast(ds):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            _hold_the_loop(HOLD)
            for _ in range(20):
                assert _live_fast(ds) == {healthy.endpoint.id}
                await asyncio.sleep(0.05)


async def test_lag_aware_timeout_still_expires_on_running_time() -> None:
    """Without lag it is ``asyncio.timeout``: a hang expires after its seconds."""
    ds = Datastore()
    task = asyncio.create_task(MetricsScraper(ds, interval_seconds=0.05, timeout_seconds=0.5).run())
    try:
        await asyncio.sleep(0.06)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with LagAwareTimeout(ds, 0.2):
                await asyncio.sleep(5)
        assert 0.19 <= time.monotonic() - started < 1.0
        async with LagAwareTimeout(ds, 0.2) as deadline:  # held 0.5 s, then done at once: no timeout
            _hold_the_loop(0.5)
            await asyncio.sleep(0.01)
        assert deadline.extended
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
