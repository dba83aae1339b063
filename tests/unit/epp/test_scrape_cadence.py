"""The metrics scraper's cadence: busy engines every ``interval``, idle ones every ``idle_interval``,
and a pick for an idle engine brings its next scrape forward (the idle cost of issue 10).

A real HTTP server (aiohttp) on 127.0.0.1 serves vLLM-format /metrics and counts the scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore
from services.epp.scraper import MetricsScraper
from tests.unit.epp.test_datastore_scheduler import vllm_metrics


@contextlib.asynccontextmanager
async def engine(state: dict[str, float]) -> AsyncIterator[str]:
    async def metrics(request: web.Request) -> web.Response:
        state["scrapes"] += 1
        return web.Response(text=vllm_metrics(state["waiting"], state["running"], 0.1))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _scrapes_during(seconds: float, state: dict[str, float]) -> float:
    start = state["scrapes"]
    await asyncio.sleep(seconds)
    return state["scrapes"] - start


async def test_idle_engines_are_scraped_slowly_busy_ones_fast_and_a_pick_wakes_the_scraper() -> None:
    state = {"scrapes": 0.0, "waiting": 0.0, "running": 0.0}
    async with engine(state) as url:
        endpoint = Endpoint(id=EndpointId(url.removeprefix("http://")), url=url, model="m")
        datastore = Datastore()
        datastore.set_endpoints({endpoint.id: endpoint})
        scraper = MetricsScraper(datastore, interval_seconds=0.05, timeout_seconds=1.0, idle_interval_seconds=0.6)
        task = asyncio.create_task(scraper.run())
        try:
            await asyncio.sleep(0.3)  # first scrape: idle
            idle = await _scrapes_during(1.2, state)
            assert 1 <= idle <= 3, idle  # one per 0.6 s, not one per 0.05 s (24)
            datastore.note_pick(endpoint.id)  # a pick: the next scrape comes within the busy interval
            before = state["scrapes"]
            await asyncio.sleep(0.2)
            assert state["scrapes"] > before
            state["running"] = 2.0  # busy: back to the fast cadence
            await asyncio.sleep(0.7)
            busy = await _scrapes_during(1.0, state)
            assert busy >= 8, busy
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_joining_endpoint_is_scraped_at_once_not_at_the_next_reconcile() -> None:
    """Membership changes wake the scraper's reconcile (the datastore's activity listener): with a 5 s
    idle cadence (its backstop), an engine that joins is still scraped within a fraction of a second."""
    state = {"scrapes": 0.0, "waiting": 0.0, "running": 0.0}
    async with engine(state) as url:
        endpoint = Endpoint(id=EndpointId(url.removeprefix("http://")), url=url, model="m")
        datastore = Datastore()
        scraper = MetricsScraper(datastore, interval_seconds=0.05, timeout_seconds=1.0, idle_interval_seconds=5.0)
        task = asyncio.create_task(scraper.run())
        try:
            await asyncio.sleep(0.2)  # the reconcile loop is now waiting on its 5 s backstop
            assert state["scrapes"] == 0
            datastore.apply_membership({endpoint.id: endpoint}, {})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 1.0
            while state["scrapes"] == 0 and loop.time() < deadline:  # noqa: ASYNC110 (observing the engine)
                await asyncio.sleep(0.02)
            assert state["scrapes"] >= 1
            assert datastore.candidates()[0].metrics.age_seconds is not None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_an_idle_engine_that_dies_is_retried_at_the_busy_cadence_and_drops_out() -> None:
    """A dead idle engine is noticed by its next idle scrape; from then on it is retried every busy
    interval, so it reaches ``max_consecutive_scrape_failures`` (3) and leaves the candidates within
    about the idle interval plus three busy intervals, never waiting three idle intervals."""
    from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams

    state = {"scrapes": 0.0, "waiting": 0.0, "running": 0.0}
    # the failure rule alone (the age rule is checked by the cadence's cap at half the max age)
    live = LiveEndpointFilter("live", LiveEndpointFilterParams(max_metrics_age_seconds=60.0))
    datastore = Datastore()
    scraper = MetricsScraper(datastore, interval_seconds=0.05, timeout_seconds=0.5, idle_interval_seconds=2.0)
    task: asyncio.Task[None] | None = None
    try:
        async with engine(state) as url:
            endpoint = Endpoint(id=EndpointId(url.removeprefix("http://")), url=url, model="m")
            datastore.set_endpoints({endpoint.id: endpoint})
            task = asyncio.create_task(scraper.run())
            await asyncio.sleep(0.3)
            assert live.is_live(datastore.candidates()[0])
        loop = asyncio.get_running_loop()  # the engine is gone (its port closed)
        died = loop.time()
        while live.is_live(datastore.candidates()[0]) and loop.time() - died < 8.0:  # noqa: ASYNC110 (observing)
            await asyncio.sleep(0.02)
        assert not live.is_live(datastore.candidates()[0])
        assert datastore.candidates()[0].metrics.consecutive_failures >= 3
        # one idle interval + three busy ones (+ slack for a loaded machine), not three idle intervals (6 s)
        assert loop.time() - died < 2.0 + 3 * 0.05 + 1.3, loop.time() - died
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
