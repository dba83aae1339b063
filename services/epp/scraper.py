"""Scrapes every live endpoint's ``<url>/metrics`` into the datastore, one task per endpoint.

Every ``interval_seconds`` (``--metrics-scrape-interval-seconds``, default 0.1) each endpoint is scraped
with ``httpx`` (timeout ``timeout_seconds``); a failure (connection refused, timeout, non-200, unparsable
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
    def __init__(self, datastore: Datastore, interval_seconds: float, timeout_seconds: float) -> None:
        self._datastore = datastore
        self._interval = interval_seconds
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
        while True:
            started = time.monotonic()
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
                if failing:
                    logger.info("metrics scrape recovered endpoint=%s", endpoint.id)
                failing = False
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))
