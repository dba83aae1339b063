"""File-backed tiers: local NVMe (``DiskTier``) and a shared filesystem such as Lustre (``SharedFsTier``).

On-disk layout (both tiers): one file per value under ``<root>/<hh>/<sha256(key)>`` where ``hh`` is
the first two hex digits (256 fan-out directories keep directories small). A file is

    header  struct "<8sIQQI": magic b"KVMSV002", key length (u32), value length (u64),
            XXH3-64 of the value (u64), meta length (u32)
    key     UTF-8 bytes (checked on read, so a hash collision is a miss, never another key's bytes)
    meta    opaque bytes the store keeps with the value: the engine's vLLM ``BlockStored`` of the
            block (msgpack), so a restarted instance can publish what it rescanned (may be empty)
    value   the bytes

Files of the first layout (``KVMSV001``: ``"<8sIQI"``, CRC-32, no meta) are still read.

**Atomic writes.** A value is written to ``.<name>.<random>.tmp`` in the same directory and then
``os.replace``-d onto its name, so a reader opens either the old complete file or the new complete
file, never a partial one (POSIX rename is atomic within a filesystem, Lustre included). A reader
that opened a file keeps reading that inode even if a writer replaces or unlinks the name.

**Checksums.** Every read recomputes XXH3-64 (``xxhash``, ~14 GB/s here against CRC-32's 1.6-3 GB/s,
docs/BENCHMARKS.md "kv_store data path") over the value and compares key and lengths; a mismatch (bit rot, a torn write after a crash, a foreign file) is
counted in ``corrupted``, the file is removed and the read is a *miss*: wrong bytes are never
returned.

**fsync policy** (``FsyncPolicy``): ``none`` (default; values are a cache, a crash may lose recent
values and a torn file is caught by its checksum), ``data`` (fsync the file before the rename: a
value that was acknowledged survives a crash), ``all`` (also fsync the directory after the rename,
so the name survives too).

**Capacity.** Value bytes (not headers) count against ``capacity_bytes``; least recently used
values are evicted for a put that needs room, exactly as the CPU tier, but only once the new
value's file is in place (**write first, then evict**): a write that fails (disk full, EIO, a
read-only mount) leaves every victim stored. The filesystem thus briefly holds one value beyond
the budget (keep that much headroom), and with ``keep_victims`` (a tier with a slower tier below)
the victims' files stay until the store ``release``-s them after demoting them (served from
memory meanwhile, see :mod:`services.kv_store.tiers.base`).
Use order is kept in memory and persisted as the file's mtime (touched on every hit), so a
**rescan on restart** (``open`` at construction) serves what was on disk again, in LRU order by
mtime, dropping leftover temp files and anything over the budget; :meth:`FileTier.take_rescanned`
hands the rescanned keys and their meta to the store once (which republishes them as KV events).

**Reads.** A value is read by one ``os.read`` straight into its ``bytes`` (one copy, from the page
cache) after ``posix_fadvise(SEQUENTIAL)`` (the kernel doubles its read-ahead window; ``WILLNEED``
and ``O_DIRECT`` measured slower on this disk, see docs/BENCHMARKS.md), then checksummed.

**Shared namespace** (``SharedFsTier``): many kv_store instances mount the same ``root``. Names
are derived from the key alone (content addressing: KV block keys are hashes of their tokens), so
concurrent writers of one key race only on a rename, and the last complete file wins. Each
instance keeps its own view of the namespace (rescanned at start, extended on every hit), looks a
key up on the filesystem when its view lacks it, and enforces ``capacity_bytes`` over its view;
with N instances the namespace-wide budget is soft (each evicts what it knows; use a filesystem
quota for a hard limit). A read-only mount still serves reads; writes to it raise
TierUnavailable. The root must exist (a missing root is *not* created). An **unmounted**
filesystem usually leaves its mount point behind as an empty local directory, which exists, is a
directory and is writable: values written there fill the local disk and are hidden once the
filesystem mounts over them. Two opt-in guards tell the mounted filesystem from its mount point
(:func:`shared_root_guard`): ``require_mount`` (the root must be a mount point,
``os.path.ismount``: its device differs from its parent's; for a root that *is* the mount) and
``marker`` (a file the operator creates once on the mounted filesystem, e.g. ``.kvmesh-shared``,
must exist in the root; for a subdirectory of the mount, or a bind mount, which ``ismount`` cannot
tell). While a guard fails the tier is unavailable (a degraded mode: nothing is read from or
written to the local directory); a working tier re-checks its guard at most every
:data:`GUARD_RECHECK_S`, so an unmount at run time is noticed and a mount is used without a
restart. Both are off by default (a plain directory, as in tests, is then used as is; the service
logs a WARNING at start when the path is no mount point): the marker is never created by
kvmesh, since creating it on an empty mount point would bless exactly the local directory it
guards against.

Errors: a missing, unreadable or read-only root, or a failed guard, raises
:class:`~services.kv_store.errors.TierUnavailable`; ENOSPC raises
:class:`~services.kv_store.errors.StorageFull`; both leave the index consistent.

All file I/O runs in worker threads (``asyncio.to_thread``); puts and evictions are serialised by
one ``asyncio.Lock`` per tier, reads run concurrently. ``put``, ``evict`` and ``release`` run to
their end when their caller is cancelled (:func:`~services.kv_store.tiers.base.run_to_end`): the
index always matches the files.

**Interrupted moves.** Victims a move down could not finish (its caller failed or was cancelled
mid-cascade) are :meth:`FileTier.reinstate`-d rather than released: their files are still here and
a restart's rescan would serve them, so they return to the index (least recently used first) instead
of being unlinked.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hashlib
import os
import struct
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvmesh.types import Medium
from services.kv_store.errors import StorageFull, TierUnavailable, ValueTooLarge
from services.kv_store.tiers.base import (
    PutResult,
    ReleaseFailed,
    TierStats,
    forget_replaced,
    reinstate_pending,
    run_to_end,
    take_pending,
)

MAGIC = b"KVMSV002"
HEADER = struct.Struct("<8sIQQI")
MAGIC_V1 = b"KVMSV001"
HEADER_V1 = struct.Struct("<8sIQI")
MAX_META_BYTES = 1 << 20
_TMP_SUFFIX = ".tmp"


class FsyncPolicy(enum.StrEnum):
    """When a write is forced to stable storage (see the module docstring)."""

    NONE = "none"
    DATA = "data"
    ALL = "all"


def file_name(key: str) -> str:
    """``sha256(key)`` in hex: the content-addressed file name of ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def checksum(value: bytes | memoryview) -> int:
    """XXH3-64 of ``value``: the per-value checksum of the current layout."""
    return xxhash.xxh3_64_intdigest(value)


