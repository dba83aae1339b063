"""The multiplexed admission stream (``FlowControl.AdmitMany``): the router's client against the real
flow_control servicer and controller on a real gRPC server (loopback), the interceptor chain included.

One stream carries every admission; decisions come back by ticket; Complete/Release free slots
without a round trip; the stream's end frees every slot it holds; flow_control gone is
``FlowControlUnreachable`` (the degraded mode's cue) and a restarted one is used again; an older
flow_control without ``AdmitMany`` is asked one stream per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.interceptors import server_interceptors
from services.flow_control.controller import ControllerLimits, FlowController
from services.flow_control.servicer import FlowControlServicer
from services.router.clients import AdmissionClient, AdmitQuery, CompletionReport
from services.router.degraded import FlowControlUnreachable

REPORT = CompletionReport(10, 2, 0.01, 0.02, True)


def _query(i: int, flow: str = "f") -> AdmitQuery:
    return AdmitQuery(f"r{i}", flow, 0, 10, 10, "tiny")


async def _serve(controller: FlowController, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=server_interceptors())
    flow_control_pb2_grpc.add_FlowControlServicer_to_server(FlowControlServicer(controller), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms (flow_control reads the stream in its own time); TimeoutError after ``timeout``."""
    async with asyncio.timeout(timeout):
        for _ in iter(int, 1):
            if predicate():
                return
            await asyncio.sleep(0.01)


async def test_many_admissions_share_one_stream_and_slots_come_back() -> None:
    controller = FlowController(ControllerLimits(4, 30.0, 1000))
    server, port = await _serve(controller)
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=10, close_timeout_seconds=1)
    await client.connect()
    try:
        first = await asyncio.gather(*(client.admit(_query(i)) for i in range(4)))
        assert controller.stats().in_flight == 4
        queued = [asyncio.create_task(client.admit(_query(10 + i))) for i in range(3)]
        await _until(lambda: controller.stats().queued == 3)
        for ticket in first:
            await ticket.close(REPORT)  # no round trip: the slot frees when flow_control reads it
        later = await asyncio.gather(*queued)
        assert all(t.queue_seconds > 0 for t in later)
        for ticket in later:
            await ticket.close(None)
        await _until(lambda: controller.stats().in_flight == 0 and controller.stats().queued == 0)
        assert controller.stats().dispatched_total == 7
    finally:
        await client.close()
        await server.stop(0)


async def test_the_stream_ending_releases_every_slot_it_holds() -> None:
    controller = FlowController(ControllerLimits(8, 30.0, 1000))
    server, port = await _serve(controller)
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=10, close_timeout_seconds=1)
    await client.connect()
    try:
        await asyncio.gather(*(client.admit(_query(i)) for i in range(3)))
        assert controller.stats().in_flight == 3
    finally:
        await client.close()  # the router going away (a crash ends the stream the same way)
    try:
        await _until(lambda: controller.stats().in_flight == 0)
    finally:
        await server.stop(0)


async def test_a_queued_admission_past_the_timeout_is_released_and_the_stream_goes_on() -> None:
    controller = FlowController(ControllerLimits(1, 30.0, 1000))
    server, port = await _serve(controller)
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=0.3, close_timeout_seconds=1)
    await client.connect()
    try:
        held = await client.admit(_query(1))
        with pytest.raises(errors.QueueTTLExpired):
            await client.admit(_query(2))
        await _until(lambda: controller.stats().queued == 0)  # the Release cancelled it in flow_control
        with pytest.raises(errors.InvalidRequest, match="flow_id"):  # one malformed enqueue: that one alone fails
            await client.admit(_query(3, flow="x" * 300))
        await held.close(REPORT)
        again = await client.admit(_query(4))
        assert controller.stats().in_flight == 1
        await again.close(REPORT)
        await _until(lambda: controller.stats().in_flight == 0)
    finally:
        await client.close()
        await server.stop(0)


async def test_flow_control_gone_is_unreachable_and_a_restarted_one_is_used_again() -> None:
    controller = FlowController(ControllerLimits(8, 30.0, 1000))
    server, port = await _serve(controller)
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=5, close_timeout_seconds=1)
    await client.connect()
    try:
        held = await client.admit(_query(1))
        await server.stop(0)
        with pytest.raises(FlowControlUnreachable):
            await client.admit(_query(2))
        await held.close(REPORT)  # its stream is gone: a no-op, nothing raised
        restarted = FlowController(ControllerLimits(8, 30.0, 1000))
        server, _ = await _serve(restarted, port)

        async def admitted() -> bool:
            try:
                ticket = await client.admit(_query(3))
            except FlowControlUnreachable:
                await asyncio.sleep(0.1)  # the channel reconnects within its backoff
                return False
            await ticket.close(REPORT)
            return True

        async with asyncio.timeout(10):
            while not await admitted():
                pass
        await _until(lambda: restarted.stats().dispatched_total == 1 and restarted.stats().in_flight == 0)
    finally:
        await client.close()
        await server.stop(0)


class PerRequestOnly(flow_control_pb2_grpc.FlowControlServicer):
    """An older flow_control: ``Admit`` only (``AdmitMany`` answers UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls = 0

    async def Admit(self, request_iterator: AsyncIterator[flow_control_pb2.AdmitRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[flow_control_pb2.AdmitResponse]:
        self.calls += 1
        async for request in request_iterator:
            if request.HasField("enqueue"):
                yield flow_control_pb2.AdmitResponse(outcome=flow_control_pb2.QUEUE_OUTCOME_DISPATCHED)


async def test_a_flow_control_without_admit_many_is_asked_per_request() -> None:
    servicer = PerRequestOnly()
    server = grpc.aio.server()
    flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=5, close_timeout_seconds=1)
    await client.connect()
    try:
        for i in range(2):
            ticket = await client.admit(_query(i))
            await ticket.close(REPORT)
        assert servicer.calls == 2
    finally:
        await client.close()
        await server.stop(0)
