"""flow_control as a process: the limit, FCFS queueing, release on close and on cancel, TTL, bad input."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as pb
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as pb_grpc
from tests.support import wait_until_async

pytestmark = pytest.mark.integration


def metrics_url(proc) -> str:
    argv = list(proc.argv)
    return f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics"


def enqueue(request_id: str, **kw: Any) -> pb.AdmitRequest:
    return pb.AdmitRequest(enqueue=pb.Enqueue(request_id=request_id, model="m", prompt_tokens=10, **kw))


async def admit(stub: pb_grpc.FlowControlStub, request_id: str) -> grpc.aio.StreamStreamCall:
    call = stub.Admit()
    await call.write(enqueue(request_id))
    return call


async def stats_become(stub: pb_grpc.FlowControlStub, *, in_flight: int, queued: int, timeout: float = 10.0) -> None:
    """Wait until Stats reports ``(in_flight, queued)``; the failure names the last pair seen."""

    async def observed() -> tuple[int, int]:
        s = await stub.Stats(pb.StatsRequest())
        return s.in_flight, s.queued

    want = (in_flight, queued)
    await wait_until_async(observed, timeout, f"(in_flight, queued) == {want}", until=want.__eq__, interval=0.02)


async def test_limit_queue_release_and_cancel(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "2", "--queue-ttl-seconds", "30")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        a, b = await admit(stub, "a"), await admit(stub, "b")
        assert (await a.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        assert (await b.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        c = await admit(stub, "c")
        await stats_become(stub, in_flight=2, queued=1)

        # Normal close of a: send Complete, half-close, the server ends the stream and releases.
        await a.write(pb.AdmitRequest(complete=pb.Complete(success=True, completion_tokens=5)))
        await a.done_writing()
        assert await a.read() == grpc.aio.EOF
        assert await a.code() == grpc.StatusCode.OK
        reply = await c.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_DISPATCHED
        assert reply.queue_seconds > 0
        await stats_become(stub, in_flight=2, queued=0)

        # A queued client that cancels leaves the queue.
        d = await admit(stub, "d")
        await stats_become(stub, in_flight=2, queued=1)
        d.cancel()
        await stats_become(stub, in_flight=2, queued=0)

        # Dispatched clients that cancel mid-way give their slots back.
        b.cancel()
        c.cancel()
        await stats_become(stub, in_flight=0, queued=0)
        final = await stub.Stats(pb.StatsRequest())
        assert (final.dispatched_total, final.rejected_total, final.max_in_flight) == (3, 0, 2)


async def test_queue_ttl_rejects_with_reason(start_service) -> None:
    proc, address = start_service("flow_control", "--max-in-flight", "1", "--queue-ttl-seconds", "0.3")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = await admit(stub, "holder")
        assert (await holder.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        late = await admit(stub, "late")
        reply = await late.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_EVICTED_TTL
        assert "queue_ttl_seconds=0.3" in reply.reason
        assert reply.queue_seconds >= 0.3
        assert await late.read() == grpc.aio.EOF  # the server ends a rejected stream
        holder.cancel()
        await stats_become(stub, in_flight=0, queued=0)
        assert (await stub.Stats(pb.StatsRequest())).rejected_total == 1
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(metrics_url(proc))).text
    assert 'kvmesh_flow_control_outcome_total{outcome="evicted_ttl"} 1.0' in text
    assert 'kvmesh_flow_control_outcome_total{outcome="dispatched"} 1.0' in text
    assert "kvmesh_flow_control_in_flight 0.0" in text
    assert "kvmesh_flow_control_queue_size 0.0" in text
    assert 'kvmesh_flow_control_queue_duration_seconds_count{outcome="evicted_ttl"} 1.0' in text


async def test_queue_full_rejects(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "1", "--max-queue-size", "0")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = await admit(stub, "holder")
        assert (await holder.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        rejected = await admit(stub, "rejected")
        reply = await rejected.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_REJECTED_CAPACITY
        assert "max_queue_size=0" in reply.reason
        await holder.done_writing()
        assert await holder.read() == grpc.aio.EOF
        await stats_become(stub, in_flight=0, queued=0)


BAD_FIRST_MESSAGES = {
    "complete-first": pb.AdmitRequest(complete=pb.Complete()),
    "empty-message": pb.AdmitRequest(),
    "no-message": None,
    "enqueue-without-request-id": pb.AdmitRequest(enqueue=pb.Enqueue(model="m")),
}


async def test_bad_first_message_is_invalid_argument(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "1")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        for name, first in BAD_FIRST_MESSAGES.items():
            call = stub.Admit()
            if first is not None:
                await call.write(first)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await call.read()
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            # The service keeps serving, and the bad stream held no slot.
            ok = await admit(stub, "ok")
            assert (await ok.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED, name
            await ok.done_writing()
            assert await ok.read() == grpc.aio.EOF
            await stats_become(stub, in_flight=0, queued=0)
        # A second enqueue after dispatch is a protocol error; the slot is still released.
        twice = await admit(stub, "twice")
        assert (await twice.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        await twice.write(enqueue("twice"))
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await twice.read()
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stats_become(stub, in_flight=0, queued=0)


def test_reflection_lists_methods(start_service) -> None:
    _, address = start_service("flow_control")
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        service = DescriptorPool(database).FindServiceByName("kvmesh.flow_control.v1.FlowControl")
        assert {m.name for m in service.methods} == {"Admit", "Stats"}


async def test_many_streams_with_random_cancels_release_every_slot(start_service) -> None:
    """Concurrent clients that finish, cancel while dispatched or cancel while queued."""
    _, address = start_service("flow_control", "--max-in-flight", "3")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)

        async def client(i: int) -> None:
            call = await admit(stub, f"r{i}")
            if i % 5 == 4:
                await asyncio.sleep(0.01 * (i % 3))
                call.cancel()  # may be queued or dispatched by now
                return
            reply = await call.read()
            assert reply.outcome == pb.QUEUE_OUTCOME_DISPATCHED
            if i % 3 == 0:
                call.cancel()
            else:
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF

        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, (await stub.Stats(pb.StatsRequest())).in_flight)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(40))), 30)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await stats_become(stub, in_flight=0, queued=0)
        assert 1 <= peak <= 3
