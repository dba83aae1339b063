"""The index's bulk apply (``InMemoryIndex.apply_batch``, the shared sole-holder values, the bulk
store/removal passes) against a plain reference model, and the residency log's deltas against the
same model: random vLLM 0.32-shaped event streams (``kvmesh.kv_events``) over several endpoints
that share prefixes, two media, hash reuse, repeats, unknown and repeated hashes, clears."""

from __future__ import annotations

import random

import pytest

from kvmesh.hashing import block_keys
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.index.residency import ResidencyLog
from services.kv_indexer.scoring import MEDIUM_LANE

B = 4
MEDIA = ("GPU", "CPU")


class Reference:
    """Per endpoint: engine hash -> (key, media)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, tuple[int, set[str]]]] = {}

    def apply(self, ep: str, event: KVEvent) -> None:
        held = self.held.setdefault(ep, {})
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                entry = held.get(h)  # type: ignore[call-overload]
                if entry is not None and event.medium in entry[1]:
                    entry[1].discard(event.medium)  # type: ignore[arg-type]
                    if not entry[1]:
                        del held[h]  # type: ignore[arg-type]
        else:
            parent = 0 if event.parent_block_hash is None else held[event.parent_block_hash][0]  # type: ignore[index]
            keys = block_keys(event.token_ids, B, parent)
            for h, k in zip(event.block_hashes, keys, strict=True):
                entry = held.get(h)  # type: ignore[call-overload]
                if entry is not None and entry[0] == k:
                    entry[1].add(event.medium)  # type: ignore[arg-type]
                else:
                    held[h] = (k, {event.medium})  # type: ignore[index]

    def table(self) -> dict[int, dict[str, int]]:
        table: dict[int, dict[str, int]] = {}
        for ep, held in self.held.items():
            for key, media in held.values():
                for medium in media:
                    holders = table.setdefault(key, {})
                    holders[ep] = holders.get(ep, 0) + MEDIUM_LANE[Medium.parse(medium)]
        return table

    def residency(self) -> set[tuple[str, str, int]]:
        return {(ep, str(Medium.parse(m)), key) for ep, held in self.held.items()
                for key, media in held.values() for m in media}


def _stream(rnd: random.Random, ref: Reference, ep: str, prompts: list[list[int]], next_hash: list[int]) -> KVEvent:
    held = ref.held.setdefault(ep, {})
    roll = rnd.random()
    if roll < 0.03:
        return AllBlocksCleared()
    if roll < 0.35 and held:
        hashes = rnd.sample(sorted(held), min(len(held), rnd.randint(1, 6)))
        if rnd.random() < 0.3:
            hashes.append(rnd.choice(hashes))  # a repeated hash
        if rnd.random() < 0.3:
            hashes.append(10**9 + rnd.randrange(100))  # never stored
        return BlockRemoved(block_hashes=hashes, medium=rnd.choice(MEDIA))
    prompt = rnd.choice(prompts)  # endpoints share prompts, so keys are shared
    blocks = rnd.randint(1, len(prompt) // B)
    tokens = prompt[: blocks * B]
    medium = rnd.choice(MEDIA)
    if rnd.random() < 0.3 and held:  # the same hashes again (repeat, or a second medium)
        same = [h for h in held if held[h][0] in block_keys(tokens, B)]
        if same:
            keys = block_keys(tokens, B)
            hashes = [next((h for h in same if held[h][0] == k), 0) or _new(next_hash) for k in keys]
            return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=B,
                               medium=medium)
    hashes = [_new(next_hash) for _ in range(blocks)]
    if rnd.random() < 0.1 and held:  # an engine reusing a hash for other content
        hashes[0] = rnd.choice(sorted(held))
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=B, medium=medium)


def _new(counter: list[int]) -> int:
    counter[0] += 1
    return counter[0]


@pytest.mark.parametrize("seed", range(12))
def test_bulk_apply_matches_reference_and_residency_deltas_are_exact(seed: int) -> None:
    rnd = random.Random(seed)
    index = InMemoryIndex(recent_removed_blocks=8)
    index.residency = ResidencyLog(max_keys=10**9)
    endpoints = [f"127.0.0.1:{9000 + i}" for i in range(3)]
    for ep in endpoints:
        index.register_endpoint(Endpoint(id=EndpointId(ep), url="", model="m", block_size_tokens=B))
    ref = Reference()
    prompts = [[rnd.randrange(50) for _ in range(B * 6)] for _ in range(4)]
    prompts.append(prompts[0][: B * 3] + [rnd.randrange(50) for _ in range(B * 3)])  # a shared prefix
    counter = [0]
    replica: set[tuple[str, str, int]] = set()
    seen = 0
    for step in range(150):
        ep = rnd.choice(endpoints)
        batch = [_stream(rnd, ref, ep, prompts, counter)]
        for event in batch:
            ref.apply(ep, event)
        if step % 3:
            outcomes = index.apply_batch(EndpointId(ep), batch)
        else:
            outcomes = [index.apply(EndpointId(ep), e) for e in batch]
        assert all(o.value == "applied" for o in outcomes), outcomes
        table = {k: dict(v) for k, v in index._tables[("m", B)].items()}
        assert table == ref.table(), f"step {step}: {batch}"
        for ep_id in endpoints:
            expected = {h: frozenset(Medium.parse(m) for m in media) for h, (_, media) in ref.held.get(ep_id, {}).items()}
            assert index.held_blocks(EndpointId(ep_id)) == expected
        records = index.residency.since(seen, 10**9)
        assert records is not None
        seen += len(records)
        for record in records:  # what a Watch replica applies, in order
            if record.cleared:
                replica = {r for r in replica if r[0] != record.endpoint_id}
            replica |= {(record.endpoint_id, record.medium, k) for k in record.added}
            replica -= {(record.endpoint_id, record.medium, k) for k in record.removed}
        assert replica == ref.residency(), f"step {step}: {batch}"
    snapshot = {(ep, medium, k) for ep, medium, keys in index.residency_snapshot() for k in keys}
    assert snapshot == ref.residency()


def test_apply_batch_counts_outcomes_like_apply() -> None:
    index = InMemoryIndex()
    ep = EndpointId("127.0.0.1:1")
    index.register_endpoint(Endpoint(id=ep, url="", model="m", block_size_tokens=B))
    events: list[KVEvent] = [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=B),
        BlockStored(block_hashes=[3], parent_block_hash=99, token_ids=list(range(4)), block_size=B),  # orphan
        BlockRemoved(block_hashes=[1], medium="NOPE"),  # invalid medium
        AllBlocksCleared(),
    ]
    outcomes = index.apply_batch(ep, events)
    assert [o.value for o in outcomes] == ["applied", "orphaned", "invalid", "applied"]
    stats = index.stats()
    assert stats.events_applied == 2 and stats.per_endpoint[0].events_applied == 2
    assert stats.outcomes[outcomes[1]] == 1 and stats.outcomes[outcomes[2]] == 1
    unknown = index.apply_batch(EndpointId("127.0.0.1:2"), events[:1])
    assert [o.value for o in unknown] == ["unregistered"]


def test_recent_removals_place_a_chain_after_bulk_removal() -> None:
    index = InMemoryIndex(recent_removed_blocks=4)
    ep = EndpointId("127.0.0.1:1")
    index.register_endpoint(Endpoint(id=ep, url="", model="m", block_size_tokens=B))
    tokens = list(range(40))
    index.apply_batch(ep, [BlockStored(block_hashes=list(range(1, 11)), parent_block_hash=None, token_ids=tokens,
                                       block_size=B)])
    index.apply_batch(ep, [BlockRemoved(block_hashes=list(range(1, 11)))])  # 10 > 4: the newest 4 kept
    state = index._endpoints[ep]
    assert set(state.older) | set(state.recent) == {7, 8, 9, 10}
    outcome = index.apply(ep, BlockStored(block_hashes=[11], parent_block_hash=10, token_ids=list(range(40, 44)),
                                          block_size=B))
    assert outcome.value == "applied"
    assert index.held_blocks(ep) == {11: frozenset({Medium.GPU})}
    assert index.score("m", tokens + list(range(40, 44))).scores == []  # blocks 0..9 are gone


def test_list_block_keys_equals_block_keys() -> None:
    """The ingest path's ``list_block_keys`` (one block hashed from its ``array``, longer chains as
    ``bytes`` slices) gives ``block_keys``' values: one block, many, a trailing partial block, none,
    a parent key (masked to 64 bits), block sizes 1-64; token ids outside uint32 or not ints raise."""
    from kvmesh.hashing import list_block_keys

    rnd = random.Random(7)
    for _ in range(400):
        size = rnd.choice((1, 2, 4, 16, 64))
        tokens = [rnd.randrange(2**32) for _ in range(rnd.randint(0, 9) * size + rnd.choice((0, 0, 0, 1)))]
        parent = rnd.choice((0, rnd.randrange(2**64), 2**64 + 5))
        assert list_block_keys(tokens, size, parent) == block_keys(tokens, size, parent)
    assert list_block_keys([7] * 16, 16) == block_keys([7] * 16, 16) != list_block_keys([7] * 16, 16, 1)
    for bad, error in (([2**32] + [0] * 15, OverflowError), ([-1] + [0] * 15, OverflowError), (["x"] * 16, TypeError)):
        with pytest.raises(error):
            list_block_keys(bad, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        list_block_keys([1], 0)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_matches_equals_the_reference_walk(seed: int) -> None:
    """``scoring.prefix_matches`` (``kvmesh.prefix_index.longest_prefix_matches``, C-level passes)
    answers as a plain per-block walk: shared sole-holder values, equal and different dicts, holes,
    late starters, candidates."""
    from services.kv_indexer.scoring import prefix_matches

    def reference(keys: list[int], table: dict[int, dict[str, int]], candidates: set[str] | None) -> dict[str, int]:
        first = table.get(keys[0]) if keys else None
        if not first:
            return {}
        active = {e for e in first if candidates is None or e in candidates}
        result: dict[str, int] = {}
        for i, key in enumerate(keys):
            holders = table.get(key) or {}
            for e in [e for e in active if e not in holders]:
                result[e] = i
                active.discard(e)
            if not holders:
                break
        else:
            i = len(keys)
        result.update(dict.fromkeys(active, i))
        return result

    rnd = random.Random(seed)
    for _ in range(300):
        n = rnd.randint(0, 300)
        endpoints = [f"127.0.0.1:{9000 + e}" for e in range(rnd.randint(1, 6))]
        sole = {ep: {ep: 1} for ep in endpoints}
        table: dict[int, dict[str, int]] = {}
        for ep in endpoints:
            start = 0 if rnd.random() < 0.8 else rnd.randint(0, n)
            for key in range(start, rnd.randint(start, n)):
                if rnd.random() < 0.02:
                    continue  # a hole
                holders = table.get(key)
                if holders is None:
                    table[key] = sole[ep] if rnd.random() < 0.5 else {ep: rnd.choice((1, 1 << 32))}
                else:
                    table[key] = {**holders, ep: 1}
        candidates = None if rnd.random() < 0.5 else {ep for ep in endpoints if rnd.random() < 0.6}
        keys = list(range(n))
        assert prefix_matches(keys, table, candidates) == reference(keys, table, candidates)  # type: ignore[arg-type]


# -- the batch fast path against the per-event path (Hypothesis) ---------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PROMPTS = [[(p * 7919 + i * 31) % 97 for i in range(B * 8)] for p in range(3)]
_PROMPTS.append(_PROMPTS[0][: B * 4] + [(i * 13) % 89 for i in range(B * 4)])  # shares 4 blocks with prompt 0


@st.composite
def _event(draw: st.DrawFn, used: list[int | bytes], mine: list[int | bytes]) -> KVEvent:
    """An event of one endpoint: ``used`` every hash sent so far, ``mine`` the ones this endpoint stored."""
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 3 + ["cleared"]))
    medium = draw(st.sampled_from(["GPU", "GPU", "CPU", "cpu"]))
    if kind == "cleared":
        return AllBlocksCleared()
    if kind == "removed":
        hashes = draw(st.lists(st.sampled_from(used or [1]), max_size=6)) + draw(st.lists(st.integers(10**6, 10**6 + 3), max_size=1))
        return BlockRemoved(block_hashes=hashes, medium=medium)
    fresh = draw(st.lists(st.integers(0, 2**32 - 1), min_size=B * 8, max_size=B * 8))  # keys new to the index
    prompt = draw(st.sampled_from([fresh, fresh, *_PROMPTS]))
    start = draw(st.integers(0, 7))
    count = draw(st.integers(0 if draw(st.booleans()) and start else 1, 8 - start))
    hashes: list[int | bytes] = []
    for _ in range(count):
        shape = draw(st.sampled_from(["new"] * 30 + ["used", "repeat", "negative", "digest"]))
        if shape == "used" and used:
            hashes.append(draw(st.sampled_from(used)))
        elif shape == "repeat" and hashes:
            hashes.append(hashes[-1])
        elif shape == "negative":
            hashes.append(-draw(st.integers(1, 50)))
        elif shape == "digest":
            hashes.append(draw(st.integers(0, 50)).to_bytes(32, "big"))
        else:
            hashes.append(len(used) + 100 + draw(st.integers(0, 10**6)))
        used.append(hashes[-1])
        mine.append(hashes[-1])
    parent_shape = draw(st.sampled_from(["none"] * 8 + ["used"] * 11 + ["unknown"]))
    parent = None if parent_shape == "none" or not mine else (
        draw(st.sampled_from(mine[-8:])) if parent_shape == "used" else 5 * 10**6 + draw(st.integers(0, 3)))
    tokens = prompt[start * B : (start + count) * B]
    if draw(st.integers(0, 19)) == 0:
        tokens = tokens[:-1]  # not whole blocks: invalid
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=draw(st.sampled_from([B] * 12 + [8])),
        medium=medium, lora_name=draw(st.sampled_from([None] * 9 + ["adapter"])),
    )


@st.composite
def _batches(draw: st.DrawFn) -> list[tuple[int, list[KVEvent]]]:
    used: list[int | bytes] = []
    mine: list[list[int | bytes]] = [[], [], []]
    batches = []
    for _ in range(draw(st.integers(1, 25))):
        ep = draw(st.integers(0, 2))
        batches.append((ep, draw(st.lists(_event(used, mine[ep]), min_size=1, max_size=6))))
    return batches


def _state(index: InMemoryIndex, endpoints: list[EndpointId]) -> object:
    per_endpoint = [
        (index.held_blocks(ep), dict(index._endpoints[ep].recent), dict(index._endpoints[ep].older),
         dict(index._endpoints[ep].medium_blocks), index._endpoints[ep].block_size)
        for ep in endpoints
    ]
    tables = {space: {k: dict(v) for k, v in table.items()} for space, table in index._tables.items()}
    return tables, per_endpoint, index.orphan_count(), index.stats(), sorted(index.residency_snapshot())


def _assert_batches_equal_per_event(batches: list[tuple[int, list[KVEvent]]], endpoints: int, watched: bool) -> None:
    """``apply_batch`` of each batch on one index, ``apply`` per event on another: the same outcomes
    and the same state after every batch, and (``watched``) the same residency records in order."""
    eps = [EndpointId(f"127.0.0.1:{9000 + i}") for i in range(endpoints)]
    fast, slow = InMemoryIndex(recent_removed_blocks=4), InMemoryIndex(recent_removed_blocks=4)
    logs = []
    for index in (fast, slow):
        if watched:
            index.residency = ResidencyLog(max_keys=10**9)
            logs.append(index.residency)
        for ep in eps:
            index.register_endpoint(Endpoint(id=ep, url="", model="m", block_size_tokens=B, hash_algo="sha256_cbor"))
    for i, events in batches:
        outcomes = fast.apply_batch(eps[i], events)
        assert outcomes == [slow.apply(eps[i], e) for e in events]
        assert _state(fast, eps) == _state(slow, eps)
    if watched:
        assert [(r.endpoint_id, r.medium, r.cleared, list(r.added), list(r.removed)) for r in logs[0].since(0, 10**9) or []] == \
            [(r.endpoint_id, r.medium, r.cleared, list(r.added), list(r.removed)) for r in logs[1].since(0, 10**9) or []]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches(), st.booleans())
def test_apply_batch_fast_path_equals_the_per_event_path(batches: list[tuple[int, list[KVEvent]]], watched: bool) -> None:
    """``apply_batch`` (runs of common stores written with whole-run ``dict.update``s, the general
    path for the rest) leaves the index exactly as ``apply`` per event does: tables, blocks and
    media, recent removals, orphans, outcomes, residency records (vLLM 0.32-shaped events with
    chains under held, evicted and unknown parents, repeated and reused hashes, SGLang int64 and
    32-byte digest hashes, two media, a LoRA scope, a wrong block size, partial blocks, clears)."""
    _assert_batches_equal_per_event(batches, 3, watched)


_SHARED = [(i * 37) % 101 for i in range(B * 4)]
"""Tokens any store may send again (parent None: the same keys as an earlier store's)."""


@st.composite
def _run_store(draw: st.DrawFn, mine: list[int], batch: list[int], counter: list[int]) -> BlockStored:
    """A store shaped to join a run of common stores, or to break one: ``mine`` every hash the
    endpoint was sent, ``batch`` the ones this batch sent so far, ``counter`` the last new hash."""
    count = draw(st.integers(1, 4))
    hashes: list[int] = []
    for _ in range(count):
        shape = draw(st.sampled_from(["new"] * 14 + ["batch", "repeat", "held"]))
        if shape == "batch" and batch:  # a hash an earlier store of this batch (this run) sent
            hashes.append(draw(st.sampled_from(batch)))
        elif shape == "repeat" and hashes:  # repeated within the event
            hashes.append(hashes[-1])
        elif shape == "held" and mine:  # sent in an earlier batch (held, removed or cleared since)
            hashes.append(draw(st.sampled_from(mine)))
        else:
            counter[0] += 1
            hashes.append(counter[0])
    parent_shape = draw(st.sampled_from(["none"] * 4 + ["chain"] * 3 + ["batch", "held", "unknown"]))
    parent: int | None = None
    if parent_shape == "chain" and batch:  # continues the previous store of this batch
        parent = batch[-1]
    elif parent_shape == "batch" and batch:
        parent = draw(st.sampled_from(batch))
    elif parent_shape == "held" and mine:
        parent = draw(st.sampled_from(mine))
    elif parent_shape == "unknown":
        parent = 10**9 + draw(st.integers(0, 3))
    if draw(st.integers(0, 7)) == 0:
        tokens = _SHARED[: count * B]  # keys another store (this run, an earlier batch, another endpoint) has
    else:
        counter[1] += 1
        tokens = [(counter[1] * 7919 + i) % 2**32 for i in range(count * B)]  # keys new to the index
    medium = draw(st.sampled_from(["GPU"] * 7 + ["CPU"]))
    batch.extend(hashes)
    mine.extend(hashes)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B, medium=medium)


