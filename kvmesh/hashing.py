"""Block hashing: vLLM's ``sha256_cbor`` block hashes and kvmesh's own block keys.

Both chain over *full* blocks of ``block_size`` tokens; a trailing partial block has no hash.

vLLM (``--prefix-caching-hash-algo sha256_cbor``; ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``, checked against vLLM 0.32.0 recordings in
``shared/data/vllm-0.32-cpu``)::

    NONE = sha256(cbor(("vllm-none-hash"), canonical))
    h_i  = sha256(cbor((h_{i-1} or NONE, tuple(tokens[i*B:(i+1)*B]), extra_keys_i), canonical))

``extra_keys_i`` is ``None`` without LoRA, multimodal input or cache salt. KV events carry the
digest's low 64 bits as a uint64 (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default) or
the whole 32-byte digest; :func:`external_hash_to_int` maps both to the uint64 form.

kvmesh's block keys (:func:`block_keys`) are its own: XXH3-64 (the ``xxhash`` package, xxHash
0.8) over the block's token ids as little-endian uint32, seeded with the parent key (plus, for a
block with content extras such as a multimodal item, their canonical bytes). Dynamo's KV router keys
blocks the same way (``xxh3_64_with_seed`` over the tokens' bytes, chained). They need no agreement
with any engine's hash seed, so the index works with every engine and hash algorithm; engine hashes
are mapped to these keys when a ``BlockStored`` event arrives with its token ids. XXH3 is not
collision resistant against a crafted prompt: the worst such a collision does here is make a pick
believe a prefix is cached (the engine's own hashes still decide what it reuses).

Speed: one C call per block over a zero-copy view of one buffer, ~0.15 µs per 64-token block,
plus ~6 ns per token to turn a Python list into that buffer (none for ``bytes``, ``array('I')`` or a
numpy ``uint32`` array). :class:`PrefixKeyCache` remembers recent prompts so one that extends a
cached prompt hashes only its new blocks (one ``memcmp`` finds the shared prefix);
:class:`GrowingTokenIds` (a growing chat's ids, shared base plus tail) carries its keys with it, so
its grown version hashes only its new blocks with no ``memcmp`` and no copy of the history.

**Scopes.** A LoRA adapter and a ``cache_salt`` change what a cached block *is* (vLLM 0.32 puts
``("lora", name, path)`` in every block's extra keys and ``("cache_salt", salt)`` in the first
block's, ``vllm/v1/core/kv_cache_utils.py`` ``generate_block_hash_extra_keys``; SGLang 0.5.23
seeds its hash chain with them, ``sglang/srt/mem_cache/utils.py`` ``storage_namespace_seed``). In
kvmesh a :class:`KeyScope` ``(lora_name, cache_salt)`` gives a chain its root key
(:meth:`KeyScope.root_key`: 0 for the default scope, so unscoped keys are unchanged); every key
chains from it, so the same tokens under another adapter or salt never share a key. The request
side (``Score``) and the event side (``BlockStored``'s ``lora_name``/``lora_id``, ``extra_keys``
and SGLang's ``cache_salt``, :func:`kvmesh.kv_events.stored_key_scope`) build the same scope.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, overload

import cbor2
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_NATIVE_U32 = sys.byteorder == "little" and array("I").itemsize == 4

_NONE_HASH: bytes = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def sha256_cbor_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes | None = None,
    extra_keys: Sequence[object | None] | None = None,
) -> list[bytes]:
    """vLLM's ``sha256_cbor`` digests (32 bytes each) for the full blocks of ``token_ids``.

    Args:
        token_ids: the tokens exactly as the engine saw them (BOS included).
        block_size: tokens per block (> 0).
        parent: digest of the block before ``token_ids[0]`` (None: start of the prompt).
        extra_keys: per-block extra keys (None: no LoRA / multimodal / salt).

    Raises:
        ValueError: when ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    digests: list[bytes] = []
    prev = parent if parent is not None else _NONE_HASH
    for i in range(len(token_ids) // block_size):
        block = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        extra = None if extra_keys is None else extra_keys[i]
        prev = hashlib.sha256(cbor2.dumps((prev, block, extra), canonical=True)).digest()
        digests.append(prev)
    return digests


def external_hash_to_int(block_hash: int | bytes) -> int:
    """An event's block hash as uint64: ints unchanged, digests by their last 8 bytes (big-endian)."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFFFFFFFFFFFFFF
    return int.from_bytes(bytes(block_hash)[-8:], "big")


_SCOPE_TAG = b"kvmesh-key-scope-v1"


@dataclass(frozen=True, slots=True)
class KeyScope:
    """The namespace a prompt's blocks are cached under: LoRA adapter name and ``cache_salt``.

    ``KeyScope()`` (both None) is the default scope; an empty string counts as None (vLLM ignores
    an empty salt).
    """

    lora_name: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.lora_name == "":
            object.__setattr__(self, "lora_name", None)
        if self.cache_salt == "":
            object.__setattr__(self, "cache_salt", None)

    @property
    def is_default(self) -> bool:
        return self.lora_name is None and self.cache_salt is None

    def root_key(self) -> int:
        """The parent key of a prompt's first block: 0 for the default scope, else BLAKE2b-64 over
        a tag and each part with a presence byte and a length prefix (``("a", "bc")`` and
        ``("ab", "c")`` differ), never 0."""
        if self.is_default:
            return 0
        digest = hashlib.blake2b(_SCOPE_TAG, digest_size=8)
        for part in (self.lora_name, self.cache_salt):
            if part is None:
                digest.update(b"\x00")
                continue
            encoded = part.encode("utf-8")
            digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
        return int.from_bytes(digest.digest(), "little") or 1


DEFAULT_SCOPE = KeyScope()


TokenIds = Sequence[int] | bytes | bytearray | memoryview | Any
"""Token ids: a sequence of ints, an ``array('I')``, a numpy integer array, or their little-endian
uint32 bytes (``bytes``/``bytearray``/``memoryview``, 4 bytes per token)."""


def token_bytes(token_ids: TokenIds, limit: int | None = None) -> bytes:
    """``token_ids[:limit]`` as little-endian uint32 bytes (4 per token; zero-copy when already so).

    Raises:
        OverflowError: a token id outside uint32.
        ValueError: a bytes-like input whose length is not a multiple of 4.
    """
    if isinstance(token_ids, bytes | bytearray | memoryview):
        raw = bytes(token_ids) if not isinstance(token_ids, bytes) else token_ids
        if len(raw) % 4:
            raise ValueError(f"token bytes must be uint32 little-endian (4 per token), got {len(raw)} bytes")
        return raw if limit is None or limit * 4 >= len(raw) else raw[: limit * 4]
    if isinstance(token_ids, GrowingTokenIds):
        raw = token_ids.tobytes()
        return raw if limit is None or limit * 4 >= len(raw) else raw[: limit * 4]
    if isinstance(token_ids, array) and token_ids.typecode == "I" and _NATIVE_U32:
        return token_ids.tobytes() if limit is None or limit >= len(token_ids) else token_ids[:limit].tobytes()
    if hasattr(token_ids, "dtype"):  # numpy: checked cast, no Python ints
        arr: Any = token_ids if limit is None else token_ids[:limit]
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise OverflowError("token id outside uint32")
        return bytes(arr.astype("<u4", copy=False).tobytes())
    if _NATIVE_U32:
        converted = array("I", token_ids)  # the whole list, then a cheap truncation (no list slice)
        if limit is not None and limit < len(converted):
            del converted[limit:]
        return converted.tobytes()
    if limit is not None:  # pragma: no cover
        token_ids = token_ids[:limit]
    import numpy as np  # big-endian host: numpy does the byte order  # pragma: no cover

    return np.asarray(token_ids, dtype="<u4").tobytes()  # pragma: no cover


def _chain(raw: bytes, width: int, start: int, stop: int, prev: int, out: list[int],
           content_extras: Sequence[bytes | None] | None = None) -> None:
    """Append the keys of blocks ``start..stop-1`` of ``raw`` (``width`` bytes each) to ``out``."""
    view = memoryview(raw)
    append = out.append
    if not content_extras:
        for offset in range(start * width, stop * width, width):
            prev = _xxh3(view[offset : offset + width], prev)
            append(prev)
        return
    n_extras = len(content_extras)
    for i in range(start, stop):
        extra = content_extras[i] if i < n_extras else None
        block = view[i * width : (i + 1) * width]
        prev = _xxh3(block if extra is None else bytes(block) + b"\xffextra" + extra, prev)
        append(prev)


def list_block_keys(token_ids: Sequence[int], block_size: int, parent_key: int = 0) -> list[int]:
    """:func:`block_keys` of a list of ints whose length is a multiple of ``block_size``, with the
    least per-call work (the ingest path: one ``BlockStored`` per call, no content extras).

    Same keys as ``block_keys(token_ids, block_size, parent_key)``; the ids go into one
    ``array('I')``, hashed as it is when it is one block, else as ``bytes`` slices of it (a bytes
    slice is cheaper to make and to hash than a memoryview slice).

    Raises:
        ValueError: when ``block_size`` is not positive.
        OverflowError: a token id outside uint32.
        TypeError: a token id that is not an int.
    """
    if not _NATIVE_U32 or block_size <= 0:
        return block_keys(token_ids, block_size, parent_key)
    ids = array("I", token_ids)
    prev = parent_key & 0xFFFFFFFFFFFFFFFF
    if len(ids) == block_size:  # one block (a decode step's event): no copy, no slice
        return [_xxh3(ids, prev)]
    raw = ids.tobytes()
    width = block_size * 4
    keys: list[int] = []
    append = keys.append
    for offset in range(0, len(raw) - width + 1, width):
        prev = _xxh3(raw[offset : offset + width], prev)
        append(prev)
    return keys


def block_keys(
    token_ids: TokenIds,
    block_size: int,
    parent_key: int = 0,
    content_extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """kvmesh's chained 64-bit keys for the full blocks of ``token_ids``.

    ``key_i = XXH3_64(uint32le(tokens of block i) [+ b"\\xffextra" + extra_i], seed=key_{i-1})``
    with ``key_{-1} = parent_key``. Key ``i`` depends on every token of blocks ``0..i`` (and on
    ``parent_key``), so equal keys mean equal prefixes. ``parent_key=0`` starts a prompt in the
    default scope; a :meth:`KeyScope.root_key` starts one in that scope.

    Args:
        token_ids: see :data:`TokenIds`; a trailing partial block has no key.
        content_extras: per block, canonical bytes of what else the block's content depends on
            (a multimodal item and offset, a prompt-embeddings digest: :func:`canonical_extra`),
            None where nothing; shorter than the blocks means None for the rest.

    Raises:
        ValueError: when ``block_size`` is not positive.
        OverflowError: a token id outside uint32.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = (len(token_ids) // (4 if isinstance(token_ids, bytes | bytearray | memoryview) else 1)) // block_size
    if n == 0:
        return []
    raw = token_bytes(token_ids) if type(token_ids) is bytes else token_bytes(token_ids, n * block_size)
    keys: list[int] = []
    _chain(raw, block_size * 4, 0, n, parent_key & 0xFFFFFFFFFFFFFFFF, keys, content_extras)
    return keys


_FLAT_TAIL = 16384
"""Bytes a :class:`GrowingTokenIds` tail may reach before a splice flattens it into a new base."""
_MEMO_SPACES = 4
"""Key spaces (block size, parent key) whose keys one :class:`GrowingTokenIds` memoises."""


class GrowingTokenIds(Sequence[int]):
    """Token ids as little-endian uint32 bytes in two parts, ``base[:4 * keep] + tail``, with their block
    keys memoised: a read-only ``Sequence[int]`` equal to the same ids as a list.

    A chat's prompt grows by a turn per call, replacing its last few ids (the generation prompt) and
    appending the turn's. :meth:`spliced` (``self[:keep] + ids``) shares ``base`` (the part after the
    cut ignored) and copies only the tail (flattened into a new base once it passes :data:`_FLAT_TAIL`
    bytes, or when less than half the base would be used: an early edit), so a 33k-token chat does not
    copy its 131 KB of ids per call.
    :meth:`block_keys` memoises the keys per (block size, parent key); a splice carries the keys of
    the blocks wholly before the cut, so the grown prompt hashes only its new blocks, without
    comparing any bytes (its first ``keep`` ids are the same bytes by construction).
    :class:`PrefixKeyCache` reads these keys (its first call for a key space goes through the cache,
    so sessions sharing a prefix still share its hashing). Little-endian hosts only (callers check).
    """

    __slots__ = ("_base", "_bview", "_keep", "_memo", "_n", "_tail", "_tview")

    def __init__(self, base: bytes, keep: int, tail: bytes = b"",
                 memo: dict[tuple[int, int], list[int]] | None = None) -> None:
        if len(tail) % 4 or not 0 <= 4 * keep <= len(base):
            raise ValueError("not uint32 token ids")
        self._base, self._keep, self._tail = base, keep, tail
        self._bview = memoryview(base).cast("I")[:keep]
        self._tview = memoryview(tail).cast("I")
        self._n = keep + len(tail) // 4
        self._memo: dict[tuple[int, int], list[int]] = memo if memo is not None else {}

    @classmethod
    def build(cls, ids: Sequence[int]) -> GrowingTokenIds:
        """``ids`` packed (``OverflowError``: an id outside uint32)."""
        raw = array("I", ids).tobytes()
        return cls(raw, len(raw) // 4)

    def spliced(self, keep: int, ids: Sequence[int]) -> GrowingTokenIds:
        """``self[:keep] + ids``, sharing this one's base where the cut is in its tail, with the keys
        of the blocks before the cut."""
        if not 0 <= keep <= self._n:
            raise ValueError(f"cut {keep} outside {self._n} ids")
        new = array("I", ids).tobytes()
        memo = {space: keys[: keep // space[0]] for space, keys in self._memo.items()}
        if keep >= self._keep:  # the cut is in the tail
            base_keep, tail = self._keep, b"".join((memoryview(self._tail)[: 4 * (keep - self._keep)], new))
        else:  # the cut is in the base (the generation prompt of a flat one, or an edit): its rest is ignored
            base_keep, tail = keep, new
        if len(tail) <= _FLAT_TAIL and 8 * base_keep >= len(self._base):  # shares at least half the base
            return GrowingTokenIds(self._base, base_keep, tail, memo)
        base = b"".join((memoryview(self._base)[: 4 * base_keep], tail))
        return GrowingTokenIds(base, len(base) // 4, b"", memo)

    def tobytes(self) -> bytes:
        """The ids' little-endian uint32 bytes (no copy when the tail is empty and the base exact)."""
        if not self._tail:
            return self._base if 4 * self._keep == len(self._base) else self._base[: 4 * self._keep]
        return b"".join((memoryview(self._base)[: 4 * self._keep], self._tail))

    def _bytes(self, start: int, stop: int) -> bytes | memoryview:
        """Ids ``start..stop-1`` as bytes (a view where they lie in one part)."""
        keep = self._keep
        if stop <= keep:
            return memoryview(self._base)[4 * start: 4 * stop]
        if start >= keep:
            return memoryview(self._tail)[4 * (start - keep): 4 * (stop - keep)]
        return b"".join((memoryview(self._base)[4 * start: 4 * keep], memoryview(self._tail)[: 4 * (stop - keep)]))

    def memo_keys(self, block_size: int, parent_key: int) -> list[int] | None:
        """The memoised keys of this key space (a prefix of the full blocks' keys), or None."""
        return self._memo.get((block_size, parent_key))

    def extend_keys(self, block_size: int, parent_key: int, known: list[int]) -> tuple[list[int], int]:
        """(the keys of every full block, how many were hashed now) from ``known``, the keys of a prefix of
        the blocks (the memo, or :class:`PrefixKeyCache`'s answer); memoised. ``block_size`` > 0."""
        n = self._n // block_size
        have = min(len(known), n)
        keys = known[:have]
        if have < n:
            raw = self._bytes(have * block_size, n * block_size)
            _chain(raw if isinstance(raw, bytes) else bytes(raw), block_size * 4, 0, n - have,
                   keys[-1] if keys else parent_key, keys)
        memo = self._memo
        if (block_size, parent_key) not in memo and len(memo) >= _MEMO_SPACES:
            memo.pop(next(iter(memo)))
        memo[(block_size, parent_key)] = keys
        return keys.copy(), n - have

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return self.tolist()[i]
            if stop <= start:
                return []
            return memoryview(self._bytes(start, stop)).cast("I").tolist()
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return int(self._bview[i]) if i < self._keep else int(self._tview[i - self._keep])

    def __iter__(self) -> Iterator[int]:
        return chain(self._bview, self._tview)

    def tolist(self) -> list[int]:
        return self._bview.tolist() + self._tview.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GrowingTokenIds):
            return self.tobytes() == other.tobytes()
        if isinstance(other, list | tuple):
            return len(other) == self._n and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GrowingTokenIds({self._n} ids, tail {len(self._tail) // 4})"


class _Keyed:
    """One remembered prompt: its token bytes (full blocks, maybe a trailing partial one) and their keys."""

    __slots__ = ("keys", "raw")

    def __init__(self, raw: bytes, keys: list[int]) -> None:
        self.raw = raw
        self.keys = keys


class PrefixKeyCache:
    """Block keys of recent prompts, so a prompt that extends (or shares a prefix with) one of
    them hashes only the blocks after the shared prefix.

    Entries are found by ``(block size, parent key, key of block 0)``; each such bucket keeps the
    ``per_bucket`` latest prompts. A prompt that extends (or is a prefix of) one of them is found with
    one ``bytes.startswith`` (``memcmp``) each, newest first; a partial match (an edit in the middle)
    is searched for only in the newest, by a binary search over blocks.
    A prompt that extends a remembered one replaces it. The cache holds at most ``max_bytes`` of
    token bytes (4 per token) and keys (8 per block, counted as 40 for the Python int), least
    recently used evicted first. Not thread-safe (one event loop owns it).

    Args:
        max_bytes: bound on what is held (0 disables the cache).
        per_bucket: prompts kept per first block (e.g. sessions sharing one system prompt).
    """

    def __init__(self, max_bytes: int = 64 << 20, per_bucket: int = 4) -> None:
        self._max_bytes = max_bytes
        self._per_bucket = max(per_bucket, 1)
        self._buckets: OrderedDict[tuple[int, int, int], list[_Keyed]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        """Lookups that reused at least one remembered block."""
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @staticmethod
    def _cost(entry: _Keyed) -> int:
        return len(entry.raw) + 40 * len(entry.keys) + 64

    def block_keys(self, token_ids: TokenIds, block_size: int, parent_key: int = 0) -> list[int]:
        """Same as :func:`block_keys` (without content extras), reusing remembered prefixes.

        The returned list is the caller's (a copy is kept).

        Raises:
            ValueError: when ``block_size`` is not positive.
            OverflowError: a token id outside uint32.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if isinstance(token_ids, GrowingTokenIds):
            parent_key &= 0xFFFFFFFFFFFFFFFF
            known = token_ids.memo_keys(block_size, parent_key)
            if known is None:  # first time in this key space: through the cache (a shared prefix is reused)
                known = self.block_keys(token_ids.tobytes(), block_size, parent_key)
                return token_ids.extend_keys(block_size, parent_key, known)[0]
            grown, hashed = token_ids.extend_keys(block_size, parent_key, known)
            self.hits += bool(known)
            self.reused_blocks += len(grown) - hashed
            self.hashed_blocks += hashed
            return grown
        n = (len(token_ids) // (4 if isinstance(token_ids, bytes | bytearray | memoryview) else 1)) // block_size
        if n == 0:
            return []
        parent_key &= 0xFFFFFFFFFFFFFFFF
        # bytes (e.g. a tokenizer's packed ids) are kept whole, trailing partial block included: no
        # copy of the prompt per call (a slice would copy it, and a buffer over the allocator's mmap
        # threshold costs page faults); only the full blocks are hashed and compared
        raw = token_bytes(token_ids) if type(token_ids) is bytes else token_bytes(token_ids, n * block_size)
        width = block_size * 4
        if self._max_bytes <= 0:
            keys: list[int] = []
            _chain(raw, width, 0, n, parent_key, keys)
            return keys
        first = _xxh3(memoryview(raw)[:width], parent_key)
        bucket_key = (block_size, parent_key, first)
        bucket = self._buckets.get(bucket_key)
        best, best_blocks = None, 0
        if bucket is not None:
            self._buckets.move_to_end(bucket_key)
            for position, entry in enumerate(reversed(bucket)):  # newest first
                # the newest gets a binary search for a partial match; older ones only the
                # one-memcmp checks (extends / is a prefix), so a bucket costs ~1 prompt's memcmp
                shared = self._shared_blocks(raw, entry.raw, width, n, len(entry.keys), search=position == 0)
                if shared > best_blocks:
                    best, best_blocks = entry, shared
                    if shared == min(n, len(entry.keys)):
                        break
        if best is not None:
            keys = best.keys[:best_blocks]
            self.hits += 1
            self.reused_blocks += best_blocks
        else:
            keys = [first]
            best_blocks = 1
        _chain(raw, width, best_blocks, n, keys[-1], keys)
        self.hashed_blocks += n - best_blocks
        if best is not None and best_blocks == n:
            return keys  # a prefix of a remembered prompt: nothing new to remember
        self._remember(bucket_key, bucket, best if best is not None and best_blocks == len(best.keys) else None,
                       _Keyed(raw, keys.copy()))
        return keys

    @staticmethod
    def _shared_blocks(raw: bytes, old: bytes, width: int, n: int, n_old: int, search: bool = True) -> int:
        """Full blocks ``raw`` and ``old`` share from the start (without ``search``: all of the
        shorter one, or 0). Either may carry a trailing partial block, which is not compared."""
        view = memoryview(old)
        if n_old <= n and raw.startswith(view[: n_old * width]):
            return n_old
        if n < n_old and old.startswith(memoryview(raw)[: n * width]):
            return n
        if not search:
            return 0
        lo, hi = 0, min(n, n_old)  # invariant: lo blocks shared, hi+1 not (or past the end)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw.startswith(view[: mid * width]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _remember(self, bucket_key: tuple[int, int, int], bucket: list[_Keyed] | None,
                  extended: _Keyed | None, entry: _Keyed) -> None:
        if self._cost(entry) > self._max_bytes:
            return
        if bucket is None:
            bucket = self._buckets[bucket_key] = []
        if extended is not None:
            bucket.remove(extended)
            self._bytes -= self._cost(extended)
        elif len(bucket) >= self._per_bucket:
            self._bytes -= self._cost(bucket.pop(0))
        bucket.append(entry)
        self._bytes += self._cost(entry)
        while self._bytes > self._max_bytes and self._buckets:
            oldest_key, oldest = next(iter(self._buckets.items()))
            if oldest:
                self._bytes -= self._cost(oldest.pop(0))
            if not oldest:
                del self._buckets[oldest_key]

    def clear(self) -> None:
        self._buckets.clear()
        self._bytes = 0


def canonical_extra(values: Sequence[object]) -> bytes | None:
    """Canonical CBOR of a block's content extras (None when there are none).

    Raises:
        ValueError: when a value cannot be encoded (cbor2's own error, re-raised).
    """
    if not values:
        return None
    try:
        return cbor2.dumps(list(values), canonical=True)
    except (cbor2.CBOREncodeError, TypeError) as exc:
        raise ValueError(f"cannot encode block extra keys {values!r}: {exc}") from exc
