"""The flow controller: FCFS admission with a global in-flight limit and a queue TTL.

Algorithm (one event loop, no locks: every method runs to completion without awaiting):

* ``enqueue(request)`` creates a :class:`Ticket`. If nothing is waiting and fewer than
  ``max_in_flight`` requests are in flight, the request is dispatched at once. Otherwise, when
  ``max_queue_size`` requests already wait, it is rejected (``REJECTED_CAPACITY``); else it
  joins the queue.
* ``release(ticket)`` is called exactly when the request's admission stream closes, for any
  reason (normal close, client cancel, error). A dispatched ticket gives its slot back and the
  oldest waiting request is dispatched; a queued ticket leaves the queue
  (``EVICTED_CANCELLED``); a rejected or already released ticket changes nothing. Every ticket
  moves ``QUEUED -> DISPATCHED | REJECTED -> RELEASED`` once, so a slot cannot be released
  twice and ``in_flight`` is exact.
* A request that waited ``queue_ttl_seconds`` is evicted (``EVICTED_TTL``) with a reason.
  ``expire_due()`` does this for every due request (called before each dispatch and by the
  ``run_expiry()`` background loop, which sleeps on the injected clock until the next deadline).
  The TTL is global, so arrival order is deadline order and the sweep only looks at the head.

Parameters: ``max_in_flight`` >= 1 (requests), ``queue_ttl_seconds`` > 0 (clock seconds),
``max_queue_size`` >= 0 (requests; 0 means "never queue").

Extension points (the shape follows GIE's flow controller, ``pkg/epp/flowcontrol``):

* ``queue_factory`` builds a :class:`~services.flow_control.queues.base.QueueOrdering`;
  other orderings plug in there.
* :meth:`FlowController._has_capacity` is the only place that decides whether anything may be
  dispatched now: a saturation detector joins the in-flight limit there.
* :meth:`FlowController._select_queue` is the only place that decides which queue the next
  request comes from: priority bands (one queue per ``priority``, strictly ordered) and
  fairness across ``flow_id`` inside a band (round robin over per-flow queues) replace it.
* ``Ticket.request`` keeps ``flow_id`` and ``priority`` for those policies.
* :class:`ControllerObserver` receives every outcome and state change (metrics, logging).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.clock import Clock, SystemClock
from services.flow_control.queues.base import QueuedItem, QueueOrdering
from services.flow_control.queues.fcfs import FcfsQueue
from services.flow_control.types import AdmissionDecision, AdmissionRequest, QueueOutcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControllerLimits:
    """The controller's knobs (see the module docstring for meaning and ranges).

    No defaults here: they live once, in :class:`~services.flow_control.config.FlowControlConfig`
    (``FlowControlConfig.limits()`` builds this).
    """

    max_in_flight: int
    queue_ttl_seconds: float
    max_queue_size: int

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if not self.queue_ttl_seconds > 0:
            raise ValueError(f"queue_ttl_seconds must be > 0, got {self.queue_ttl_seconds}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """A snapshot: requests in flight and queued, the limit, and lifetime totals.

    ``rejected_total`` counts every request that got a rejection (capacity, TTL, shed, other);
    requests whose client left while queued are in neither total.
    """

    in_flight: int
    queued: int
    max_in_flight: int
    dispatched_total: int
    rejected_total: int


class ControllerObserver(Protocol):
    """Hooks for metrics and logging; called synchronously, must not block."""

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        """A request left the queue (or never entered it) with ``outcome``."""
        ...

    def on_state(self, queued: int, in_flight: int) -> None:
        """The number of queued or in-flight requests changed."""
        ...


class NullObserver:
    """Observes nothing (the default)."""

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        pass

    def on_state(self, queued: int, in_flight: int) -> None:
        pass


class TicketState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REJECTED = "rejected"
    RELEASED = "released"


class Ticket:
    """One request's place in the controller; ``await ticket.wait()`` yields its :class:`AdmissionDecision`."""

    __slots__ = ("_decided", "decision", "enqueued_at", "id", "request", "state")

    def __init__(self, ticket_id: int, request: AdmissionRequest, enqueued_at: float) -> None:
        self.id = ticket_id
        self.request = request
        self.enqueued_at = enqueued_at
        self.state = TicketState.QUEUED
        self.decision: AdmissionDecision | None = None
        self._decided = asyncio.Event()

    @property
    def decided(self) -> bool:
        return self.decision is not None

    async def wait(self) -> AdmissionDecision:
        """Wait until the request is dispatched or rejected (cancel-safe: just stop waiting)."""
        await self._decided.wait()
        assert self.decision is not None
        return self.decision

    def _decide(self, decision: AdmissionDecision, state: TicketState) -> None:
        self.decision = decision
        self.state = state
        self._decided.set()

    def __repr__(self) -> str:
        return f"Ticket(id={self.id}, state={self.state.value}, request_id={self.request.request_id!r})"


