"""The ``StoreTier`` contract: one medium, one byte budget, four verbs.

A tier stores whole values (``bytes``) under string keys within ``capacity_bytes`` and evicts
on its own when a ``put`` needs room (CPU: least recently used). The store above it decides
placement and promotion across tiers. Every implementation passes
``tests/contract/test_store_tiers.py``.

**Moves down are two-phase.** A ``put(..., keep_victims=True)`` (the store's put into any tier
but the last) hands its victims out without dropping them: they leave the budget
(``used_bytes``), the LRU order and ``keys`` at once, but stay readable (``get`` and ``contains``
find them; ``stats().pending`` counts them) until the caller ``release``-s them, once a slower
tier stored them (or none could: then it is an eviction). A value moving down is thus never in
no tier. While victims are pending the medium holds them beyond ``capacity_bytes`` (the CPU tier's
memory, a file tier's files, Mooncake's objects): at most the victims of the puts whose moves are
in flight.

**Write first, then evict.** A tier whose write can fail (files, Mooncake) stores the new value
before it removes or hands out any victim; a put that raises evicted nothing.

**Cancellation-safe.** A tier whose verbs run blocking I/O in worker threads (files, Mooncake)
runs each mutating verb (``put``, ``evict``, ``release``) to its end (:func:`run_to_end`): a
cancelled caller (a gRPC deadline on the put whose cascade demotes here) gets ``CancelledError``
only once the thread finished and the tier's index matches what it did on the medium (no index
entry for an unlinked file, no file outside the budget).

The verbs are async so tiers backed by disks, shared filesystems or remote stores (NVMe,
Lustre, Mooncake, LMCache) fit the same contract; the in-memory tier never suspends.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvmesh.types import Medium
from services.kv_store.errors import TierUnavailable

T = TypeVar("T")


class ReleaseFailed(TierUnavailable):
    """``release`` failed on the medium (a file or object may be left behind); ``released`` holds
    the flags :meth:`StoreTier.release` would have returned: which victims were still pending
    (and are no longer), so the caller marks only those removed."""

    def __init__(self, message: str, released: Sequence[bool]) -> None:
        super().__init__(message)
        self.released = list(released)


async def run_to_end(operation: Coroutine[Any, Any, T]) -> T:
    """Await ``operation`` in its own task; a cancellation of the caller waits for the task to end
    (its bookkeeping done) and is then re-raised. Returns or raises what ``operation`` does.

    Raises:
        asyncio.CancelledError: the caller was cancelled (after ``operation`` ended).
    """
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                continue
        if not task.cancelled():
            task.exception()  # retrieved: the caller sees the cancellation, not this
        raise


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a ``put`` did: the keys the tier evicted to make room (oldest first).

    ``victims`` holds ``(key, value)`` of the evicted keys that could still be read, in the same
    order, when the put was called with ``keep_victims=True``: they are *pending* in the tier
    (still readable) until :meth:`StoreTier.release` (the store demotes them to the next tier,
    then releases them); empty otherwise (the evicted keys are gone when ``put`` returns).
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
    pending: int = 0
    """Victims handed out by ``put(keep_victims=True)`` and still readable here until released
    (not counted in ``keys`` or ``used_bytes``)."""


def take_pending(pending: dict[str, bytes], victims: Sequence[tuple[str, bytes]]) -> list[bool]:
    """Drop from ``pending`` each victim still pending with that value (the first half of every tier's
    ``release``). One flag per victim: ``True`` when it was, ``False`` when a put replaced it or an
    evict removed it meanwhile (left as it is)."""
    released: list[bool] = []
    for key, value in victims:
        held = pending.get(key)
        gone = held is not None and (held is value or held == value)
        if gone:
            del pending[key]
        released.append(gone)
    return released


def forget_replaced(pending: dict[str, bytes], index: OrderedDict[str, int], key: str,
                    victims: Sequence[str]) -> int:
    """A tier's bookkeeping once ``key``'s new value is written: drop the key's old entry (or a pending
    victim of that key: the write replaced it) and the victims' entries from the LRU ``index`` (key ->
    size; a victim a concurrent get already dropped is skipped). Returns the bytes those entries held,
    for the caller to take off its used bytes. No I/O."""
    pending.pop(key, None)
    freed = index.pop(key, 0)
    for victim in victims:
        if victim in index:
            freed += index.pop(victim)
    return freed


def reinstate_pending(
    pending: dict[str, bytes], index: OrderedDict[str, int], victims: Sequence[tuple[str, bytes]]
) -> tuple[list[bool], int]:
    """Move victims still pending with that value back into a tier's LRU ``index`` (key -> size, least
    recently used first), oldest first, instead of releasing them (an interrupted move down whose
    bytes are still on the medium). Returns one flag per victim and the bytes taken back; the caller
    adds those to its used bytes and takes the victims back out of its eviction count. No I/O."""
    back: list[bool] = []
    taken = 0
    for key, value in reversed(victims):
        held = pending.get(key)
        ok = held is not None and (held is value or held == value) and key not in index
        if ok:
            del pending[key]
            index[key] = len(value)
            index.move_to_end(key, last=False)
            taken += len(value)
        back.append(ok)
    return back[::-1], taken


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

        The new value is stored before any victim is removed or handed out (a put that raises
        evicted nothing). With ``keep_victims`` the evicted values are returned in
        ``PutResult.victims`` and stay readable here until :meth:`release`; without it they are
        removed once the new value is stored. A put of a pending victim's key replaces it (its
        release is then a no-op). ``meta``:
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
        """Drop ``key`` (a pending victim too); ``True`` when it was present (an explicit delete,
        not counted in ``evictions``)."""
        ...

    async def release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Drop victims a ``put(keep_victims=True)`` handed out: a slower tier now holds them (or
        none could take them). One flag per victim: ``True`` when it was still pending with that
        value and is now gone; ``False`` when a put replaced it or an evict removed it meanwhile
        (nothing is dropped).

        Raises:
            services.kv_store.errors.TierUnavailable: removing the victims from the medium failed
                (they are no longer pending; a file or object may be left behind).
        """
        ...

    def held_keys(self) -> list[str]:
        """The keys this instance's view of the tier holds, pending victims first, then least
        recently used first (no I/O: a shared tier lists what this instance wrote or read, not what
        other instances put)."""
        ...

    def stats(self) -> TierStats:
        """A consistent snapshot of the tier's counters."""
        ...
