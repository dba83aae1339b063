"""kv_store's domain errors (mapped to gRPC status by the shared table in :mod:`kvmesh.errors`)."""

from __future__ import annotations

from kvmesh.errors import InvalidRequest, NotFound


class KeyNotFound(NotFound):
    """No tier holds the requested key (gRPC ``NOT_FOUND``)."""


class ValueTooLarge(InvalidRequest):
    """A value larger than the capacity of the tier it must go to (gRPC ``INVALID_ARGUMENT``)."""
