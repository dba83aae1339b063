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
the block's token ids as little-endian uint32. They need no agreement with any engine's hash
seed, so the index works with every engine and hash algorithm; engine hashes are mapped to
these keys when a ``BlockStored`` event arrives with its token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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


def block_keys(token_ids: Sequence[int], block_size: int, parent_key: int = 0) -> list[int]:
    """kvmesh's chained 64-bit keys for the full blocks of ``token_ids``.

    Key ``i`` depends on every token of blocks ``0..i`` (and on ``parent_key``), so equal keys
    mean equal prefixes. ``parent_key=0`` starts a prompt.

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
    for i in range(len(tokens) // block_size):
        digest = hashlib.blake2b(
            prev.to_bytes(8, "little") + raw[i * width : (i + 1) * width], digest_size=8
        ).digest()
        prev = int.from_bytes(digest, "little")
        keys.append(prev)
    return keys
