"""Which media hold each published value, and the vLLM 0.32 KV events that describe each change.

kv_store makes what it holds visible to routing the way an engine does: as KV events on vLLM's
wire (``kvmesh.kv_events``), one ``medium`` per tier kind (``CPU``, ``DISK``, ``SHARED`` for the
shared filesystem and Mooncake tiers). A value is *published* only when its put carried the
engine's own ``BlockStored`` for that one block (``PutRequest.block_stored_event``): the event
gives kv_indexer the block's engine hash, parent hash, token ids, block size and key scope (LoRA,
``cache_salt`` extra keys), so the indexer computes the same kvmesh block key the engine's own
events give. Values put without it (LMCache values, opaque data) are stored and served but never
published.

Rules (vLLM's field rule "a block moved between tiers is one removal plus one store"):

* a medium's first tier gaining the key emits ``BlockStored(medium)``, its last tier losing the key
  emits ``BlockRemoved(medium)``; two tiers of one medium (``sharedfs`` and ``mooncake``) are one
  presence;
* a move (demotion, promotion) emits the store on the new medium **before** the removal on the old
  one, in the same batch, so the block is never absent from the index;
* a key that leaves every tier is forgotten (its description too).

Pure bookkeeping: no I/O. The store calls :meth:`Residency.added` / :meth:`Residency.removed`
as tiers change and the app publishes :meth:`Residency.take_events` after each operation.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from kvmesh.types import Medium

_DECODE_STORED = msgspec.msgpack.Decoder(BlockStored)
_ENCODE = msgspec.msgpack.Encoder()


class BadBlockEvent(ValueError):
    """A ``block_stored_event`` that is not a vLLM ``BlockStored`` of exactly one block."""


def parse_block_event(raw: bytes, block_size_tokens: int | None = None) -> BlockStored:
    """Decode and check a put's ``block_stored_event`` (msgpack map, vLLM 0.32 ``BlockStored``).

    Raises:
        BadBlockEvent: undecodable, not exactly one hash, or ``len(token_ids) != block_size`` (or
            ``block_size`` differs from ``block_size_tokens`` when given).
    """
    try:
        event = _DECODE_STORED.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadBlockEvent(f"block_stored_event is not a vLLM BlockStored: {exc}") from exc
    if len(event.block_hashes) != 1:
        raise BadBlockEvent(f"block_stored_event must describe one block, got {len(event.block_hashes)} hashes")
    if event.block_size <= 0 or len(event.token_ids) != event.block_size:
        raise BadBlockEvent(
            f"block_stored_event has {len(event.token_ids)} token ids for block_size {event.block_size}"
        )
    if block_size_tokens is not None and event.block_size != block_size_tokens:
        raise BadBlockEvent(
            f"block_stored_event block_size {event.block_size} differs from this kv_store's {block_size_tokens}"
        )
    return event


class Residency:
    """Tiers holding each described key, and the pending events of their changes.

    Args:
        tier_media: tier name -> its medium (the store's tiers).
    """

    def __init__(self, tier_media: Mapping[str, Medium]) -> None:
        self._medium_of = dict(tier_media)
        self._where: dict[str, set[str]] = {}
        self._blocks: dict[str, BlockStored] = {}
        self._pending: list[KVEvent] = []
        self.ignored = 0
        """Changes of keys without a description (not published)."""

    def describe(self, key: str, event: BlockStored) -> None:
        """Attach the engine's event to ``key`` (on put); a key already published keeps its media."""
        self._blocks[key] = event

    def forget_if_absent(self, key: str) -> None:
        """Drop the description of a key no tier holds (its put failed)."""
        if key not in self._where:
            self._blocks.pop(key, None)

    def described(self, key: str) -> bool:
        return key in self._blocks

    def encoded(self, key: str) -> bytes:
        """The description of ``key`` as vLLM's msgpack ``BlockStored`` (what a put carried;
        :func:`parse_block_event` reads it back), ``b""`` when the key is not described. File
        tiers keep it with the value so a restarted instance can publish what it rescanned."""
        block = self._blocks.get(key)
        return _ENCODE.encode(block) if block is not None else b""

    def media(self, key: str) -> set[Medium]:
        return {self._medium_of[t] for t in self._where.get(key, ())}

    def added(self, key: str, tier: str) -> None:
        """``tier`` now holds ``key``; emits ``BlockStored`` when its medium is new for the key."""
        block = self._blocks.get(key)
        if block is None:
            self.ignored += 1
            return
        where = self._where.setdefault(key, set())
        if tier in where:
            return
        medium = self._medium_of[tier]
        new_medium = all(self._medium_of[t] != medium for t in where)
        where.add(tier)
        if new_medium:
            self._pending.append(
                BlockStored(
                    block_hashes=list(block.block_hashes),
                    parent_block_hash=block.parent_block_hash,
                    token_ids=list(block.token_ids),
                    block_size=block.block_size,
                    lora_id=block.lora_id,
                    medium=str(medium),
                    lora_name=block.lora_name,
                    extra_keys=block.extra_keys,
                )
            )

    def removed(self, key: str, tier: str) -> None:
        """``tier`` no longer holds ``key``; emits ``BlockRemoved`` when no tier of its medium does."""
        where = self._where.get(key)
        block = self._blocks.get(key)
        if where is None or block is None or tier not in where:
            if block is None:
                self.ignored += 1
            return
        where.discard(tier)
        medium = self._medium_of[tier]
        if all(self._medium_of[t] != medium for t in where):
            self._pending.append(BlockRemoved(block_hashes=list(block.block_hashes), medium=str(medium)))
        if not where:
            del self._where[key]
            del self._blocks[key]

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order (one batch)."""
        events, self._pending = self._pending, []
        return events

    def published_keys(self) -> int:
        return len(self._where)