@st.composite
def _run_batches(draw: st.DrawFn) -> list[tuple[int, list[KVEvent]]]:
    """Batches of 1-8 events over 2 endpoints, mostly common stores (so runs of several form),
    with removals and clears between them."""
    mine: list[list[int]] = [[], []]
    counter = [0, 0]
    batches: list[tuple[int, list[KVEvent]]] = []
    for _ in range(draw(st.integers(1, 12))):
        ep = draw(st.integers(0, 1))
        in_batch: list[int] = []
        events: list[KVEvent] = []
        for _ in range(draw(st.integers(1, 8))):
            kind = draw(st.sampled_from(["stored"] * 12 + ["removed"] * 2 + ["cleared"]))
            if kind == "removed" and mine[ep]:
                hashes = draw(st.lists(st.sampled_from(mine[ep]), min_size=1, max_size=4))
                events.append(BlockRemoved(block_hashes=hashes, medium=draw(st.sampled_from(["GPU", "GPU", "CPU"]))))
            elif kind == "cleared":
                events.append(AllBlocksCleared())
            else:
                events.append(draw(_run_store(mine[ep], in_batch, counter)))
        batches.append((ep, events))
    return batches


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_run_batches(), st.booleans())
def test_merged_runs_of_stores_equal_the_per_event_path(batches: list[tuple[int, list[KVEvent]]], watched: bool) -> None:
    """Runs of several common stores in one batch (``InMemoryIndex._write_run``: one ``dict.update``
    per dict for the run) against ``apply`` per event: chains whose parent is stored earlier in the
    same run, a hash repeated within an event, across the run or held from an earlier batch, keys
    repeated across the run or already indexed, a medium change, removals and clears between stores,
    with and without a residency log."""
    _assert_batches_equal_per_event(batches, 2, watched)


