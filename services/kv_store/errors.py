"""kv_store's domain errors.

``KeyNotFound`` is a stopgap: ``kvmesh.errors`` has no generic not-found error yet, and
:func:`kvmesh.errors.mapping_for` walks the MRO, so subclassing ``UnknownEndpoint`` maps it to
``NOT_FOUND`` (404). Replace the base with ``kvmesh.errors.NotFound`` once the lead adds it.
"""

from __future__ import annotations

from kvmesh.errors import InvalidRequest, UnknownEndpoint


class KeyNotFound(UnknownEndpoint):
    """No tier holds the requested key (gRPC ``NOT_FOUND``)."""


class ValueTooLarge(InvalidRequest):
    """A value larger than the capacity of the tier it must go to (gRPC ``INVALID_ARGUMENT``)."""
