"""KV-event wire formats of vLLM 0.32 and SGLang 0.5.23 (ZMQ + msgpack), as msgspec structs.

Mirrors ``vllm/distributed/kv_events.py`` of vLLM 0.32 (checked field by field against the
recordings in ``tests/compat/fixtures/vllm-0.32-cpu``) and ``sglang/srt/disaggregation/kv_events.py``
of SGLang 0.5.23 (fixtures encoded by SGLang's own structs, ``tests/compat/fixtures/sglang-0.5.23``):

* ZMQ multipart message: ``[topic (utf-8), seq (8-byte big-endian uint), payload]``.
* payload: msgpack array ``[ts: float64, events: list, data_parallel_rank: int]`` (SGLang calls
  the third field ``attn_dp_rank``).
* each event: a msgpack map whose first key is ``"type"`` (the tag): ``BlockStored``,
  ``BlockRemoved`` or ``AllBlocksCleared``. Both engines use this shape; the structs below hold
  the union of their fields, so one decoder reads both.
* block hashes: uint64 (vLLM default), 32-byte digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)
  or signed int64 (SGLang); :func:`kvmesh.hashing.external_hash_to_int` maps all to uint64.

Fields that an engine sends only when set (vLLM's ``kv_cache_spec_sliding_window``, ``locality``,
``ownership``, ``session_id``; SGLang's ``cache_salt``, ``session_id``) default to
``msgspec.UNSET``, so a decoded vLLM batch re-encodes to vLLM's exact bytes. What kvmesh does with
every field is :data:`FIELD_HANDLING`; fields it does not act on are counted per event by
:func:`ignored_fields`. The topic follows llm-d's convention ``kv@<endpoint host:port>@<model>`` so
a subscriber bound for many engines knows which endpoint each message is from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kvmesh.hashing import KeyScope, block_keys, canonical_extra, external_hash_to_int

ExternalBlockHash = int | bytes
"""A block hash as it travels: uint64, or a 32-byte digest."""


class KVCacheEvent(msgspec.Struct, tag=True, tag_field="type", gc=False):
    """Base of the tagged union; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the cache (a chain: block i's parent is block i-1, the first's is
    ``parent_block_hash``). ``token_ids`` holds ``len(block_hashes) * block_size`` tokens.

    ``extra_keys`` (vLLM): per block, the untagged extra keys of its hash, in order: the LoRA
    name (when ``lora_name`` is set), ``[mm_identifier, offset]`` pairs, the ``cache_salt`` (first
    block of a request only) and prompt-embedding digests. ``cache_salt`` (SGLang) is the salt of
    the request that stored the chain.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    locality: str | UnsetType | None = UNSET
    ownership: str | UnsetType | None = UNSET
    session_id: str | UnsetType | None = UNSET
    cache_salt: str | UnsetType | None = UNSET


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache on ``medium`` (evicted, or moved to another tier)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = "GPU"
    group_idx: int | None = 0
    locality: str | UnsetType | None = UNSET
    ownership: str | UnsetType | None = UNSET


class AllBlocksCleared(KVCacheEvent):
    """The engine dropped its whole prefix cache (e.g. ``POST /reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One ZMQ message's payload."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The payload bytes of ``batch``, as vLLM writes them (fields left ``UNSET`` are omitted; maps
    are sized to the fields present, so a decoded vLLM payload re-encodes byte for byte)."""
    return _encoder.encode(msgspec.to_builtins(batch, builtin_types=(bytes,)))


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload.

    Raises:
        msgspec.DecodeError: malformed msgpack, an unknown event type, or a field of the wrong type.
    """
    return _decoder.decode(payload)


class _BatchHead(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


_head_decoder = msgspec.msgpack.Decoder(_BatchHead)


def peek_data_parallel_rank(payload: bytes) -> int | None:
    """The batch's data-parallel rank without decoding its events (None when absent or unreadable)."""
    try:
        return _head_decoder.decode(payload).data_parallel_rank
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# -- what kvmesh does with each field -----------------------------------------------------------

