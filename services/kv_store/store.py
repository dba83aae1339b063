"""The KV store core: validation, placement and lookup across an ordered list of tiers.

Tiers are ordered fastest first. Today there is one (CPU), so the policy is simple:

* ``put`` validates the key and writes to the first tier (placement); any older copy in a
  slower tier is dropped so a key lives in exactly one tier.
* ``get`` searches the tiers in order and returns the first hit with its medium
  (promotion to a faster tier comes with the second tier).
* ``contains`` is true when any tier holds the key; ``delete`` drops it everywhere.

Keys are non-empty strings of at most :data:`MAX_KEY_BYTES` UTF-8 bytes. No grpc here: the
servicer assembles chunk streams into ``bytes`` and maps the domain errors raised below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.errors import InvalidRequest
from kvmesh.types import Medium
from services.kv_store.errors import KeyNotFound, ValueTooLarge
from services.kv_store.tiers.base import StoreTier, TierStats

MAX_KEY_BYTES = 4096
MAX_CONTAINS_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class StoredValue:
    """A value read from the store and the medium it came from."""

    value: bytes
    medium: Medium


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """Where a put landed and how many keys were evicted to make room."""

    medium: Medium
    evicted: int


def validate_key(key: str) -> None:
    """Raises :class:`InvalidRequest` for an empty or over-long key."""
    if not key:
        raise InvalidRequest("key must not be empty")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidRequest(f"key of {len(key.encode())} bytes exceeds {MAX_KEY_BYTES} bytes")


class BlockStore:
    """Values by key over ordered tiers (see the module docstring)."""

    def __init__(self, tiers: Sequence[StoreTier]) -> None:
        if not tiers:
            raise ValueError("a BlockStore needs at least one tier")
        self.tiers = list(tiers)

    @property
    def max_value_bytes(self) -> int:
        """The largest value a put accepts (the placement tier's capacity)."""
        return self.tiers[0].capacity_bytes

    def check_value_size(self, key: str, total_bytes: int) -> None:
        """Validate a put before its bytes arrive.

        Raises:
            InvalidRequest: bad key. ValueTooLarge: ``total_bytes > max_value_bytes``.
        """
        validate_key(key)
        if total_bytes > self.max_value_bytes:
            raise ValueTooLarge(
                f"value of {total_bytes} bytes for key {key!r} exceeds the store's capacity of"
                f" {self.max_value_bytes} bytes"
            )

    async def put(self, key: str, value: bytes) -> PutOutcome:
        """Store ``value`` in the first tier. Raises InvalidRequest / ValueTooLarge."""
        self.check_value_size(key, len(value))
        target = self.tiers[0]
        result = await target.put(key, value)
        for tier in self.tiers[1:]:
            await tier.evict(key)
        return PutOutcome(target.medium, len(result.evicted))

    async def get(self, key: str) -> StoredValue:
        """The value from the fastest tier holding it.

        Raises:
            InvalidRequest: bad key. KeyNotFound: no tier holds ``key``.
        """
        validate_key(key)
        for tier in self.tiers:
            value = await tier.get(key)
            if value is not None:
                return StoredValue(value, tier.medium)
        raise KeyNotFound(f"key {key!r} not found")

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in order (empty keys are simply absent)."""
        if len(keys) > MAX_CONTAINS_KEYS:
            raise InvalidRequest(f"{len(keys)} keys in one Contains call, at most {MAX_CONTAINS_KEYS}")
        present = [False] * len(keys)
        for tier in self.tiers:
            for i, found in enumerate(await tier.contains(keys)):
                present[i] = present[i] or found
        return present

    async def delete(self, key: str) -> bool:
        """Drop ``key`` from every tier; ``True`` when any held it. Raises InvalidRequest."""
        validate_key(key)
        deleted = False
        for tier in self.tiers:
            deleted = await tier.evict(key) or deleted
        return deleted

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]
