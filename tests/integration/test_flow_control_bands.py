"""Client-chosen priorities cannot grow a running flow_control's bands or /metrics (real process, gRPC, HTTP scrape)."""

from __future__ import annotations

import asyncio
import re

import grpc
import httpx
import pytest

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as pb
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as pb_grpc
from tests.integration.test_flow_control import enqueue, metrics_url, stats_become
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


def _sample(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_distinct_priorities_share_capped_bands_and_idle_bands_leave_metrics(start_service) -> None:
    proc, address = start_service("flow_control", "--max-dynamic-bands", "3", "--dynamic-band-idle-seconds", "1")
    async with grpc.aio.insecure_channel(address) as channel, httpx.AsyncClient(timeout=5.0) as http:
        stub = pb_grpc.FlowControlStub(channel)

        async def one(priority: int) -> int:
            call = stub.Admit()
            await call.write(enqueue(f"r{priority}", priority=priority, flow_id=f"tenant-{priority}"))
            reply = await call.read()
            await call.done_writing()
            await call.read()  # the stream ends: the slot is released
            return int(reply.outcome)

        outcomes = [await one(priority) for priority in range(1, 61)]
        assert set(outcomes) == {pb.QUEUE_OUTCOME_DISPATCHED}
        await stats_become(stub, in_flight=0, queued=0)
        stats = await stub.Stats(pb.StatsRequest())
        assert [b.priority for b in stats.bands] == [3, 2, 1]
        text = (await http.get(metrics_url(proc))).text
        assert _sample(text, "kvmesh_flow_control_band_overflow_total") == 57
        assert 'kvmesh_flow_control_band_overflow_total{band="3"} 57.0' in text
        bands = set(re.findall(r'[{,]band="([^"]*)"', text))
        assert bands == {"1", "2", "3"}

        async def dynamic_bands() -> float:
            scraped = (await http.get(metrics_url(proc))).text
            return _sample(scraped, "kvmesh_flow_control_dynamic_bands")

        await asyncio.sleep(1.0)
        await wait_until_async(dynamic_bands, 10.0, "idle dynamic bands removed", until=lambda n: n == 0)
        text = (await http.get(metrics_url(proc))).text
        assert 'band="' not in text
        assert _sample(text, "kvmesh_flow_control_bands_removed_total") == 3
        assert (await stub.Stats(pb.StatsRequest())).bands == []
