"""The Mooncake distributed store tier: values in a Mooncake cluster that many kv_store instances share.

The client is Mooncake's own (``mooncake.store.MooncakeDistributedStore`` from the
``mooncake-transfer-engine-non-cuda`` wheel, 0.3.13.post1), set up by ``app.py`` against a
``mooncake_master`` and passed in here; this core only uses the methods in
:class:`MooncakeClient` (the names and return conventions of Mooncake's Python binding: ``put_parts``
returns 0 or a negative error code, ``get`` returns ``b""`` for a missing key, ``batch_is_exist``
1/0/-1 per key, ``remove`` 0 or negative; ``force=True`` skips the read lease, ``upsert_parts`` inserts
or replaces). Its calls block, so they run in worker threads.

**Framing.** Mooncake cannot store an empty value and has no checksum, so each value is stored
as ``struct "<4sIQ"`` (magic ``b"KVMC"``, CRC-32 of the value, value length) followed by the
value, written with ``upsert_parts`` (no join copy, replaces an old value). A read whose frame or checksum does not match
is a miss counted in ``corrupted``, and the object is removed.

**Keys.** ``namespace + key``: instances configured with the same namespace on one cluster share
values (an instance that never wrote a key still finds it); tests use a fresh namespace each.

**Capacity.** The cluster's memory is Mooncake's to manage (its master evicts at its high
watermark); ``capacity_bytes`` is this instance's budget in it: the instance keeps an LRU view of
the keys it wrote or read and removes the least recently used when a put needs room, exactly as
the other tiers. A key Mooncake evicted on its own is a miss and leaves the view.

**Failures.** A negative code or an exception (master down, transfer error) raises
:class:`~services.kv_store.errors.TierUnavailable` and is counted in ``errors``; the store treats
it as a degraded tier.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvmesh.types import Medium
from services.kv_store.errors import TierUnavailable, ValueTooLarge
from services.kv_store.tiers.base import PutResult, TierStats

FRAME = struct.Struct("<4sIQ")
MAGIC = b"KVMC"


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

    def __init__(self, client: MooncakeClient, capacity_bytes: int, namespace: str = "kvmesh/") -> None:
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
        async with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used_bytes -= old
            victims: list[str] = []
            while self._used_bytes + size > self.capacity_bytes:
                victim, victim_size = self._index.popitem(last=False)
                self._used_bytes -= victim_size
                victims.append(victim)
            self._evictions += len(victims)
            kept: list[tuple[str, bytes]] = []
            for victim in victims:
                if keep_victims:
                    data = await self._read(victim)
                    if data is not None:
                        kept.append((victim, data))
                await self._call("remove", self._client.remove, self._key(victim), True)
            frame = FRAME.pack(MAGIC, zlib.crc32(value), size)
            code = await self._call("put", self._client.upsert_parts, self._key(key), frame, value)
            self._check("put", code)
            self._index[key] = size
            self._used_bytes += size
            return PutResult(tuple(victims), tuple(kept))

    async def _read(self, key: str) -> bytes | None:
        raw = await self._call("get", self._client.get, self._key(key))
        if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) == 0:
            return None
        view = memoryview(raw)
        if len(view) < FRAME.size:
            self._corrupted += 1
            return None
        magic, crc, size = FRAME.unpack(view[: FRAME.size])
        body = view[FRAME.size :]
        if magic != MAGIC or size != len(body) or zlib.crc32(body) != crc:
            self._corrupted += 1
            await self._call("remove", self._client.remove, self._key(key), True)
            return None
        return bytes(body)

    async def get(self, key: str) -> bytes | None:
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
        present = [key in self._index for key in keys]
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
            known = key in self._index
            if known:
                self._used_bytes -= self._index.pop(key)
            codes = await self._call("batch_is_exist", self._client.batch_is_exist, [self._key(key)])
            exists = isinstance(codes, list) and codes[0] == 1
            if exists:
                await self._call("remove", self._client.remove, self._key(key), True)
            return known or exists

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
        )
