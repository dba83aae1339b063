"""The one translator between kvmesh's nouns (:mod:`kvmesh.types`) and their protobuf messages.

Every servicer and client converts :class:`~kvmesh.types.Endpoint`, :class:`~kvmesh.types.Medium`
and :class:`~kvmesh.types.EndpointRole` through these functions, so a service core never sees a
wire type and every service agrees on defaults (``kvmesh.common.v1``, ``proto/kvmesh/common/v1``).
"""

from __future__ import annotations

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2
from kvmesh.types import (
    DEFAULT_BLOCK_SIZE_TOKENS,
    CompletionOutcome,
    Endpoint,
    EndpointId,
    EndpointRole,
    Medium,
    RequestCompletion,
)

_MEDIUM_TO_PB: dict[Medium, common_pb2.Medium] = {
    Medium.GPU: common_pb2.MEDIUM_GPU,
    Medium.CPU: common_pb2.MEDIUM_CPU,
    Medium.DISK: common_pb2.MEDIUM_DISK,
    Medium.SHARED: common_pb2.MEDIUM_SHARED,
}
_MEDIUM_FROM_PB: dict[int, Medium] = {v: k for k, v in _MEDIUM_TO_PB.items()}


def medium_to_proto(medium: Medium) -> common_pb2.Medium:
    """``Medium.CPU`` -> ``common_pb2.MEDIUM_CPU`` (an int of the ``kvmesh.common.v1.Medium`` enum)."""
    return _MEDIUM_TO_PB[medium]


def medium_from_proto(value: int) -> Medium:
    """The inverse of :func:`medium_to_proto`; ``MEDIUM_UNSPECIFIED`` (0) means GPU, vLLM's default.

    Raises:
        ValueError: for an enum number kvmesh does not know.
    """
    if value == common_pb2.MEDIUM_UNSPECIFIED:
        return Medium.GPU
    try:
        return _MEDIUM_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown medium {value}") from None


def role_from_proto(value: str) -> EndpointRole:
    """A role string off the wire; ``""`` and unknown roles mean ``both`` (an older or foreign peer)."""
    try:
        return EndpointRole(value or EndpointRole.BOTH)
    except ValueError:
        return EndpointRole.BOTH


def endpoint_to_proto(endpoint: Endpoint) -> common_pb2.Endpoint:
    """An :class:`Endpoint` as ``kvmesh.common.v1.Endpoint``."""
    return common_pb2.Endpoint(
        id=endpoint.id,
        url=endpoint.url,
        model=endpoint.model,
        block_size_tokens=endpoint.block_size_tokens,
        events_endpoint=endpoint.events_endpoint,
        role=str(endpoint.role),
        labels=endpoint.labels,
    )


def endpoint_from_proto(message: common_pb2.Endpoint) -> Endpoint:
    """The inverse of :func:`endpoint_to_proto`: trailing ``/`` of the URL dropped, 0 block size -> default."""
    return Endpoint(
        id=EndpointId(message.id),
        url=message.url.rstrip("/"),
        model=message.model,
        block_size_tokens=message.block_size_tokens or DEFAULT_BLOCK_SIZE_TOKENS,
        events_endpoint=message.events_endpoint,
        role=role_from_proto(message.role),
        labels=dict(message.labels),
    )


_OUTCOME_TO_PB: dict[CompletionOutcome, int] = {
    CompletionOutcome.SUCCESS: epp_pb2.COMPLETION_OUTCOME_SUCCESS,
    CompletionOutcome.ERROR: epp_pb2.COMPLETION_OUTCOME_ERROR,
    CompletionOutcome.CANCELLED: epp_pb2.COMPLETION_OUTCOME_CANCELLED,
    CompletionOutcome.NOT_DISPATCHED: epp_pb2.COMPLETION_OUTCOME_NOT_DISPATCHED,
}
_OUTCOME_FROM_PB: dict[int, CompletionOutcome] = {v: k for k, v in _OUTCOME_TO_PB.items()}


def completion_to_proto(completion: RequestCompletion) -> epp_pb2.CompletedRequest:
    """:class:`~kvmesh.types.RequestCompletion` -> ``kvmesh.epp.v1.CompletedRequest`` (counts clamped to uint32)."""
    return epp_pb2.CompletedRequest(
        request_id=completion.request_id,
        endpoint_id=completion.endpoint_id,
        prompt_tokens=min(max(0, completion.prompt_tokens), 0xFFFFFFFF),
        cached_tokens=min(max(0, completion.cached_tokens), 0xFFFFFFFF),
        outcome=_OUTCOME_TO_PB[completion.outcome],  # type: ignore[arg-type]
        completion_tokens=min(max(0, completion.completion_tokens), 0xFFFFFFFF),
    )


def completion_from_proto(message: epp_pb2.CompletedRequest) -> RequestCompletion:
    """The inverse of :func:`completion_to_proto`; an unspecified or unknown outcome reads as ``ERROR``
    (the request ended; how is unknown)."""
    return RequestCompletion(
        request_id=message.request_id,
        endpoint_id=message.endpoint_id,
        prompt_tokens=message.prompt_tokens,
        cached_tokens=message.cached_tokens,
        outcome=_OUTCOME_FROM_PB.get(message.outcome, CompletionOutcome.ERROR),
        completion_tokens=message.completion_tokens,
    )
