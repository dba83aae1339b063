"""FlowControl gRPC servicer: protobuf <-> :class:`FlowController`, and the stream's lifetime.

``AdmitMany`` carries every admission of one client on one long-lived stream (entries keyed by the
client's ticket ids, decisions batched per write; :class:`_AdmitSession`): the router's default
since issue 10 (no call set-up per request). ``Admit``, one stream per request, stays for other clients.
A client that sends a ``CreditRequest`` on ``AdmitMany`` is lent admission credits
(:mod:`services.flow_control.credits`): the session only carries the controller's grants and
revocations (``AdmitDecisions.credits``) and the client's answers, the controller decides.

The admission stream (``proto/kvmesh/flow_control/v1/flow_control.proto``): the router sends
``AdmitRequest{enqueue}``, receives one ``AdmitResponse`` (``DISPATCHED`` or a rejection with a
reason and a retry hint), may send ``AdmitRequest{complete}`` (the tokens actually used: fairness
accounting), then closes its side. The slot is released in a ``finally`` when the handler ends
for any reason: the client's half-close, a cancel (the handler task is cancelled), a protocol
error or server shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable

import grpc
from opentelemetry import propagate, trace

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.errors import InvalidRequest, KvmeshError, NotFound, mapping_for
from kvmesh.streams import stop_stream_writer
from services.flow_control.controller import FlowController, Ticket
from services.flow_control.credits import CreditAccount
from services.flow_control.types import (
    DEFAULT_FLOW_ID,
    MAX_FLOW_ID_CHARS,
    AdmissionRequest,
    FlowQuota,
    QueueOutcome,
    ServedTokens,
)

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.flow_control")

SERVICE_NAME = flow_control_pb2.DESCRIPTOR.services_by_name["FlowControl"].full_name

_OUTCOME_TO_PROTO = {
    QueueOutcome.DISPATCHED: flow_control_pb2.QUEUE_OUTCOME_DISPATCHED,
    QueueOutcome.REJECTED_CAPACITY: flow_control_pb2.QUEUE_OUTCOME_REJECTED_CAPACITY,
    QueueOutcome.EVICTED_TTL: flow_control_pb2.QUEUE_OUTCOME_EVICTED_TTL,
    QueueOutcome.SHED: flow_control_pb2.QUEUE_OUTCOME_SHED,
    QueueOutcome.REJECTED_OTHER: flow_control_pb2.QUEUE_OUTCOME_REJECTED_OTHER,
    QueueOutcome.REJECTED_RATE_LIMITED: flow_control_pb2.QUEUE_OUTCOME_REJECTED_RATE_LIMITED,
    QueueOutcome.REJECTED_NO_ENDPOINTS: flow_control_pb2.QUEUE_OUTCOME_REJECTED_NO_ENDPOINTS,
}


def _non_negative(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"enqueue.{name} must be a finite number >= 0, got {value}")
    return value


def admission_request(enqueue: flow_control_pb2.Enqueue) -> AdmissionRequest:
    """Convert an ``Enqueue`` message (an empty flow_id becomes ``"default"``).

    Raises:
        InvalidRequest: a flow_id over 256 characters, a negative or non-finite TTL, SLO or rate.
    """
    if len(enqueue.flow_id) > MAX_FLOW_ID_CHARS:
        raise InvalidRequest(f"enqueue.flow_id is {len(enqueue.flow_id)} characters (at most {MAX_FLOW_ID_CHARS})")
    return AdmissionRequest(
        request_id=enqueue.request_id,
        flow_id=enqueue.flow_id or DEFAULT_FLOW_ID,
        priority=enqueue.priority,
        prompt_tokens=enqueue.prompt_tokens,
        max_tokens=enqueue.max_tokens,
        model=enqueue.model,
        byte_size=enqueue.byte_size,
        ttl_seconds=_non_negative("ttl_seconds", enqueue.ttl_seconds),
        ttft_slo_seconds=_non_negative("ttft_slo_seconds", enqueue.ttft_slo_seconds),
        quota=FlowQuota(enqueue.max_concurrency, _non_negative("rate_per_second", enqueue.rate_per_second), enqueue.burst),
    )


class FlowControlServicer(flow_control_pb2_grpc.FlowControlServicer):
    def __init__(self, controller: FlowController) -> None:
        self._controller = controller

    async def Admit(
        self,
        request_iterator: AsyncIterator[flow_control_pb2.AdmitRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[flow_control_pb2.AdmitResponse]:
        """One request's admission (the proto's stream protocol: an Enqueue, one AdmitResponse, at
        most one Complete, the client's half-close). The rest of the stream is read from the first
        message on (:class:`_FollowUps`), so a protocol error is answered when it arrives:

        - a second Enqueue (or an empty message) before the decision: ``INVALID_ARGUMENT`` at once,
          the queued request leaves the queue; a Complete sent ahead of the decision (grpcurl sends
          both messages at once) is applied after dispatch;
        - after a rejection: the call ends OK once the client half-closes, or after
          ``_REJECTED_GRACE_SECONDS``; a second Enqueue sent along is ``INVALID_ARGUMENT``;
        - after dispatch: a second Enqueue, a second Complete or an empty message is ``INVALID_ARGUMENT``.

        The slot is released when the handler ends, for any reason.
        """
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            raise InvalidRequest("Admit stream closed before its first message (expected an enqueue)") from None
        if first.WhichOneof("kind") != "enqueue":
            raise InvalidRequest(
                f"the first Admit message must be an enqueue, got {first.WhichOneof('kind') or 'an empty message'}"
            )
        if not first.enqueue.request_id:
            raise InvalidRequest("enqueue.request_id is required")
        ticket = self._controller.enqueue(admission_request(first.enqueue))
        rest = _FollowUps(request_iterator)
        try:
            if ticket.decision is None:
                await rest.until(ticket.wait())
            decision = ticket.decision
            assert decision is not None
            _annotate_admit(first.enqueue, decision)
            yield flow_control_pb2.AdmitResponse(
                outcome=_OUTCOME_TO_PROTO[decision.outcome],
                reason=decision.reason,
                queue_seconds=decision.queue_seconds,
                retry_after_seconds=decision.retry_after_seconds,
            )
            if decision.outcome is not QueueOutcome.DISPATCHED:
                await rest.settle(_REJECTED_GRACE_SECONDS)
                return
            completed = False
            while (message := await rest.next()) is not None:
                kind = message.WhichOneof("kind")
                if kind == "complete" and not completed:
                    completed = True
                    done = message.complete
                    self._controller.complete(ticket, ServedTokens(done.prompt_tokens, done.completion_tokens))
                    logger.debug(
                        "complete request_id=%s success=%s prompt_tokens=%d completion_tokens=%d e2e_seconds=%.3f",
                        ticket.request.request_id, done.success, done.prompt_tokens, done.completion_tokens,
                        done.e2e_seconds,
                    )
                else:
                    raise InvalidRequest(_protocol_error(kind, "after dispatch"))
        finally:
            rest.stop()
            self._controller.release(ticket)

    async def AdmitMany(
        self,
        request_iterator: AsyncIterator[flow_control_pb2.AdmitBatch],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Every admission of one client on one stream (see :class:`_AdmitSession`); the stream's
        end, for any reason, releases every slot it holds."""
        session = _AdmitSession(self._controller, context)
        try:
            async for batch in request_iterator:
                for entry in batch.entries:
                    session.handle(entry)
        finally:
            await session.close()

    async def Stats(
        self, request: flow_control_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> flow_control_pb2.StatsResponse:
        stats = self._controller.stats()
        sat = stats.saturation
        saturation = flow_control_pb2.Saturation(enabled=False)
        if sat is not None:
            saturation = flow_control_pb2.Saturation(
                enabled=True, saturated=sat.saturated, stale=sat.stale, saturation=sat.saturation,
                headroom=min(sat.headroom, 1e18), unseen_dispatches=sat.unseen_dispatches,
                metrics_age_seconds=min(sat.metrics_age_seconds, 1e18),
            )
        return flow_control_pb2.StatsResponse(
            in_flight=stats.in_flight,
            queued=stats.queued,
            max_in_flight=stats.max_in_flight,
            dispatched_total=stats.dispatched_total,
            rejected_total=stats.rejected_total,
            queued_bytes=stats.queued_bytes,
            bands=[
                flow_control_pb2.BandStats(priority=b.priority, name=b.name, queued=b.queued, queued_bytes=b.queued_bytes,
                                           in_flight=b.in_flight, flows=b.flows)
                for b in stats.bands
            ],
            flows=[
                flow_control_pb2.FlowStats(flow_id=f.flow_id, priority=f.priority, queued=f.queued, in_flight=f.in_flight,
                                           oldest_wait_seconds=f.oldest_wait_seconds, served_tokens=f.served_tokens,
                                           share=f.share)
                for f in stats.flows
            ],
            saturation=saturation,
            jain_index=stats.jain_index,
            fairness_window_seconds=stats.fairness_window_seconds,
            credits_lent=stats.credits_lent,
        )


_REJECTED_GRACE_SECONDS = 0.1
"""How long a rejected ``Admit`` stream waits for the client's half-close (or a second Enqueue sent
along with the first, answered ``INVALID_ARGUMENT``) before it ends the call itself: messages that
reach a call already ended cannot be answered. A client that half-closes (grpcurl) or cancels (the
router) ends it at once."""


def _protocol_error(kind: str | None, when: str) -> str:
    """The ``INVALID_ARGUMENT`` message for an ``AdmitRequest`` of ``kind`` that the Admit protocol does not allow ``when``."""
    if kind == "enqueue":
        return (f"a second enqueue on one Admit stream ({when}): an Admit stream carries one request; "
                "open a new stream per request, or use AdmitMany")
    if kind == "complete":
        return f"a second complete on one Admit stream ({when}): a request is completed once"
    return f"unexpected Admit message {when}: an empty message (set enqueue or complete)"


class _FollowUps:
    """The messages of an ``Admit`` stream after its Enqueue, read by a task of their own so a
    protocol error is seen while the request waits in the queue. Reading stops after the first
    message that breaks the protocol (anything but one Complete): at most three are held."""

    def __init__(self, stream: AsyncIterator[flow_control_pb2.AdmitRequest]) -> None:
        self._queue: asyncio.Queue[flow_control_pb2.AdmitRequest | None] = asyncio.Queue()
        self._broken = asyncio.Event()
        self._violation: str | None = None
        self._task = asyncio.create_task(self._read(stream), name="flow_control-admit-reader")

    async def _read(self, stream: AsyncIterator[flow_control_pb2.AdmitRequest]) -> None:
        completes = 0
        try:
            async for message in stream:
                self._queue.put_nowait(message)
                kind = message.WhichOneof("kind")
                completes += kind == "complete"
                if kind != "complete" or completes > 1:
                    self._violation = _protocol_error(kind, "before its decision")
                    self._broken.set()
                    return
        except Exception as exc:  # the call broke (cancelled, reset): the handler is ending too
            logger.debug("admit stream read ended: %r", exc)
        finally:
            self._queue.put_nowait(None)

    async def until(self, decided: Awaitable[object]) -> None:
        """Wait for ``decided``; raises InvalidRequest when the client breaks the protocol meanwhile
        (a Complete sent ahead is kept for :meth:`next`)."""
        waiter = asyncio.ensure_future(decided)
        alarm = asyncio.ensure_future(self._broken.wait())
        done = False
        try:
            await asyncio.wait((waiter, alarm), return_when=asyncio.FIRST_COMPLETED)
            done = waiter.done()
        finally:  # the call cancelled, or a protocol error: nothing is left waiting
            alarm.cancel()
            if not waiter.done():
                waiter.cancel()
        if not done:
            raise InvalidRequest(self._violation or "Admit protocol error")

    async def settle(self, seconds: float) -> None:
        """After a rejection: wait (at most ``seconds``) for the client's half-close; raises
        InvalidRequest when it sent a second Enqueue or an empty message (a Complete is moot)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while (message := await self._queue.get()) is not None:
                    if message.WhichOneof("kind") != "complete":
                        raise InvalidRequest(_protocol_error(message.WhichOneof("kind"), "after a rejection"))

    async def next(self) -> flow_control_pb2.AdmitRequest | None:
        """The next message in order; None once the client half-closed (or the call broke)."""
        return await self._queue.get()

    def stop(self) -> None:
        self._task.cancel()


def _annotate_admit(enqueue: flow_control_pb2.Enqueue, decision: object) -> None:
    """Trace attributes on the Admit span (issue 11): request id, model, flow, priority, the outcome
    and the time the request waited in the queue (seconds)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    outcome = getattr(decision, "outcome", None)
    span.set_attribute("kvmesh.request_id", enqueue.request_id)
    span.set_attribute("kvmesh.model", enqueue.model)
    span.set_attribute("kvmesh.flow_id", enqueue.flow_id)
    span.set_attribute("kvmesh.priority", int(enqueue.priority))
    span.set_attribute("kvmesh.admission", str(getattr(outcome, "value", outcome)))
    span.set_attribute("kvmesh.queue_seconds", float(getattr(decision, "queue_seconds", 0.0)))


_FLUSH_SECONDS = 1.0
"""How long a closing ``AdmitMany`` stream may take to write its last decisions."""


class _AdmitSession:
    """One ``AdmitMany`` stream: client ticket id -> controller ticket, and the decisions' writer.

    An ``Enqueue`` is decided at once when the controller dispatches or rejects it on arrival (the
    common case: no task); a queued one gets a task that waits for its decision. Decisions are
    written by one writer task, every decision ready at that moment in one ``AdmitDecisions``
    (under load one write carries many). A ``Complete`` reports and releases, a ``Release``
    releases (a queued request is cancelled). Every entry the session refuses is answered for its
    ticket alone with an ``AdmitDecision.error`` (status and class from kvmesh/errors.py's table, as
    epp's ``PickMany``), and the stream goes on: a malformed enqueue (bad flow id, TTL, duplicate or
    zero ticket) is ``INVALID_ARGUMENT`` / ``InvalidRequest``; a Complete or Release for a ticket
    the stream does not hold is ``NOT_FOUND`` / ``NotFound`` (its slot is already free: a client
    that gave up on the ticket ignores the answer); an entry with no kind, or a CreditReturn
    without a CreditRequest, is ``INVALID_ARGUMENT``.

    After an error for a ticket the stream holds nothing under it (the proto's contract; the
    router drops a ticket on any error). So an Enqueue under a ticket the stream still holds
    (queued, or dispatched and not yet completed or released) releases that earlier admission
    too (a queued one leaves the queue and is never answered; a dispatched one frees its slot)
    and the one error answers both. A ticket id is free again once the stream no longer holds it
    (after its Complete or Release, a rejection, or an error): a later Enqueue may reuse it.

    Credits: a ``CreditRequest`` opens (or resizes) the stream's :class:`CreditAccount`; its
    grants and revocations ride the writer's next ``AdmitDecisions`` (``credits``). An Enqueue
    ``on_credit`` is recorded as dispatched and gets no decision (a malformed one is answered as
    above: the client drops it); a ``CreditReturn`` answers a revoke. The stream's end frees the
    account's credits with its slots.
    """

    def __init__(self, controller: FlowController, context: grpc.aio.ServicerContext) -> None:
        self._controller = controller
        self._context = context
        self._tickets: dict[int, Ticket] = {}
        self._waiters: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[flow_control_pb2.AdmitDecision] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._credits: CreditAccount | None = None
        self._writer = asyncio.create_task(self._write(), name="flow_control-admit-many-writer")

    def handle(self, entry: flow_control_pb2.AdmitEntry) -> None:
        kind = entry.WhichOneof("kind")
        if kind == "enqueue":
            self._enqueue(entry)
        elif kind == "complete":
            ticket = self._forget(entry.ticket)
            if ticket is None:
                self._refuse(entry.ticket, _not_held(entry.ticket, "complete"))
                return
            done = entry.complete
            self._controller.complete(ticket, ServedTokens(done.prompt_tokens, done.completion_tokens))
            self._controller.release(ticket)
        elif kind == "release":
            ticket = self._forget(entry.ticket)
            if ticket is None:
                self._refuse(entry.ticket, _not_held(entry.ticket, "release"))
                return
            self._controller.release(ticket)
        elif kind == "credit_request":
            if self._credits is None:
                self._credits = self._controller.open_credits(entry.credit_request.max_credits, self._wake.set)
            else:
                self._controller.want_credits(self._credits, entry.credit_request.max_credits)
        elif kind == "credit_return":
            if self._credits is None:
                self._refuse(entry.ticket, InvalidRequest(
                    "credit_return without a credit_request on this stream: no credits were lent"))
                return
            self._controller.credits_returned(self._credits, entry.credit_return.returned)
        else:
            self._refuse(entry.ticket, InvalidRequest(
                f"entry for ticket {entry.ticket} carries nothing: set one of enqueue, complete, release, "
                "credit_request, credit_return"))

    def _enqueue(self, entry: flow_control_pb2.AdmitEntry) -> None:
        enqueue = entry.enqueue
        span = _admit_span(entry)
        try:
            if entry.ticket == 0:
                raise InvalidRequest("ticket 0 is reserved for credit entries: an enqueue needs a non-zero ticket")
            held = self._forget(entry.ticket)
            if held is not None:  # an error answers the ticket: it must hold nothing after it
                state = held.state.value
                self._controller.release(held)
                raise InvalidRequest(
                    f"ticket {entry.ticket} is already in use on this stream ({state}): the duplicate enqueue is "
                    f"refused and the earlier admission under ticket {entry.ticket} released (a queued one leaves "
                    "the queue, a dispatched one frees its slot); the stream holds nothing for it now")
            if not enqueue.request_id:
                raise InvalidRequest("enqueue.request_id is required")
            request = admission_request(enqueue)
        except InvalidRequest as exc:
            if entry.on_credit:  # the client spent the credit on it: gone, nothing in flight
                self._controller.spend_credit(self._credits)
            self._refuse(entry.ticket, exc)
            if span is not None:
                span.end()
            return
        if entry.on_credit:  # already dispatched by the client: recorded, no decision sent
            ticket = self._controller.enqueue_on_credit(request, self._credits)
            self._tickets[entry.ticket] = ticket
            if span is not None:
                with trace.use_span(span, end_on_exit=True):
                    span.set_attribute("kvmesh.admission_credit", True)
                    _annotate_admit(enqueue, ticket.decision)
            return
        ticket = self._controller.enqueue(request)
        if ticket.decision is not None:
            self._decided(entry.ticket, ticket, span, enqueue)
        else:
            self._tickets[entry.ticket] = ticket
            self._waiters[entry.ticket] = asyncio.create_task(self._wait(entry.ticket, ticket, span, enqueue))

    async def _wait(self, key: int, ticket: Ticket, span: trace.Span | None, enqueue: flow_control_pb2.Enqueue) -> None:
        try:
            await ticket.wait()
        except asyncio.CancelledError:  # released while queued (Release, a duplicate enqueue, the stream's end)
            if span is not None:
                span.end()
            raise
        self._waiters.pop(key, None)
        self._decided(key, ticket, span, enqueue)

    def _decided(self, key: int, ticket: Ticket, span: trace.Span | None, enqueue: flow_control_pb2.Enqueue) -> None:
        decision = ticket.decision
        assert decision is not None
        if decision.outcome is QueueOutcome.DISPATCHED:
            self._tickets[key] = ticket
        else:
            self._tickets.pop(key, None)
            self._controller.release(ticket)
        if span is not None:
            with trace.use_span(span, end_on_exit=True):
                _annotate_admit(enqueue, decision)
        self._answer(key, flow_control_pb2.AdmitResponse(
            outcome=_OUTCOME_TO_PROTO.get(decision.outcome, flow_control_pb2.QUEUE_OUTCOME_REJECTED_OTHER),
            reason=decision.reason, queue_seconds=decision.queue_seconds,
            retry_after_seconds=decision.retry_after_seconds,
        ))

    def _forget(self, key: int) -> Ticket | None:
        waiter = self._waiters.pop(key, None)
        if waiter is not None:
            waiter.cancel()
        return self._tickets.pop(key, None)

    def _answer(self, key: int, response: flow_control_pb2.AdmitResponse) -> None:
        self._outbox.append(flow_control_pb2.AdmitDecision(ticket=key, response=response))
        self._wake.set()

    def _refuse(self, key: int, exc: KvmeshError) -> None:
        """Answer ``key`` with what a unary call would have answered for ``exc`` (kvmesh/errors.py's table)."""
        self._outbox.append(flow_control_pb2.AdmitDecision(ticket=key, error=error_to_proto(exc)))
        self._wake.set()

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            update = self._credits.take_update() if self._credits is not None else None
            if self._outbox or update is not None:
                batch, self._outbox = self._outbox, []
                message = flow_control_pb2.AdmitDecisions(decisions=batch)
                if update is not None:
                    message.credits.grant = update.grant
                    message.credits.revoke = update.revoke
                    message.credits.priority = update.priority
                await self._context.write(message)
            if self._closing:
                return

    async def close(self) -> None:
        """The client's side ended (or the call broke): answer what is decided (the client may
        still read), stop the waiters and the writer, release every ticket the stream holds."""
        for waiter in self._waiters.values():
            waiter.cancel()
        self._closing = True
        try:
            await stop_stream_writer(self._writer, self._wake, _FLUSH_SECONDS)
        finally:
            if self._credits is not None:
                self._controller.close_credits(self._credits)
            released = len(self._tickets)
            for ticket in self._tickets.values():
                self._controller.release(ticket)
            self._tickets.clear()
            self._waiters.clear()
        if released:
            logger.info("admit-many stream ended released=%d", released)


def error_to_proto(exc: KvmeshError) -> flow_control_pb2.AdmitError:
    """An entry's error as ``AdmitError``: the gRPC status name and class of ``exc`` from
    kvmesh/errors.py's table (the shape of epp's ``PickError``)."""
    return flow_control_pb2.AdmitError(code=mapping_for(exc).grpc_status, error_class=type(exc).__name__,
                                       message=str(exc))


def _not_held(key: int, kind: str) -> NotFound:
    return NotFound(f"{kind} for ticket {key}, which this stream does not hold (never enqueued, rejected, "
                    "refused, or already completed or released)")


_SAMPLED_LAST_HEX = frozenset("13579bdfBDF")
"""Last hex digit of the W3C trace flags when the sampled bit (0x01) is set."""


def _admit_span(entry: flow_control_pb2.AdmitEntry) -> trace.Span | None:
    """A ``flow_control.Admit`` span, child of the request's trace, when the caller's context is sampled
    (the sampled bit of the W3C trace flags); None otherwise (nothing is built per admission)."""
    flags = entry.traceparent[-2:]
    if len(entry.traceparent) < 55 or flags[-1:] not in _SAMPLED_LAST_HEX:
        return None
    carrier = {"traceparent": entry.traceparent}
    if entry.tracestate:
        carrier["tracestate"] = entry.tracestate
    span = _tracer.start_span("flow_control.Admit", context=propagate.extract(carrier), kind=trace.SpanKind.SERVER)
    return span if span.is_recording() else None
