"""In-memory :class:`~services.kv_indexer.index.base.KVBlockIndex`: hash maps, no I/O, one thread.

Layout (``E`` = endpoint id, ``M`` = medium):

* ``tables[(model, block_size)]``: ``block key -> {E: refcounts}``, ``refcounts`` one int packing a
  32-bit count per medium (:data:`services.kv_indexer.scoring.Holders`). One key space per model
  and block size, since a key chains the tokens of fixed-size blocks. A count is the number of engine
  hashes of ``E`` mapping to that key on ``M`` (normally 1; >1 only when an engine stores the same
  tokens under two hashes, e.g. two LoRA adapters).
* per registered endpoint: ``blocks: engine hash -> key | media bitmask << 64`` (one int: what
  ``BlockRemoved`` needs; bit ``i`` of the mask is ``Medium`` number ``i``),
  and ``recent`` / ``older``: the latest removed ``engine hash -> key`` pairs (two generations,
  at least the newest ``recent_removed_blocks``), so a chain stored after its parent was evicted
  can still be placed.
* per registered endpoint, ``orphans: engine hash -> (parent hash, tokens, media)``: blocks whose
  parent's key is not known yet (the index restarted, or lost the parent); ``waiting[(model,
  block size)]: parent hash -> endpoints with orphans under it``. An orphan is keyed (moved into
  ``blocks``) when its parent's key becomes known: the parent stored by any endpoint of the key
  space, or, for endpoints whose registration says ``hash_algo="sha256_cbor"``, a scored prompt
  whose vLLM hashes (:func:`kvmesh.hashing.sha256_cbor_block_hashes`) name it.

Costs: ``BlockStored`` of ``b`` blocks is O(b) hashing + O(b) dict writes; ``BlockRemoved`` O(b);
both are applied a chain at a time (:meth:`InMemoryIndex.apply_batch`: bulk ``dict.update`` /
``map(dict.pop)`` passes while one medium is in use and the hashes are new, a loop otherwise; a
batch's consecutive common stores share one ``dict.update`` per dict);
``AllBlocksCleared`` and ``remove_endpoint`` O(blocks of that endpoint); ``score`` see
:mod:`services.kv_indexer.scoring`.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import or_ as _or
from operator import xor as _xor

from kvmesh.hashing import (
    DEFAULT_SCOPE,
    KeyScope,
    PrefixKeyCache,
    block_keys,
    external_hash_to_int,
    list_block_keys,
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
    media_counts,
    media_of,
    prefix_matches,
)

logger = logging.getLogger(__name__)

Table = dict[BlockKey, dict[EndpointId, int]]

_KEY_MASK = 0xFFFFFFFFFFFFFFFF
_MEDIUM_TAG: dict[Medium, int] = {m: 1 << (64 + i) for i, m in enumerate(MEDIA)}
"""Media bit of each medium in a block's value (above the 64-bit key)."""
_FLIP = _MEDIUM_TAG[MEDIA[0]]
"""``blocks`` keeps ``value ^ _FLIP``: a block held on the GPU alone (the common case) is stored as
its key int itself, the same object the key table holds (no int made per stored block, none
unmade per removed one)."""
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

class _Sole(dict[EndpointId, int]):
    """The holders of every key that one endpoint alone holds, once, on one medium: one shared,
    never mutated ``{endpoint: lane}`` per (endpoint, medium) instead of a dict per key (the common
    case: ~200 bytes and an allocation per indexed block saved). Writers copy before changing a
    key's holders (:func:`_release`, ``_store_keyed``); readers see an ordinary mapping."""

    __slots__ = ()