FIELD_HANDLING: Mapping[str, str] = {
    "EventBatch.ts": "honoured: within one endpoint, tells a duplicate (not newer) from a publisher restart (newer) when seq goes back",
    "EventBatch.events": "honoured: applied in order",
    "EventBatch.data_parallel_rank": "honoured: part of the endpoint identity (kvmesh.types.dp_endpoint_id)",
    "BlockStored.block_hashes": "honoured: engine hash -> kvmesh key map (BlockRemoved needs it)",
    "BlockStored.parent_block_hash": "honoured: the chain's parent key",
    "BlockStored.token_ids": "honoured: kvmesh keys are computed from them",
    "BlockStored.block_size": "honoured: the key space; adopted while empty, a mismatch is invalid",
    "BlockStored.lora_id": "honoured when lora_name is absent: scope 'lora-id:<n>' (never matches a named adapter)",
    "BlockStored.medium": "honoured: per-medium holders (GPU, CPU, DISK, SHARED; SGLang/vLLM aliases mapped)",
    "BlockStored.lora_name": "honoured: part of the key scope (kvmesh.hashing.KeyScope)",
    "BlockStored.extra_keys": "honoured: LoRA name and cache_salt -> key scope; multimodal and embedding keys -> block content",
    "BlockStored.group_idx": "honoured: only full-attention groups are indexed; removals from other groups are ignored",
    "BlockStored.kv_cache_spec_kind": "honoured: stores of a non-full-attention group are skipped (counted)",
    "BlockStored.kv_cache_spec_sliding_window": "ignored (counted): sliding-window groups are not indexed",
    "BlockStored.locality": "ignored (counted)",
    "BlockStored.ownership": "ignored (counted)",
    "BlockStored.session_id": "ignored (counted): attribution only, the hash does not depend on it",
    "BlockStored.cache_salt": "honoured (SGLang): part of the key scope",
    "BlockRemoved.block_hashes": "honoured",
    "BlockRemoved.medium": "honoured: the block leaves that medium only (a tier move is a store on one medium and a removal from another)",
    "BlockRemoved.group_idx": "honoured: removals from a group known to be non-full-attention are skipped",
    "BlockRemoved.locality": "ignored (counted)",
    "BlockRemoved.ownership": "ignored (counted)",
}
"""Every field of both engines' structs and what kvmesh does with it (``docs/engines.md``)."""

