"""The saturation signal's source: epp's ``ListEndpoints`` polled every ``pool_poll_interval_seconds``
(0.1 s) while a request is queued or in flight, every ``pool_idle_poll_interval_seconds`` (1 s, at most
half of ``metrics_staleness_seconds``) otherwise; the first request after an idle spell finds a
snapshot younger than the staleness limit and moves the loop to the busy cadence at once
(``FlowController.activity`` wakes the idle wait; nothing runs in between). Idle, that is one
``ListEndpoints`` a second: epp scrapes an idle engine once a second, so reading it faster only
re-reads the same samples (idle cost, docs/BENCHMARKS.md §3, issue 10).

Why epp and not a second scraper: epp already scrapes every engine's ``/metrics`` (vLLM 0.32 names,
every 0.1 s by default) for the endpoints etcd lists, and ``ListEndpoints`` returns each one's
``num_requests_waiting``, ``kv_cache_usage_perc`` and ``metrics_age_seconds``. Reading it means
flow_control and the scheduler judge the pool from the same numbers, and engines are scraped once.
A failed call (epp down, deadline) leaves the last snapshot to age: the detector fails open after
``metrics_staleness_seconds`` and ``kvmesh_flow_control_saturation_stale`` goes to 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.channels import insecure_channel
from kvmesh.clock import Clock, SystemClock
from services.flow_control.controller import FlowController
from services.flow_control.metrics import PrometheusObserver
from services.flow_control.saturation import EndpointLoad, PoolSnapshot

logger = logging.getLogger(__name__)


def snapshot_from_proto(reply: epp_pb2.ListEndpointsResponse, received_at: float) -> PoolSnapshot:
    """``ListEndpointsResponse`` -> :class:`PoolSnapshot` (a negative age means never scraped)."""
    return PoolSnapshot(
        tuple(
            EndpointLoad(
                e.endpoint.id, e.endpoint.model, e.num_requests_waiting, e.kv_cache_usage_perc,
                None if e.metrics_age_seconds < 0 else e.metrics_age_seconds, e.num_requests_running,
            )
            for e in reply.endpoints
        ),
        received_at,
    )


class EppPoolSource:
    """Polls epp and feeds :meth:`FlowController.update_pool`; ``run()`` is a background task."""

    def __init__(
        self, address: str, controller: FlowController, interval_seconds: float,
        observer: PrometheusObserver | None = None, clock: Clock | None = None,
        idle_interval_seconds: float | None = None,
    ) -> None:
        self._address = address
        self._controller = controller
        self._interval = interval_seconds
        self._idle_interval = max(interval_seconds, idle_interval_seconds or interval_seconds)
        self._observer = observer
        self._clock = clock or SystemClock()

    async def run(self) -> None:
        # No client span per poll: a background read with no request behind it would start a root trace
        # every poll (noise in the trace store, and the interceptor's per-call task: idle cost, issue 10).
        channel = insecure_channel(self._address, client_spans=False)
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        failing = False
        try:
            while True:
                try:
                    reply = await stub.ListEndpoints(epp_pb2.ListEndpointsRequest(), timeout=max(self._interval * 4, 0.5))
                except grpc.aio.AioRpcError as exc:
                    if self._observer is not None:
                        self._observer.pool_poll("error")
                    if not failing:
                        logger.warning("epp ListEndpoints failed address=%s code=%s; saturation fails open once stale",
                                       self._address, exc.code().name)
                    failing = True
                    self._controller.refresh()  # once the last snapshot is stale, queued requests go (fail open)
                else:
                    if failing:
                        logger.info("epp ListEndpoints recovered address=%s", self._address)
                    failing = False
                    if self._observer is not None:
                        self._observer.pool_poll("ok")
                    self._controller.update_pool(snapshot_from_proto(reply, self._clock.now()))
                await asyncio.sleep(self._interval)
                if not self._controller.busy:  # idle: sleep until the idle interval ends or a request arrives
                    activity = self._controller.activity
                    activity.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(activity.wait(), self._idle_interval - self._interval)
        finally:
            await channel.close()