def _release(table: Table, key: BlockKey, endpoint_id: EndpointId, lane: int, lane_mask: int) -> bool | None:
    """One hash of ``endpoint_id`` fewer for ``key`` on the medium of ``lane``: None when it held
    none there, True when it now holds none there, False when it still does."""
    holders = table.get(key)
    if holders is None:
        return None
    packed = holders.get(endpoint_id, 0)
    if not packed & lane_mask:
        return None
    packed -= lane
    if packed:
        if type(holders) is _Sole:  # copy on write
            table[key] = {**holders, endpoint_id: packed}
        else:
            holders[endpoint_id] = packed
    elif len(holders) == 1:
        del table[key]
    else:
        del holders[endpoint_id]  # a _Sole has one holder: never here
    return not packed & lane_mask


def _uint64_hashes(raw: list[int | bytes]) -> list[int]:
    """An event's block hashes as uint64 (:func:`external_hash_to_int`), the list itself when it
    already is (vLLM's default: one C-level pass, ``array('Q')``, instead of a Python loop)."""
    try:
        array("Q", raw)  # type: ignore[type-var]  # uint64 ints: raises for a negative, a digest, a non-int
        return raw  # type: ignore[return-value]
    except (OverflowError, TypeError):
        pass
    try:
        if not raw or (min(raw) >= 0 and max(raw) <= _KEY_MASK):  # type: ignore[operator]
            return raw  # type: ignore[return-value]
        return [h & _KEY_MASK for h in raw]  # type: ignore[operator]  # SGLang's int64
    except TypeError:  # 32-byte digests (or a mix)
        return [external_hash_to_int(h) for h in raw]


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
    """Engine hash -> ``(key | media bitmask << 64) ^ _FLIP`` (a GPU-only block: its key)."""
    recent: dict[EngineBlockHash, BlockKey] = field(default_factory=dict)
    """Removed ``engine hash -> key``, the current generation (fewer than ``recent_removed_blocks``;
    a re-removed hash's value is overwritten in place). When it reaches that many it becomes
    ``older`` and a new one starts: one ``dict.update`` per removal, no per-block LRU upkeep and no
    rebuild, and at least the newest ``recent_removed_blocks`` pairs are always remembered."""
    older: dict[EngineBlockHash, BlockKey] = field(default_factory=dict)
    """The previous generation of ``recent`` (looked up after it)."""
    medium_blocks: Counter[Medium] = field(default_factory=Counter)
    """Blocks held per medium: with one medium in use, Score needs no per-medium walk."""
    events_applied: int = 0
    orphans: dict[EngineBlockHash, _Orphan] = field(default_factory=dict)
    children: dict[EngineBlockHash, set[EngineBlockHash]] = field(default_factory=dict)
    """Orphans by parent hash."""
    sole: dict[Medium, _Sole] = field(default_factory=dict)
    """This endpoint's shared holders value per medium (:class:`_Sole`)."""

    def sole_for(self, medium: Medium) -> _Sole:
        holders = self.sole.get(medium)
        if holders is None:
            holders = self.sole[medium] = _Sole({self.endpoint.id: MEDIUM_LANE[medium]})
        return holders


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
        outcome = ApplyOutcome.UNREGISTERED if state is None else self._apply_one(state, event)
        self._outcomes[outcome] += 1
        if outcome is ApplyOutcome.APPLIED and state is not None:
            state.events_applied += 1
        return outcome

    def _apply_one(self, state: _EndpointState, event: IndexEvent) -> ApplyOutcome:
        if isinstance(event, BlockStored):
            return self._apply_stored(state, event)
        if isinstance(event, BlockRemoved):
            return self._apply_removed(state, event)
        if isinstance(event, AllBlocksCleared):
            self._clear(state)
            return ApplyOutcome.APPLIED
        if isinstance(event, KeyedBlockStored):
            return self._apply_keyed(state, event)
        return ApplyOutcome.INVALID

    def apply_batch(self, endpoint_id: EndpointId, events: Iterable[IndexEvent]) -> list[ApplyOutcome]:
        """:meth:`apply` of each event in order (one ZMQ message's batch), with one dispatch and
        one outcome count per batch instead of per event. Returns the outcomes, in order.

        A ``BlockStored`` in the common shape (a known medium, the endpoint's block size, whole
        blocks, uint64 hashes, no LoRA / salt / content extras, its parent held by the endpoint or
        none, no orphan waiting in its key space) only has its keys computed here; consecutive
        common stores on one medium form a run, written by :meth:`_write_run` with one
        ``dict.update`` into the endpoint's blocks and one into the key table for the whole run
        (every key sharing the endpoint's sole-holder value) when its hashes are new to the
        endpoint and its keys new to the index. Anything else writes the run first, then takes
        the general path (:meth:`_apply_stored` and the rest), with the same result as
        :meth:`apply` per event."""
        state = self._endpoints.get(endpoint_id)
        if state is None:
            outcomes = [ApplyOutcome.UNREGISTERED for _ in events]
            self._outcomes[ApplyOutcome.UNREGISTERED] += len(outcomes)
            return outcomes
        outcomes = []
        append = outcomes.append
        applied = ApplyOutcome.APPLIED
        blocks = state.blocks
        size = state.block_size  # what the general path may change, re-read after it runs
        quiet = not state.children and not self._waiting.get((state.endpoint.model, size))
        run: list[BlockStored] = []  # common stores not written yet, in order, all on run_medium
        run_hashes: list[int] = []
        run_keys: list[int] = []
        run_medium: Medium | None = None
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                stored_event: BlockStored = event  # type: ignore[assignment]
                medium = _MEDIUM_OF.get(stored_event.medium)
                if run and medium is not run_medium:  # a run is on one medium: write it first
                    self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
                    run, run_hashes, run_keys = [], [], []
                hashes: list[int] = stored_event.block_hashes  # type: ignore[assignment]  # checked below
                n = len(hashes)
                parent = stored_event.parent_block_hash
                if parent is None:
                    parent_key: int | None = 0
                else:
                    parent_key = blocks.get(parent)  # type: ignore[arg-type]  # a digest: not held
                    if parent_key is None and run:  # maybe stored earlier in the run: write it first
                        self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
                        run, run_hashes, run_keys = [], [], []
                        parent_key = blocks.get(parent)  # type: ignore[arg-type]
                # Nothing below writes the run, so the parent's key and this chain's keys are what
                # apply() per event would compute unless the run also re-sends a hash the endpoint
                # holds (the parent's, say): then _write_run re-applies every event of the run.
                if (
                    quiet and medium is not None and parent_key is not None and n > 0
                    and stored_event.block_size == size and len(stored_event.token_ids) == n * size
                    and stored_event.lora_name is None and stored_event.lora_id is None
                    and not stored_event.extra_keys and type(stored_event.cache_salt) is not str
                ):
                    try:
                        array("Q", hashes)  # uint64 ints (vLLM's), else (SGLang's int64, digests) the general path
                        keys = list_block_keys(stored_event.token_ids, size, parent_key & _KEY_MASK)
                    except (OverflowError, ValueError, TypeError):
                        keys = None  # the general path (which says INVALID for bad token ids)
                    if keys is not None:
                        if run:
                            run_keys += keys
                        else:
                            run_medium = medium
                            run_keys = keys
                        run.append(stored_event)
                        run_hashes += hashes
                        continue
                if run:
                    self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
                    run, run_hashes, run_keys = [], [], []
                append(self._apply_stored(state, stored_event))
            elif kind is BlockRemoved:
                if run:
                    self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
                    run, run_hashes, run_keys = [], [], []
                append(self._apply_removed(state, event))  # type: ignore[arg-type]
                continue  # a removal neither orphans nor changes the key space
            else:  # AllBlocksCleared, KeyedBlockStored, anything else
                if run:
                    self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
                    run, run_hashes, run_keys = [], [], []
                append(self._apply_one(state, event))
            blocks = state.blocks
            size = state.block_size
            quiet = not state.children and not self._waiting.get((state.endpoint.model, size))
        if run:
            self._write_run(state, run, run_hashes, run_keys, run_medium, outcomes)  # type: ignore[arg-type]
        applied_count = outcomes.count(applied)
        state.events_applied += applied_count
        if applied_count == len(outcomes):
            self._outcomes[applied] += applied_count
        else:
            self._outcomes.update(outcomes)
        return outcomes

    def _write_run(
        self,
        state: _EndpointState,
        run: list[BlockStored],
        hashes: list[int],
        keys: list[int],
        medium: Medium,
        outcomes: list[ApplyOutcome],
    ) -> None:
        """Write a run of common stores (:meth:`apply_batch`; ``hashes`` and ``keys`` their chains
        end to end) and append their outcomes. When every hash is new to the endpoint and every key
        new to the index, with none repeated within the run: one ``dict.update`` per dict, one
        medium count, the residency records per event as :meth:`apply` makes them. Otherwise (a
        hash the endpoint holds or the run repeats, a key the index holds or the run repeats) each
        event goes through :meth:`_apply_stored` in order instead, with nothing of the run written."""
        blocks, table = state.blocks, state.table
        n = len(hashes)
        if blocks.keys().isdisjoint(hashes) and table.keys().isdisjoint(keys):
            stored = _MEDIUM_TAG[medium] ^ _FLIP
            before_blocks, before_keys = len(blocks), len(table)
            blocks.update(zip(hashes, map(_or, keys, repeat(stored, n)) if stored else keys, strict=True))
            table.update(zip(keys, repeat(state.sole.get(medium) or state.sole_for(medium), n), strict=True))
            if len(blocks) - before_blocks == n and len(table) - before_keys == n:
                state.medium_blocks[medium] += n
                log = self.residency
                if log is not None:
                    endpoint_id, name = state.endpoint.id, str(medium)
                    if len(run) == 1:
                        log.record(endpoint_id, name, keys, ())
                    else:
                        start = 0
                        for event in run:
                            end = start + len(event.block_hashes)
                            log.record(endpoint_id, name, keys[start:end], ())
                            start = end
                outcomes += repeat(ApplyOutcome.APPLIED, len(run))
                return
            # a hash or a key repeated within the run: undo, each event through the general path
            deque(map(blocks.pop, hashes, repeat(None, n)), maxlen=0)
            deque(map(table.pop, keys, repeat(None, n)), maxlen=0)
        outcomes += map(self._apply_stored, repeat(state), run)

    def _apply_stored(self, state: _EndpointState, event: BlockStored) -> ApplyOutcome:
        medium = _MEDIUM_OF.get(event.medium)
        if medium is None:
            try:
                medium = _parse_medium(event.medium)
            except ValueError:
                return ApplyOutcome.INVALID
        hashes = _uint64_hashes(event.block_hashes)
        if not event.token_ids and hashes and event.block_size in (0, state.block_size):
            # vLLM 0.32 OffloadingConnector's form: hashes only, a new medium. Its default (not
            # self-describing) placeholder carries block_size 0, one hash per event
            # (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py, _placeholder_stored).
            return self._apply_medium_only(state, hashes, medium)
        if event.block_size != state.block_size and not self._adopt_block_size(state, event.block_size):
            return ApplyOutcome.INVALID
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
                keys = list_block_keys(event.token_ids, state.block_size, parent_key or 0)
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
        medium = _MEDIUM_OF.get(event.medium)
        if medium is None:
            try:
                medium = _parse_medium(event.medium)
            except ValueError:
                return ApplyOutcome.INVALID
        hashes = _uint64_hashes(event.block_hashes)
        counts = state.medium_blocks
        if len(counts) == 1 and medium in counts:
            return self._remove_bulk(state, hashes, medium)
        tag = _MEDIUM_TAG[medium]
        lane = MEDIUM_LANE[medium]
        blocks = state.blocks
        table = state.table
        endpoint_id = state.endpoint.id
        log = self.residency
        gone: list[int] | None = [] if log is not None else None
        lane_mask = LANE_MASK * lane
        removed = 0
        left_hashes: list[int] = []
        left_keys: list[int] = []
        for block_hash in hashes:  # _drop, inlined
            held = blocks.get(block_hash)
            if held is not None and (held ^ _FLIP) & tag:
                removed += 1
                held ^= _FLIP ^ tag
                key = held & _KEY_MASK
                if held >> 64:
                    blocks[block_hash] = held ^ _FLIP
                else:
                    del blocks[block_hash]
                    left_hashes.append(block_hash)
                    left_keys.append(key)
                if _release(table, key, endpoint_id, lane, lane_mask) and gone is not None:
                    gone.append(key)
                continue
            orphan = state.orphans.get(block_hash)
            if orphan is not None:
                orphan.media.discard(medium)
                if not orphan.media:
                    self._forget_orphan(state, block_hash)
        if gone:
            log.record(endpoint_id, str(medium), (), gone)  # type: ignore[union-attr]
        if removed:
            counts[medium] -= removed
            if counts[medium] <= 0:
                del counts[medium]
        if left_hashes:
            self._remember_removed(state, left_hashes, left_keys)
        return ApplyOutcome.APPLIED

    def _remove_bulk(self, state: _EndpointState, hashes: list[int], medium: Medium) -> ApplyOutcome:
        """``BlockRemoved`` while every held block is on ``medium`` alone (one medium in use, the
        common case): the blocks leave wholesale, with C-level passes (``map``) where a Python loop
        per block was. Same result as the general path."""
        blocks = state.blocks
        values = list(map(blocks.pop, hashes, repeat(None, len(hashes))))
        if None in values:  # not held: maybe an orphan, else a no-op
            if state.orphans:
                for block_hash, value in zip(hashes, values, strict=True):
                    if value is None and block_hash in state.orphans:
                        orphan = state.orphans[block_hash]
                        orphan.media.discard(medium)
                        if not orphan.media:
                            self._forget_orphan(state, block_hash)
            hashes = [h for h, v in zip(hashes, values, strict=True) if v is not None]
            values = [v for v in values if v is not None]
        n = len(values)
        if not n:
            return ApplyOutcome.APPLIED
        stored = _MEDIUM_TAG[medium] ^ _FLIP  # one medium in use: every value is key | stored
        keys: list[int] = list(map(_xor, values, repeat(stored, n))) if stored else values  # type: ignore[assignment]
        counts = state.medium_blocks
        counts[medium] -= n
        if counts[medium] <= 0:
            del counts[medium]
        self._remember_removed(state, hashes, keys)
        table = state.table
        endpoint_id = state.endpoint.id
        lane = MEDIUM_LANE[medium]
        sole = state.sole_for(medium)
        popped = list(map(table.pop, keys, repeat(None, n)))
        log = self.residency
        if popped.count(sole) == n:  # each key's only holder, one hash (identity tests): keys leave
            if log is not None:
                log.record(endpoint_id, str(medium), (), keys)
            return ApplyOutcome.APPLIED
        lane_mask = LANE_MASK * lane
        gone: list[int] = []
        for key, holders in zip(keys, popped, strict=True):  # put back what others hold too, then release
            if holders is sole:
                gone.append(key)
                continue
            if holders is not None:
                table[key] = holders
            if _release(table, key, endpoint_id, lane, lane_mask):  # (a repeated key: popped None)
                gone.append(key)
        if log is not None and gone:
            log.record(endpoint_id, str(medium), (), gone)
        return ApplyOutcome.APPLIED

    def _remember_removed(self, state: _EndpointState, hashes: list[int], keys: list[int]) -> None:
        """Blocks that left the endpoint go to ``recent``; see ``_EndpointState.recent``."""
        limit = self._recent_limit
        if not limit:
            return
        if len(hashes) >= limit:  # one removal fills a generation: its newest ``limit`` pairs
            state.older = dict(zip(hashes[-limit:], keys[-limit:], strict=True))
            state.recent = {}
            return
        recent = state.recent
        recent.update(zip(hashes, keys, strict=True))
        if len(recent) >= limit:
            state.older = recent
            state.recent = {}

    # -- chains without their parents -------------------------------------------------------

    def _key_of(self, state: _EndpointState, block_hash: EngineBlockHash) -> BlockKey | None:
        """The kvmesh key of an engine hash: this endpoint's blocks, its recent removals, then any
        endpoint of the same key space (engines hashing alike agree on hashes)."""
        held = state.blocks.get(block_hash)
        if held is not None:
            return held & _KEY_MASK
        recent = state.recent.get(block_hash)
        if recent is None:
            recent = state.older.get(block_hash)
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
        n = len(hashes)
        if n != len(keys):
            raise ValueError(f"{n} block hashes but {len(keys)} keys")
        if n and blocks.keys().isdisjoint(hashes):  # the common case, in bulk: hashes new to this endpoint
            size = len(blocks)
            stored = tag ^ _FLIP
            blocks.update(zip(hashes, map(_or, keys, repeat(stored, n)) if stored else keys, strict=True))
            if len(blocks) - size != n:  # a hash repeated in the chain: undo, the general path below
                deque(map(blocks.pop, hashes, repeat(None, n)), maxlen=0)
            else:
                self._hold_new_keys(state, keys, medium)
                return
        new: list[int] | None = [] if log is not None else None
        added = 0
        for block_hash, key in zip(hashes, keys, strict=True):
            held = blocks.get(block_hash)
            if held is None:
                blocks[block_hash] = (key | tag) ^ _FLIP
            elif held & _KEY_MASK == key:
                held ^= _FLIP
                if held & tag:
                    continue  # a repeat: idempotent
                blocks[block_hash] = (held | tag) ^ _FLIP
            else:  # the engine reused a hash for other content: replace
                held ^= _FLIP
                for old_medium in _MASK_MEDIA[held >> 64]:
                    held = self._drop(state, block_hash, held, old_medium)
                blocks[block_hash] = (key | tag) ^ _FLIP
            added += 1
            holders = table.get(key)
            if holders is None:
                table[key] = state.sole_for(medium)
                if new is not None:
                    new.append(key)
            else:
                if type(holders) is _Sole:  # copy on write
                    holders = table[key] = dict(holders)
                old = holders.get(endpoint_id, 0)
                holders[endpoint_id] = old + lane
                if new is not None and not old & lane_mask:
                    new.append(key)
        if added:
            state.medium_blocks[medium] += added
        if new:
            log.record(endpoint_id, str(medium), new, ())  # type: ignore[union-attr]

    def _hold_new_keys(self, state: _EndpointState, keys: list[int], medium: Medium) -> None:
        """``state`` holds one more hash on ``medium`` for each of ``keys`` (its ``blocks`` written)."""
        n = len(keys)
        state.medium_blocks[medium] += n
        sole = state.sole_for(medium)
        table = state.table
        log = self.residency
        endpoint_id = state.endpoint.id
        if table.keys().isdisjoint(keys):  # keys new to the index: all share the sole holders value
            size = len(table)
            table.update(zip(keys, repeat(sole, n), strict=True))
            if len(table) - size == n:
                if log is not None:
                    log.record(endpoint_id, str(medium), list(keys), ())
                return
            deque(map(table.pop, keys), maxlen=0)  # a key repeated in the chain: undo, per key below
        lane = MEDIUM_LANE[medium]
        lane_mask = LANE_MASK * lane
        fresh: list[int] = []
        for key in keys:
            holders = table.get(key)
            if holders is None:
                table[key] = sole
                fresh.append(key)
                continue
            if type(holders) is _Sole:  # copy on write
                holders = table[key] = dict(holders)
            old = holders.get(endpoint_id, 0)
            holders[endpoint_id] = old + lane
            if not old & lane_mask:
                fresh.append(key)
        if log is not None and fresh:
            log.record(endpoint_id, str(medium), fresh, ())

    def _drop(self, state: _EndpointState, block_hash: EngineBlockHash, held: int, medium: Medium) -> int:
        """``held`` (the block's value, ``blocks``' entry ``^ _FLIP``) leaves ``medium``; returns its new value (0: gone)."""
        held &= ~_MEDIUM_TAG[medium]
        counts = state.medium_blocks
        counts[medium] -= 1
        if counts[medium] <= 0:
            del counts[medium]
        key = held & _KEY_MASK
        if held >> 64:
            state.blocks[block_hash] = held ^ _FLIP
        else:
            held = 0
            del state.blocks[block_hash]
            self._remember_removed(state, [block_hash], [key])
        if self._unlink(state.table, key, state.endpoint.id, medium) and self.residency is not None:
            self.residency.record(state.endpoint.id, str(medium), (), [key])
        return held

    @staticmethod
    def _unlink(table: Table, key: BlockKey, endpoint_id: EndpointId, medium: Medium) -> bool:
        """One hash of ``endpoint_id`` on ``medium`` fewer for ``key``; True when none is left on it."""
        lane = MEDIUM_LANE[medium]
        return bool(_release(table, key, endpoint_id, lane, LANE_MASK * lane))

    def forget_blocks(self, endpoint_id: EndpointId) -> int:
        """Forget every entry of ``endpoint_id`` (its blocks on every medium and its orphans), as an
        ``AllBlocksCleared`` does, after its event stream lost messages for good: those entries may be
        stale. Unlike a clear, its blocks' ``engine hash -> key`` pairs are kept as its recent removals
        (until ``recent_removed_blocks`` later removals roll them out), so a chain the engine stores
        after the loss on a parent it stored before still gets its keys; a pair only says what a hash
        stands for, never that the block is held. Replicas see one ``cleared`` record.

        Returns the entries forgotten (blocks + orphans); 0 for an unregistered endpoint.
        """
        state = self._endpoints.get(endpoint_id)
        if state is None:
            return 0
        forgotten = len(state.blocks) + len(state.orphans)
        pairs = {block_hash: held & _KEY_MASK for block_hash, held in state.blocks.items()}
        recent = {**state.older, **state.recent}
        self._clear(state)
        if self._recent_limit:
            recent.update(pairs)
            state.older = recent
        return forgotten

    def _clear(self, state: _EndpointState) -> None:
        if state.blocks and self.residency is not None:
            self.residency.record(state.endpoint.id, "", cleared=True)
        for held in state.blocks.values():
            for medium in _MASK_MEDIA[(held ^ _FLIP) >> 64]:
                self._unlink(state.table, held & _KEY_MASK, state.endpoint.id, medium)
        state.blocks.clear()
        state.recent.clear()
        state.older.clear()
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
            for endpoint_id, blocks in prefix_matches(keys, table, wanted).items():
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
        held = {h: _MASK_MEDIA[(b ^ _FLIP) >> 64] for h, b in state.blocks.items()}
        held.update((h, frozenset(o.media)) for h, o in state.orphans.items())
        return held

    def orphan_count(self) -> int:
        return sum(len(st.orphans) for st in self._endpoints.values())

    def dump(self) -> list[tuple[EndpointId, IndexEvent]]:
        events: list[tuple[EndpointId, IndexEvent]] = []
        for endpoint_id, state in sorted(self._endpoints.items()):
            by_medium: dict[Medium, tuple[list[int], list[int]]] = {}
            for block_hash, held in state.blocks.items():
                for medium in _MASK_MEDIA[(held ^ _FLIP) >> 64]:
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
