"""The pick's hot-path representations (issue 10) give exactly what the plain ones give.

* :func:`kvmesh.prefix_index.longest_prefix_matches` (its C-level single-holder run) equals a plain
  reference walk on random tables with holes, several holders and candidate restrictions;
* :class:`kvmesh.prefix_index.PackedTokenIds`: the tokenizer's ids carry their exact uint32 bytes
  through incremental growth, and the replica scores them as it scores the plain list;
* :class:`~services.epp.framework.interfaces.ScoredCandidate` rows read their breakdown lazily from
  the pick's columns and equal explicitly built ones; a scorer breaking its contract still fails
  the pick.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_simulator.tokenizer import synthetic_corpus
from kvmesh.hashing import GrowingTokenIds, block_keys
from kvmesh.prefix_index import PackedTokenIds, PrefixReplica, ReplicaEndpoint, longest_prefix_matches
from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    PluginError,
    SchedulingRequest,
    ScoreColumns,
    ScoredCandidate,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.profile import SchedulerProfile, WeightedScorer
from services.epp.plugins.pickers.max_score import MaxScorePicker
from services.epp.tokenization.local import LocalTokenizer, message_chain
from tests.unit.epp.helpers import cand


def reference_walk(keys: Sequence[int], table: Mapping[int, Mapping[str, int]],
                   candidates: set[str] | None) -> dict[str, int]:
    """Per endpoint, the longest run of leading keys it holds (>= 1), the plain way."""
    result: dict[str, int] = {}
    endpoints = {e for holders in table.values() for e in holders}
    for endpoint in endpoints:
        if candidates is not None and endpoint not in candidates:
            continue
        n = 0
        while n < len(keys) and endpoint in table.get(keys[n], {}):
            n += 1
        if n:
            result[endpoint] = n
    return result


@settings(max_examples=300, deadline=None)
@given(
    holdings=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(0, 40)), max_size=12),
    length=st.integers(0, 40),
    restrict=st.one_of(st.none(), st.sets(st.integers(0, 5))),
)
def test_prefix_walk_equals_the_reference(holdings: list[tuple[int, int, int]], length: int,
                                          restrict: set[int] | None) -> None:
    keys = list(range(1000, 1000 + length))
    table: dict[int, dict[str, int]] = {}
    for endpoint, start, stop in holdings:  # runs of keys, holes between them
        for key in keys[start:stop]:
            table.setdefault(key, {})[f"e{endpoint}"] = 1
    candidates = None if restrict is None else {f"e{e}" for e in restrict}
    assert longest_prefix_matches(keys, table, candidates) == reference_walk(keys, table, candidates)


def test_packed_token_ids_are_the_ids_bytes() -> None:
    ids = PackedTokenIds.build([1, 2, 70000])
    assert ids == [1, 2, 70000] and ids == [1, 2, 70000] and ids == (1, 2, 70000) and ids != [1, 2]
    assert len(ids) == 3 and ids[2] == 70000 and ids[-1] == 70000 and ids[1:] == [2, 70000] and list(ids) == [1, 2, 70000]
    assert ids.packed == array("I", [1, 2, 70000]).tobytes() == bytes.fromhex("0100000002000000701101" "00")
    grown = ids.spliced(2, [9, 8])
    assert grown == [1, 2, 9, 8] and grown.packed == array("I", [1, 2, 9, 8]).tobytes()
    assert ids == [1, 2, 70000]  # the original is untouched
    with pytest.raises(ValueError, match="packed bytes"):
        PackedTokenIds(b"\x00" * 6)
    with pytest.raises(OverflowError):
        PackedTokenIds.build([-1])


def test_growing_chat_ids_carry_their_exact_bytes_and_score_alike(tok_dir: Path) -> None:
    local = LocalTokenizer(tok_dir)
    reference = LocalTokenizer(tok_dir)
    replica = PrefixReplica()
    replica.set_endpoints([ReplicaEndpoint("a", "m", 16), ReplicaEndpoint("b", "m", 16)])
    replica.set_status(True, ())
    rng = random.Random(3)
    docs = synthetic_corpus(documents=50)
    messages: list[dict[str, str]] = [{"role": "system", "content": "agent"}]
    packed_seen = 0
    for _turn in range(12):
        messages.append({"role": "user", "content": rng.choice(docs)})
        body = {"messages": list(messages), "add_generation_prompt": True}
        ids = local.chat_ids(body, message_chain("r", messages))
        plain = reference.encode_text(reference.chat_text(body), add_special_tokens=False)
        assert ids == plain
        if isinstance(ids, GrowingTokenIds):
            packed_seen += 1
            assert ids.tobytes() == array("I", plain).tobytes()
        keys = block_keys(plain, 16)
        replica.apply_delta("a", "GPU", keys[: len(keys) // 2], [])  # a holds half the prompt
        assert replica.score("m", ids).matched_blocks == replica.score("m", list(plain)).matched_blocks \
            == {"a": len(keys) // 2}
        messages.append({"role": "assistant", "content": rng.choice(docs)})
    assert packed_seen == 12 and local.stats["incremental"] >= 10


class _Fixed(Scorer):
    type_name = "fixed"
    category = ScorerCategory.DISTRIBUTION

    def __init__(self, name: str, scores: dict[EndpointId, float]) -> None:
        super().__init__(name)
        self.scores = scores

    def score(self, state: CycleState, request: SchedulingRequest, candidates: Sequence[object]) -> dict[EndpointId, float]:
        return dict(self.scores)


def test_scored_rows_read_the_columns_and_equal_explicit_rows() -> None:
    a, b = cand(1), cand(2)
    columns = ScoreColumns(("x", "y"), ([0.5, 1.0], [0.25, 0.0]))
    rows = ScoredCandidate.rows([a, b], [1.0, 2.0], columns)
    assert rows[0].scores == {"x": 0.5, "y": 0.25} and rows[1].scores == {"x": 1.0, "y": 0.0}
    assert rows[1] == ScoredCandidate(b, {"x": 1.0, "y": 0.0}, 2.0) and rows[0] != rows[1]
    assert rows[0].id == a.id and "total=1.0" in repr(rows[0])


def test_profile_totals_breakdown_and_contract() -> None:
    a, b, c = cand(1), cand(2), cand(3)
    profile = SchedulerProfile("p", [], [
        WeightedScorer(_Fixed("x", {a.id: 0.1, b.id: 0.7, c.id: 0.3}), 3.0),
        WeightedScorer(_Fixed("y", {a.id: 1.0, b.id: 0.0, c.id: 0.9}), 2.0),
    ], MaxScorePicker("max", random.Random(0)))
    ranked = profile.run(CycleState(), SchedulingRequest(model="m"), [a, b, c]).ranked
    assert [s.id for s in ranked] == [c.id, a.id, b.id]  # 2.7, 2.3, 2.1
    assert [s.total for s in ranked] == [0.0 + 3.0 * 0.3 + 2.0 * 0.9, 0.0 + 3.0 * 0.1 + 2.0 * 1.0, 0.0 + 3.0 * 0.7 + 2.0 * 0.0]
    assert ranked[0].scores == {"x": 0.3, "y": 0.9}
    for broken in ({a.id: 0.1, b.id: 0.7}, {a.id: 0.1, b.id: 0.7, c.id: 0.3, EndpointId("x:1"): 0.5},
                   {a.id: 0.1, b.id: 1.5, c.id: 0.3}, {a.id: float("nan"), b.id: 0.7, c.id: 0.3},
                   {a.id: "high", b.id: 0.7, c.id: 0.3}):
        bad = SchedulerProfile("p", [], [WeightedScorer(_Fixed("z", broken), 1.0)], MaxScorePicker("max"))  # type: ignore[arg-type]
        with pytest.raises(PluginError, match="broke its contract"):
            bad.run(CycleState(), SchedulingRequest(model="m"), [a, b, c])