def encode_header(key: bytes, value: bytes | memoryview, meta: bytes = b"") -> bytes:
    """The header, key and meta bytes that precede ``value`` in a file."""
    return HEADER.pack(MAGIC, len(key), len(value), checksum(value), len(meta)) + key + meta


class _Head(NamedTuple):
    size: int
    """Bytes of the fixed header (before the key)."""
    key_len: int
    value_len: int
    digest: int
    meta_len: int
    v1: bool
    """The first layout: CRC-32, no meta."""


def _parse_head(head: bytes) -> _Head | None:
    """The fixed header at the start of ``head``; ``None`` when it is not a value file's."""
    if head[:8] == MAGIC and len(head) >= HEADER.size:
        _, key_len, value_len, digest, meta_len = HEADER.unpack_from(head)
        return _Head(HEADER.size, key_len, value_len, digest, meta_len, False)
    if head[:8] == MAGIC_V1 and len(head) >= HEADER_V1.size:
        _, key_len, value_len, crc = HEADER_V1.unpack_from(head)
        return _Head(HEADER_V1.size, key_len, value_len, crc, 0, True)
    return None


class _Corrupt(Exception):
    """A file whose header, key, length or checksum does not match."""


def _read_value(path: Path, key: bytes, touch: bool) -> bytes | None:
    """The verified value in ``path``; ``None`` when absent. Raises _Corrupt.

    ``posix_fadvise(SEQUENTIAL)`` (a doubled read-ahead window), one small read of header, key and
    meta, then one ``os.read`` straight into the value's ``bytes`` (no buffered-reader copy), then
    the checksum over it (XXH3-64 at ~14 GB/s: a few per cent of the read).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        file_size = os.fstat(fd).st_size
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        head = os.read(fd, HEADER.size + len(key))
        parsed = _parse_head(head)
        if parsed is None or parsed.key_len != len(key):
            raise _Corrupt(f"{path}: not a value of this key")
        if parsed.meta_len > MAX_META_BYTES:
            raise _Corrupt(f"{path}: meta of {parsed.meta_len} bytes")
        prefix = parsed.size + parsed.key_len
        if len(head) < prefix:
            head += os.read(fd, prefix - len(head))
        if head[parsed.size : prefix] != key:
            raise _Corrupt(f"{path}: not a value of this key")
        if file_size != prefix + parsed.meta_len + parsed.value_len:
            raise _Corrupt(f"{path}: {file_size} bytes on disk, header says {prefix + parsed.meta_len + parsed.value_len}")
        if len(head) != prefix + parsed.meta_len:
            os.lseek(fd, prefix + parsed.meta_len, os.SEEK_SET)
        value = os.read(fd, parsed.value_len) if parsed.value_len else b""
        while len(value) < parsed.value_len:  # a short read (signals, some network filesystems)
            more = os.read(fd, parsed.value_len - len(value))
            if not more:
                break
            value += more
    finally:
        os.close(fd)
    digest = zlib.crc32(value) if parsed.v1 else checksum(value)
    if len(value) != parsed.value_len or digest != parsed.digest:
        raise _Corrupt(f"{path}: length or checksum mismatch")
    if touch:
        with contextlib.suppress(OSError):  # a read-only mount: LRU order is then this process's alone
            os.utime(path)
    return value


def _read_header(path: Path) -> tuple[str, int, bytes] | None:
    """``(key, value_len, meta)`` from a file's header, or ``None`` when it is not a value file."""
    try:
        with open(path, "rb") as f:
            parsed = _parse_head(f.read(HEADER.size))
            if parsed is None or parsed.meta_len > MAX_META_BYTES:
                return None
            f.seek(parsed.size)
            key = f.read(parsed.key_len).decode()
            meta = f.read(parsed.meta_len)
        if os.path.getsize(path) != parsed.size + parsed.key_len + parsed.meta_len + parsed.value_len:
            return None
        return key, parsed.value_len, meta
    except (OSError, UnicodeDecodeError):
        return None


