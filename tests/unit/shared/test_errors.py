"""The one error table: every domain error maps to the documented gRPC and HTTP status."""

import pytest

from kvmesh import errors


@pytest.mark.parametrize(
    ("exc", "grpc_status", "http_status"),
    [
        (errors.InvalidRequest("x"), "INVALID_ARGUMENT", 400),
        (errors.NotFound("x"), "NOT_FOUND", 404),
        (errors.UnknownModel("x"), "NOT_FOUND", 404),
        (errors.UnknownEndpoint("x"), "NOT_FOUND", 404),
        (errors.NoEndpointsAvailable("x"), "UNAVAILABLE", 503),
        (errors.NotReady("x"), "UNAVAILABLE", 503),
        (errors.Saturated("x"), "RESOURCE_EXHAUSTED", 429),
        (errors.QueueFull("x"), "RESOURCE_EXHAUSTED", 429),
        (errors.Shed("x"), "RESOURCE_EXHAUSTED", 429),
        (errors.QueueTTLExpired("x"), "DEADLINE_EXCEEDED", 504),
        (errors.LeaseLost("x"), "FAILED_PRECONDITION", 500),
        (RuntimeError("boom"), "INTERNAL", 500),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_mapping(exc: Exception, grpc_status: str, http_status: int) -> None:
    row = errors.mapping_for(exc)
    assert (row.grpc_status, row.http_status) == (grpc_status, http_status)


def test_subclass_inherits_mapping() -> None:
    class KeyMissing(errors.NotFound):
        pass

    assert errors.mapping_for(KeyMissing("k")).grpc_status == "NOT_FOUND"


def test_round_trip_from_grpc() -> None:
    err = errors.from_grpc_status("RESOURCE_EXHAUSTED", "queue full")
    assert isinstance(err, errors.Saturated) and str(err) == "queue full"


@pytest.mark.parametrize("status", sorted(errors.REMOTE_ERRORS))
def test_remote_errors_read_the_table_backwards(status: str) -> None:
    """A remote status becomes the first table class with that status, so it answers the same after a hop."""
    error_cls = errors.REMOTE_ERRORS[status]
    first = next(cls for cls, row in errors.ERROR_TABLE.items() if row.grpc_status == status)
    assert error_cls is first and errors.mapping_for(error_cls("x")).grpc_status == status


def test_deadline_and_unknown_statuses_are_left_to_the_caller() -> None:
    """``DEADLINE_EXCEEDED`` means what the caller says (a per-call override); unmapped statuses are internal."""
    for status in ("DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"):
        err = errors.from_grpc_status(status, "why")
        assert type(err) is errors.KvmeshError and errors.mapping_for(err) is errors.INTERNAL
