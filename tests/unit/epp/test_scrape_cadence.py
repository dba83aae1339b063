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
