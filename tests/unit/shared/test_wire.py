"""kvmesh.wire: every noun round-trips through its protobuf message (kvmesh.common.v1)."""

from __future__ import annotations

import pytest

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh.types import Endpoint, EndpointId, EndpointRole, Medium
from kvmesh.wire import (
    endpoint_from_proto,
    endpoint_to_proto,
    medium_from_proto,
    medium_to_proto,
    role_from_proto,
)


@pytest.mark.parametrize("medium", list(Medium), ids=str)
def test_medium_round_trips(medium: Medium) -> None:
    assert medium_from_proto(medium_to_proto(medium)) is medium
    assert common_pb2.Medium.Name(medium_to_proto(medium)) == f"MEDIUM_{medium.value}"


def test_medium_unspecified_is_gpu_and_unknown_raises() -> None:
    assert medium_from_proto(common_pb2.MEDIUM_UNSPECIFIED) is Medium.GPU
    with pytest.raises(ValueError, match="unknown medium 99"):
        medium_from_proto(99)


@pytest.mark.parametrize(("wire", "role"), [("", EndpointRole.BOTH), ("prefill", EndpointRole.PREFILL),
                                            ("decode", EndpointRole.DECODE), ("gpu?", EndpointRole.BOTH)])
def test_role_from_proto(wire: str, role: EndpointRole) -> None:
    assert role_from_proto(wire) is role


def test_endpoint_round_trips_and_defaults() -> None:
    ep = Endpoint(id=EndpointId("h:1"), url="http://h:1", model="m", block_size_tokens=16,
                  events_endpoint="tcp://h:2", role=EndpointRole.DECODE, labels={"engine": "vllm"})
    back = endpoint_from_proto(endpoint_to_proto(ep))
    assert back == ep and back.labels == ep.labels
    bare = endpoint_from_proto(common_pb2.Endpoint(id="h:1", url="http://h:1/", model="m"))
    assert bare.url == "http://h:1" and bare.block_size_tokens == 64 and bare.role is EndpointRole.BOTH
