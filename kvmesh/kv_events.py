"""vLLM's KV-event wire format (ZMQ + msgpack), as msgspec structs, for encoding and decoding.

Mirrors ``vllm/distributed/kv_events.py`` of vLLM 0.32 (checked field by field against the
recordings in ``shared/data/vllm-0.32-cpu``):

* ZMQ multipart message: ``[topic (utf-8), seq (8-byte big-endian uint), payload]``.
* payload: msgpack array ``[ts: float64, events: list, data_parallel_rank: int]``.
* each event: a msgpack map whose first key is ``"type"`` (the tag): ``BlockStored``,
  ``BlockRemoved`` or ``AllBlocksCleared``, with the keys in the order declared below.
* block hashes: uint64 (default) or 32-byte digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

Fields that vLLM sends only when set (``kv_cache_spec_sliding_window``, ``locality``,
``ownership``, ``session_id``; vLLM 0.33's ``lookahead_token_ids``) are ignored on decode.
The topic follows llm-d's convention ``kv@<endpoint host:port>@<model>`` so a subscriber
bound for many engines knows which endpoint each message is from.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = int | bytes
"""A block hash as it travels: uint64, or a 32-byte digest."""


class KVCacheEvent(msgspec.Struct, tag=True, tag_field="type", gc=False):
    """Base of the tagged union; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the cache (a chain: block i's parent is block i-1, the first's is
    ``parent_block_hash``). ``token_ids`` holds ``len(block_hashes) * block_size`` tokens."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = "GPU"
    group_idx: int = 0


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
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload.

    Raises:
        msgspec.DecodeError: malformed msgpack, an unknown event type, or a field of the wrong type.
    """
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
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
