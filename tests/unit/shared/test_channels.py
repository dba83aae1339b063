"""Remote gRPC status -> domain error: the error table, with per-call overrides."""

from __future__ import annotations

import grpc
import pytest

from kvmesh import errors
from kvmesh.channels import to_domain_error


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
