"""Table-driven tests of every shipped plugin's math."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    ChatMessage,
    PrefixMatch,
    SchedulingRequest,
    ScoredCandidate,
)
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.plugins.pickers.max_score import MaxScorePicker
from services.epp.plugins.pickers.random_picker import RandomPicker
from services.epp.plugins.pickers.round_robin import RoundRobinPicker
from services.epp.plugins.prepare.prefix_match import (
    PREFIX_MATCH,
    TOKEN_IDS,
    PrefixMatchStep,
    uncached_prompt_tokens,
)
from services.epp.plugins.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from services.epp.plugins.scorers.precise_prefix_cache import PrecisePrefixCacheScorer
from services.epp.plugins.scorers.queue import QueueScorer
from tests.unit.epp.helpers import cand

REQ = SchedulingRequest(model="m")


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([(0, 0), (0, 0)], [1.0, 1.0]),
        ([(0, 0), (2, 2)], [1.0, 0.0]),
        ([(1, 0), (2, 0), (3, 0)], [1.0, 0.5, 0.0]),
        ([(5, 5), (0, 10), (10, 0)], [1.0, 1.0, 1.0]),
        ([(0, 4), (0, 1)], [0.0, 1.0]),
        ([(7, 0)], [1.0]),
    ],
    ids=["idle-equal", "two-extremes", "linear", "running-counts-like-waiting", "running-only", "single"],
)
def test_queue_scorer(loads: list[tuple[int, int]], expected: list[float]) -> None:
    cands = [cand(8000 + i, waiting=w, running=r) for i, (w, r) in enumerate(loads)]
    scores = QueueScorer("q").score(CycleState(), REQ, cands)
    assert [scores[c.id] for c in cands] == pytest.approx(expected)


def test_queue_scorer_counts_pending_picks() -> None:
    cands = [cand(8000, pending=3), cand(8001, waiting=1)]
    scores = QueueScorer("q").score(CycleState(), REQ, cands)
    assert scores == {cands[0].id: 0.0, cands[1].id: 1.0}


@pytest.mark.parametrize(
    ("usage", "expected"),
    [(0.0, 1.0), (0.25, 0.75), (1.0, 0.0)],
    ids=["empty", "quarter", "full"],
)
def test_kv_cache_utilization_scorer(usage: float, expected: float) -> None:
    c = cand(8000, usage=usage)
    assert KVCacheUtilizationScorer("kv").score(CycleState(), REQ, [c])[c.id] == pytest.approx(expected)


class FakeIndex:
    """An in-memory stand-in for kv_indexer's Score (the gRPC client is covered by integration tests)."""

    def __init__(self, match: PrefixMatch | None = None, fail: bool = False) -> None:
        self.match = match or PrefixMatch(0, {})
        self.fail = fail
        self.calls: list[tuple[str, list[int], list[str]]] = []

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        self.calls.append((model, list(token_ids), list(endpoint_ids)))
        if self.fail:
            raise ConnectionError("kv_indexer down")
        return self.match


