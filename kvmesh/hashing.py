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

kvmesh's block keys (:func:`block_keys`) are its own: 64-bit BLAKE2b over the parent key and
the block's token ids as little-endian uint32 (plus, for a block with content extras such as a
multimodal item, their canonical bytes). They need no agreement with any engine's hash seed, so
the index works with every engine and hash algorithm; engine hashes are mapped to these keys when
a ``BlockStored`` event arrives with its token ids.

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
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2

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


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent_key: int = 0,
    content_extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """kvmesh's chained 64-bit keys for the full blocks of ``token_ids``.

    Key ``i`` depends on every token of blocks ``0..i`` (and on ``parent_key``), so equal keys
    mean equal prefixes. ``parent_key=0`` starts a prompt in the default scope; a
    :meth:`KeyScope.root_key` starts one in that scope.

    Args:
        content_extras: per block, canonical bytes of what else the block's content depends on
            (a multimodal item and offset, a prompt-embeddings digest: :func:`canonical_extra`),
            None where nothing; shorter than the blocks means None for the rest.

    Raises:
        ValueError: when ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    keys: list[int] = []
    prev = parent_key
    tokens = array("I", token_ids[: (len(token_ids) // block_size) * block_size])
    raw = tokens.tobytes() if tokens.itemsize == 4 else array("L", tokens).tobytes()
    width = block_size * 4
    n_extras = len(content_extras) if content_extras is not None else 0
    for i in range(len(tokens) // block_size):
        data = prev.to_bytes(8, "little") + raw[i * width : (i + 1) * width]
        if i < n_extras and content_extras is not None and content_extras[i] is not None:
            data += b"\xffextra" + content_extras[i]  # type: ignore[operator]
        prev = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        keys.append(prev)
    return keys


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