class FlowController:
    """FCFS admission with a global in-flight limit and a queue TTL (see the module docstring)."""

    def __init__(
        self,
        limits: ControllerLimits,
        clock: Clock | None = None,
        queue_factory: Callable[[], QueueOrdering] = FcfsQueue,
        observer: ControllerObserver | None = None,
    ) -> None:
        self.limits = limits
        self._clock = clock or SystemClock()
        self._queue = queue_factory()
        self._observer = observer or NullObserver()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Ticket] = {}  # queued tickets in arrival (= deadline) order
        self._in_flight = 0
        self._dispatched_total = 0
        self._rejected_total = 0
        self._wake = asyncio.Event()

    # -- the contract ---------------------------------------------------------------------------

    def enqueue(self, request: AdmissionRequest) -> Ticket:
        """Admit, queue or reject ``request``; the returned ticket is decided or queued.

        The caller must call :meth:`release` with the ticket when the request's stream closes.
        """
        now = self._clock.now()
        ticket = Ticket(next(self._ids), request, now)
        self.expire_due()
        if not self._queue and self._has_capacity():
            self._dispatch(ticket, now)
        elif len(self._queue) >= self.limits.max_queue_size:
            reason = (
                f"queue full: {len(self._queue)} requests waiting (max_queue_size={self.limits.max_queue_size}),"
                f" {self._in_flight} in flight (max_in_flight={self.limits.max_in_flight})"
            )
            self._reject(ticket, QueueOutcome.REJECTED_CAPACITY, reason, now)
        else:
            self._queue.push(QueuedItem(ticket.id, request, now))
            self._waiting[ticket.id] = ticket
            self._wake.set()
            logger.debug("queued request_id=%s flow=%s queued=%d", request.request_id, request.flow_id, len(self._queue))
        self._publish_state()
        return ticket

    def release(self, ticket: Ticket) -> bool:
        """Close ``ticket`` (its stream ended); idempotent.

        Returns:
            ``True`` when this call freed an in-flight slot, ``False`` otherwise (the ticket was
            queued, rejected or already released).
        """
        freed = False
        if ticket.state is TicketState.DISPATCHED:
            self._in_flight -= 1
            assert self._in_flight >= 0, "in-flight count went negative"
            freed = True
        elif ticket.state is TicketState.QUEUED:
            self._queue.remove(ticket.id)
            self._waiting.pop(ticket.id, None)
            now = self._clock.now()
            ticket._decide(
                AdmissionDecision(
                    QueueOutcome.EVICTED_CANCELLED, "client closed the stream while queued", now - ticket.enqueued_at
                ),
                TicketState.RELEASED,
            )
            self._observer.on_outcome(ticket.request, QueueOutcome.EVICTED_CANCELLED, now - ticket.enqueued_at)
        ticket.state = TicketState.RELEASED
        if freed:
            self._dispatch_ready()
        self._publish_state()
        return freed

    def expire_due(self) -> int:
        """Evict every queued request older than ``queue_ttl_seconds``; returns how many."""
        now = self._clock.now()
        ttl = self.limits.queue_ttl_seconds
        expired = 0
        while self._waiting:
            ticket = next(iter(self._waiting.values()))
            if ticket.enqueued_at + ttl > now:
                break
            del self._waiting[ticket.id]
            self._queue.remove(ticket.id)
            reason = f"waited {now - ticket.enqueued_at:.3f} s in the queue (queue_ttl_seconds={ttl:g})"
            self._reject(ticket, QueueOutcome.EVICTED_TTL, reason, now)
            expired += 1
        if expired:
            self._publish_state()
        return expired

    def next_expiry(self) -> float | None:
        """Clock time of the next TTL eviction, ``None`` when nothing waits."""
        ticket = next(iter(self._waiting.values()), None)
        return None if ticket is None else ticket.enqueued_at + self.limits.queue_ttl_seconds

    async def run_expiry(self) -> None:
        """Background loop: evict requests at their TTL deadline, on the injected clock. Cancel to stop."""
        while True:
            self.expire_due()
            deadline = self.next_expiry()
            if deadline is None:
                self._wake.clear()
                await self._wake.wait()
            else:
                await self._clock.sleep(max(deadline - self._clock.now(), 0.001))

    def stats(self) -> ControllerStats:
        return ControllerStats(
            in_flight=self._in_flight,
            queued=len(self._queue),
            max_in_flight=self.limits.max_in_flight,
            dispatched_total=self._dispatched_total,
            rejected_total=self._rejected_total,
        )

    # -- extension points -----------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        """Whether one more request may be dispatched now (later: and the pool is not saturated)."""
        return self._in_flight < self.limits.max_in_flight

    def _select_queue(self) -> QueueOrdering | None:
        """The queue the next request comes from (later: highest non-empty band, then fairness)."""
        return self._queue if self._queue else None

    # -- internals ------------------------------------------------------------------------------

    def _dispatch_ready(self) -> None:
        self.expire_due()
        now = self._clock.now()
        while self._has_capacity():
            queue = self._select_queue()
            if queue is None:
                break
            item = queue.pop()
            ticket = self._waiting.pop(item.ticket_id)
            self._dispatch(ticket, now)

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        self._in_flight += 1
        self._dispatched_total += 1
        waited = now - ticket.enqueued_at
        ticket._decide(AdmissionDecision(QueueOutcome.DISPATCHED, "", waited), TicketState.DISPATCHED)
        self._observer.on_outcome(ticket.request, QueueOutcome.DISPATCHED, waited)
        logger.debug(
            "dispatched request_id=%s flow=%s queue_seconds=%.4f in_flight=%d",
            ticket.request.request_id, ticket.request.flow_id, waited, self._in_flight,
        )

    def _reject(self, ticket: Ticket, outcome: QueueOutcome, reason: str, now: float) -> None:
        self._rejected_total += 1
        waited = now - ticket.enqueued_at
        ticket._decide(AdmissionDecision(outcome, reason, waited), TicketState.REJECTED)
        self._observer.on_outcome(ticket.request, outcome, waited)
        logger.debug("rejected request_id=%s outcome=%s reason=%s", ticket.request.request_id, outcome.value, reason)

    def _publish_state(self) -> None:
        self._observer.on_state(len(self._queue), self._in_flight)
