"""FlowControl gRPC servicer: protobuf <-> :class:`FlowController`, and the stream's lifetime.

The admission stream (``proto/kvmesh/flow_control/v1/flow_control.proto``): the router sends
``AdmitRequest{enqueue}``, receives one ``AdmitResponse`` (``DISPATCHED`` or a rejection with a
reason), may send ``AdmitRequest{complete}``, then closes its side. The slot is released in a
``finally`` when the handler ends for any reason: the client's half-close, a cancel (the handler
task is cancelled), a protocol error or server shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh.errors import InvalidRequest
from services.flow_control.controller import FlowController
from services.flow_control.types import DEFAULT_FLOW_ID, AdmissionRequest, QueueOutcome

logger = logging.getLogger(__name__)

SERVICE_NAME = flow_control_pb2.DESCRIPTOR.services_by_name["FlowControl"].full_name

_OUTCOME_TO_PROTO = {
    QueueOutcome.DISPATCHED: flow_control_pb2.QUEUE_OUTCOME_DISPATCHED,
    QueueOutcome.REJECTED_CAPACITY: flow_control_pb2.QUEUE_OUTCOME_REJECTED_CAPACITY,
    QueueOutcome.EVICTED_TTL: flow_control_pb2.QUEUE_OUTCOME_EVICTED_TTL,
    QueueOutcome.SHED: flow_control_pb2.QUEUE_OUTCOME_SHED,
    QueueOutcome.REJECTED_OTHER: flow_control_pb2.QUEUE_OUTCOME_REJECTED_OTHER,
}


def admission_request(enqueue: flow_control_pb2.Enqueue) -> AdmissionRequest:
    """Convert an ``Enqueue`` message (an empty flow_id becomes ``"default"``)."""
    return AdmissionRequest(
        request_id=enqueue.request_id,
        flow_id=enqueue.flow_id or DEFAULT_FLOW_ID,
        priority=enqueue.priority,
        prompt_tokens=enqueue.prompt_tokens,
        max_tokens=enqueue.max_tokens,
        model=enqueue.model,
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
            yield flow_control_pb2.AdmitResponse(
                outcome=_OUTCOME_TO_PROTO[decision.outcome],
                reason=decision.reason,
                queue_seconds=decision.queue_seconds,
            )
            if decision.outcome is not QueueOutcome.DISPATCHED:
                return
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "complete":
                    done = message.complete
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
        return flow_control_pb2.StatsResponse(
            in_flight=stats.in_flight,
            queued=stats.queued,
            max_in_flight=stats.max_in_flight,
            dispatched_total=stats.dispatched_total,
            rejected_total=stats.rejected_total,
        )
