"""Admission credits on the multiplexed stream (issue 10): the router's ``AdmissionClient`` against the
real flow_control servicer and controller on a real gRPC server (loopback), the interceptor chain
included.

An uncontended request of the credits' band without a tenant quota is admitted without waiting for
flow_control (``admit()`` completes without suspending, even while flow_control is made slow); its
Enqueue still reaches flow_control, which counts it exactly; anything queued or a saturated pool
revokes the credits; a request with a quota or of another band never spends one; the stream's
end frees credits and slots; an older flow_control that knows nothing of credits is used as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.clock import ManualClock
from kvmesh.interceptors import server_interceptors
from services.flow_control.controller import ControllerLimits, FlowController
from services.flow_control.saturation import EndpointLoad, PoolSnapshot, SaturationDetector
from services.flow_control.servicer import FlowControlServicer
from services.router.clients import AdmissionClient, AdmitOptions, AdmitQuery, CompletionReport

REPORT = CompletionReport(10, 2, 0.01, 0.02, True)


class Events:
    def __init__(self) -> None:
        self.credits: dict[str, int] = {}

    def on_outcome(self, *args: object) -> None:
        pass

    def on_state(self, queued: int, in_flight: int) -> None:
        pass

    def on_credits(self, event: str, credits: int, reason: str = "") -> None:
        self.credits[event] = self.credits.get(event, 0) + credits


def _controller(max_in_flight: int = 16, credits: int = 4, detector: SaturationDetector | None = None,
                clock: ManualClock | None = None) -> tuple[FlowController, Events]:
    events = Events()
    limits = ControllerLimits(max_in_flight, 30.0, 1000, admission_credits=credits)
    return FlowController(limits, clock, observer=events, detector=detector), events


def _query(i: int, flow: str = "f", priority: int = 0, options: AdmitOptions | None = None) -> AdmitQuery:
    return AdmitQuery(f"r{i}", flow, priority, 10, 10, "tiny", options)


class SlowServicer(FlowControlServicer):
    """The real servicer, reading each batch only ``delay`` seconds after it arrives (a slow flow_control)."""

    def __init__(self, controller: FlowController) -> None:
        super().__init__(controller)
        self.delay = 0.0

    async def AdmitMany(self, request_iterator: AsyncIterator[flow_control_pb2.AdmitBatch],
                        context: grpc.aio.ServicerContext) -> None:
        async def slowed() -> AsyncIterator[flow_control_pb2.AdmitBatch]:
            async for batch in request_iterator:
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield batch

        await super().AdmitMany(slowed(), context)


async def _serve(servicer: flow_control_pb2_grpc.FlowControlServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=server_interceptors())
    flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _client(port: int, credits: int = 4, timeout: float = 10.0) -> AdmissionClient:
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=timeout, close_timeout_seconds=1,
                             credits=credits)
    await client.connect()
    return client


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (flow_control and the stream act in their own time)
            await asyncio.sleep(0.01)


def _held(client: AdmissionClient) -> int:
    stream = client._stream
    return stream.credits if stream is not None else 0


def _at_once(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to completion without letting it suspend: fails when it waits for anything."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("admit() waited (a round trip) instead of spending a credit")


async def test_uncontended_requests_are_admitted_without_a_round_trip_and_counted_exactly() -> None:
    controller, events = _controller(credits=4)
    servicer = SlowServicer(controller)
    server, port = await _serve(servicer)
    client = await _client(port, credits=8)
    try:
        first = await client.admit(_query(0))  # opens the stream: a round trip, credits arrive beside it
        await _until(lambda: _held(client) == 4)  # min(router 8, flow_control 4)
        servicer.delay = 0.5  # flow_control now answers nothing for half a second per batch
        loop = asyncio.get_running_loop()
        started = loop.time()
        spent = [_at_once(client.admit(_query(i))) for i in range(1, 4)]
        assert loop.time() - started < 0.05 and _held(client) == 1
        assert all(t.queue_seconds == 0.0 for t in spent)
        quota = asyncio.create_task(client.admit(_query(9, options=AdmitOptions(max_concurrency=5))))
        await asyncio.sleep(0.2)
        assert not quota.done()  # a request with a quota waits for flow_control's decision
        servicer.delay = 0.0
        await _until(lambda: controller.stats().in_flight == 5)  # every Enqueue arrived: exact accounting
        quota_ticket = await quota
        assert events.credits.get("spent") == 3 and "overdrawn" not in events.credits
        stats = controller.stats()
        assert stats.dispatched_total == 5 and [(f.flow_id, f.in_flight) for f in stats.flows] == [("f", 5)]
        for ticket in (first, *spent):
            await ticket.close(REPORT)  # Complete on a credit ticket: fairness accounting as for any
        await _until(lambda: controller.stats().in_flight == 1)
        assert controller.stats().flows[0].served_tokens == 4 * (REPORT.prompt_tokens + REPORT.completion_tokens)
        await quota_ticket.close(REPORT)
        # what the router holds is what flow_control counts as lent (topped up at half: 3 or 4 here)
        await _until(lambda: controller.stats().in_flight == 0 and _held(client) == controller.credits_lent >= 3)
    finally:
        await client.close()
        await server.stop(0)


async def test_a_request_of_another_band_or_with_a_rate_quota_never_spends_a_credit() -> None:
    controller, events = _controller(credits=2)
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=2)
    try:
        await (await client.admit(_query(0))).close(REPORT)
        await _until(lambda: _held(client) == 2)
        for query in (_query(1, priority=10), _query(2, options=AdmitOptions(rate_per_second=100.0, burst=10)),
                      _query(3, priority=-5)):
            ticket = await client.admit(query)
            assert _held(client) == 2
            await ticket.close(REPORT)
        assert "spent" not in events.credits
        await _until(lambda: controller.stats().dispatched_total == 4 and controller.stats().in_flight == 0)
    finally:
        await client.close()
        await server.stop(0)


async def test_anything_queued_revokes_the_credits_and_lending_resumes_once_the_queue_drains() -> None:
    controller, events = _controller(max_in_flight=8, credits=2)
    server, port = await _serve(FlowControlServicer(controller))
    router = await _client(port, credits=2)
    other = await _client(port, credits=0)  # another client, without credits
    quota = AdmitOptions(max_concurrency=1)
    try:
        await (await router.admit(_query(0))).close(REPORT)
        await _until(lambda: _held(router) == 2 and controller.credits_lent == 2)
        first = await other.admit(_query(10, flow="g", options=quota))
        waiting = asyncio.create_task(other.admit(_query(11, flow="g", options=quota)))  # behind g's quota
        await _until(lambda: events.credits.get("returned", 0) == 2)  # revoked; the router answered
        assert events.credits.get("revoked") == 1 and _held(router) == 0 and controller.credits_lent == 0
        assert controller.stats().queued == 1
        ticket = await router.admit(_query(1))  # no credit while anything waits: a round trip
        assert "spent" not in events.credits
        await first.close(REPORT)
        second = await waiting
        assert second.queue_seconds > 0
        for t in (second, ticket):
            await t.close(REPORT)
        await _until(lambda: _held(router) == 2 and controller.stats().in_flight == 0)  # nothing waits: lent again
        assert controller.stats().dispatched_total == 4
    finally:
        await router.close()
        await other.close()
        await server.stop(0)


async def test_saturation_revokes_and_room_lends_again() -> None:
    clock = ManualClock(100.0)
    detector = SaturationDetector(queue_depth_threshold=5.0, kv_cache_util_threshold=0.8)
    controller, events = _controller(credits=4, detector=detector, clock=clock)

    def snapshot(waiting: float) -> PoolSnapshot:
        return PoolSnapshot((EndpointLoad("e0", "tiny", waiting, 0.1, 0.0),), clock.now())

    controller.update_pool(snapshot(0.0))
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=4)
    try:
        await (await client.admit(_query(0))).close(REPORT)
        await _until(lambda: _held(client) == 2)  # half the headroom of 5
        clock.advance(0.2)
        controller.update_pool(snapshot(5.0))  # the engine's queue is full
        await _until(lambda: _held(client) == 0 and controller.credits_lent == 0)
        assert events.credits.get("revoked") == 1 and events.credits.get("returned") == 2
        waiting = asyncio.create_task(client.admit(_query(1)))
        await _until(lambda: controller.stats().queued == 1)  # saturated: it waits in flow_control
        clock.advance(0.2)
        controller.update_pool(snapshot(0.0))
        ticket = await waiting
        assert ticket.queue_seconds > 0
        await ticket.close(REPORT)
        await _until(lambda: _held(client) > 0)
    finally:
        await client.close()
        await server.stop(0)


async def test_the_stream_ending_frees_the_credits_and_the_slots_spent_on_them() -> None:
    controller, events = _controller(credits=4)
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=4)
    try:
        await client.admit(_query(0))
        await _until(lambda: _held(client) == 4)
        _at_once(client.admit(_query(1)))
        await _until(lambda: controller.stats().in_flight == 2)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stats = await flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest(), timeout=5)
        assert (stats.in_flight, stats.credits_lent) == (2, controller.credits_lent) and stats.credits_lent >= 3
    finally:
        await client.close()  # a crashed router ends the stream the same way
    try:
        await _until(lambda: controller.stats().in_flight == 0 and controller.credits_lent == 0)
        assert events.credits.get("freed", 0) >= 2  # the 3 unspent, less any top-up still in flight
    finally:
        await server.stop(0)


async def test_a_flow_control_that_lends_nothing_is_waited_for_as_before() -> None:
    controller, events = _controller(credits=0)  # lends none, as one that ignores the CreditRequest
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=4)
    try:
        for i in range(3):
            ticket = await client.admit(_query(i))
            await ticket.close(REPORT)
        assert _held(client) == 0 and events.credits == {}
        await _until(lambda: controller.stats().dispatched_total == 3 and controller.stats().in_flight == 0)
    finally:
        await client.close()
        await server.stop(0)


class AdmitManyWithoutCredits(flow_control_pb2_grpc.FlowControlServicer):
    """A flow_control from before credits: ``AdmitMany`` answers every enqueue, ignores other entry kinds."""

    def __init__(self) -> None:
        self.entries: list[str] = []

    async def AdmitMany(self, request_iterator: AsyncIterator[flow_control_pb2.AdmitBatch],
                        context: grpc.aio.ServicerContext) -> None:
        async for batch in request_iterator:
            decisions = []
            for entry in batch.entries:
                self.entries.append(entry.WhichOneof("kind") or "")
                if entry.WhichOneof("kind") == "enqueue":
                    decisions.append(flow_control_pb2.AdmitDecision(ticket=entry.ticket, response=flow_control_pb2.AdmitResponse(
                        outcome=flow_control_pb2.QUEUE_OUTCOME_DISPATCHED)))
            if decisions:
                await context.write(flow_control_pb2.AdmitDecisions(decisions=decisions))


async def test_an_older_flow_control_without_credits_is_used_as_before() -> None:
    servicer = AdmitManyWithoutCredits()
    server, port = await _serve(servicer)
    client = await _client(port, credits=4)
    try:
        for i in range(3):
            ticket = await client.admit(_query(i))
            await ticket.close(REPORT)
        await _until(lambda: servicer.entries.count("complete") == 3)
        assert _held(client) == 0
        assert servicer.entries.count("enqueue") == 3 and servicer.entries[0] == "credit_request"
    finally:
        await client.close()
        await server.stop(0)


@pytest.mark.parametrize("credits", [0, 4])
async def test_sequential_admissions_hold_the_same_accounting_with_or_without_credits(credits: int) -> None:
    controller, _ = _controller(max_in_flight=2, credits=4)
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=credits)
    try:
        for i in range(20):
            ticket = await client.admit(_query(i, flow=f"t{i % 3}"))
            assert controller.stats().in_flight + controller.credits_lent <= 2  # credits are reserved room
            await ticket.close(REPORT)
        await _until(lambda: controller.stats().dispatched_total == 20 and controller.stats().in_flight == 0)
        stats = controller.stats()
        assert stats.rejected_total == 0 and stats.queued == 0
        assert controller.credits_lent <= 2
    finally:
        await client.close()
        await server.stop(0)


async def test_a_malformed_enqueue_on_a_credit_uses_the_credit_up_and_holds_no_slot() -> None:
    controller, events = _controller(credits=4)
    server, port = await _serve(FlowControlServicer(controller))
    client = await _client(port, credits=4)
    try:
        await (await client.admit(_query(0))).close(REPORT)
        await _until(lambda: _held(client) == 4)
        bad = _at_once(client.admit(_query(1, flow="x" * 300)))  # the router's HTTP layer answers 400 first
        await bad.close(REPORT)
        await _until(lambda: events.credits.get("spent") == 1)
        assert controller.stats().in_flight == 0 and "overdrawn" not in events.credits
        await _until(lambda: controller.credits_lent == _held(client))  # nothing left reserved
    finally:
        await client.close()
        await server.stop(0)


async def test_an_enqueue_on_a_credit_rides_the_next_write_or_goes_after_the_flush_delay() -> None:
    controller, events = _controller(credits=4)
    server, port = await _serve(FlowControlServicer(controller))
    client = AdmissionClient(f"127.0.0.1:{port}", admission_timeout_seconds=10, close_timeout_seconds=1,
                             credits=4, credit_flush_seconds=0.3)
    await client.connect()
    try:
        await (await client.admit(_query(0))).close(REPORT)
        await _until(lambda: _held(client) == 4 and controller.stats().in_flight == 0)
        short = _at_once(client.admit(_query(1)))
        await asyncio.sleep(0.1)
        assert controller.stats().dispatched_total == 1  # not sent yet, but its credit still counts as lent:
        assert controller.credits_lent == 4  # every limit sees it as a request in flight
        await short.close(REPORT)  # the Complete carries the Enqueue along: one write for both
        await _until(lambda: controller.stats().dispatched_total == 2)
        assert controller.stats().in_flight == 0 and events.credits.get("spent") == 1
        long = _at_once(client.admit(_query(2)))
        await _until(lambda: controller.stats().in_flight == 1, timeout=2.0)  # sent by the flush timer
        await long.close(REPORT)
        await _until(lambda: controller.stats().in_flight == 0)
        assert controller.stats().dispatched_total == 3 and events.credits.get("spent") == 2
    finally:
        await client.close()
        await server.stop(0)
