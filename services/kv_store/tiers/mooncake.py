"""The Mooncake distributed store tier: values in a Mooncake cluster that many kv_store instances share.

The client is Mooncake's own (``mooncake.store.MooncakeDistributedStore`` from the
``mooncake-transfer-engine-non-cuda`` wheel, 0.3.13.post1), set up by ``app.py`` against a
``mooncake_master`` and passed in here; this core only uses the methods in
:class:`MooncakeClient` (the names and return conventions of Mooncake's Python binding: ``put_parts``
returns 0 or a negative error code, ``get`` returns ``b""`` for a missing key, ``batch_is_exist``
1/0/-1 per key, ``remove`` 0 or negative; ``force=True`` skips the read lease, ``upsert_parts`` inserts
or replaces). Its calls block, so they run in worker threads.

**Framing.** Mooncake cannot store an empty value and has no checksum, so each value is stored
as ``struct "<4sIQI"`` (magic ``b"KVM2"``, CRC-32 of description + value, value length, description
length), then the store's description of the value (the engine's ``BlockStored``, msgpack; empty
for none), then the value, written with ``upsert_parts`` (no join copy, replaces an old value).
Frames of the previous layout (``b"KVMC"``, ``"<4sIQ"``: CRC-32 and length of the value, no
description) are still read. A read whose frame or checksum does not match is a miss counted in
``corrupted``, and the object is removed.

**Rescan** (:meth:`MooncakeTier.rescan`, awaited once at start-up): Mooncake's Python client cannot
list objects, so the caller passes ``list_keys``, a blocking call returning the cluster's keys (the
master's HTTP ``/get_all_keys``, one key per line, in ``app.py``). The keys in this tier's namespace
that are not yet in its view are read (frame checked), adopted into the view while the budget
allows, and returned once by :meth:`take_rescanned` with their descriptions, so the store publishes
them again as after a disk rescan. The namespace is shared: an instance republishes every described
value it can reach there, which is what a shared medium means to kv_indexer.

**Keys.** ``namespace + key``: instances configured with the same namespace on one cluster share
values (an instance that never wrote a key still finds it); tests use a fresh namespace each.

**Capacity.** The cluster's memory is Mooncake's to manage (its master evicts at its high
watermark); ``capacity_bytes`` is this instance's budget in it: the instance keeps an LRU view of
the keys it wrote or read and removes the least recently used when a put needs room, exactly as
the other tiers, after the new value is stored (a failed put removes nothing); with
``keep_victims`` their objects stay until :meth:`MooncakeTier.release` (served from the bytes read
for the move meanwhile). A key Mooncake evicted on its own is a miss and leaves the view.

**Cancellation.** ``put``, ``evict`` and ``release`` run to their end when their caller is
cancelled (:func:`~services.kv_store.tiers.base.run_to_end`): the view always matches the objects
written and removed. Victims of an interrupted move down are :meth:`MooncakeTier.reinstate`-d (their
objects are still in the cluster, where a restart's rescan would find them), not removed.

**Failures.** A negative code or an exception (master down, transfer error) raises
:class:`~services.kv_store.errors.TierUnavailable` and is counted in ``errors``; the store treats
it as a degraded tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from kvmesh.types import Medium
from services.kv_store.errors import TierUnavailable, ValueTooLarge
from services.kv_store.tiers.base import (
    PutResult,
    ReleaseFailed,
    TierStats,
    forget_replaced,
    reinstate_pending,
    run_to_end,
    take_pending,
)

FRAME = struct.Struct("<4sIQ")
MAGIC = b"KVMC"
"""The previous frame (no description), still read."""
FRAME2 = struct.Struct("<4sIQI")
MAGIC2 = b"KVM2"


class MooncakeClient(Protocol):
    """The subset of ``mooncake.store.MooncakeDistributedStore`` this tier uses."""

    def upsert_parts(self, key: str, *parts: bytes) -> int: ...

    def get(self, key: str) -> bytes: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def remove(self, key: str, force: bool = False) -> int: ...


class MooncakeTier:
    """:class:`~services.kv_store.tiers.base.StoreTier` over a Mooncake cluster (medium ``SHARED``)."""

    medium = Medium.SHARED
    name = "mooncake"
    shared = True

    def __init__(
        self,
        client: MooncakeClient,
        capacity_bytes: int,
        namespace: str = "kvmesh/",
        list_keys: Callable[[], list[str]] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self._client = client
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._corrupted = 0
        self._errors = 0
        self._lock = asyncio.Lock()
        self._list_keys = list_keys
        self._rescanned: list[tuple[str, bytes]] = []
        self._pending: dict[str, bytes] = {}
        """Victims handed out by ``put(keep_victims=True)``, their objects kept until released."""

    def _key(self, key: str) -> str:
        return self.namespace + key

    async def _call(self, what: str, fn: object, *args: object) -> object:
        try:
            return await asyncio.to_thread(fn, *args)  # type: ignore[arg-type]
        except Exception as exc:  # the binding raises RuntimeError and friends when the cluster is gone
            self._errors += 1
            raise TierUnavailable(f"mooncake {what} failed: {exc}") from exc

    def _check(self, what: str, code: object) -> None:
        if isinstance(code, int) and code < 0:
            self._errors += 1
            raise TierUnavailable(f"mooncake {what} failed with error code {code}")

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        size = len(value)
        if size > self.capacity_bytes:
            raise ValueTooLarge(
                f"value of {size} bytes for key {key!r} exceeds the mooncake tier's capacity_bytes={self.capacity_bytes}"
            )
        async with self._lock:  # waiting for the lock is cancellable; the write then runs to its end
            return await run_to_end(self._put(key, value, keep_victims, meta))

    async def _put(self, key: str, value: bytes, keep_victims: bool, meta: bytes) -> PutResult:
        size = len(value)
        need = self._used_bytes - self._index.get(key, 0) + size - self.capacity_bytes
        victims: list[str] = []
        for victim, victim_size in self._index.items():
            if need <= 0:
                break
            if victim != key:
                victims.append(victim)
                need -= victim_size
        kept: list[tuple[str, bytes]] = []
        if keep_victims:
            for victim in victims:
                data = await self._read(victim)
                if data is not None:
                    kept.append((victim, data))
        frame = FRAME2.pack(MAGIC2, zlib.crc32(value, zlib.crc32(meta)), size, len(meta))
        parts = (frame, meta, value) if meta else (frame, value)
        code = await self._call("put", self._client.upsert_parts, self._key(key), *parts)
        self._check("put", code)  # raises before any victim is touched: they all stay
        self._used_bytes -= forget_replaced(self._pending, self._index, key, victims)  # the upsert replaced them
        self._evictions += len(victims)
        self._pending.update(kept)
        held = {victim for victim, _ in kept}
        for victim in victims:
            if victim not in held:
                with contextlib.suppress(TierUnavailable):  # counted in errors; the value is stored
                    await self._call("remove", self._client.remove, self._key(victim), True)
        self._index[key] = size
        self._used_bytes += size
        return PutResult(tuple(victims), tuple(kept))

    async def _read(self, key: str) -> bytes | None:
        framed = await self._read_framed(key)
        return None if framed is None else framed[0]

    async def _read_framed(self, key: str) -> tuple[bytes, bytes] | None:
        """``(value, description)`` of ``key``, or None when absent or corrupt (then removed)."""
        raw = await self._call("get", self._client.get, self._key(key))
        if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) == 0:
            return None
        view = memoryview(raw)
        parsed = _unframe(view)
        if parsed is None:
            self._corrupted += 1
            await self._call("remove", self._client.remove, self._key(key), True)
            return None
        value, meta = parsed
        return bytes(value), bytes(meta)

    async def rescan(self) -> int:
        """Adopt the described and undescribed values of this namespace that the cluster holds
        (see the module docstring); the number adopted. No ``list_keys``: 0.

        Raises:
            services.kv_store.errors.TierUnavailable: the listing or a read failed (master down).
        """
        if self._list_keys is None:
            return 0
        listed = await self._call("list", self._list_keys)
        assert isinstance(listed, list)
        adopted = 0
        async with self._lock:
            for name in listed:
                if not name.startswith(self.namespace):
                    continue
                key = name[len(self.namespace) :]
                if not key or key in self._index:
                    continue
                framed = await self._read_framed(key)
                if framed is None:
                    continue
                value, meta = framed
                if self._used_bytes + len(value) > self.capacity_bytes:
                    break  # the budget is full: the rest stay in the cluster, served when read
                self._index[key] = len(value)
                self._used_bytes += len(value)
                self._rescanned.append((key, meta))
                adopted += 1
        return adopted

    def take_rescanned(self) -> list[tuple[str, bytes]]:
        """``(key, description)`` of every value :meth:`rescan` adopted; once (later calls return ``[]``)."""
        rescanned, self._rescanned = self._rescanned, []
        return rescanned

    async def get(self, key: str) -> bytes | None:
        pending = self._pending.get(key)
        if pending is not None:  # a victim moving down: served from the bytes read for the move
            self._hits += 1
            return pending
        value = await self._read(key)
        if value is None:
            self._misses += 1
            size = self._index.pop(key, None)
            if size is not None:
                self._used_bytes -= size
            return None
        self._hits += 1
        if key in self._index:
            self._index.move_to_end(key)
        else:  # written by another instance: adopt it into this instance's view
            self._index[key] = len(value)
            self._used_bytes += len(value)
        return value

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        present = [key in self._index or key in self._pending for key in keys]
        missing = [i for i, found in enumerate(present) if not found]
        if missing:
            codes = await self._call(
                "batch_is_exist", self._client.batch_is_exist, [self._key(keys[i]) for i in missing]
            )
            assert isinstance(codes, list)
            for i, code in zip(missing, codes, strict=True):
                self._check("batch_is_exist", code)
                present[i] = code == 1
        return present

    async def evict(self, key: str) -> bool:
        async with self._lock:
            return await run_to_end(self._evict(key))

    async def _evict(self, key: str) -> bool:
        known = key in self._index or self._pending.pop(key, None) is not None
        size = self._index.pop(key, None)
        if size is not None:
            self._used_bytes -= size
        codes = await self._call("batch_is_exist", self._client.batch_is_exist, [self._key(key)])
        exists = isinstance(codes, list) and codes[0] == 1
        if exists:
            await self._call("remove", self._client.remove, self._key(key), True)
        return known or exists

    async def release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Drop pending victims (see :class:`StoreTier.release`): their objects are removed.

        Raises:
            ReleaseFailed: a removal failed (its ``released``: the victims no longer pending).
        """
        async with self._lock:
            return await run_to_end(self._release(victims))

    def reinstate(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Take pending victims back into the view instead of releasing them (an interrupted move
        down; see :meth:`services.kv_store.tiers.files.FileTier.reinstate`). No I/O."""
        back, taken = reinstate_pending(self._pending, self._index, victims)
        self._used_bytes += taken
        self._evictions -= sum(back)  # handed out, then taken back: not evictions after all
        return back

    async def _release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        released = take_pending(self._pending, victims)
        try:
            for (key, _), gone in zip(victims, released, strict=True):
                if gone:
                    # a negative code: the object is already gone (Mooncake evicted it), as in put
                    await self._call("remove", self._client.remove, self._key(key), True)
        except TierUnavailable as exc:
            raise ReleaseFailed(str(exc), released) from exc
        return released

    def held_keys(self) -> list[str]:
        """Pending victims, then keys of this instance's LRU view (what it wrote, read or rescanned),
        least recently used first."""
        return [*self._pending, *self._index]

    def stats(self) -> TierStats:
        return TierStats(
            medium=self.medium,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self._used_bytes,
            keys=len(self._index),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            name=self.name,
            corrupted=self._corrupted,
            errors=self._errors,
            pending=len(self._pending),
        )


def _unframe(view: memoryview) -> tuple[memoryview, memoryview] | None:
    """``(value, description)`` of a stored object, or None when its frame or checksum does not match."""
    if len(view) >= FRAME2.size and view[:4] == MAGIC2:
        _magic, crc, size, meta_size = FRAME2.unpack(view[: FRAME2.size])
        meta = view[FRAME2.size : FRAME2.size + meta_size]
        body = view[FRAME2.size + meta_size :]
        if len(meta) != meta_size or size != len(body) or zlib.crc32(body, zlib.crc32(meta)) != crc:
            return None
        return body, meta
    if len(view) >= FRAME.size and view[:4] == MAGIC:
        _magic, crc, size = FRAME.unpack(view[: FRAME.size])
        body = view[FRAME.size :]
        if size != len(body) or zlib.crc32(body) != crc:
            return None
        return body, view[:0]
    return None
