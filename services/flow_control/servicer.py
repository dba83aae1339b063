"""FlowControl gRPC servicer: protobuf <-> :class:`FlowController`, and the stream's lifetime.

The admission stream (``proto/kvmesh/flow_control/v1/flow_control.proto``): the router sends
``AdmitRequest{enqueue}``, receives one ``AdmitResponse`` (``DISPATCHED`` or a rejection with a
reason and a retry hint), may send ``AdmitRequest{complete}`` (the tokens actually used: fairness
accounting), then closes its side. The slot is released in a ``finally`` when the handler ends
for any reason: the client's half-close, a cancel (the handler task is cancelled), a protocol
error or server shutdown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.errors import InvalidRequest
from services.flow_control.controller import FlowController
from services.flow_control.types import (
    DEFAULT_FLOW_ID,
    MAX_FLOW_ID_CHARS,
    AdmissionRequest,
    FlowQuota,
    QueueOutcome,
    ServedTokens,
)

logger = logging.getLogger(__name__)

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
        try:
            decision = await ticket.wait()
            _annotate_admit(first.enqueue, decision)
            yield flow_control_pb2.AdmitResponse(
                outcome=_OUTCOME_TO_PROTO[decision.outcome],
                reason=decision.reason,
                queue_seconds=decision.queue_seconds,
                retry_after_seconds=decision.retry_after_seconds,
            )
            if decision.outcome is not QueueOutcome.DISPATCHED:
                return
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "complete":
                    done = message.complete
                    self._controller.complete(ticket, ServedTokens(done.prompt_tokens, done.completion_tokens))
                    logger.debug(
                        "complete request_id=%s success=%s prompt_tokens=%d completion_tokens=%d e2e_seconds=%.3f",
                        ticket.request.request_id, done.success, done.prompt_tokens, done.completion_tokens,
                        done.e2e_seconds,
                    )
                else:
                    raise InvalidRequest(f"unexpected Admit message after dispatch: {kind or 'an empty message'}")
        finally:
            self._controller.release(ticket)

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
        )


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
