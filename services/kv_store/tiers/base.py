"""The ``StoreTier`` contract: one medium, one byte budget, four verbs.

A tier stores whole values (``bytes``) under string keys within ``capacity_bytes`` and evicts
on its own when a ``put`` needs room (CPU: least recently used). The store above it decides
placement and promotion across tiers. Every implementation passes
``tests/contract/test_store_tiers.py``.

The verbs are async so tiers backed by disks, shared filesystems or remote stores (NVMe,
Lustre, Mooncake, LMCache) fit the same contract; the in-memory tier never suspends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.types import Medium


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a ``put`` did: the keys the tier evicted to make room (oldest first)."""

    evicted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's counters: bytes are value bytes (keys and bookkeeping not counted)."""

    medium: Medium
    capacity_bytes: int
    used_bytes: int
    keys: int
    hits: int
    misses: int
    evictions: int


class StoreTier(Protocol):
    """One storage medium with a byte budget."""

    medium: Medium
    """Where the values live (``CPU``, ``DISK``, ``SHARED``)."""
    capacity_bytes: int
    """Budget for value bytes; ``used_bytes`` never exceeds it."""

    async def put(self, key: str, value: bytes) -> PutResult:
        """Store ``value`` under ``key`` (replacing any old value), evicting as needed.

        Raises:
            services.kv_store.errors.ValueTooLarge: ``len(value) > capacity_bytes`` (nothing changes).
        """
        ...

    async def get(self, key: str) -> bytes | None:
        """The value, or ``None`` when absent; a hit counts as a use for eviction order."""
        ...

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in order; does not count as a use."""
        ...

    async def evict(self, key: str) -> bool:
        """Drop ``key``; ``True`` when it was present (an explicit delete, not counted in ``evictions``)."""
        ...

    def stats(self) -> TierStats:
        """A consistent snapshot of the tier's counters."""
        ...
