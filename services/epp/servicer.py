"""gRPC EndpointPicker servicer: protobuf in, :class:`Scheduler` call, protobuf out. Nothing clever.

Endpoints go out through :func:`kvmesh.wire.endpoint_to_proto`, the one translator. Domain errors
propagate to the shared interceptor, which maps them (InvalidRequest -> INVALID_ARGUMENT,
UnknownModel -> NOT_FOUND, NoEndpointsAvailable -> UNAVAILABLE, anything else -> INTERNAL).
"""

from __future__ import annotations

from typing import Any

import grpc
import msgspec
from opentelemetry import trace

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.errors import InvalidRequest
from kvmesh.hashing import KeyScope
from kvmesh.wire import completion_from_proto, endpoint_to_proto
from services.epp.framework.interfaces import ChatMessage, SchedulingRequest
from services.epp.metrics import record_completions
from services.epp.scheduler import Scheduler

SERVICE_NAME = epp_pb2.DESCRIPTOR.services_by_name["EndpointPicker"].full_name
"""The full gRPC service name (``kvmesh.epp.v1.EndpointPicker``): health checks and reflection use it."""


def _render_fields(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        fields = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"render_json is not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise InvalidRequest("render_json must be a JSON object")
    return fields


def request_from_proto(request: epp_pb2.PickRequest) -> SchedulingRequest:
    """Raises: InvalidRequest when ``render_json`` is not a JSON object."""
    return SchedulingRequest(
        model=request.model,
        request_id=request.request_id,
        token_ids=tuple(request.prompt_token_ids),
        prompt=request.prompt,
        messages=tuple(ChatMessage(m.role, m.content) for m in request.messages),
        exclude_endpoint_ids=frozenset(request.exclude_endpoint_ids),
        scope=KeyScope(request.lora_name or None, request.cache_salt or None),
        render=_render_fields(request.render_json),
    )


class EndpointPickerServicer(epp_pb2_grpc.EndpointPickerServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def Pick(self, request: epp_pb2.PickRequest, context: grpc.aio.ServicerContext) -> epp_pb2.PickResponse:
        decision = await self._scheduler.pick(request_from_proto(request))
        _annotate_pick(request, decision)
        return epp_pb2.PickResponse(
            target=endpoint_to_proto(decision.target),
            fallbacks=[endpoint_to_proto(e) for e in decision.fallbacks],
            breakdown=[
                epp_pb2.ScoreBreakdown(endpoint_id=s.id, scores=s.scores, total=s.total) for s in decision.breakdown
            ],
            profile=decision.profile,
            prompt_tokens=decision.prompt_tokens,
        )

    async def ListEndpoints(
        self, request: epp_pb2.ListEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> epp_pb2.ListEndpointsResponse:
        return epp_pb2.ListEndpointsResponse(
            endpoints=[
                epp_pb2.EndpointState(
                    endpoint=endpoint_to_proto(c.endpoint),
                    num_requests_waiting=c.metrics.num_requests_waiting,
                    num_requests_running=c.metrics.num_requests_running,
                    kv_cache_usage_perc=c.metrics.kv_cache_usage_perc,
                    metrics_age_seconds=-1.0 if c.metrics.age_seconds is None else c.metrics.age_seconds,
                )
                for c in self._scheduler.datastore.candidates()
            ]
        )

    async def Completed(
        self, request: epp_pb2.CompletedBatch, context: grpc.aio.ServicerContext
    ) -> epp_pb2.CompletedReply:
        """The router's completions: each frees its pick's load in the datastore at once (no I/O)."""
        datastore = self._scheduler.datastore
        matched = 0
        for message in request.requests:
            done = completion_from_proto(message)
            matched += datastore.note_completed(done.request_id, done.endpoint_id)
        record_completions(matched, len(request.requests) - matched)
        return epp_pb2.CompletedReply(matched=matched)

    async def GetPickerInfo(
        self, request: epp_pb2.GetPickerInfoRequest, context: grpc.aio.ServicerContext
    ) -> epp_pb2.PickerInfo:
        """Whether the configured profile reads the prompt, and the profile names (fixed for the process)."""
        profile = self._scheduler.profile
        return epp_pb2.PickerInfo(needs_prompt=profile.needs_prompt, profiles=[profile.name])


def _annotate_pick(request: epp_pb2.PickRequest, decision: object) -> None:
    """Trace attributes on the Pick span (issue 11): request id, model, the chosen endpoint, its
    fallbacks, the profile, the prompt's token count and each scorer's score for the winner."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    target = getattr(decision, "target", None)
    span.set_attribute("kvmesh.request_id", request.request_id)
    span.set_attribute("kvmesh.model", request.model)
    span.set_attribute("kvmesh.endpoint", str(getattr(target, "id", "")))
    span.set_attribute("kvmesh.fallbacks", [str(e.id) for e in getattr(decision, "fallbacks", ())])
    span.set_attribute("kvmesh.profile", str(getattr(decision, "profile", "")))
    span.set_attribute("kvmesh.prompt_tokens", int(getattr(decision, "prompt_tokens", 0) or 0))
    for row in getattr(decision, "breakdown", ()):
        if target is not None and row.id == target.id:
            for scorer, value in row.scores.items():
                span.set_attribute(f"kvmesh.score.{scorer}", float(value))
            span.set_attribute("kvmesh.score.total", float(row.total))