def test_merged_runs_cases() -> None:
    """The run cases by hand (each batch against ``apply`` per event, records in order)."""
    def store(hashes: list[int], tokens: list[int], parent: int | None = None, medium: str = "GPU") -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B, medium=medium)

    t = [list(range(i * 100, i * 100 + 2 * B)) for i in range(8)]
    cases: list[list[KVEvent]] = [
        [store([1, 2], t[0]), store([3, 4], t[1]), store([5, 6], t[2])],  # one run, one update per dict
        [store([1, 2], t[0]), store([3], t[1][:B], parent=2), store([4], t[2][:B], parent=3)],  # chains in the run
        [store([1, 2], t[0]), store([3, 1], t[1])],  # a hash repeated across the run
        [store([1, 1], t[0]), store([3, 4], t[1])],  # a hash repeated within an event
        [store([1, 2], t[0]), store([3, 4], t[0])],  # the same keys under other hashes
        [store([1, 2], t[0]), BlockRemoved(block_hashes=[2]), store([3], t[1][:B], parent=1), store([4, 5], t[2])],
        [store([1, 2], t[0]), store([3, 4], t[1], medium="CPU"), store([5, 6], t[2])],  # a medium change
        [store([1, 2], t[0]), store([3], t[1][:B], parent=99), store([4, 5], t[2])],  # an orphan between
        [store([1, 2], t[0]), AllBlocksCleared(), store([1, 2], t[0]), store([3, 4], t[3])],
        # hash 1 re-sent for other tokens (the engine reused it), then a chain under it: in one run,
        # and across a medium change (the chain's parent key is the new one in both)
        [store([1, 2], t[0]), store([1], t[5][:B]), store([6], t[6][:B], parent=1)],
        [store([1, 2], t[0]), store([5], t[4][:B]), store([1], t[7][:B], medium="CPU"), store([7], t[6][:B], parent=1)],
    ]
    for watched in (False, True):
        for events in cases:
            _assert_batches_equal_per_event([(0, events)], 1, watched)
        _assert_batches_equal_per_event([(0, events) for events in cases], 1, watched)  # each on what the last left
