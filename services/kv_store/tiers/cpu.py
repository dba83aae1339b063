"""The in-memory (CPU RAM) tier: a byte budget with least-recently-used eviction.

An ``OrderedDict`` keeps keys from least to most recently used: ``get`` and ``put`` move a key
to the end, eviction pops from the front until the new value fits (O(1) per key). Sizes are
``len(value)``; Python object overhead is not counted against the budget. The same structure
backs vLLM's CPU offloading LRU (``vllm/v1/kv_offload/lru_manager.py``) and LMCache's
``LocalCPUBackend``.

Victims handed out by ``put(keep_victims=True)`` wait in a side table (*pending*, still served
by ``get`` and ``contains``) until the store releases them after demoting them (see
:mod:`services.kv_store.tiers.base`); their bytes stay in memory, outside the budget, meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.types import Medium
from services.kv_store.errors import ValueTooLarge
from services.kv_store.tiers.base import PutResult, TierStats, take_pending

TYPE_NAME = "cpu"


class CpuTier:
    """:class:`~services.kv_store.tiers.base.StoreTier` in process memory with LRU eviction."""

    medium = Medium.CPU
    name = TYPE_NAME
    shared = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._pending: dict[str, bytes] = {}
        """Victims handed out and not yet released (still readable)."""
        self._used_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        size = len(value)
        if size > self.capacity_bytes:
            raise ValueTooLarge(
                f"value of {size} bytes for key {key!r} exceeds the {self.medium.value} tier's"
                f" capacity_bytes={self.capacity_bytes}"
            )
        self._pending.pop(key, None)  # a pending victim of this key is replaced
        old = self._values.pop(key, None)
        if old is not None:
            self._used_bytes -= len(old)
        evicted: list[str] = []
        victims: list[tuple[str, bytes]] = []
        while self._used_bytes + size > self.capacity_bytes:
            victim, victim_value = self._values.popitem(last=False)
            self._used_bytes -= len(victim_value)
            evicted.append(victim)
            if keep_victims:
                victims.append((victim, victim_value))
                self._pending[victim] = victim_value
        self._evictions += len(evicted)
        self._values[key] = value
        self._used_bytes += size
        return PutResult(tuple(evicted), tuple(victims))

    async def get(self, key: str) -> bytes | None:
        value = self.get_nowait(key)
        if value is None:
            self._misses += 1
        return value

    def get_nowait(self, key: str) -> bytes | None:
        """``get`` without suspending: the value (LRU-touched, a hit counted) or ``None`` (no miss
        counted: the caller falls back to :meth:`get`)."""
        value = self._values.get(key)
        if value is None:
            value = self._pending.get(key)  # moving down: still served here
            if value is not None:
                self._hits += 1
            return value
        self._hits += 1
        self._values.move_to_end(key)
        return value

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._values or key in self._pending for key in keys]

    async def evict(self, key: str) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return self._pending.pop(key, None) is not None
        self._used_bytes -= len(value)
        return True

    async def release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        return take_pending(self._pending, victims)

    def stats(self) -> TierStats:
        return TierStats(
            medium=self.medium,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self._used_bytes,
            keys=len(self._values),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            name=self.name,
            pending=len(self._pending),
        )

    def held_keys(self) -> list[str]:
        """Pending victims, then keys from least to most recently used."""
        return [*self._pending, *self._values]

    lru_order = held_keys
