"""Remote gRPC status -> domain error: the error table, with per-call overrides."""

from __future__ import annotations

import grpc
import pytest

from kvmesh import errors
from kvmesh.channels import ERROR_CLASS_TRAILER, to_domain_error


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "error_cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidRequest),
        (grpc.StatusCode.UNAVAILABLE, errors.NoEndpointsAvailable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.Saturated),
        (grpc.StatusCode.INTERNAL, errors.KvmeshError),
    ],
    ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))),
)
def test_table_decides_without_overrides(code: grpc.StatusCode, error_cls: type[errors.KvmeshError]) -> None:
    err = to_domain_error(rpc_error(code, "why"))
    assert type(err) is error_cls and str(err) == "why"


def test_override_wins_and_names_the_remote() -> None:
    overrides = {grpc.StatusCode.UNAVAILABLE: errors.NotReady}
    err = to_domain_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "down"), overrides, remote="flow_control unavailable")
    assert type(err) is errors.NotReady and str(err) == "flow_control unavailable: down"
    other = to_domain_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad"), overrides, remote="flow_control")
    assert type(other) is errors.InvalidRequest and str(other) == "bad"


def answered_error(code: grpc.StatusCode, details: str, error_class: str) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata((ERROR_CLASS_TRAILER, error_class))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=details)


@pytest.mark.parametrize(
    ("code", "named", "expected"),
    [
        # epp's "no endpoint serves model" stays UnknownModel across the hop (the router answers a model it
        # validated a moment ago with 503, not the table's first NOT_FOUND row, a 404: found by the soak)
        (grpc.StatusCode.NOT_FOUND, "UnknownModel", errors.UnknownModel),
        (grpc.StatusCode.NOT_FOUND, "UnknownEndpoint", errors.UnknownEndpoint),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "QueueFull", errors.QueueFull),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "Shed", errors.Shed),
        # a trailer that disagrees with the status, or names no table class, changes nothing
        (grpc.StatusCode.NOT_FOUND, "Saturated", errors.NotFound),
        (grpc.StatusCode.NOT_FOUND, "ValueError", errors.NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest", errors.InvalidRequest),
    ],
    ids=lambda v: getattr(v, "name", getattr(v, "__name__", str(v))),
)
def test_the_remote_names_its_error_class(code: grpc.StatusCode, named: str, expected: type[errors.KvmeshError]) -> None:
    err = to_domain_error(answered_error(code, "why", named))
    assert type(err) is expected and str(err) == "why"
    assert errors.mapping_for(err).grpc_status == code.name  # the status class never changes