class FileTier:
    """A :class:`~services.kv_store.tiers.base.StoreTier` of one file per value under ``root``."""

    medium: Medium = Medium.DISK
    name = "disk"
    shared = False

    def __init__(
        self, root: str | os.PathLike[str], capacity_bytes: int, fsync: FsyncPolicy = FsyncPolicy.NONE
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = FsyncPolicy(fsync)
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._corrupted = 0
        self._errors = 0
        self._lock = asyncio.Lock()
        self._available = False
        self._rescanned: list[tuple[str, bytes]] = []
        self._pending: dict[str, bytes] = {}
        """Victims handed out by ``put(keep_victims=True)``, their files kept until released."""
        self._rescan()

    # -- paths and startup ---------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        name = file_name(key)
        return self.root / name[:2] / name

    def _prepare_root(self) -> None:
        """Make sure ``root`` is usable (created for a local disk, required for a shared mount)."""
        self.root.mkdir(parents=True, exist_ok=True)

    def _check_root(self) -> None:
        """Raise TierUnavailable when the root is missing or not writable."""
        if not self._available:
            try:
                self._prepare_root()
            except OSError as exc:
                self._errors += 1
                raise TierUnavailable(f"{self.name} tier root {self.root} is unavailable: {exc}") from exc
            self._available = True

    def _rescan(self) -> None:
        """Rebuild the index from the files under root (LRU order by mtime), dropping temp files."""
        try:
            self._prepare_root()
        except OSError:
            return  # degraded: every operation retries and reports TierUnavailable
        self._available = True
        found: list[tuple[float, str, int, bytes]] = []
        for sub in self.root.iterdir() if self.root.is_dir() else ():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(_TMP_SUFFIX):
                    if not self.shared:  # a shared tmp may be another instance's write in flight
                        _unlink(Path(entry.path))
                    continue
                head = _read_header(Path(entry.path))
                if head is None or file_name(head[0]) != entry.name:
                    continue
                try:
                    mtime = entry.stat().st_mtime
                except OSError:
                    continue
                found.append((mtime, head[0], head[1], head[2]))
        found.sort(key=lambda entry: entry[0])
        meta_of: dict[str, bytes] = {}
        for _, key, size, meta in found:
            self._index[key] = size
            self._used_bytes += size
            meta_of[key] = meta
        while self._used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used_bytes -= size
            _unlink(self.path_of(key))
        self._rescanned = [(key, meta_of[key]) for key in self._index]

    def take_rescanned(self) -> list[tuple[str, bytes]]:
        """``(key, meta)`` of every value the start-up rescan found, least recently used first; once
        (later calls return ``[]``). ``meta`` is what the value was put with (``b""`` for none)."""
        rescanned, self._rescanned = self._rescanned, []
        return rescanned

    # -- the StoreTier verbs ---------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, keep_victims: bool = False, meta: bytes = b"") -> PutResult:
        """Write ``value`` (temp file + rename), then evict: see :class:`StoreTier.put`.

        The victims (least recently used first, until the new value fits ``capacity_bytes``) are
        chosen first but removed only after the new file is in place, so a write that fails (disk
        full, EIO, a read-only mount) raises with every victim still stored and indexed. The
        medium therefore holds one value beyond the budget while the write runs (leave that much
        headroom on the filesystem: a filesystem full to the budget refuses the put with
        StorageFull rather than evicting to make room); with ``keep_victims`` the victims' files
        also stay until :meth:`release` (they are served from memory meanwhile).
        """
        size = len(value)
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"meta of {len(meta)} bytes exceeds {MAX_META_BYTES}")
        if size > self.capacity_bytes:
            raise ValueTooLarge(
                f"value of {size} bytes for key {key!r} exceeds the {self.name} tier's"
                f" capacity_bytes={self.capacity_bytes}"
            )
        async with self._lock:  # waiting for the lock is cancellable; the write then runs to its end
            return await run_to_end(self._put(key, value, keep_victims, meta))

    async def _put(self, key: str, value: bytes, keep_victims: bool, meta: bytes) -> PutResult:
        size = len(value)
        self._check_root()
        need = self._used_bytes - self._index.get(key, 0) + size - self.capacity_bytes
        victims: list[str] = []
        for victim, victim_size in self._index.items():
            if need <= 0:
                break
            if victim != key:
                victims.append(victim)
                need -= victim_size
        try:
            kept = await asyncio.to_thread(self._write, key, value, victims, keep_victims, meta)
        except OSError as exc:
            self._errors += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"{self.name} tier at {self.root} is full: {exc}") from exc
            self._available = False
            raise TierUnavailable(f"{self.name} tier at {self.root} cannot store {key!r}: {exc}") from exc
        # stored: the new file replaced the old value (or a pending victim) of this key
        self._used_bytes -= forget_replaced(self._pending, self._index, key, victims)
        self._evictions += len(victims)
        self._pending.update(kept)
        self._index[key] = size
        self._used_bytes += size
        return PutResult(tuple(victims), tuple(kept))

    def _write(
        self, key: str, value: bytes, victims: list[str], keep_victims: bool, meta: bytes = b""
    ) -> list[tuple[str, bytes]]:
        """Read the victims (``keep_victims``), write the new file, then unlink the victims'
        files unless they were kept (a corrupt one is unlinked and not kept). Raises OSError from
        the write only: nothing is unlinked then."""
        kept: list[tuple[str, bytes]] = []
        drop: list[Path] = []
        for victim in victims:
            path = self.path_of(victim)
            if keep_victims:
                try:
                    data = _read_value(path, victim.encode(), touch=False)
                except _Corrupt:
                    data = None
                    self._corrupted += 1
                except OSError:
                    data = None
                if data is not None:
                    kept.append((victim, data))
                    continue
            drop.append(path)
        path = self.path_of(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, encode_header(key.encode(), value, meta))
                _write_all(fd, value)
                if self.fsync is not FsyncPolicy.NONE:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if self.fsync is FsyncPolicy.ALL:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        for victim_path in drop:  # the value is stored: now the victims go
            _unlink_quietly(victim_path)
        return kept

    async def get(self, key: str) -> bytes | None:
        pending = self._pending.get(key)
        if pending is not None:  # a victim moving down: served from the bytes read for the move
            self._hits += 1
            return pending
        known = key in self._index
        if not known and not self.shared:
            self._misses += 1
            return None
        self._check_root()
        try:
            value = await asyncio.to_thread(_read_value, self.path_of(key), key.encode(), True)
        except _Corrupt:
            self._corrupted += 1
            await self._forget(key, unlink=True)
            self._misses += 1
            return None
        except OSError as exc:
            self._errors += 1
            self._available = False
            raise TierUnavailable(f"{self.name} tier at {self.root} cannot read {key!r}: {exc}") from exc
        if value is None:
            await self._forget(key, unlink=False)
            self._misses += 1
            return None
        self._hits += 1
        if key in self._index:
            self._index.move_to_end(key)
        else:  # another instance's value: adopt it into this instance's view
            self._index[key] = len(value)
            self._used_bytes += len(value)
        return value

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        present = [key in self._index or key in self._pending for key in keys]
        if self.shared and not all(present):
            self._check_root()
            missing = [i for i, found in enumerate(present) if not found]
            exists = await asyncio.to_thread(lambda: [self.path_of(keys[i]).exists() for i in missing])
            for i, found in zip(missing, exists, strict=True):
                present[i] = found
        return present

    async def evict(self, key: str) -> bool:
        async with self._lock:
            return await run_to_end(self._evict(key))

    async def _evict(self, key: str) -> bool:
        self._check_root()
        known = key in self._index or self._pending.pop(key, None) is not None
        path = self.path_of(key)
        try:
            removed = await asyncio.to_thread(_unlink, path)
        except OSError as exc:  # the root went away under us (not a directory any more, unmounted)
            self._errors += 1
            self._available = False
            raise TierUnavailable(f"{self.name} tier at {self.root} cannot evict {key!r}: {exc}") from exc
        size = self._index.pop(key, None)
        if size is not None:
            self._used_bytes -= size
        return known or removed

    async def release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Drop pending victims (see :class:`StoreTier.release`): their files are unlinked.

        Raises:
            ReleaseFailed: unlinking failed (its ``released``: the victims no longer pending).
        """
        async with self._lock:
            return await run_to_end(self._release(victims))

    def reinstate(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Take pending victims back into the index instead of releasing them (a move down that
        was interrupted: their files are still here, see the module docstring), least recently
        used first, over the budget until the next put evicts them again. One flag per victim:
        ``True`` when it was still pending with that value. No I/O."""
        back, taken = reinstate_pending(self._pending, self._index, victims)
        self._used_bytes += taken
        self._evictions -= sum(back)  # handed out, then taken back: not evictions after all
        return back

    async def _release(self, victims: Sequence[tuple[str, bytes]]) -> list[bool]:
        released = take_pending(self._pending, victims)
        paths = [self.path_of(key) for (key, _), gone in zip(victims, released, strict=True) if gone]
        if paths:
            try:
                await asyncio.to_thread(lambda: [_unlink(path) for path in paths])
            except OSError as exc:
                self._errors += 1
                self._available = False
                raise ReleaseFailed(
                    f"{self.name} tier at {self.root} cannot remove victims: {exc}", released
                ) from exc
        return released

    async def _forget(self, key: str, unlink: bool) -> None:
        async with self._lock:
            await run_to_end(self._forget_locked(key, unlink))

    async def _forget_locked(self, key: str, unlink: bool) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used_bytes -= size
        if unlink:
            await asyncio.to_thread(_unlink, self.path_of(key))

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

    def held_keys(self) -> list[str]:
        """Pending victims, then keys of this instance's index (its own and rescanned values), least
        recently used first."""
        return [*self._pending, *self._index]

    lru_order = held_keys


