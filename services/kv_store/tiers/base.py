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
    """What a ``put`` did: the keys the tier evicted to make room (oldest first).

    ``victims`` holds ``(key, value)`` of the evicted keys that could still be read, in the same
    order, when the put was called with ``keep_victims=True`` (the store demotes them to the next
    tier); empty otherwise.
    """

    evicted: tuple[str, ...] = ()
    victims: tuple[tuple[str, bytes], ...] = ()


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
    name: str = ""
    """The tier's kind (``cpu``, ``disk``, ``sharedfs``, ``mooncake``): two tiers may share a medium."""
    corrupted: int = 0
    """Reads that found a value failing its checksum (served as misses, the value dropped)."""
    errors: int = 0
    """Operations that failed because the medium was unavailable or full."""


class StoreTier(Protocol):
    """One storage medium with a byte budget."""

    medium: Medium
    """Where the values live (``CPU``, ``DISK``, ``SHARED``)."""
    name: str
    """The tier's kind, unique within a store (``cpu``, ``disk``, ``sharedfs``, ``mooncake``)."""
    shared: bool
    """True when other kv_store instances read the same values (shared FS, Mooncake)."""
    capacity_bytes: int
    """Budget for value bytes; ``used_bytes`` never exceeds it."""

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        """Store ``value`` under ``key`` (replacing any old value), evicting as needed.

        With ``keep_victims`` the evicted values are returned in ``PutResult.victims``. ``meta``:
        the store's description of the value (the engine's ``BlockStored``, msgpack); a tier that
        survives a restart keeps it with the value and returns it from ``take_rescanned`` (file
        tiers), the others ignore it.

        Raises:
            services.kv_store.errors.ValueTooLarge: ``len(value) > capacity_bytes`` (nothing changes).
            services.kv_store.errors.TierUnavailable: the medium cannot be reached (disk tiers, Mooncake).
            services.kv_store.errors.StorageFull: the medium ran out of space before the budget did.
        """
        ...

    async def get(self, key: str) -> bytes | None:
        """The value, or ``None`` when absent or corrupt; a hit counts as a use for eviction order.

        Raises:
            services.kv_store.errors.TierUnavailable: the medium cannot be reached.
        """
        ...

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in order; does not count as a use."""
        ...

    async def evict(self, key: str) -> bool:
        """Drop ``key``; ``True`` when it was present (an explicit delete, not counted in ``evictions``)."""
        ...

    def held_keys(self) -> list[str]:
        """The keys this instance's view of the tier holds, least recently used first (no I/O: a
        shared tier lists what this instance wrote or read, not what other instances put)."""
        ...

    def stats(self) -> TierStats:
        """A consistent snapshot of the tier's counters."""
        ...
