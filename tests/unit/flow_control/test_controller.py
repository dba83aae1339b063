"""FlowController: FCFS, the in-flight limit, queue capacity, TTL and exact release accounting."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.clock import ManualClock
from services.flow_control.controller import ControllerLimits, FlowController, Ticket, TicketState
from services.flow_control.queues.base import QueuedItem
from services.flow_control.queues.fcfs import FcfsQueue
from services.flow_control.types import AdmissionRequest, QueueOutcome


class RecordingObserver:
    def __init__(self) -> None:
        self.outcomes: list[tuple[str, QueueOutcome, float]] = []
        self.states: list[tuple[int, int]] = []

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        self.outcomes.append((request.request_id, outcome, queue_seconds))

    def on_state(self, queued: int, in_flight: int) -> None:
        self.states.append((queued, in_flight))


def make(max_in_flight: int = 2, ttl: float = 10.0, max_queue: int = 10) -> tuple[FlowController, ManualClock, RecordingObserver]:
    clock = ManualClock(100.0)
    observer = RecordingObserver()
    controller = FlowController(ControllerLimits(max_in_flight, ttl, max_queue), clock, observer=observer)
    return controller, clock, observer


def req(i: int | str, **kw: object) -> AdmissionRequest:
    return AdmissionRequest(request_id=str(i), **kw)  # type: ignore[arg-type]


def outcome(ticket: Ticket) -> QueueOutcome | None:
    return ticket.decision.outcome if ticket.decision else None


@pytest.mark.parametrize(
    ("max_in_flight", "max_queue", "arrivals", "expected"),
    [
        (2, 10, 2, ["dispatched", "dispatched"]),
        (2, 10, 4, ["dispatched", "dispatched", None, None]),
        (1, 1, 3, ["dispatched", None, "rejected_capacity"]),
        (1, 0, 2, ["dispatched", "rejected_capacity"]),
        (3, 0, 3, ["dispatched", "dispatched", "dispatched"]),
    ],
    ids=["under-limit", "queue-after-limit", "queue-full", "no-queueing", "exactly-at-limit"],
)
def test_arrivals(max_in_flight: int, max_queue: int, arrivals: int, expected: list[str | None]) -> None:
    controller, _, _ = make(max_in_flight=max_in_flight, max_queue=max_queue)
    tickets = [controller.enqueue(req(i)) for i in range(arrivals)]
    assert [outcome(t) for t in tickets] == [QueueOutcome(e) if e else None for e in expected]
    stats = controller.stats()
    assert stats.in_flight == expected.count("dispatched")
    assert stats.queued == expected.count(None)
    assert stats.rejected_total == expected.count("rejected_capacity")


def test_capacity_rejection_has_reason() -> None:
    controller, _, _ = make(max_in_flight=1, max_queue=0)
    controller.enqueue(req(0))
    rejected = controller.enqueue(req(1))
    assert rejected.decision is not None
    assert "max_queue_size=0" in rejected.decision.reason
    assert "max_in_flight=1" in rejected.decision.reason


def test_fcfs_order_on_release() -> None:
    controller, clock, _ = make(max_in_flight=1)
    first = controller.enqueue(req("a"))
    waiting = [controller.enqueue(req(name)) for name in "bcd"]
    order = []
    current = first
    for _ in range(3):
        clock.advance(1.0)
        assert controller.release(current) is True
        current = next(t for t in waiting if t.state is TicketState.DISPATCHED and t.request.request_id not in order)
        order.append(current.request.request_id)
    assert order == ["b", "c", "d"]
    assert waiting[0].decision is not None and waiting[0].decision.queue_seconds == pytest.approx(1.0)
    assert waiting[2].decision is not None and waiting[2].decision.queue_seconds == pytest.approx(3.0)


def test_activity_is_set_by_a_dispatch_and_by_a_queued_request() -> None:
    """``activity`` (what ends the pool poller's idle wait) is set by both ways a request arrives."""
    controller, _, _ = make(max_in_flight=1)
    assert not controller.activity.is_set()
    first = controller.enqueue(req("a"))
    assert first.state is TicketState.DISPATCHED and controller.activity.is_set()
    controller.activity.clear()
    queued = controller.enqueue(req("b"))
    assert queued.state is TicketState.QUEUED and controller.activity.is_set()
    controller.release(first)
    controller.release(queued)
    controller.activity.clear()
    assert not controller.busy and not controller.activity.is_set()  # a release is not activity


@pytest.mark.parametrize("state", ["dispatched", "queued", "rejected"])
def test_double_release_is_a_noop(state: str) -> None:
    controller, _, _ = make(max_in_flight=1, max_queue=1)
    dispatched = controller.enqueue(req("d"))
    queued = controller.enqueue(req("q"))
    rejected = controller.enqueue(req("r"))
    ticket = {"dispatched": dispatched, "queued": queued, "rejected": rejected}[state]
    controller.release(ticket)
    before = controller.stats()
    assert controller.release(ticket) is False
    assert controller.release(ticket) is False
    assert controller.stats() == before
    assert controller.stats().in_flight >= 0


def test_release_of_dispatched_frees_slot_once() -> None:
    controller, _, _ = make(max_in_flight=1)
    a = controller.enqueue(req("a"))
    b = controller.enqueue(req("b"))
    assert controller.release(a) is True
    assert outcome(b) is QueueOutcome.DISPATCHED
    assert controller.release(a) is False  # must not free b's slot
    assert controller.stats().in_flight == 1
    assert controller.release(b) is True
    assert controller.stats().in_flight == 0


def test_cancel_while_queued_leaves_queue() -> None:
    controller, _, observer = make(max_in_flight=1)
    a = controller.enqueue(req("a"))
    b = controller.enqueue(req("b"))
    c = controller.enqueue(req("c"))
    assert controller.release(b) is False
    assert controller.stats().queued == 1
    controller.release(a)
    assert outcome(c) is QueueOutcome.DISPATCHED
    assert b.state is TicketState.RELEASED
    assert ("b", QueueOutcome.EVICTED_CANCELLED, 0.0) in observer.outcomes
    assert controller.stats().dispatched_total == 2
    assert controller.stats().rejected_total == 0


@pytest.mark.parametrize(
    ("advance", "expired"),
    [(9.999, 0), (10.0, 1), (25.0, 2)],
    ids=["before-ttl", "at-ttl", "both"],
)
def test_ttl_eviction(advance: float, expired: int) -> None:
    controller, clock, _ = make(max_in_flight=1, ttl=10.0)
    controller.enqueue(req("busy"))
    first = controller.enqueue(req("first"))
    clock.advance(5.0)
    second = controller.enqueue(req("second"))
    clock.advance(advance - 5.0)  # advance is measured from "first"'s arrival
    assert controller.expire_due() == expired
    evicted = [t for t in (first, second) if outcome(t) is QueueOutcome.EVICTED_TTL]
    assert len(evicted) == expired
    for ticket in evicted:
        assert ticket.decision is not None
        assert "queue_ttl_seconds=10" in ticket.decision.reason
        assert ticket.decision.queue_seconds >= 10.0
    assert controller.stats().queued == 2 - expired
    assert controller.stats().rejected_total == expired


def test_expired_request_is_not_dispatched_on_release() -> None:
    controller, clock, _ = make(max_in_flight=1, ttl=1.0)
    busy = controller.enqueue(req("busy"))
    late = controller.enqueue(req("late"))
    clock.advance(2.0)
    controller.release(busy)  # no sweep ran yet: the release must not dispatch an expired request
    assert outcome(late) is QueueOutcome.EVICTED_TTL
    assert controller.stats().in_flight == 0


def test_next_expiry_follows_head() -> None:
    controller, clock, _ = make(max_in_flight=1, ttl=10.0)
    assert controller.next_expiry() is None
    controller.enqueue(req("busy"))
    controller.enqueue(req("q1"))
    clock.advance(3.0)
    controller.enqueue(req("q2"))
    assert controller.next_expiry() == pytest.approx(110.0)
    clock.advance(7.0)
    controller.expire_due()
    assert controller.next_expiry() == pytest.approx(113.0)


def test_observer_sees_outcomes_and_state() -> None:
    controller, clock, observer = make(max_in_flight=1, max_queue=1, ttl=1.0)
    a = controller.enqueue(req("a"))
    controller.enqueue(req("b"))
    controller.enqueue(req("c"))
    clock.advance(1.5)
    controller.expire_due()
    controller.release(a)
    assert [(rid, o) for rid, o, _ in observer.outcomes] == [
        ("a", QueueOutcome.DISPATCHED),
        ("c", QueueOutcome.REJECTED_CAPACITY),
        ("b", QueueOutcome.EVICTED_TTL),
    ]
    assert observer.states[-1] == (0, 0)


def test_queued_item_keeps_flow_and_priority() -> None:
    queue = FcfsQueue()
    controller = FlowController(ControllerLimits(1, 10.0, 10), ManualClock(), queue_factory=lambda: queue)
    controller.enqueue(req("busy"))
    controller.enqueue(req("q", flow_id="tenant-a", priority=7))
    (item,) = list(queue)
    assert isinstance(item, QueuedItem)
    assert (item.request.flow_id, item.request.priority) == ("tenant-a", 7)


async def test_wait_resolves_on_dispatch() -> None:
    controller, _, _ = make(max_in_flight=1)
    a = controller.enqueue(req("a"))
    b = controller.enqueue(req("b"))
    waiter = asyncio.ensure_future(b.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    controller.release(a)
    decision = await asyncio.wait_for(waiter, 1.0)
    assert decision.outcome is QueueOutcome.DISPATCHED


async def test_run_expiry_evicts_on_the_clock() -> None:
    # ManualClock.sleep advances time, so the loop reaches the deadline without real waiting.
    controller, _, _ = make(max_in_flight=1, ttl=5.0)
    controller.enqueue(req("busy"))
    waiting = controller.enqueue(req("w"))
    task = asyncio.create_task(controller.run_expiry())
    try:
        decision = await asyncio.wait_for(waiting.wait(), 1.0)
        assert decision.outcome is QueueOutcome.EVICTED_TTL
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(
    "kwargs",
    [{"max_in_flight": 0}, {"queue_ttl_seconds": 0}, {"max_queue_size": -1}],
    ids=["zero-in-flight", "zero-ttl", "negative-queue"],
)
def test_limits_validate(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ControllerLimits(**{"max_in_flight": 1, "queue_ttl_seconds": 1.0, "max_queue_size": 0, **kwargs})  # type: ignore[arg-type]


def test_fcfs_queue_contract() -> None:
    queue = FcfsQueue()
    items = [QueuedItem(i, req(i), float(i)) for i in range(4)]
    for item in items:
        queue.push(item)
    with pytest.raises(ValueError):
        queue.push(items[0])
    assert queue.remove(2) is items[2]
    assert queue.remove(2) is None
    assert queue.peek() is items[0]
    assert [queue.pop(), queue.pop(), queue.pop()] == [items[0], items[1], items[3]]
    assert queue.peek() is None and len(queue) == 0
    with pytest.raises(IndexError):
        queue.pop()