class DiskTier(FileTier):
    """Local NVMe: a directory per kv_store instance (``<path>/<instance_id>``), medium ``DISK``."""

    medium = Medium.DISK
    name = "disk"
    shared = False


GUARD_RECHECK_S = 1.0
"""How often a working shared tier with a guard (``require_mount``, ``marker``) re-checks it, seconds."""


class SharedFsTier(FileTier):
    """A shared filesystem namespace (Lustre-style) that many instances mount, medium ``SHARED``.

    Args:
        root, capacity_bytes, fsync: as :class:`FileTier`.
        require_mount: the root must be a mount point (see the module docstring).
        marker: a file name that must exist in the root (``""``: none).
        clock: monotonic seconds, for :data:`GUARD_RECHECK_S`.
    """

    medium = Medium.SHARED
    name = "sharedfs"
    shared = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        fsync: FsyncPolicy = FsyncPolicy.NONE,
        *,
        require_mount: bool = False,
        marker: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_marker_name(marker)
        self.require_mount = require_mount
        self.marker = marker
        self._clock = clock
        self._guard_due = 0.0
        super().__init__(root, capacity_bytes, fsync)

    def _prepare_root(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(
                errno.ENOENT, "shared filesystem root does not exist (not mounted?)", str(self.root)
            )
        reason = shared_root_guard(self.root, require_mount=self.require_mount, marker=self.marker)
        if reason is not None:
            raise OSError(errno.ENODEV, reason)
        self._guard_due = self._clock() + GUARD_RECHECK_S

    def _check_root(self) -> None:
        if self._available and (self.require_mount or self.marker) and self._clock() >= self._guard_due:
            self._available = False  # re-check the guard below (an unmount at run time)
        super()._check_root()


NOT_A_DIRECTORY = "not a directory"
""":func:`check_tier_root`'s reason for a path that exists and is no directory."""


def check_marker_name(marker: str) -> None:
    """Raises ValueError unless ``marker`` is empty or a plain file name (no ``/``, not ``.``/``..``)."""
    if marker and ("/" in marker or "\0" in marker or marker in (".", "..")):
        raise ValueError(f"the shared marker must be a plain file name in the shared path, got {marker!r}")


def shared_root_guard(root: str | os.PathLike[str], *, require_mount: bool, marker: str) -> str | None:
    """Why the directory ``root`` is not the mounted shared filesystem, or ``None`` (see the module
    docstring): ``require_mount`` and ``root`` is no mount point (``os.path.ismount``), or
    ``marker`` names a file that does not exist in ``root``. No guard set: ``None``."""
    path = Path(root)
    if require_mount and not os.path.ismount(path):
        return (
            "is not a mount point (the shared filesystem is not mounted there; --shared-require-mount)"
        )
    if marker:
        try:
            os.stat(path / marker)
        except OSError:
            return (
                f"has no marker file {marker} (the shared filesystem is not mounted there, or the marker"
                " was never created on it; --shared-marker)"
            )
    return None


def check_tier_root(
    root: str | os.PathLike[str], *, create: bool, require_mount: bool = False, marker: str = ""
) -> str | None:
    """Why ``root`` cannot hold a file tier, or ``None`` when it can (checked at start-up).

    ``root`` must be a directory (``create``: made when missing, its parent must exist; a local
    disk tier) that passes :func:`shared_root_guard` (``require_mount``, ``marker``: a shared
    tier's guards against an unmounted filesystem's empty mount point) and that this process can
    write: a real probe writes ``.kvmesh-probe-<random>.tmp`` in it, renames it and deletes it, as
    every value is written (so a read-only mount, a full filesystem or missing permissions are
    caught, root's bypass of mode bits included). Without a guard an empty mount point passes
    (it exists, is a directory and is writable). No exception: the reason is a short phrase for a
    one-line error (``"not a directory"``).
    """
    path = Path(root)
    if not path.exists():
        if not create:
            return "does not exist (the shared filesystem must be mounted there)"
        try:
            path.mkdir()
        except OSError as exc:
            return f"cannot create the directory: {exc.strerror or exc}"
    if not path.is_dir():
        return NOT_A_DIRECTORY
    guard = shared_root_guard(path, require_mount=require_mount, marker=marker)
    if guard is not None:
        return guard
    probe = path / f".kvmesh-probe-{uuid.uuid4().hex}"
    tmp = probe.with_name(probe.name + _TMP_SUFFIX)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, b"kvmesh write probe")
        finally:
            os.close(fd)
        os.replace(tmp, probe)
        os.unlink(probe)
    except OSError as exc:
        _unlink_quietly(tmp)
        _unlink_quietly(probe)
        return f"not writable (a write probe failed: {exc.strerror or exc})"
    return None


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
