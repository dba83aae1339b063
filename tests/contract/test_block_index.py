"""The KV-block index contract, run against every ``KVBlockIndex`` backend (add new ones to BACKENDS).

Add, evict, clear, purge, fence, scoring, dump and the invariants hold for each backend: the in-memory
index and the metrics decorator around it today, a Redis- or sharded-backed index later, as llm-d-kv-cache
runs one suite over its index backends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.hashing import block_keys
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.index import ApplyOutcome, InMemoryIndex, InstrumentedIndex, KVBlockIndex

IndexFactory = Callable[[], KVBlockIndex]

BACKENDS: dict[str, IndexFactory] = {
    "in-memory": InMemoryIndex,
    "instrumented": lambda: InstrumentedIndex(InMemoryIndex()),
}

B = 4
M = "m"
A = EndpointId("127.0.0.1:1")
C = EndpointId("127.0.0.1:2")
PROMPT = list(range(1, 17))  # 4 blocks


def ep(endpoint_id: EndpointId = A, model: str = M, block_size: int = B) -> Endpoint:
    return Endpoint(id=endpoint_id, url=f"http://{endpoint_id}", model=model, block_size_tokens=block_size)


def stored(
    hashes: list, tokens: list[int], parent: int | bytes | None = None, medium: str | None = "GPU", size: int = B
) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size, medium=medium)


@pytest.fixture(scope="module", params=list(BACKENDS), ids=list(BACKENDS))
def make_index(request: pytest.FixtureRequest) -> IndexFactory:
    """A factory of fresh, empty indexes of one backend (module scope: it holds no state)."""
    return BACKENDS[request.param]


@pytest.fixture
def index(make_index: IndexFactory) -> KVBlockIndex:
    idx = make_index()
    idx.register_endpoint(ep(A))
    idx.register_endpoint(ep(C))
    return idx


def matches(
    index: KVBlockIndex, tokens: list[int] = PROMPT, endpoint_ids: Sequence[EndpointId] | None = None
) -> dict[str, int]:
    return {s.endpoint_id: s.matched_blocks for s in index.score(M, tokens, endpoint_ids).scores}


def test_protocol_is_satisfied(index: KVBlockIndex) -> None:
    assert isinstance(index, KVBlockIndex)


def test_chain_from_parent_and_scores(index: KVBlockIndex) -> None:
    assert index.apply(A, stored([10, 11], PROMPT[:8])) is ApplyOutcome.APPLIED
    assert index.apply(A, stored([12], PROMPT[8:12], parent=11)) is ApplyOutcome.APPLIED
    assert index.apply(C, stored([20], PROMPT[:4])) is ApplyOutcome.APPLIED
    result = index.score(M, PROMPT + [99])
    assert (result.total_blocks, result.block_size_tokens) == (4, B)
    assert [(s.endpoint_id, s.matched_blocks, s.matched_tokens) for s in result.scores] == [(A, 3, 12), (C, 1, 4)]
    assert result.scores[0].matched_blocks_by_medium == {Medium.GPU: 3}
    assert matches(index, endpoint_ids=[C]) == {C: 1}
    assert matches(index, [0] + PROMPT[1:]) == {}
    assert matches(index, PROMPT[:3]) == {}  # no full block
    assert index.score("other-model", PROMPT).scores == []


def test_keys_follow_tokens_not_engine_hashes(index: KVBlockIndex) -> None:
    """Engines with different hash seeds still meet on the same kvmesh keys."""
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.apply(C, stored([0xDEAD, 0xBEEF], PROMPT[:8]))
    assert matches(index) == {A: 2, C: 2}
    locs = index.lookup(M, PROMPT)
    assert [loc.block_key for loc in locs] == block_keys(PROMPT, B)
    assert [dict(loc.holders) for loc in locs[:3]] == [
        {A: frozenset({Medium.GPU}), C: frozenset({Medium.GPU})},
        {A: frozenset({Medium.GPU}), C: frozenset({Medium.GPU})},
        {},
    ]


def test_bytes_hashes_map_like_their_low_64_bits(index: KVBlockIndex) -> None:
    digest = bytes(range(32))
    index.apply(A, stored([digest], PROMPT[:4]))
    low = int.from_bytes(digest[-8:], "big")
    assert index.apply(A, stored([5], PROMPT[4:8], parent=low)) is ApplyOutcome.APPLIED
    assert matches(index) == {A: 2}
    index.apply(A, BlockRemoved(block_hashes=[digest]))
    assert matches(index) == {}


def test_evict_breaks_the_prefix_at_the_hole(index: KVBlockIndex) -> None:
    index.apply(A, stored([1, 2, 3, 4], PROMPT))
    index.apply(A, BlockRemoved(block_hashes=[3]))
    assert matches(index) == {A: 2}
    index.apply(A, BlockRemoved(block_hashes=[1]))
    assert matches(index) == {}
    assert index.stats().per_endpoint[0].blocks == 2


def test_media_are_tracked_separately(index: KVBlockIndex) -> None:
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.apply(A, stored([1], PROMPT[:4], medium="CPU"))
    [score] = index.score(M, PROMPT).scores
    assert score.matched_blocks_by_medium == {Medium.GPU: 2, Medium.CPU: 1}
    index.apply(A, BlockRemoved(block_hashes=[1], medium="GPU"))
    assert matches(index) == {A: 2}  # still on CPU
    index.apply(A, BlockRemoved(block_hashes=[1], medium="CPU"))
    assert matches(index) == {}


def test_duplicates_are_idempotent(index: KVBlockIndex) -> None:
    for _ in range(3):
        index.apply(A, stored([1, 2], PROMPT[:8]))
        index.apply(A, stored([3], PROMPT[8:12], parent=2))
    assert matches(index) == {A: 3}
    assert index.stats().blocks == 3
    index.apply(A, BlockRemoved(block_hashes=[3]))
    index.apply(A, BlockRemoved(block_hashes=[3]))
    assert matches(index) == {A: 2}


@pytest.mark.parametrize(
    ("event", "outcome"),
    [
        (stored([1], PROMPT[:4], parent=999), ApplyOutcome.ORPHANED),
        (stored([1, 2], PROMPT[:4]), ApplyOutcome.INVALID),
        (stored([1], PROMPT[:4], medium="TAPE"), ApplyOutcome.INVALID),
        (stored([1], [2**32] * 4), ApplyOutcome.INVALID),
        (BlockRemoved(block_hashes=[12345]), ApplyOutcome.APPLIED),
        (AllBlocksCleared(), ApplyOutcome.APPLIED),
    ],
    ids=["orphan", "token-count", "unknown-medium", "token-over-uint32", "remove-unknown", "clear-empty"],
)
def test_bad_or_unplaceable_events_are_counted_not_raised(index: KVBlockIndex, event: object, outcome: ApplyOutcome) -> None:
    assert index.apply(A, event) is outcome  # type: ignore[arg-type]
    assert index.stats().outcomes[outcome] == 1
    assert matches(index) == {}


def test_parent_evicted_before_child_is_still_placed(index: KVBlockIndex) -> None:
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.apply(A, BlockRemoved(block_hashes=[1, 2]))
    assert index.apply(A, stored([3], PROMPT[8:12], parent=2)) is ApplyOutcome.APPLIED
    index.apply(A, stored([1, 2], PROMPT[:8]))
    assert matches(index) == {A: 3}


def test_all_blocks_cleared_only_touches_that_endpoint(index: KVBlockIndex) -> None:
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.apply(C, stored([1, 2], PROMPT[:8]))
    index.apply(A, AllBlocksCleared())
    assert matches(index) == {C: 2}
    # C still holds hash 2: engines hashing alike agree, so A's chain is keyed through C's
    assert index.apply(A, stored([3], PROMPT[8:12], parent=2)) is ApplyOutcome.APPLIED
    assert [set(b.holders) for b in index.lookup(M, PROMPT)] == [{C}, {C}, {A}, set()]


def test_remove_endpoint_purges_and_fences(index: KVBlockIndex) -> None:
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.apply(C, stored([7], PROMPT[:4]))
    assert index.remove_endpoint(A) is True
    assert index.remove_endpoint(A) is False
    assert matches(index) == {C: 1}
    assert index.apply(A, stored([1, 2], PROMPT[:8])) is ApplyOutcome.UNREGISTERED
    assert matches(index) == {C: 1}
    index.register_endpoint(ep(A))  # a rejoin starts empty
    assert matches(index) == {C: 1}
    assert index.apply(A, stored([3], PROMPT[8:12], parent=2)) is ApplyOutcome.ORPHANED


def test_reregistration_with_another_block_size_purges(index: KVBlockIndex) -> None:
    index.apply(A, stored([1], PROMPT[:4]))
    index.register_endpoint(ep(A))  # same identity: kept
    assert matches(index) == {A: 1}
    index.register_endpoint(ep(A, block_size=8))
    assert index.stats().per_endpoint[0].blocks == 0


def test_event_block_size_wins_while_endpoint_is_empty(make_index: IndexFactory) -> None:
    index = make_index()
    index.register_endpoint(ep(A, block_size=64))
    assert index.apply(A, stored([1], PROMPT[:8], size=8)) is ApplyOutcome.APPLIED
    result = index.score(M, PROMPT)
    assert (result.block_size_tokens, result.total_blocks) == (8, 2)
    assert [(s.matched_blocks, s.matched_tokens) for s in result.scores] == [(1, 8)]
    assert index.apply(A, stored([2], PROMPT[:4], size=4)) is ApplyOutcome.INVALID


def test_mixed_block_sizes_in_one_model(make_index: IndexFactory) -> None:
    index = make_index()
    index.register_endpoint(ep(A, block_size=4))
    index.register_endpoint(ep(C, block_size=8))
    index.apply(A, stored([1, 2, 3], PROMPT[:12]))
    index.apply(C, BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=PROMPT[:8], block_size=8))
    assert [(s.endpoint_id, s.matched_blocks, s.matched_tokens) for s in index.score(M, PROMPT).scores] == [(A, 3, 12), (C, 1, 8)]


def test_dump_replays_into_an_equal_index(index: KVBlockIndex, make_index: IndexFactory) -> None:
    index.apply(A, stored([1, 2, 3], PROMPT[:12]))
    index.apply(A, stored([1], PROMPT[:4], medium="CPU"))
    index.apply(C, stored([9], PROMPT[:4]))
    replica = make_index()
    replica.register_endpoint(ep(A))
    replica.register_endpoint(ep(C))
    index.apply(C, stored([77], PROMPT[12:16], parent=66))  # an orphan survives the round trip too
    for endpoint_id, event in index.dump():
        assert replica.apply(endpoint_id, event) in (ApplyOutcome.APPLIED, ApplyOutcome.ORPHANED)
    assert replica.held_blocks(C) == index.held_blocks(C) == {9: frozenset({Medium.GPU}), 77: frozenset({Medium.GPU})}
    assert replica.score(M, PROMPT) == index.score(M, PROMPT)
    assert replica.dump() == index.dump()
    replica.apply(A, BlockRemoved(block_hashes=[2]))  # engine hashes survive the round trip
    assert {s.endpoint_id: s.matched_blocks for s in replica.score(M, PROMPT).scores} == {A: 1, C: 1}


def test_a_new_incarnation_starts_empty_the_same_one_keeps(make_index: IndexFactory) -> None:
    index = make_index()
    first = Endpoint(id=A, url=f"http://{A}", model=M, block_size_tokens=B, instance_id="one")
    index.register_endpoint(first)
    index.apply(A, stored([1, 2], PROMPT[:8]))
    index.register_endpoint(first)  # the same incarnation rejoins (its lease expired): kept
    assert matches(index) == {A: 2}
    index.register_endpoint(Endpoint(id=A, url=f"http://{A}", model=M, block_size_tokens=B, instance_id="two"))
    assert matches(index) == {} and index.held_blocks(A) == {}


def test_chain_without_its_parent_is_held_then_keyed_when_the_parent_arrives(index: KVBlockIndex) -> None:
    assert index.apply(A, stored([3, 4], PROMPT[8:16], parent=2)) is ApplyOutcome.ORPHANED
    assert set(index.held_blocks(A)) == {3, 4}  # indexed by its own (engine) hashes
    assert matches(index) == {}
    assert index.apply(A, stored([1, 2], PROMPT[:8])) is ApplyOutcome.APPLIED
    assert matches(index) == {A: 4}  # the orphans were keyed under their parent
    assert index.stats().per_endpoint[0].blocks == 4
    index.apply(A, BlockRemoved(block_hashes=[4]))
    assert matches(index) == {A: 3}


def test_orphan_removed_before_its_parent_is_known(index: KVBlockIndex) -> None:
    index.apply(A, stored([3], PROMPT[8:12], parent=2))
    index.apply(A, BlockRemoved(block_hashes=[3]))
    assert index.held_blocks(A) == {}
    index.apply(A, stored([1, 2], PROMPT[:8]))
    assert matches(index) == {A: 2}


def test_orphans_are_keyed_by_a_scored_prompt_when_the_hash_algorithm_is_computable(make_index: IndexFactory) -> None:
    """vLLM 0.32's sha256_cbor (kvmesh.hashing): the index computes the prompt's engine hashes itself."""
    from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes

    index = make_index()
    index.register_endpoint(Endpoint(id=A, url=f"http://{A}", model=M, block_size_tokens=B, hash_algo="sha256_cbor"))
    hashes = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(PROMPT, B)]
    # the indexer missed blocks 0-1 (restart): blocks 2-3 arrive chained to an unknown parent
    assert index.apply(A, stored(hashes[2:], PROMPT[8:], parent=hashes[1])) is ApplyOutcome.ORPHANED
    index.score(M, PROMPT)
    assert [set(b.holders) for b in index.lookup(M, PROMPT)] == [set(), set(), {A}, {A}]
    index.apply(A, stored(hashes[:2], PROMPT[:8]))
    assert matches(index) == {A: 4}


# -- invariants -------------------------------------------------------------------------------

tokens_st = st.lists(st.integers(0, 50), min_size=B, max_size=6 * B)


@settings(max_examples=60, deadline=None)
@given(st.lists(tokens_st, min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_add_then_evict_everything_returns_to_empty(make_index: IndexFactory, prompts: list[list[int]], rnd) -> None:
    index = make_index()
    index.register_endpoint(ep(A))
    stored_hashes: list[int] = []
    for i, prompt in enumerate(prompts):
        n = len(prompt) // B
        hashes = [i * 1000 + j for j in range(n)]
        index.apply(A, stored(hashes, prompt[: n * B]))
        stored_hashes += hashes
    assert index.stats().blocks > 0
    rnd.shuffle(stored_hashes)
    for h in stored_hashes:
        index.apply(A, BlockRemoved(block_hashes=[h]))
    assert index.stats().blocks == 0
    assert index.dump() == []
    assert all(index.score(M, p).scores == [] for p in prompts)


@settings(max_examples=60, deadline=None)
@given(tokens_st, st.integers(0, 6), tokens_st)
def test_score_is_monotone_in_prefix_length(make_index: IndexFactory, prompt: list[int], held: int, query: list[int]) -> None:
    index = make_index()
    index.register_endpoint(ep(A))
    n = min(held, len(prompt) // B)
    if n:
        index.apply(A, stored(list(range(n)), prompt[: n * B]))
    previous = None
    for length in range(len(prompt) + 1):
        got = {s.endpoint_id: s.matched_blocks for s in index.score(M, prompt[:length]).scores}.get(A, 0)
        assert got == min(n, length // B)
        assert previous is None or got >= previous
        previous = got
    # a query matches exactly as many blocks as it shares with the held prefix
    shared = 0
    while shared < n and query[: (shared + 1) * B] == prompt[: (shared + 1) * B] and len(query) >= (shared + 1) * B:
        shared += 1
    assert {s.endpoint_id: s.matched_blocks for s in index.score(M, query).scores}.get(A, 0) == shared
