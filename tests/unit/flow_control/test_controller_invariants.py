"""Random enqueue/release/clock sequences keep the controller's accounting exact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.clock import ManualClock
from services.flow_control.controller import ControllerLimits, FlowController, Ticket, TicketState
from services.flow_control.types import AdmissionRequest, QueueOutcome

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 0)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("advance"), st.integers(1, 4)),
        st.tuples(st.just("expire"), st.integers(0, 0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(max_in_flight=st.integers(1, 4), max_queue=st.integers(0, 5), ops=OPS)
def test_accounting_is_exact(max_in_flight: int, max_queue: int, ops: list[tuple[str, int]]) -> None:
    clock = ManualClock()
    controller = FlowController(ControllerLimits(max_in_flight, 5.0, max_queue), clock)
    tickets: list[Ticket] = []
    dispatch_order: list[int] = []
    for op, arg in ops:
        before = {t.id for t in tickets if t.state is TicketState.DISPATCHED or t.state is TicketState.RELEASED}
        if op == "enqueue":
            tickets.append(controller.enqueue(AdmissionRequest(str(len(tickets)))))
        elif op == "release" and tickets:
            controller.release(tickets[arg % len(tickets)])
        elif op == "advance":
            clock.advance(arg)
        else:
            controller.expire_due()
        dispatch_order += [
            t.id for t in tickets
            if t.id not in before and t.decision is not None and t.decision.outcome is QueueOutcome.DISPATCHED
        ]
        stats = controller.stats()
        dispatched = [t for t in tickets if t.state is TicketState.DISPATCHED]
        queued = [t for t in tickets if t.state is TicketState.QUEUED]
        assert stats.in_flight == len(dispatched) <= max_in_flight
        assert stats.queued == len(queued) <= max_queue
        # Work conserving: nothing waits while a slot is free.
        assert not (queued and stats.in_flight < max_in_flight)
        assert stats.dispatched_total == len(set(dispatch_order))
    # FCFS: requests were dispatched in arrival order.
    assert dispatch_order == sorted(dispatch_order)
    for ticket in tickets:
        controller.release(ticket)
    assert controller.stats().in_flight == 0 and controller.stats().queued == 0