_IGNORED_IF_SET = {
    BlockStored: ("kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    BlockRemoved: ("locality", "ownership"),
}


def ignored_fields(event: KVCacheEvent) -> list[str]:
    """Fields set on ``event`` that kvmesh does not act on (for ``..._event_fields_ignored_total``)."""
    names = _IGNORED_IF_SET.get(type(event), ())
    return [name for name in names if getattr(event, name) not in (UNSET, None)]


FULL_ATTENTION = "full_attention"


def is_full_attention(event: BlockStored) -> bool:
    """Whether a store belongs to a full-attention KV-cache group (the only kind kvmesh indexes)."""
    return event.kv_cache_spec_kind in (None, FULL_ATTENTION)


def stored_key_scope(event: BlockStored) -> tuple[KeyScope, list[bytes | None] | None]:
    """The key scope of a stored chain and its blocks' content extras.

    Scope: ``lora_name`` (else ``"lora-id:<lora_id>"`` when only the deprecated id is set); the salt
    from SGLang's ``cache_salt`` or from vLLM's first block's extra keys (the string left after the
    LoRA name). Content extras (per block, :func:`kvmesh.hashing.canonical_extra`): what else is
    left in a block's extra keys (multimodal ``[identifier, offset]`` pairs, embedding digests).
    A salt can only start a chain: it is read from the first block when ``parent_block_hash`` is None.
    """
    lora = event.lora_name or (f"lora-id:{event.lora_id}" if event.lora_id is not None else None)
    salt = event.cache_salt if isinstance(event.cache_salt, str) else None
    extras: list[bytes | None] | None = None
    if event.extra_keys:
        extras = []
        for i, keys in enumerate(event.extra_keys):
            rest = list(keys) if isinstance(keys, list | tuple) else ([] if keys is None else [keys])
            if event.lora_name is not None and rest and rest[0] == event.lora_name:
                rest = rest[1:]
            if i == 0 and event.parent_block_hash is None:
                strings = [k for k in rest if isinstance(k, str)]
                if strings and salt is None:
                    salt = strings[-1]
                rest = [k for k in rest if not isinstance(k, str)]
            extras.append(canonical_extra(rest))
        if not any(e is not None for e in extras):
            extras = None
    return KeyScope(lora, salt), extras


def stored_block_keys(event: BlockStored, block_size: int, parent_key: int | None) -> list[int]:
    """kvmesh keys of a stored chain: from ``parent_key``, or (None: the chain starts a prompt) from
    its scope's root key; content extras folded into their blocks.

    Raises:
        ValueError, OverflowError, TypeError: token ids outside uint32, unencodable extra keys.
    """
    scope, extras = stored_key_scope(event)
    root = scope.root_key() if parent_key is None else parent_key
    return block_keys(event.token_ids, block_size, root, extras)


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay protocol's end-of-replay sequence frame (vLLM 0.32 ``ZmqEventPublisher.END_SEQ``)."""


def encode_seq(seq: int) -> bytes:
    """A sequence number as vLLM's 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number frame (8-byte big-endian unsigned).

    Raises:
        ValueError: when the frame is not 8 bytes.
    """
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def make_topic(endpoint_id: str, model: str) -> str:
    """``kv@<host:port>@<model>`` (llm-d's convention)."""
    return f"kv@{endpoint_id}@{model}"


def parse_topic(topic: bytes | str) -> tuple[str, str]:
    """``(endpoint_id, model)`` from ``kv@<host:port>@<model>``.

    Raises:
        ValueError: for any other shape (e.g. vLLM's bare ``kv@<model>``, which names no endpoint).
    """
    text = topic.decode("utf-8") if isinstance(topic, bytes) else topic
    parts = text.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        raise ValueError(f"topic {text!r} is not kv@<host:port>@<model>")
    return parts[1], parts[2]


# -- SGLang 0.5.23's shapes (for engines and fixtures that speak SGLang) -------------------------
# ``sglang/srt/disaggregation/kv_events.py``: events are tagged maps with ``omit_defaults``, fields in
# SGLang's order; ``lora_id`` has no default (always sent, None: SGLang names adapters by
# ``lora_name``); block hashes are signed int64 (the first 8 bytes of a SHA-256, big-endian).
# kvmesh decodes these with the structs above; these exist to *write* SGLang's bytes.


class _SGLangEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SGLangBlockStored(_SGLangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SGLangBlockRemoved(_SGLangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SGLangAllBlocksCleared(_SGLangEvent, tag="AllBlocksCleared"):
    pass


class SGLangEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SGLangBlockStored | SGLangBlockRemoved | SGLangAllBlocksCleared]
    attn_dp_rank: int | None = None


SGLANG_MEDIA: Mapping[str, str] = {"GPU": "GPU", "CPU": "CPU_PINNED", "DISK": "DISK", "SHARED": "EXTERNAL"}
"""kvmesh medium -> SGLang 0.5.23 ``StorageMedium`` value."""


def to_sglang_hash(block_hash: ExternalBlockHash) -> int:
    """A block hash in SGLang's signed int64 range (the uint64 form's two's complement)."""
    value = external_hash_to_int(block_hash)
    return value - (1 << 64) if value >= 1 << 63 else value


def to_sglang_event(
    event: KVEvent, cache_salt: str | None = None
) -> SGLangBlockStored | SGLangBlockRemoved | SGLangAllBlocksCleared:
    """One kvmesh (vLLM-shaped) event as SGLang 0.5.23 would publish it.

    ``cache_salt`` is the salt of the request that stored the chain (SGLang sends it on every store
    of that request; vLLM carries it in the first block's extra keys instead).
    """
    if isinstance(event, BlockStored):
        scope, _ = stored_key_scope(event)
        return SGLangBlockStored(
            block_hashes=[to_sglang_hash(h) for h in event.block_hashes],
            parent_block_hash=None if event.parent_block_hash is None else to_sglang_hash(event.parent_block_hash),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=SGLANG_MEDIA.get((event.medium or "GPU").upper(), event.medium),
            cache_salt=cache_salt if cache_salt is not None else scope.cache_salt,
            lora_name=event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return SGLangBlockRemoved(
            block_hashes=[to_sglang_hash(h) for h in event.block_hashes],
            medium=SGLANG_MEDIA.get((event.medium or "GPU").upper(), event.medium),
        )
    return SGLangAllBlocksCleared()


def encode_sglang_batch(ts: float, events: list[KVEvent], attn_dp_rank: int = 0) -> bytes:
    """The payload SGLang 0.5.23 would publish for ``events`` (see :func:`to_sglang_event`)."""
    return _encoder.encode(SGLangEventBatch(ts, [to_sglang_event(e) for e in events], attn_dp_rank))
