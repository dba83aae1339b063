"""The one translator between kvmesh's nouns (:mod:`kvmesh.types`) and their protobuf messages.

Every servicer and client converts :class:`~kvmesh.types.Endpoint`, :class:`~kvmesh.types.Medium`
and :class:`~kvmesh.types.EndpointRole` through these functions, so a service core never sees a
wire type and every service agrees on defaults (``kvmesh.common.v1``, ``proto/kvmesh/common/v1``).
"""

from __future__ import annotations

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh.types import DEFAULT_BLOCK_SIZE_TOKENS, Endpoint, EndpointId, EndpointRole, Medium

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
