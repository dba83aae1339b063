"""Prefix scoring shared by kv_indexer (the global index) and epp (its event-fed replica).

:func:`longest_prefix_matches` is the walk both use: given a prompt's chained block keys
(:func:`kvmesh.hashing.block_keys`) and a table ``key -> {endpoint: media}``, per endpoint the
number of leading blocks it holds. :class:`PrefixReplica` is a replica of kv_indexer's key
residency (which endpoint holds which key on which medium), fed by its ``Watch`` stream
(``kvmesh.kv_indexer.v1.KVIndexer/Watch``: a snapshot, then ordered deltas), so a precise pick
scores in process with no kv_indexer call, as llm-d's EPP embeds its kv-cache indexer.

Pure: no I/O, one thread (the owner's event loop). The transport that feeds the replica is epp's
``services/epp/kv_indexer_client.py``.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat, takewhile
from operator import itemgetter, methodcaller, or_
from typing import Any, TypeVar, overload

from kvmesh.hashing import DEFAULT_SCOPE, KeyScope, PrefixKeyCache, TokenIds
from kvmesh.kv_reach import Reach, build_reach
from kvmesh.types import Medium

LIVE = "live"
"""The state of an endpoint whose entries are scored (kv_indexer's recovery state ``live``)."""


E = TypeVar("E", bound=Hashable)
"""An endpoint id type (``str``, ``kvmesh.types.EndpointId``)."""


_FIRST_CHUNK = 32
"""Blocks fetched in the walk's first pass; each later pass fetches 4x more."""


def longest_prefix_matches(
    keys: Sequence[int],
    table: Mapping[int, Mapping[E, Any]],
    candidates: Collection[E] | None = None,
) -> dict[E, int]:
    """Per endpoint with at least one matched block, the longest consecutive prefix of ``keys`` it holds.

    Walks the keys keeping the set of endpoints that held every block so far; an endpoint leaves
    the set at the first block it does not hold (its match: the blocks before it); stops when the
    set is empty or a key has no holder, i.e. as soon as no endpoint can extend its match. Same
    walk as llm-d's longest-prefix scorer and Dynamo's ``find_matches``, on a flat hash map since
    the keys are already chained. Walked in C-level passes: a pass's holders are fetched with one
    ``map(table.get, ...)``, and runs of equal holders (kv_indexer's one shared value for the keys
    an endpoint holds alone, equal ``{endpoint: media}`` dicts in epp's replica) are skipped by
    :func:`itertools.groupby`, so Python runs per change of holders, not per block (a subset test
    only where the holders change). Passes start at 32 blocks and grow 4x, so a prompt whose
    prefix nobody holds past a few blocks fetches little. kv_indexer's Score and epp's replica both
    use this walk (``services/kv_indexer/scoring.py``, :class:`PrefixReplica`).

    Args:
        keys: the prompt's chained block keys, block 0 first.
        table: block key -> holders (endpoint -> a non-zero media value).
        candidates: restrict to these endpoints (None: every holder).

    Returns:
        ``{endpoint: n}`` with ``1 <= n <= len(keys)``.
    """
    total = len(keys)
    if not total:
        return {}
    get = table.get
    first = get(keys[0])
    if not first:
        return {}
    active = set(first) if candidates is None else set(first).intersection(candidates)
    result: dict[E, int] = {}
    matched = 0  # blocks every endpoint in ``active`` holds
    checked: object = None  # the last holders value found to cover ``active``
    chunk = _FIRST_CHUNK
    while active and matched < total:
        stop = min(total, matched + chunk)
        chunk *= 4
        for holders, run in groupby(map(get, keys[matched:stop])):
            if not holders:  # nobody holds this block: nobody matches further
                for endpoint_id in active:
                    result[endpoint_id] = matched
                return result
            if holders is not checked:
                present = holders.keys()
                if not present >= active:
                    survivors = active.intersection(present)
                    for endpoint_id in active.difference(survivors):
                        result[endpoint_id] = matched
                    active = survivors
                    if not active:
                        return result
                checked = holders
            matched += len(list(run))
    for endpoint_id in active:
        result[endpoint_id] = matched
    return result


_NONE: Mapping[Any, int] = {}
"""The holders of a key nobody holds (the C-level walk's default)."""


@dataclass(frozen=True, slots=True)
class ReplicaEndpoint:
    """An endpoint as the replica knows it (``WatchedEndpoint``): only ``state == "live"`` is scored.

    ``kv_source``: a kv_store, never scored; its blocks count for the engines that reach it
    (:mod:`kvmesh.kv_reach`): an engine's ``kv_stores`` (source ids), a source's ``shared_domains``.
    ``reach_listed``: those two are filled (a kv_indexer from before them sends neither); a model with
    a source some endpoint of which is not ``reach_listed`` is left to kv_indexer's Score."""

    endpoint_id: str
    model: str
    block_size_tokens: int
    state: str = LIVE
    kv_source: bool = False
    kv_stores: tuple[str, ...] = ()
    shared_domains: tuple[str, ...] = ()
    reach_listed: bool = False


@dataclass(frozen=True, slots=True)
class ReplicaScore:
    """A local Score: the prompt's full blocks at the model's primary block size and, per scored
    endpoint, its matched leading blocks (only endpoints with >= 1) and, of those, how many it holds
    on each medium (``{"GPU": n, "CPU": m}``; a block on two media counts in both, every matched
    endpoint listed: kv_indexer's ``EndpointScore.matched_blocks_by_medium``)."""

    total_blocks: int
    block_size_tokens: int
    matched_blocks: dict[str, int]
    matched_blocks_by_medium: dict[str, dict[str, int]] = field(default_factory=dict)
    reached_blocks: dict[str, int] = field(default_factory=dict)
    """Per endpoint whose match a kv_store extends: the matched blocks past its own run (kv_indexer's
    ``EndpointScore.reached_blocks``); endpoints without any are absent."""


class PackedTokenIds(Sequence[int]):
    """Token ids held as their little-endian uint32 bytes (``packed``, 4 per token): a read-only
    ``Sequence[int]`` (indexing, slices as lists, iteration in C) equal to the same ids as a list.

    epp's tokenizer keeps a cached chat's prompt this way and appends only the new turn's bytes
    (:meth:`spliced`: a memcpy), and the replica hashes straight from ``packed``: a grown 33k-token
    chat costs neither a copy of 33k Python ints nor their conversion to a buffer (~0.2-0.5 ms each)
    on every pick. Little-endian hosts only (``array('I')`` is the packing; callers check).
    """

    __slots__ = ("_view", "packed")

    def __init__(self, packed: bytes) -> None:
        if len(packed) % 4:
            raise ValueError(f"{len(packed)} packed bytes: not uint32 token ids")
        self.packed = packed
        self._view = memoryview(packed).cast("I")

    @classmethod
    def build(cls, ids: Sequence[int]) -> PackedTokenIds:
        """``ids`` packed (``OverflowError``: an id outside uint32)."""
        return cls(array("I", ids).tobytes())

    def spliced(self, keep: int, tail: Sequence[int]) -> PackedTokenIds:
        """``self[:keep] + tail``: the kept ids' bytes reused, only ``tail`` packed (one copy of the kept
        bytes: a slice would copy them twice, and fresh pages cost more than the copy)."""
        return PackedTokenIds(b"".join((memoryview(self.packed)[: 4 * keep], array("I", tail))))

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._view[i].tolist()
        return int(self._view[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def tolist(self) -> list[int]:
        return self._view.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokenIds):
            return self.packed == other.packed
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self._view.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedTokenIds({len(self)} ids)"


def packed_or_ids(token_ids: TokenIds) -> TokenIds:
    """The little-endian uint32 bytes of ``token_ids`` when it carries them (:class:`PackedTokenIds`), else itself."""
    packed = getattr(token_ids, "packed", None)
    return packed if type(packed) is bytes else token_ids


@dataclass(slots=True)
class _Walk:
    """A scored prompt's walk: the key space's removal epoch then, and the matches."""

    epoch: int
    matched: dict[str, int]


_WALKS = 4096
"""Scored prompts (by key space and last key) whose walk :class:`PrefixReplica` keeps (LRU)."""
_WALK_PROBES = 256
"""How many of a prompt's last keys are looked up for a scored prefix (a turn adds fewer blocks)."""


def extend_matches(
    keys: Sequence[int],
    table: Mapping[int, Mapping[E, int]],
    candidates: Collection[E] | None,
    known: Mapping[E, int],
) -> dict[E, int]:
    """:func:`longest_prefix_matches`, given ``known[e]`` leading blocks of ``keys`` each endpoint is known to hold.

    Each holder of ``keys[0]`` (among ``candidates``) is walked from ``known.get(e, 1)`` on, so a
    prompt that extends one whose matches are known costs its new blocks, not the whole prompt.
    Exact when ``known`` is true now: the caller guarantees that no endpoint dropped any of those
    keys since they were counted (:class:`PrefixReplica`: no removal in the key space since).
    """
    if not keys:
        return {}
    first = table.get(keys[0])
    if not first:
        return {}
    active = first.keys() if candidates is None else set(first.keys()).intersection(candidates)
    n = len(keys)
    get = table.get
    result: dict[E, int] = {}
    for endpoint_id in active:
        i = known.get(endpoint_id, 1) or 1
        while i < n and endpoint_id in get(keys[i], _NONE):
            i += 1
        result[endpoint_id] = i
    return result


class ReplicaGap(Exception):
    """A delta message does not follow the replica's sequence: it must resync (reconnect)."""


class PrefixReplica:
    """kv_indexer's key residency, replayed from its ``Watch`` stream; scores like ``Score``.

    State: ``tables[(model, block_size)]: key -> {endpoint: media bitmask}`` (bit ``i`` = the
    ``i``-th medium name seen), per endpoint how many keys it holds on each medium, the endpoint
    list, readiness and load-only models. The key space and the walk are kv_indexer's
    (:func:`kvmesh.hashing.block_keys` in the request's :class:`~kvmesh.hashing.KeyScope`,
    :func:`longest_prefix_matches`), and the per-medium counts are its ``media_counts`` (each
    matched block counted once on every medium holding it; an endpoint holding keys on one medium
    only needs no walk), so a local score equals kv_indexer's for the same state.

    Sequence: each message covers the server's log range ``(prev_seq, seq]``; a message whose
    ``prev_seq`` is not the replica's ``seq`` raises :class:`ReplicaGap` (the caller reconnects,
    which starts with a snapshot). ``synced`` is False from a reset until the snapshot's last
    message; :meth:`score` must not be used while it is False.

    Args:
        prompt_key_cache_bytes: bound of the prompts' key cache (a prompt extending a recent one
            hashes only its new blocks; 0 disables).
    """

    def __init__(self, prompt_key_cache_bytes: int = 64 << 20) -> None:
        self._keys = PrefixKeyCache(prompt_key_cache_bytes)
        self._walks: OrderedDict[tuple[str, int, int], _Walk] = OrderedDict()
        """Per (key space, a scored prompt's last key): its walk, reused by a prompt that extends it
        while no key was removed from that space (:meth:`_matches`)."""
        self._removals: dict[tuple[str, int], int] = {}
        """Per key space: a counter bumped whenever an endpoint stops holding a key there."""
        self.reuse_walks = True
        """Whether a prompt extending the last one walks only its new blocks (False: every score walks
        the whole prompt; the benchmark's A/B switch)."""
        self.tables: dict[tuple[str, int], dict[int, dict[str, int]]] = {}
        self.endpoints: dict[str, ReplicaEndpoint] = {}
        self._space: dict[str, tuple[str, int]] = {}
        self._media: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._held: dict[str, dict[int, int]] = {}
        self._sizes: dict[str, list[int]] = {}
        self._deferred: set[str] = set()
        self._reach: dict[str, Reach[str]] = {}
        """Per model with a live kv_store source some engine reaches: the reach (folded by :meth:`score`)."""
        self._not_live: frozenset[str] = frozenset()
        """Listed endpoints whose state is not ``live`` (not scored)."""
        self.seq = 0
        self.synced = False
        self.ready = False
        self.load_only: frozenset[str] = frozenset()

    # -- feeding ----------------------------------------------------------------------------

    def reset(self, seq: int) -> None:
        """Forget everything; a snapshot as of ``seq`` follows."""
        self.tables.clear()
        self._held.clear()
        self._walks.clear()
        self.seq = seq
        self.synced = False

    def check_sequence(self, prev_seq: int) -> None:
        """Raises :class:`ReplicaGap` unless a message starting after ``prev_seq`` follows this replica."""
        if prev_seq != self.seq:
            raise ReplicaGap(f"message starts after seq {prev_seq}, replica is at {self.seq}")

    def set_endpoints(self, endpoints: Iterable[ReplicaEndpoint]) -> None:
        """Replace the endpoint list; endpoints no longer listed lose their entries."""
        new = {e.endpoint_id: e for e in endpoints}
        for endpoint_id, old in self.endpoints.items():
            now = new.get(endpoint_id)
            if now is None or (now.model, now.block_size_tokens) != (old.model, old.block_size_tokens):
                self.clear_endpoint(endpoint_id)
        self.endpoints = new
        self._space = {e.endpoint_id: (e.model, e.block_size_tokens) for e in new.values()}
        by_model: dict[str, dict[int, int]] = {}
        deferred: set[str] = set()
        with_sources: set[str] = set()
        for e in new.values():
            sizes = by_model.setdefault(e.model, {})
            sizes[e.block_size_tokens] = sizes.get(e.block_size_tokens, 0) + 1
            if e.kv_source:
                with_sources.add(e.model)
        for e in new.values():
            if e.model in with_sources and not e.reach_listed:
                deferred.add(e.model)  # a kv_indexer that does not list the reach: its Score folds
        self._reach = {}
        for model in with_sources - deferred:
            of_model = [e for e in new.values() if e.model == model]
            reach = build_reach(
                {e.endpoint_id: e.kv_stores for e in of_model if not e.kv_source},
                {e.endpoint_id: e.shared_domains for e in of_model if e.kv_source and e.state == LIVE},
            )
            if reach.direct:
                self._reach[model] = reach
        # most common block size first, ties smallest (kv_indexer's InMemoryIndex._block_sizes)
        self._sizes = {m: sorted(s, key=lambda size: (-s[size], size)) for m, s in by_model.items()}
        self._deferred = deferred
        self._not_live = frozenset(e.endpoint_id for e in new.values() if e.state != LIVE)

    def set_status(self, ready: bool, load_only_models: Iterable[str]) -> None:
        self.ready = ready
        self.load_only = frozenset(load_only_models)

    def _bit(self, medium: str) -> int:
        bit = self._media.get(medium)
        if bit is None:
            bit = self._media[medium] = 1 << len(self._media)
            self._names[bit] = medium
        return bit

    def apply_delta(
        self, endpoint_id: str, medium: str, added: Iterable[int], removed: Iterable[int], cleared: bool = False
    ) -> None:
        """One endpoint's residency change on ``medium`` (``cleared`` first: every key of the endpoint goes).

        Keys of an endpoint not in the endpoint list are ignored (the list always comes first)."""
        space = self._space.get(endpoint_id)
        if space is None:
            return
        if cleared:
            self.clear_endpoint(endpoint_id)
        if not added and not removed:
            return
        table = self.tables.get(space)
        if table is None:
            table = self.tables[space] = {}
        bit = self._bit(medium)
        change = 0  # keys of the endpoint gaining (+) or losing (-) this medium
        for key in added:
            holders = table.get(key)
            if holders is None:
                table[key] = {endpoint_id: bit}
                change += 1
            else:
                old = holders.get(endpoint_id, 0)
                if not old & bit:
                    holders[endpoint_id] = old | bit
                    change += 1
        for key in removed:
            holders = table.get(key)
            if holders is None:
                continue
            old = holders.get(endpoint_id, 0)
            if not old & bit:
                continue
            change -= 1
            mask = old & ~bit
            if mask:
                holders[endpoint_id] = mask
            else:
                del holders[endpoint_id]
                self._removals[space] = self._removals.get(space, 0) + 1
                if not holders:
                    del table[key]
        if change:
            held = self._held.setdefault(endpoint_id, {})
            count = held.get(bit, 0) + change
            if count > 0:
                held[bit] = count
            else:
                held.pop(bit, None)

    def clear_endpoint(self, endpoint_id: str) -> None:
        """Drop every key of ``endpoint_id`` (O(keys of its key space); rare: a restart or a leave)."""
        self._held.pop(endpoint_id, None)
        space = self._space.get(endpoint_id)
        table = self.tables.get(space) if space is not None else None
        if not table or space is None:
            return
        self._removals[space] = self._removals.get(space, 0) + 1
        empty = []
        for key, holders in table.items():
            if holders.pop(endpoint_id, None) is not None and not holders:
                empty.append(key)
        for key in empty:
            del table[key]

    def advance(self, seq: int, synced: bool | None = None) -> None:
        self.seq = seq
        if synced is not None:
            self.synced = synced

    # -- queries ----------------------------------------------------------------------------

    def defers(self, model: str) -> bool:
        """Whether ``model``'s scores need kv_indexer itself: it has kv_store sources and the feed did not
        list the reach (an older kv_indexer), so only ``Score`` can fold their blocks."""
        return model in self._deferred

    def score(
        self,
        model: str,
        token_ids: TokenIds,
        endpoint_ids: Sequence[str] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> ReplicaScore:
        """kv_indexer's ``Score`` on the replica: WARMING / LOAD_ONLY give no data (0 blocks, no
        match, as epp reads those states); endpoints not ``live`` are not scored.

        Returns the prompt's total blocks, per endpoint its matched leading blocks and their split
        per medium name (:class:`ReplicaScore`). Cost: the prompt's keys (cached per prefix) + the
        walk over matched blocks, + one pass over its matched blocks per endpoint holding keys on
        more than one medium; for a model with kv_store sources, per engine reaching one, its folded
        blocks (:meth:`_fold`: the sources' run read once per reach group, C-level passes per engine).
        """
        if not self.ready or model in self.load_only:
            return ReplicaScore(0, 0, {})
        sizes = self._sizes.get(model)
        if not sizes:
            return ReplicaScore(0, 0, {})
        endpoints = self.endpoints
        candidates = endpoint_ids or [e for e, ep in endpoints.items() if ep.model == model and not ep.kv_source]
        not_live = self._not_live
        allowed = [e for e in candidates if e not in not_live] if not_live else candidates
        matched: dict[str, int] = {}
        by_medium: dict[str, dict[str, int]] = {}
        reached: dict[str, int] = {}
        total = 0
        source = packed_or_ids(token_ids)  # the prompt's bytes when the tokenizer kept them: no conversion
        for size in sizes:
            keys = self._keys.block_keys(source, size, scope.root_key())
            if size == sizes[0]:
                total = len(keys)
            if not allowed:
                break
            table = self.tables.get((model, size))
            if not table:
                continue
            for endpoint_id, blocks in self._matches((model, size), keys, table, allowed).items():
                if endpoints[endpoint_id].block_size_tokens == size:
                    matched[endpoint_id] = blocks
                    by_medium[endpoint_id] = self._media_counts(keys, blocks, table, endpoint_id)
            reach = self._reach.get(model)
            if reach is not None:
                self._fold(keys, table, reach, [e for e in allowed if endpoints[e].block_size_tokens == size],
                           matched, by_medium, reached)
        return ReplicaScore(total, sizes[0], matched, by_medium, reached)

    def _fold(self, keys: Sequence[int], table: Mapping[int, Mapping[str, int]], reach: Reach[str],
              engines: Sequence[str], matched: dict[str, int], by_medium: dict[str, dict[str, int]],
              reached: dict[str, int]) -> None:
        """Extend ``matched`` / ``by_medium`` of the ``engines`` reaching a source over the blocks they reach
        (kv_indexer's fold, ``services/kv_indexer/reach.py``: the longest run from block 0 of blocks the
        engine holds *or* reaches; each block counted once per medium it is available on), writing the
        blocks past an engine's own run to ``reached``. Per group of engines with the same reach, the
        sources' media are read once per block; per engine, C-level passes over its folded blocks."""
        shared_bit = self._media.get(Medium.SHARED.value, 0)
        groups: dict[tuple[frozenset[str], frozenset[str]], list[int]] = {}
        group_counts: dict[tuple[frozenset[str], frozenset[str]], dict[str, int]] = {}
        n = len(keys)

        def source_mask(direct: frozenset[str], shared: frozenset[str], i: int) -> int:
            holders = table.get(keys[i])
            if not holders:
                return 0
            mask = 0
            for sid in direct:
                mask |= holders.get(sid, 0)
            if shared_bit:
                for sid in shared:
                    if holders.get(sid, 0) & shared_bit:
                        mask |= shared_bit
                        break
            return mask

        for engine in engines:
            direct = reach.direct.get(engine)
            if not direct:
                continue
            shared = reach.shared.get(engine, frozenset())
            group = (direct, shared)
            masks = groups.get(group)
            if masks is None:  # the sources' run from block 0, with each block's media
                if len(direct) == 1 and not (shared_bit and shared):  # one kv_store: in C
                    get = methodcaller("get", next(iter(direct)), 0)
                    masks = list(takewhile(bool, map(get, map(table.get, keys, repeat(_NONE)))))
                else:
                    masks = []
                    while len(masks) < n and (mask := source_mask(direct, shared, len(masks))):
                        masks.append(mask)
                groups[group] = masks
            own = matched.get(engine, 0)
            end = max(own, len(masks))
            extra: list[int] = []  # the sources' media past their run, where the union goes on
            while end < n:  # past both runs: on while the engine or a source holds the next block
                holders = table.get(keys[end])
                their_mask = source_mask(direct, shared, end)
                if not (holders.get(engine, 0) if holders else 0) | their_mask:
                    break
                extra.append(their_mask)
                end += 1
            if end == 0:
                continue
            if own == 0 and not extra:  # the sources' run alone (most engines): one count per reach group
                counts = group_counts.get(group)
                if counts is None:
                    counts = group_counts[group] = self._mask_counts(Counter(masks))
                matched[engine] = end
                by_medium[engine] = dict(counts)
                reached[engine] = end
                continue
            theirs = masks[:end]
            if len(theirs) < end:  # inside the engine's own run past the sources' run, then the extension
                theirs += [source_mask(direct, shared, i) for i in range(len(masks), end - len(extra))]
                theirs += extra
            mine = map(methodcaller("get", engine, 0), map(table.__getitem__, keys[:end]))
            matched[engine] = end
            by_medium[engine] = self._mask_counts(Counter(map(or_, mine, theirs)))
            if end > own:
                reached[engine] = end - own

    def _mask_counts(self, masks: Counter[int]) -> dict[str, int]:
        """Per medium name, how many blocks carry it, from a count of blocks per media mask."""
        counts: dict[str, int] = {}
        for mask, count in masks.items():
            for bit, name in self._names.items():
                if mask & bit:
                    counts[name] = counts.get(name, 0) + count
        return counts

    def _matches(self, space: tuple[str, int], keys: Sequence[int], table: Mapping[int, Mapping[str, int]],
                 allowed: Collection[str]) -> dict[str, int]:
        """:func:`longest_prefix_matches`, starting from the walk of a scored prompt this one extends.

        A scored prompt is found by its last key among this prompt's last :data:`_WALK_PROBES` keys,
        longest first (the keys are chained: an equal key at position ``i`` means an equal prefix of
        ``i + 1`` blocks; a session's previous pick, whatever prompts other sessions sharing its
        first blocks scored meanwhile). Its matches are reused when no key was removed from the key
        space since (additions only extend matches, which the walk from the known counts finds);
        endpoints not counted then start at block 1. Cost: the probes (dict lookups) plus the blocks
        after the known matches, instead of the walk over every matched block.
        """
        if not keys:
            return {}
        epoch = self._removals.get(space, 0)
        walks = self._walks
        model, size = space
        n = len(keys)
        prev = None
        if self.reuse_walks:
            for i in range(n - 1, max(-1, n - 1 - _WALK_PROBES), -1):
                found = walks.get((model, size, keys[i]))
                if found is not None:
                    prev = found if found.epoch == epoch else None
                    break
        matched = longest_prefix_matches(keys, table, allowed) if prev is None else \
            extend_matches(keys, table, allowed, prev.matched)
        slot = (model, size, keys[-1])
        walks[slot] = _Walk(epoch, matched)
        walks.move_to_end(slot)
        if len(walks) > _WALKS:
            walks.popitem(last=False)
        return matched

    def _media_counts(
        self, keys: Sequence[int], blocks: int, table: Mapping[int, Mapping[str, int]], endpoint_id: str
    ) -> dict[str, int]:
        """Of ``keys[:blocks]`` (all held by ``endpoint_id``), how many it holds on each medium."""
        held = self._held.get(endpoint_id)
        if held is not None and len(held) == 1:
            return {self._names[next(iter(held))]: blocks}
        # per distinct media mask, how many matched blocks carry it (the iteration and counting run in C)
        return self._mask_counts(Counter(map(itemgetter(endpoint_id), map(table.__getitem__, keys[:blocks]))))

    def block_count(self) -> int:
        return sum(len(t) for t in self.tables.values())
