"""The router's ``PickerClient`` keeps each endpoint of epp's answers converted once (issue 10, wave 10):
the same ``Endpoint`` as :func:`kvmesh.wire.endpoint_from_proto` reads, for every field, a changed
endpoint (a re-registration with a new URL, labels or role) read afresh, the cache bounded."""

from __future__ import annotations

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh.types import Endpoint, EndpointId, EndpointRole
from kvmesh.wire import endpoint_from_proto, endpoint_to_proto
from services.router import clients
from services.router.clients import PickerClient


def _proto(**changes: object) -> common_pb2.Endpoint:
    fields: dict[str, object] = {"id": EndpointId("127.0.0.1:9000"), "url": "http://127.0.0.1:9000/", "model": "m",
                                 "block_size_tokens": 0, "events_endpoint": "tcp://127.0.0.1:5557",
                                 "role": EndpointRole.BOTH, "labels": {"engine": "simulator"}}
    fields.update(changes)
    return endpoint_to_proto(Endpoint(**fields))  # type: ignore[arg-type]


def test_an_endpoint_reads_as_endpoint_from_proto_and_is_converted_once() -> None:
    client = PickerClient("127.0.0.1:1", timeout_seconds=1.0)
    message = _proto()
    first = client._endpoint(message)
    assert first == endpoint_from_proto(message) and first.labels == {"engine": "simulator"}
    assert first.url == "http://127.0.0.1:9000" and first.block_size_tokens == endpoint_from_proto(message).block_size_tokens
    assert client._endpoint(common_pb2.Endpoint.FromString(message.SerializeToString())) is first


def test_a_changed_endpoint_is_read_afresh() -> None:
    client = PickerClient("127.0.0.1:1", timeout_seconds=1.0)
    base = client._endpoint(_proto())
    for changed in (_proto(url="http://127.0.0.1:9001"), _proto(labels={"engine": "vllm"}),
                    _proto(role=EndpointRole.DECODE), _proto(block_size_tokens=32), _proto(model="other")):
        endpoint, expected = client._endpoint(changed), endpoint_from_proto(changed)
        assert endpoint == expected and endpoint.labels == expected.labels  # (labels: compare=False)
        assert endpoint is not base and (endpoint != base or endpoint.labels != base.labels)
    assert client._endpoint(_proto()) is base


def test_the_cache_is_bounded() -> None:
    client = PickerClient("127.0.0.1:1", timeout_seconds=1.0)
    for i in range(clients._ENDPOINT_CACHE_MAX + 10):
        message = _proto(id=EndpointId(f"127.0.0.1:{10000 + i}"), url=f"http://127.0.0.1:{10000 + i}")
        assert client._endpoint(message) == endpoint_from_proto(message)
    assert len(client._endpoints) <= clients._ENDPOINT_CACHE_MAX
