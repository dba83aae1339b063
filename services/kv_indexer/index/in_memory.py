"""In-memory :class:`~services.kv_indexer.index.base.KVBlockIndex`: hash maps, no I/O, one thread.

Layout (``E`` = endpoint id, ``M`` = medium):

* ``tables[(model, block_size)]``: ``block key -> {E: refcounts}``, ``refcounts`` one int packing a
  32-bit count per medium (:data:`services.kv_indexer.scoring.Holders`). One key space per model
  and block size, since a key chains the tokens of fixed-size blocks. A count is the number of engine
  hashes of ``E`` mapping to that key on ``M`` (normally 1; >1 only when an engine stores the same
  tokens under two hashes, e.g. two LoRA adapters).
* per registered endpoint: ``blocks: engine hash -> key | media bitmask << 64`` (one int: what
  ``BlockRemoved`` needs; bit ``i`` of the mask is ``Medium`` number ``i``),
  and ``recent``: a bounded LRU of removed ``engine hash -> key`` pairs, so a chain stored after
  its parent was evicted can still be placed.
* per registered endpoint, ``orphans: engine hash -> (parent hash, tokens, media)``: blocks whose
  parent's key is not known yet (the index restarted, or lost the parent); ``waiting[(model,
  block size)]: parent hash -> endpoints with orphans under it``. An orphan is keyed (moved into
  ``blocks``) when its parent's key becomes known: the parent stored by any endpoint of the key
  space, or, for endpoints whose registration says ``hash_algo="sha256_cbor"``, a scored prompt
  whose vLLM hashes (:func:`kvmesh.hashing.sha256_cbor_block_hashes`) name it.

Costs: ``BlockStored`` of ``b`` blocks is O(b) hashing + O(b) dict writes; ``BlockRemoved`` O(b);
``AllBlocksCleared`` and ``remove_endpoint`` O(blocks of that endpoint); ``score`` see
:mod:`services.kv_indexer.scoring`.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.hashing import (
    DEFAULT_SCOPE,
    KeyScope,
    PrefixKeyCache,
    block_keys,
    external_hash_to_int,
    sha256_cbor_block_hashes,
)
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, stored_block_keys, stored_key_scope
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.index.base import (
    ApplyOutcome,
    BlockKey,
    BlockLocation,
    EndpointIndexStats,
    EndpointScore,
    EngineBlockHash,
    IndexEvent,
    IndexStats,
    KeyedBlockStored,
    ScoreResult,
)
from services.kv_indexer.index.residency import ResidencyLog
from services.kv_indexer.scoring import (
    LANE_MASK,
    MEDIA,
    MEDIUM_LANE,
    MEDIUM_SHIFT,
    longest_prefix_matches,
    media_counts,
    media_of,
)

logger = logging.getLogger(__name__)

Table = dict[BlockKey, dict[EndpointId, int]]

_KEY_MASK = 0xFFFFFFFFFFFFFFFF
_MEDIUM_TAG: dict[Medium, int] = {m: 1 << (64 + i) for i, m in enumerate(MEDIA)}
"""``blocks`` value bit of each medium (above the 64-bit key)."""
_MASK_MEDIA: tuple[frozenset[Medium], ...] = tuple(
    frozenset(m for i, m in enumerate(MEDIA) if mask >> i & 1) for mask in range(1 << len(MEDIA))
)
_MEDIUM_OF: dict[str | None, Medium] = {}
"""Event medium strings already parsed (``Medium.parse`` per event is measurable at 1M blocks/s)."""


def _parse_medium(value: str | None) -> Medium:
    medium = _MEDIUM_OF.get(value)
    if medium is None:
        medium = Medium.parse(value)  # ValueError for an unknown medium: not cached
        if len(_MEDIUM_OF) < 64:
            _MEDIUM_OF[value] = medium
    return medium

COMPUTABLE_HASH_ALGOS = frozenset({"sha256_cbor"})
"""Engine hash algorithms the index can compute itself (unseeded, so any process agrees)."""


class _Orphan:
    """A stored block whose parent's key is unknown: its parent hash, its tokens, its media."""

    __slots__ = ("extra", "media", "parent", "tokens")

    def __init__(self, parent: EngineBlockHash, tokens: list[int], medium: Medium, extra: bytes | None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.media = {medium}
        self.extra = extra
        """The block's content extra (multimodal, embeddings: :func:`kvmesh.kv_events.stored_key_scope`)."""


@dataclass
class _EndpointState:
    endpoint: Endpoint
    block_size: int
    table: Table
    blocks: dict[EngineBlockHash, int] = field(default_factory=dict)
    """Engine hash -> ``key | media bitmask << 64``."""
    recent: OrderedDict[EngineBlockHash, BlockKey] = field(default_factory=OrderedDict)
    medium_blocks: Counter[Medium] = field(default_factory=Counter)
    """Blocks held per medium: with one medium in use, Score needs no per-medium walk."""
    events_applied: int = 0
    orphans: dict[EngineBlockHash, _Orphan] = field(default_factory=dict)
    children: dict[EngineBlockHash, set[EngineBlockHash]] = field(default_factory=dict)
    """Orphans by parent hash."""


class InMemoryIndex:
    """The default index backend (see the module docstring for layout and costs).

    Args:
        recent_removed_blocks: per endpoint, how many removed ``engine hash -> key`` pairs to keep
            for placing later chains whose parent was evicted (0 disables).
        orphan_blocks: per endpoint, blocks held by engine hash while their parent's key is unknown.
        prompt_key_cache_bytes: bound of the :class:`~kvmesh.hashing.PrefixKeyCache` of scored
            prompts' keys (a prompt extending a recent one hashes only its new blocks; 0 disables).
    """

    def __init__(
        self, recent_removed_blocks: int = 4096, orphan_blocks: int = 65536, prompt_key_cache_bytes: int = 64 << 20
    ) -> None:
        self._prompt_keys = PrefixKeyCache(prompt_key_cache_bytes)
        self._recent_limit = recent_removed_blocks
        self._orphan_limit = orphan_blocks
        self._tables: dict[tuple[str, int], Table] = {}
        self._waiting: dict[tuple[str, int], dict[EngineBlockHash, set[EndpointId]]] = {}
        self._endpoints: dict[EndpointId, _EndpointState] = {}
        self._outcomes: Counter[ApplyOutcome] = Counter()
        self.residency: ResidencyLog | None = None
        """Where key residency changes are recorded while a replica watches (None: not recorded)."""

    # -- membership -------------------------------------------------------------------------

    def register_endpoint(self, endpoint: Endpoint) -> None:
        state = self._endpoints.get(endpoint.id)
        if state is not None:
            if (
                state.endpoint.model == endpoint.model
                and state.endpoint.block_size_tokens == endpoint.block_size_tokens
                and state.endpoint.instance_id == endpoint.instance_id
            ):
                state.endpoint = endpoint
                return
            self.remove_endpoint(endpoint.id)
        self._endpoints[endpoint.id] = _EndpointState(
            endpoint, endpoint.block_size_tokens, self._table(endpoint.model, endpoint.block_size_tokens)
        )

    def remove_endpoint(self, endpoint_id: EndpointId) -> bool:
        state = self._endpoints.pop(endpoint_id, None)
        if state is None:
            return False
        self._clear(state)
        return True

    def registered(self) -> Mapping[EndpointId, Endpoint]:
        return {eid: st.endpoint for eid, st in self._endpoints.items()}

    def is_registered(self, endpoint_id: EndpointId) -> bool:
        return endpoint_id in self._endpoints

    # -- events -----------------------------------------------------------------------------

    def apply(self, endpoint_id: EndpointId, event: IndexEvent) -> ApplyOutcome:
        state = self._endpoints.get(endpoint_id)
        if state is None:
            outcome = ApplyOutcome.UNREGISTERED
        elif isinstance(event, BlockStored):
            outcome = self._apply_stored(state, event)
        elif isinstance(event, BlockRemoved):
            outcome = self._apply_removed(state, event)
        elif isinstance(event, AllBlocksCleared):
            self._clear(state)
            outcome = ApplyOutcome.APPLIED
        elif isinstance(event, KeyedBlockStored):
            outcome = self._apply_keyed(state, event)
        else:
            outcome = ApplyOutcome.INVALID
        self._outcomes[outcome] += 1
        if outcome is ApplyOutcome.APPLIED and state is not None:
            state.events_applied += 1
        return outcome

    def _apply_stored(self, state: _EndpointState, event: BlockStored) -> ApplyOutcome:
        try:
            medium = _parse_medium(event.medium)
        except ValueError:
            return ApplyOutcome.INVALID
        if event.block_size != state.block_size and not self._adopt_block_size(state, event.block_size):
            return ApplyOutcome.INVALID
        try:
            hashes = [h & _KEY_MASK for h in event.block_hashes]  # type: ignore[operator]  # uint64 / int64
        except TypeError:  # 32-byte digests
            hashes = [external_hash_to_int(h) for h in event.block_hashes]
        if not event.token_ids and hashes:  # vLLM 0.32 OffloadingConnector's form: hashes only, a new medium
            return self._apply_medium_only(state, hashes, medium)
        if len(event.token_ids) != len(hashes) * state.block_size:
            return ApplyOutcome.INVALID
        parent_key: int | None = None  # None: the chain starts a prompt (its key scope's root)
        if event.parent_block_hash is not None:
            parent_hash = external_hash_to_int(event.parent_block_hash)
            known = self._key_of(state, parent_hash)
            if known is None:
                if any(t < 0 or t > 0xFFFFFFFF for t in event.token_ids):
                    return ApplyOutcome.INVALID
                try:
                    _, extras = stored_key_scope(event)
                except (ValueError, TypeError):
                    return ApplyOutcome.INVALID
                self._orphan(state, parent_hash, hashes, list(event.token_ids), medium, extras)
                return ApplyOutcome.ORPHANED
            parent_key = known
        try:
            if (  # the common case: no LoRA, salt or content extras, so no scope to build
                event.lora_name is None and event.lora_id is None and not event.extra_keys
                and not isinstance(event.cache_salt, str)
            ):
                keys = block_keys(event.token_ids, state.block_size, parent_key or 0)
            else:
                keys = stored_block_keys(event, state.block_size, parent_key)  # LoRA / cache_salt scoped
        except (OverflowError, ValueError, TypeError):  # token ids outside uint32, unencodable extra keys
            return ApplyOutcome.INVALID
        self._store(state, hashes, keys, medium)
        return ApplyOutcome.APPLIED

    def _apply_medium_only(self, state: _EndpointState, hashes: list[int], medium: Medium) -> ApplyOutcome:
        """``BlockStored`` without token ids (vLLM's OffloadingConnector ``take_events``: parent None,
        ``token_ids=[]``, medium ``CPU``): blocks the endpoint already stored (their keys known from its
        own events, recent removals or its key space) gain ``medium``; unknown hashes are skipped."""
        known = [(h, k) for h in hashes if (k := self._key_of(state, h)) is not None]
        if not known:
            return ApplyOutcome.INVALID
        self._store(state, [h for h, _ in known], [k for _, k in known], medium)
        return ApplyOutcome.APPLIED

    def _apply_keyed(self, state: _EndpointState, event: KeyedBlockStored) -> ApplyOutcome:
        if len(event.block_keys) != len(event.block_hashes) or not self._adopt_block_size(state, event.block_size):
            return ApplyOutcome.INVALID
        self._store(state, list(event.block_hashes), list(event.block_keys), event.medium)
        return ApplyOutcome.APPLIED

    def _apply_removed(self, state: _EndpointState, event: BlockRemoved) -> ApplyOutcome:
        try:
            medium = _parse_medium(event.medium)
        except ValueError:
            return ApplyOutcome.INVALID
        tag = _MEDIUM_TAG[medium]
        lane = MEDIUM_LANE[medium]
        blocks = state.blocks
        table = state.table
        endpoint_id = state.endpoint.id
        recent = state.recent if self._recent_limit else None
        log = self.residency
        gone: list[int] | None = [] if log is not None else None
        lane_mask = LANE_MASK * lane
        removed = 0
        for raw in event.block_hashes:  # _drop, inlined: one removal is the hottest path of ingest
            block_hash = raw & _KEY_MASK if isinstance(raw, int) else external_hash_to_int(raw)
            held = blocks.get(block_hash)
            if held is not None and held & tag:
                removed += 1
                held ^= tag
                key = held & _KEY_MASK
                if held >> 64:
                    blocks[block_hash] = held
                else:
                    del blocks[block_hash]
                    if recent is not None:
                        recent[block_hash] = key
                        recent.move_to_end(block_hash)
                holders = table.get(key)
                if holders is not None:
                    packed = holders.get(endpoint_id, 0)
                    if packed & lane_mask:
                        packed -= lane
                        if gone is not None and not packed & lane_mask:
                            gone.append(key)
                        if packed:
                            holders[endpoint_id] = packed
                        else:
                            del holders[endpoint_id]
                            if not holders:
                                del table[key]
                continue
            orphan = state.orphans.get(block_hash)
            if orphan is not None:
                orphan.media.discard(medium)
                if not orphan.media:
                    self._forget_orphan(state, block_hash)
        if gone:
            log.record(endpoint_id, str(medium), (), gone)  # type: ignore[union-attr]
        if removed:
            counts = state.medium_blocks
            counts[medium] -= removed
            if counts[medium] <= 0:
                del counts[medium]
        if recent is not None:
            while len(recent) > self._recent_limit:
                recent.popitem(last=False)
        return ApplyOutcome.APPLIED

    # -- chains without their parents -------------------------------------------------------

    def _key_of(self, state: _EndpointState, block_hash: EngineBlockHash) -> BlockKey | None:
        """The kvmesh key of an engine hash: this endpoint's blocks, its recent removals, then any
        endpoint of the same key space (engines hashing alike agree on hashes)."""
        held = state.blocks.get(block_hash)
        if held is not None:
            return held & _KEY_MASK
        recent = state.recent.get(block_hash)
        if recent is not None:
            return recent
        for other in self._endpoints.values():
            if other is not state and other.table is state.table:
                held = other.blocks.get(block_hash)
                if held is not None:
                    return held & _KEY_MASK
        return None

    def _orphan(
        self,
        state: _EndpointState,
        parent: EngineBlockHash,
        hashes: list[int],
        tokens: list[int],
        medium: Medium,
        extras: Sequence[bytes | None] | None = None,
    ) -> None:
        size = state.block_size
        waiting = self._waiting.setdefault((state.endpoint.model, size), {})
        for i, block_hash in enumerate(hashes):
            if block_hash in state.blocks:  # already keyed: only the medium may be new
                key = state.blocks[block_hash] & _KEY_MASK
                self._store(state, [block_hash], [key], medium)
                parent = block_hash
                continue
            orphan = state.orphans.get(block_hash)
            if orphan is None:
                while len(state.orphans) >= self._orphan_limit > 0:
                    oldest = next(iter(state.orphans))
                    logger.warning("orphan limit reached endpoint=%s; forgetting hash=%x", state.endpoint.id, oldest)
                    self._forget_orphan(state, oldest)
                extra = extras[i] if extras is not None else None
                state.orphans[block_hash] = _Orphan(parent, tokens[i * size : (i + 1) * size], medium, extra)
                state.children.setdefault(parent, set()).add(block_hash)
                waiting.setdefault(parent, set()).add(state.endpoint.id)
            else:
                orphan.media.add(medium)
            parent = block_hash

    def _forget_orphan(self, state: _EndpointState, block_hash: EngineBlockHash) -> _Orphan | None:
        orphan = state.orphans.pop(block_hash, None)
        if orphan is None:
            return None
        siblings = state.children.get(orphan.parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del state.children[orphan.parent]
                waiting = self._waiting.get((state.endpoint.model, state.block_size))
                if waiting is not None and orphan.parent in waiting:
                    waiting[orphan.parent].discard(state.endpoint.id)
                    if not waiting[orphan.parent]:
                        del waiting[orphan.parent]
        return orphan

    def _resolve(self, state: _EndpointState, parent: EngineBlockHash, parent_key: BlockKey) -> None:
        """Key every orphan of ``state`` chained under ``parent`` (whose key is now known)."""
        work = [(parent, parent_key)]
        while work:
            block_hash, key = work.pop()
            for child in list(state.children.get(block_hash, ())):
                orphan = self._forget_orphan(state, child)
                if orphan is None:
                    continue
                extras = None if orphan.extra is None else [orphan.extra]
                child_key = block_keys(orphan.tokens, state.block_size, key, extras)[0]
                for medium in orphan.media:
                    self._store(state, [child], [child_key], medium, resolve=False)
                work.append((child, child_key))
                if state.endpoint.id not in self._waiting.get((state.endpoint.model, state.block_size), {}).get(child, ()):
                    self._wake_waiters(state, [child], [child_key])

    def _wake_waiters(self, state: _EndpointState, hashes: list[int], keys: list[int]) -> None:
        waiting = self._waiting.get((state.endpoint.model, state.block_size))
        if not waiting:
            return
        for block_hash, key in zip(hashes, keys, strict=True):
            endpoints = waiting.get(block_hash)
            if not endpoints:
                continue
            for endpoint_id in list(endpoints):
                waiter = self._endpoints.get(endpoint_id)
                if waiter is not None and waiter.table is state.table:
                    self._resolve(waiter, block_hash, key)

    def _resolve_from_prompt(self, model: str, size: int, token_ids: Sequence[int], keys: list[int]) -> None:
        """Key orphans named by the prompt's engine hashes (endpoints whose hash algorithm the index computes)."""
        table = self._tables.get((model, size))
        states = [
            st for st in self._endpoints.values()
            if st.orphans and st.table is table and st.endpoint.hash_algo in COMPUTABLE_HASH_ALGOS
        ]
        if not states:
            return
        digests = sha256_cbor_block_hashes(token_ids[: len(keys) * size], size)
        for i, digest in enumerate(digests):
            block_hash = external_hash_to_int(digest)
            for st in states:
                orphan = st.orphans.get(block_hash)
                if orphan is None:
                    continue
                self._forget_orphan(st, block_hash)
                for medium in orphan.media:
                    self._store(st, [block_hash], [keys[i]], medium)

    def _adopt_block_size(self, state: _EndpointState, block_size: int) -> bool:
        """The event's block size wins over the registration's while the endpoint holds nothing."""
        if block_size == state.block_size:
            return True
        if block_size <= 0 or state.blocks or state.orphans:
            logger.warning(
                "block size mismatch endpoint=%s registered=%d event=%d; event skipped",
                state.endpoint.id, state.block_size, block_size,
            )
            return False
        logger.warning(
            "endpoint=%s registered block_size_tokens=%d but its events use %d; using %d",
            state.endpoint.id, state.block_size, block_size, block_size,
        )
        state.block_size = block_size
        state.table = self._table(state.endpoint.model, block_size)
        return True

    # -- state changes ----------------------------------------------------------------------

    def _table(self, model: str, block_size: int) -> Table:
        return self._tables.setdefault((model, block_size), {})

    def _store(
        self, state: _EndpointState, hashes: list[int], keys: list[int], medium: Medium, resolve: bool = True
    ) -> None:
        self._store_keyed(state, hashes, keys, medium)
        if resolve and (state.children or self._waiting.get((state.endpoint.model, state.block_size))):
            for block_hash, key in zip(hashes, keys, strict=True):
                if block_hash in state.children:
                    self._resolve(state, block_hash, key)
            self._wake_waiters(state, hashes, keys)

    def _store_keyed(self, state: _EndpointState, hashes: list[int], keys: list[int], medium: Medium) -> None:
        endpoint_id = state.endpoint.id
        table = state.table
        blocks = state.blocks
        tag = _MEDIUM_TAG[medium]
        lane = MEDIUM_LANE[medium]
        lane_mask = LANE_MASK * lane
        log = self.residency
        new: list[int] | None = [] if log is not None else None
        added = 0
        for block_hash, key in zip(hashes, keys, strict=True):
            held = blocks.get(block_hash)
            if held is None:
                blocks[block_hash] = key | tag
            elif held & _KEY_MASK == key:
                if held & tag:
                    continue  # a repeat: idempotent
                blocks[block_hash] = held | tag
            else:  # the engine reused a hash for other content: replace
                for old_medium in _MASK_MEDIA[held >> 64]:
                    held = self._drop(state, block_hash, held, old_medium)
                blocks[block_hash] = key | tag
            added += 1
            holders = table.get(key)
            if holders is None:
                table[key] = {endpoint_id: lane}
                if new is not None:
                    new.append(key)
            else:
                old = holders.get(endpoint_id, 0)
                holders[endpoint_id] = old + lane
                if new is not None and not old & lane_mask:
                    new.append(key)
        if added:
            state.medium_blocks[medium] += added
        if new:
            log.record(endpoint_id, str(medium), new, ())  # type: ignore[union-attr]

    def _drop(self, state: _EndpointState, block_hash: EngineBlockHash, held: int, medium: Medium) -> int:
        """``held`` (the block's ``blocks`` value) leaves ``medium``; returns its new value (0: gone)."""
        held &= ~_MEDIUM_TAG[medium]
        counts = state.medium_blocks
        counts[medium] -= 1
        if counts[medium] <= 0:
            del counts[medium]
        key = held & _KEY_MASK
        if held >> 64:
            state.blocks[block_hash] = held
        else:
            held = 0
            del state.blocks[block_hash]
            if self._recent_limit:
                recent = state.recent
                recent[block_hash] = key
                recent.move_to_end(block_hash)
                if len(recent) > self._recent_limit:
                    recent.popitem(last=False)
        if self._unlink(state.table, key, state.endpoint.id, medium) and self.residency is not None:
            self.residency.record(state.endpoint.id, str(medium), (), [key])
        return held

    @staticmethod
    def _unlink(table: Table, key: BlockKey, endpoint_id: EndpointId, medium: Medium) -> bool:
        """One hash of ``endpoint_id`` on ``medium`` fewer for ``key``; True when none is left on it."""
        holders = table.get(key)
        if holders is None:
            return False
        packed = holders.get(endpoint_id)
        if packed is None or not (packed >> MEDIUM_SHIFT[medium]) & LANE_MASK:
            return False
        packed -= MEDIUM_LANE[medium]
        if packed:
            holders[endpoint_id] = packed
            return not (packed >> MEDIUM_SHIFT[medium]) & LANE_MASK
        del holders[endpoint_id]
        if not holders:
            del table[key]
        return True

    def _clear(self, state: _EndpointState) -> None:
        if state.blocks and self.residency is not None:
            self.residency.record(state.endpoint.id, "", cleared=True)
        for held in state.blocks.values():
            for medium in _MASK_MEDIA[held >> 64]:
                self._unlink(state.table, held & _KEY_MASK, state.endpoint.id, medium)
        state.blocks.clear()
        state.recent.clear()
        state.medium_blocks.clear()
        for block_hash in list(state.orphans):
            self._forget_orphan(state, block_hash)

    # -- queries ----------------------------------------------------------------------------

    def _block_sizes(self, model: str) -> list[int]:
        """Block sizes of ``model``'s registered endpoints, most common first (ties: smallest)."""
        sizes = Counter(st.block_size for st in self._endpoints.values() if st.endpoint.model == model)
        return [size for size, _ in sorted(sizes.items(), key=lambda item: (-item[1], item[0]))]

    def score(
        self,
        model: str,
        token_ids: Sequence[int],
        endpoint_ids: Sequence[EndpointId] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> ScoreResult:
        sizes = self._block_sizes(model)
        if not sizes:
            return ScoreResult([], 0, 0)
        wanted = set(endpoint_ids) if endpoint_ids else None
        scores: list[EndpointScore] = []
        primary_blocks = 0
        for size in sizes:
            keys = self._prompt_keys.block_keys(token_ids, size, scope.root_key())
            if scope.is_default and self._waiting.get((model, size)):
                self._resolve_from_prompt(model, size, token_ids, keys)
            if size == sizes[0]:
                primary_blocks = len(keys)
            table = self._tables.get((model, size), {})
            for endpoint_id, blocks in longest_prefix_matches(keys, table, wanted).items():
                media = self._endpoints[endpoint_id].medium_blocks
                if len(media) == 1:
                    by_medium = {next(iter(media)): blocks}
                else:
                    by_medium = media_counts(keys[:blocks], table, endpoint_id)
                scores.append(EndpointScore(endpoint_id, blocks, blocks * size, by_medium))
        scores.sort(key=lambda s: (-s.matched_blocks, s.endpoint_id))
        return ScoreResult(scores, primary_blocks, sizes[0])

    def lookup(self, model: str, token_ids: Sequence[int], scope: KeyScope = DEFAULT_SCOPE) -> list[BlockLocation]:
        sizes = self._block_sizes(model)
        if not sizes:
            return []
        table = self._tables.get((model, sizes[0]), {})
        locations = []
        for key in self._prompt_keys.block_keys(token_ids, sizes[0], scope.root_key()):
            holders = table.get(key, {})
            locations.append(BlockLocation(key, {eid: media_of(packed) for eid, packed in holders.items()}))
        return locations

    def residency_snapshot(self) -> list[tuple[EndpointId, str, list[int]]]:
        """Every ``(endpoint, medium, keys held)`` of the index: the state a replica starts from
        (O(held blocks); ~0.2 s per million on this machine, on the caller's loop)."""
        lists: dict[tuple[EndpointId, Medium], list[int]] = {}
        gpu = Medium.GPU
        for table in self._tables.values():
            for key, holders in table.items():
                for endpoint_id, packed in holders.items():
                    if packed <= LANE_MASK:  # GPU only: the common case
                        keys = lists.get((endpoint_id, gpu))
                        if keys is None:
                            keys = lists[(endpoint_id, gpu)] = []
                        keys.append(key)
                        continue
                    for medium in media_of(packed):
                        lists.setdefault((endpoint_id, medium), []).append(key)
        return [(endpoint_id, str(medium), keys) for (endpoint_id, medium), keys in sorted(lists.items())]

    def block_count(self) -> int:
        """Distinct block keys held by any endpoint (O(tables))."""
        return sum(len(table) for table in self._tables.values())

    def stats(self) -> IndexStats:
        per_endpoint = [
            EndpointIndexStats(eid, st.endpoint.model, st.block_size, len(st.blocks) + len(st.orphans), st.events_applied)
            for eid, st in sorted(self._endpoints.items())
        ]
        return IndexStats(
            blocks=self.block_count(),
            endpoints=len(self._endpoints),
            events_applied=self._outcomes[ApplyOutcome.APPLIED],
            outcomes=dict(self._outcomes),
            per_endpoint=per_endpoint,
        )

    def held_blocks(self, endpoint_id: EndpointId) -> dict[EngineBlockHash, frozenset[Medium]]:
        state = self._endpoints.get(endpoint_id)
        if state is None:
            return {}
        held = {h: _MASK_MEDIA[b >> 64] for h, b in state.blocks.items()}
        held.update((h, frozenset(o.media)) for h, o in state.orphans.items())
        return held

    def orphan_count(self) -> int:
        return sum(len(st.orphans) for st in self._endpoints.values())

    def dump(self) -> list[tuple[EndpointId, IndexEvent]]:
        events: list[tuple[EndpointId, IndexEvent]] = []
        for endpoint_id, state in sorted(self._endpoints.items()):
            by_medium: dict[Medium, tuple[list[int], list[int]]] = {}
            for block_hash, held in state.blocks.items():
                for medium in _MASK_MEDIA[held >> 64]:
                    hashes, keys = by_medium.setdefault(medium, ([], []))
                    hashes.append(block_hash)
                    keys.append(held & _KEY_MASK)
            for medium, (hashes, keys) in sorted(by_medium.items()):
                events.append(
                    (endpoint_id, KeyedBlockStored(tuple(hashes), tuple(keys), state.block_size, medium))
                )
            for block_hash, orphan in state.orphans.items():  # parents before children (insertion order)
                for medium in sorted(orphan.media):
                    events.append((endpoint_id, BlockStored(
                        block_hashes=[block_hash], parent_block_hash=orphan.parent, token_ids=orphan.tokens,
                        block_size=state.block_size, medium=str(medium),
                    )))
        return events