class FakeTokenizer:
    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = tokens
        self.calls = 0

    async def tokenize(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> list[int]:
        self.calls += 1
        if self.tokens is None:
            raise RuntimeError("tokenize failed")
        return self.tokens


A, B, C = cand(8000), cand(8001), cand(8002)


@pytest.mark.parametrize(
    ("match", "expected"),
    [
        (PrefixMatch(4, {A.id: 4, B.id: 2}), [1.0, 0.5, 0.0]),
        (PrefixMatch(4, {}), [0.0, 0.0, 0.0]),
        (PrefixMatch(0, {}), [0.0, 0.0, 0.0]),
        (PrefixMatch(3, {C.id: 1}), [0.0, 0.0, 1 / 3]),
    ],
    ids=["full-and-half", "no-match", "no-full-block", "third"],
)
async def test_precise_prefix_scorer_math(match: PrefixMatch, expected: list[float]) -> None:
    index = FakeIndex(match)
    state = CycleState()
    await PrefixMatchStep("pm", index, None).prepare(state, SchedulingRequest(model="m", token_ids=(1, 2, 3)), [A, B, C])
    scores = PrecisePrefixCacheScorer("p").score(state, REQ, [A, B, C])
    assert [scores[c.id] for c in (A, B, C)] == pytest.approx(expected)
    assert index.calls == [("m", [1, 2, 3], [A.id, B.id, C.id])]


def test_precise_prefix_scorer_without_a_match_is_zero() -> None:
    state = CycleState()
    assert PrecisePrefixCacheScorer("p").score(state, REQ, [A]) == {A.id: 0.0}
    state.set(PREFIX_MATCH, None)
    assert PrecisePrefixCacheScorer("p").score(state, REQ, [A]) == {A.id: 0.0}


async def test_prefix_match_step_tokenizes_text() -> None:
    index = FakeIndex(PrefixMatch(1, {A.id: 1}))
    tokenizer = FakeTokenizer([1, 5, 6])
    state = CycleState()
    request = SchedulingRequest(model="m", messages=(ChatMessage("user", "hi"),))
    await PrefixMatchStep("pm", index, tokenizer).prepare(state, request, [A])
    assert state.get(TOKEN_IDS) == [1, 5, 6]
    assert state.get(PREFIX_MATCH) == PrefixMatch(1, {A.id: 1})
    assert tokenizer.calls == 1
    assert index.calls == [("m", [1, 5, 6], [A.id])]


async def test_prefix_match_step_prefers_given_token_ids() -> None:
    tokenizer = FakeTokenizer([9])
    state = CycleState()
    await PrefixMatchStep("pm", FakeIndex(), tokenizer).prepare(state, SchedulingRequest(model="m", token_ids=(4, 5), prompt="x"), [A])
    assert list(state.get(TOKEN_IDS) or ()) == [4, 5] and tokenizer.calls == 0


@pytest.mark.parametrize(
    ("index", "tokenizer", "request_"),
    [
        (FakeIndex(fail=True), None, SchedulingRequest(model="m", token_ids=(1, 2))),
        (FakeIndex(PrefixMatch(1, {A.id: 1})), FakeTokenizer(None), SchedulingRequest(model="m", prompt="x")),
        (FakeIndex(PrefixMatch(1, {A.id: 1})), None, SchedulingRequest(model="m", prompt="x")),
        (FakeIndex(PrefixMatch(1, {A.id: 1})), FakeTokenizer([1]), SchedulingRequest(model="m")),
    ],
    ids=["indexer-down", "tokenize-fails", "no-tokenizer", "empty-prompt"],
)
async def test_precise_prefix_scorer_degrades_to_zero(
    index: FakeIndex, tokenizer: FakeTokenizer | None, request_: SchedulingRequest
) -> None:
    state = CycleState()
    await PrefixMatchStep("pm", index, tokenizer).prepare(state, request_, [A, B])
    assert PREFIX_MATCH in state and state.get(PREFIX_MATCH) is None
    assert PrecisePrefixCacheScorer("p").score(state, request_, [A, B]) == {A.id: 0.0, B.id: 0.0}


def _blocks(port: int, *, scraped: int | None = None, registered: int = 64) -> Candidate:
    c = cand(port)
    endpoint = dataclasses.replace(c.endpoint, block_size_tokens=registered)
    return Candidate(endpoint, dataclasses.replace(c.metrics, block_size_tokens=scraped))


@pytest.mark.parametrize(
    ("candidate", "prompt_tokens", "match", "expected"),
    [
        (_blocks(1), 640, PrefixMatch(10, {"127.0.0.1:1": 8}), 640 - 8 * 64),
        (_blocks(1, scraped=32), 640, PrefixMatch(10, {"127.0.0.1:1": 8}), 640 - 8 * 32),  # scraped size wins
        (_blocks(1, registered=16), 640, PrefixMatch(10, {"127.0.0.1:1": 8}), 640 - 8 * 16),
        (_blocks(1), 640, PrefixMatch(10, {"127.0.0.1:2": 8}), 640),  # cached elsewhere only
        (_blocks(1), 640, PrefixMatch(10, {"127.0.0.1:1": 99}), 0),  # never negative
        (_blocks(1), 640, PrefixMatch(0, {"127.0.0.1:1": 8}), 640),  # no full block: no match
        (_blocks(1), 640, None, 640),  # kv_indexer failed or not asked
        (_blocks(1), 0, PrefixMatch(10, {"127.0.0.1:1": 8}), 0),  # prompt length unknown
    ],
    ids=["hit", "scraped-block-size", "registered-block-size", "miss", "clamped", "no-full-block", "no-match", "no-prompt"],
)
def test_uncached_prompt_tokens(candidate: Candidate, prompt_tokens: int, match: PrefixMatch | None, expected: int) -> None:
    assert uncached_prompt_tokens(candidate, prompt_tokens, match) == expected


@pytest.mark.parametrize(
    ("candidate", "request_", "kept"),
    [
        (cand(1), SchedulingRequest(model="m"), True),
        (cand(1, model="other"), SchedulingRequest(model="m"), False),
        (cand(1), SchedulingRequest(model="m", exclude_endpoint_ids=frozenset({"127.0.0.1:1"})), False),
        (cand(1, age=None), SchedulingRequest(model="m"), False),
        (cand(1, age=2.5), SchedulingRequest(model="m"), False),
        (cand(1, age=1.9), SchedulingRequest(model="m"), True),
        (cand(1, failures=2), SchedulingRequest(model="m"), True),
        (cand(1, failures=3), SchedulingRequest(model="m"), False),
    ],
    ids=["live", "other-model", "excluded", "never-scraped", "stale", "fresh-enough", "two-failures", "three-failures"],
)
def test_live_endpoint_filter(candidate: Candidate, request_: SchedulingRequest, kept: bool) -> None:
    plugin = LiveEndpointFilter("live", LiveEndpointFilterParams(max_metrics_age_seconds=2.0))
    assert plugin.filter(CycleState(), request_, [candidate]) == ([candidate] if kept else [])


def _scored(*totals: float) -> list[ScoredCandidate]:
    return [ScoredCandidate(cand(9000 + i), {}, t) for i, t in enumerate(totals)]


def test_max_score_picker_orders_by_total() -> None:
    scored = _scored(0.2, 0.9, 0.5)
    result = MaxScorePicker("max", random.Random(1)).pick(CycleState(), scored)
    assert [s.total for s in result.ranked] == [0.9, 0.5, 0.2]
    assert result.target.total == 0.9


def test_max_score_picker_breaks_ties_at_random() -> None:
    scored = _scored(1.0, 1.0, 1.0, 0.0)
    picker = MaxScorePicker("max", random.Random(7))
    targets = {picker.pick(CycleState(), scored).target.id for _ in range(200)}
    assert targets == {s.id for s in scored[:3]}
    assert all(picker.pick(CycleState(), scored).ranked[-1].total == 0.0 for _ in range(20))


def test_random_picker_covers_all_and_keeps_everyone() -> None:
    scored = _scored(0.0, 0.5, 1.0)
    picker = RandomPicker("rand", random.Random(3))
    results = [picker.pick(CycleState(), scored) for _ in range(200)]
    assert {r.target.id for r in results} == {s.id for s in scored}
    assert all(sorted(s.id for s in r.ranked) == sorted(s.id for s in scored) for r in results)


def test_round_robin_picker_cycles_in_id_order() -> None:
    scored = _scored(0.0, 0.0, 0.0)
    picker = RoundRobinPicker("rr")
    shuffled = [scored[2], scored[0], scored[1]]
    results = [picker.pick(CycleState(), shuffled) for _ in range(4)]
    assert [r.target.id for r in results] == [scored[0].id, scored[1].id, scored[2].id, scored[0].id]
    assert [s.id for s in results[1].ranked] == [scored[1].id, scored[2].id, scored[0].id]
