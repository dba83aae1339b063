"""kv_store's domain errors (mapped to gRPC status by the shared table in :mod:`kvmesh.errors`)."""

from __future__ import annotations

from kvmesh.errors import InvalidRequest, NotFound, NotReady, Saturated


class KeyNotFound(NotFound):
    """No tier holds the requested key (gRPC ``NOT_FOUND``)."""


class ValueTooLarge(InvalidRequest):
    """A value larger than the capacity of the tier it must go to (gRPC ``INVALID_ARGUMENT``)."""


class TierUnavailable(NotReady):
    """A tier's medium cannot be reached: a missing or read-only shared path, Mooncake down (``UNAVAILABLE``).

    The store treats it as a degraded tier (a miss, a metric) unless it is the only place a value can go.
    """


class StorageFull(Saturated):
    """The medium ran out of space before the tier's byte budget did (ENOSPC; ``RESOURCE_EXHAUSTED``)."""
