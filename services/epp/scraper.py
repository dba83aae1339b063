"""Scrapes every live endpoint's ``<url>/metrics`` into the datastore, one task per endpoint.

Each endpoint is scraped with ``httpx`` (timeout ``timeout_seconds``) every ``interval_seconds``
(``--metrics-scrape-interval-seconds``, default 0.1) while it is busy: its last sample showed
requests running or waiting, or epp picked it since that scrape. An idle endpoint is scraped every
``idle_interval_seconds`` (``--metrics-idle-scrape-interval-seconds``, default 1.0, capped at half of
``max_metrics_age_seconds``), and a pick for it brings its next scrape forward to within
``interval_seconds`` (the loop checks the datastore's pick count, a local read, at that cadence).
So an idle mesh costs one scrape per engine per second instead of ten (docs/BENCHMARKS.md §3,
idle cost), and a busy one is scraped as before. A failure (connection refused, timeout, non-200, unparsable
text) increments the endpoint's consecutive-failure count, which the live-endpoint filter reads. A
reconcile loop starts a task when an endpoint joins and cancels it when it leaves; ``run()`` is the
one background coroutine and cancelling it stops every task and closes the HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, parse_vllm_metrics
from services.epp.metrics import record_scrape

logger = logging.getLogger(__name__)


class MetricsScraper:
    def __init__(self, datastore: Datastore, interval_seconds: float, timeout_seconds: float,
                 idle_interval_seconds: float | None = None) -> None:
        self._datastore = datastore
        self._interval = interval_seconds
        self._idle_interval = max(interval_seconds, idle_interval_seconds or interval_seconds)
        self._timeout = timeout_seconds
        self._tasks: dict[EndpointId, tuple[Endpoint, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=self._timeout, limits=limits) as client:
            try:
                while True:
                    self._reconcile(client)
                    await asyncio.sleep(self._interval)
            finally:
                tasks = [task for _, task in self._tasks.values()]
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                self._tasks.clear()

    def _reconcile(self, client: httpx.AsyncClient) -> None:
        current = {ep.id: ep for ep in self._datastore.endpoints()}
        for endpoint_id, (endpoint, task) in list(self._tasks.items()):
            if current.get(endpoint_id) != endpoint:
                task.cancel()
                del self._tasks[endpoint_id]
        for endpoint_id, endpoint in current.items():
            if endpoint_id not in self._tasks:
                task = asyncio.create_task(self._scrape_loop(client, endpoint), name=f"scrape:{endpoint_id}")
                self._tasks[endpoint_id] = (endpoint, task)

    async def _scrape_loop(self, client: httpx.AsyncClient, endpoint: Endpoint) -> None:
        url = endpoint.url.rstrip("/") + "/metrics"
        failing = False
        idle = False
        while True:
            started = time.monotonic()
            picks_seen = self._datastore.picks_total(endpoint.id)
            try:
                reply = await client.get(url)
                reply.raise_for_status()
                sample = parse_vllm_metrics(reply.text)
            except (httpx.HTTPError, ValueError) as exc:
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
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))
            if idle and not failing:  # wait up to the idle interval, scraping early once it is picked
                idle_until = started + self._idle_interval
                while time.monotonic() < idle_until and self._datastore.picks_total(endpoint.id) == picks_seen:  # noqa: ASYNC110 (a local counter, no event to wait on)
                    await asyncio.sleep(min(self._interval, max(0.0, idle_until - time.monotonic())))
