"""epp's own loop lag vs its engines' freshness: ``python bench/epp_loop_lag.py [--max-age 2.0] [--plot PNG]``.

In process, A/B in one run: epp's real ``MetricsScraper`` + ``Datastore`` on this loop, two healthy engines
(aiohttp ``/metrics`` on another thread, so holding this loop is epp's stall alone), and the live-endpoint
filter at ``--max-age``. For each stall length, with the loop-lag monitor (the fix) and without it (before):

* **live after**: endpoints live right after the stall (the first thing run, as a pick would be);
* **failures**: scrape failures counted against the healthy engines across the stall and 0.6 s after it
  (timeouts that were epp's lateness);
* **hung drop s**: with one engine hung (its /metrics never answers) from the stall's start, seconds of
  running after the stall until it is dropped (must stay within ``--max-age``).

Then the costs: idle CPU of the scraper's loop with and without the monitor (ms of CPU per second, this
thread, no engines), the per-pick cost of ``note_lagged_candidates`` (no lag: the O(1) gate) and of the
ledger read each ``candidates()`` call adds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import threading
import time
import timeit
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web
from prometheus_client import REGISTRY
from rich.console import Console
from rich.table import Table

from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import SchedulingRequest
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.scraper import DEFAULT_LAG_TICK_SECONDS, MetricsScraper

METRICS = (
    'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
)


class ThreadEngine:
    """vLLM-format /metrics on its own loop in a thread; ``hung``: accepts and never answers."""

    def __init__(self) -> None:
        self.hung = False
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _metrics(self, request: web.Request) -> web.Response:
        while self.hung:  # noqa: ASYNC110 - set from the bench's thread
            await asyncio.sleep(0.01)
        return web.Response(text=METRICS)

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

    def start(self) -> ThreadEngine:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self.hung = False
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(id=EndpointId(self.url.removeprefix("http://")), url=self.url, model="m")


@contextlib.asynccontextmanager
async def scraping(engines: list[ThreadEngine], monitor: bool) -> AsyncIterator[Datastore]:
    ds = Datastore()
    ds.set_endpoints({e.endpoint.id: e.endpoint for e in engines})
    scraper = MetricsScraper(ds, 0.1, 0.5, idle_interval_seconds=1.0,
                             lag_tick_seconds=DEFAULT_LAG_TICK_SECONDS if monitor else None)
    task = asyncio.create_task(scraper.run())
    try:
        while any(c.metrics.age_seconds is None for c in ds.candidates("m")):  # noqa: ASYNC110 - polls the scrapes
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        yield ds
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def live(ds: Datastore, live_filter: LiveEndpointFilter) -> set[str]:
    return {c.id for c in live_filter.filter(CycleState(), SchedulingRequest(model="m"), ds.candidates("m"))}


async def stall_row(stall: float, monitor: bool, live_filter: LiveEndpointFilter, max_age: float) -> dict[str, str]:
    engines = [ThreadEngine().start() for _ in range(2)]
    try:
        async with scraping(engines, monitor) as ds:
            errors = scrape_errors()
            time.sleep(stall)  # noqa: ASYNC251 - epp's loop held: the stall under test
            after = len(live(ds, live_filter))
            await asyncio.sleep(0.6)
            failures = round(scrape_errors() - errors)
        hung_engine = engines[1]
        async with scraping(engines, monitor) as ds:
            hung_engine.hung = True
            time.sleep(stall)  # noqa: ASYNC251
            resumed = time.monotonic()
            dropped = None
            while time.monotonic() - resumed < max_age + 3.0:
                if hung_engine.endpoint.id not in live(ds, live_filter):
                    dropped = time.monotonic() - resumed
                    break
                await asyncio.sleep(0.01)
            hung_engine.hung = False
    finally:
        for engine in engines:
            engine.stop()
    return {"live": f"{after}/2", "failures": str(failures), "drop": "never" if dropped is None else f"{dropped:.2f}"}


def scrape_errors() -> float:
    return REGISTRY.get_sample_value("kvmesh_epp_metrics_scrape_total", {"result": "error"}) or 0.0


def thread_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


async def idle_cpu(monitor: bool, seconds: float) -> float:
    ds = Datastore()
    scraper = MetricsScraper(ds, 0.1, 0.5, idle_interval_seconds=1.0,
                             lag_tick_seconds=DEFAULT_LAG_TICK_SECONDS if monitor else None)
    task = asyncio.create_task(scraper.run())
    await asyncio.sleep(0.2)
    started = thread_cpu()
    await asyncio.sleep(seconds)
    spent = thread_cpu() - started
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return spent / seconds * 1e3


def pick_costs() -> tuple[float, float]:
    """(us per ``note_lagged_candidates`` with no lag: the gate every pick runs; us per ``loop_lag_seconds``:
    the one ledger read each ``candidates()`` call adds), 100 endpoints."""
    ds = Datastore()
    endpoints = {EndpointId(f"127.0.0.1:{i}"): Endpoint(id=EndpointId(f"127.0.0.1:{i}"), url=f"http://127.0.0.1:{i}",
                                                        model="m") for i in range(100)}
    ds.set_endpoints(endpoints)
    for endpoint_id in endpoints:
        ds.record_scrape(endpoint_id, ScrapeSample(0.0, 1.0, 0.1))
    ds.note_loop_tick(3600.0)  # a monitor whose next tick is far off: no lag, the ledger running
    candidates = ds.candidates("m")
    n = 20_000
    gate = min(timeit.repeat(lambda: ds.note_lagged_candidates(candidates, 2.0), number=n, repeat=5)) / n * 1e6
    read = min(timeit.repeat(ds.loop_lag_seconds, number=n, repeat=5)) / n * 1e6
    return gate, read


async def main(args: argparse.Namespace) -> list[tuple[float, dict[str, str], dict[str, str]]]:
    live_filter = LiveEndpointFilter("live", LiveEndpointFilterParams(max_metrics_age_seconds=args.max_age))
    console = Console()
    rows = []
    for stall in args.stalls:
        before = await stall_row(stall, False, live_filter, args.max_age)
        after = await stall_row(stall, True, live_filter, args.max_age)
        rows.append((stall, before, after))
    table = Table(title=f"epp stalled (loop held) with healthy engines; max metrics age {args.max_age} s")
    for column in ("stall s", "live after: before / fix", "failures: before / fix", "hung drop s: before / fix"):
        table.add_column(column, justify="right")
    for stall, before, after in rows:
        table.add_row(f"{stall:.1f}", f"{before['live']} / {after['live']}", f"{before['failures']} / {after['failures']}",
                      f"{before['drop']} / {after['drop']}")
    console.print(table)
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):  # interleaved
        for monitor in (False, True):
            cpu[monitor].append(await idle_cpu(monitor, args.idle_seconds))
    gate, read = pick_costs()
    costs = Table(title="costs")
    costs.add_column("what")
    costs.add_column("value", justify="right")
    costs.add_row("idle scraper loop CPU, no monitor (ms/s)", f"{min(cpu[False]):.3f}")
    costs.add_row("idle scraper loop CPU, monitor (ms/s)", f"{min(cpu[True]):.3f}")
    costs.add_row("note_lagged_candidates per pick, no lag (us)", f"{gate:.3f}")
    costs.add_row("loop_lag_seconds(), once per candidates() (us)", f"{read:.3f}")
    console.print(costs)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--max-age", type=float, default=2.0, help="max_metrics_age_seconds (s)")
    parser.add_argument("--stalls", type=float, nargs="+", default=[1.0, 2.5, 5.0], help="stall lengths (s)")
    parser.add_argument("--idle-seconds", type=float, default=4.0, help="length of each idle CPU sample (s)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the stall rows (matplotlib)")
    return parser


if __name__ == "__main__":
    args = build_parser().parse_args()
    result = asyncio.run(main(args))
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed (pip install -e .[bench]): no plot")
        else:
            fig, ax = plt.subplots(figsize=(8, 4))
            stalls = [r[0] for r in result]
            for label, index in (("before", 1), ("fix", 2)):
                ax.plot(stalls, [int(r[index]["live"].split("/")[0]) for r in result], marker="o",  # type: ignore[index]
                        label=f"live endpoints right after the stall ({label})")
            ax.set_xlabel("epp stall (s)")
            ax.set_ylabel("live endpoints (of 2)")
            ax.axvline(args.max_age, linestyle=":", color="grey")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot)
            print(f"wrote {args.plot}")
