"""EppPoolSource's cadence against a real gRPC server on 127.0.0.1 that answers epp's ``ListEndpoints``
and counts the calls: idle (nothing queued or in flight) it reads epp every idle interval, busy every
poll interval, and the switch to the busy cadence follows ``FlowController.busy`` within one poll
interval (the idle cost of issue 10: flow_control's 2 reads a second of an idle pool were most of its
idle CPU; the default idle interval is now 1 s, at most half of ``metrics_staleness_seconds``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from services.flow_control.config import FlowControlConfig
from services.flow_control.pool import EppPoolSource
from services.flow_control.saturation import PoolSnapshot


class CountingEpp(epp_pb2_grpc.EndpointPickerServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def ListEndpoints(self, request: epp_pb2.ListEndpointsRequest, context: grpc.aio.ServicerContext
                            ) -> epp_pb2.ListEndpointsResponse:
        self.calls += 1
        return epp_pb2.ListEndpointsResponse()


class Controller:
    """What EppPoolSource reads and feeds (FlowController's ``busy``, ``activity``, ``update_pool``,
    ``refresh``): setting ``busy`` sets ``activity``, as a queued or dispatched request does."""

    def __init__(self) -> None:
        self._busy = False
        self.activity = asyncio.Event()
        self.snapshots: list[PoolSnapshot] = []

    @property
    def busy(self) -> bool:
        return self._busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self._busy = value
        if value:
            self.activity.set()

    def update_pool(self, snapshot: PoolSnapshot) -> None:
        self.snapshots.append(snapshot)

    def refresh(self) -> None:
        pass


@contextlib.asynccontextmanager
async def epp() -> AsyncIterator[tuple[str, CountingEpp]]:
    server = grpc.aio.server()
    servicer = CountingEpp()
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)


async def _calls_during(seconds: float, servicer: CountingEpp) -> int:
    start = servicer.calls
    await asyncio.sleep(seconds)
    return servicer.calls - start


async def test_idle_pool_is_read_at_the_idle_interval_and_a_busy_one_at_the_poll_interval() -> None:
    async with epp() as (address, servicer):
        controller = Controller()
        source = EppPoolSource(address, controller, 0.05, idle_interval_seconds=0.5)  # type: ignore[arg-type]
        task = asyncio.create_task(source.run())
        try:
            await asyncio.sleep(0.3)
            assert controller.snapshots  # the first read comes at once
            idle = await _calls_during(1.5, servicer)
            assert 2 <= idle <= 4, idle  # one per 0.5 s, not one per 0.05 s (30)
            before_busy = servicer.calls
            controller.busy = True
            await asyncio.sleep(0.01)  # the idle wait ends on the activity event, not after its interval
            assert servicer.calls - before_busy >= 1
            busy = await _calls_during(1.0, servicer)
            assert busy >= 8, busy
            controller.busy = False
            await asyncio.sleep(0.6)
            assert await _calls_during(1.0, servicer) <= 3  # back to the idle cadence
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_the_default_idle_read_keeps_an_idle_snapshot_fresh() -> None:
    """The defaults keep the guarantee the cap exists for: an idle pool's snapshot (read every idle
    interval, its samples scraped by epp every 1 s) is never older than ``metrics_staleness_seconds``."""
    config = FlowControlConfig()
    assert config.pool_idle_poll_interval_seconds <= config.metrics_staleness_seconds / 2
    assert config.pool_idle_poll_interval_seconds + 1.0 <= config.metrics_staleness_seconds
