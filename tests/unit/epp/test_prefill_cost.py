"""``prefill-cost-scorer`` math and the datastore's queued-prefill accounting it reads."""

from __future__ import annotations

import random

import pytest

from kvmesh.clock import ManualClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    EndpointMetrics,
    PluginHandle,
    PrefixMatch,
    SchedulingRequest,
)
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.framework.registry import parse_params
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.plugins.prepare.prefix_match import PrefixMatchStep
from services.epp.plugins.scorers.prefill_cost import (
    PrefillCostScorer,
    PrefillCostScorerParams,
    prefill_costs,
)
from services.epp.scheduler import Scheduler
from tests.unit.epp.test_plugins import FakeIndex, FakeTokenizer


def _cand(port: int, *, queued: int = 0, known: int = 0, unprefilled: int = 0, block: int = 64) -> Candidate:
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="m")
    metrics = EndpointMetrics(
        block_size_tokens=block, age_seconds=0.0, queued_prefill_tokens=queued,
        known_unprefilled_requests=known, unprefilled_requests=unprefilled,
    )
    return Candidate(endpoint, metrics)


A, B, C = _cand(1), _cand(2), _cand(3)


@pytest.mark.parametrize(
    ("cands", "matched", "weight", "expected_costs"),
    [
        ([A, B], {A.id: 8}, 1.0, [640 - 512, 640]),  # idle: the holder saves its cached 8 blocks
        ([_cand(1, queued=4000, known=1, unprefilled=1), B], {"127.0.0.1:1": 8}, 1.0, [128 + 4000, 640]),
        ([_cand(1, queued=4000, known=1, unprefilled=1), B], {"127.0.0.1:1": 8}, 0.1, [128 + 400, 640]),
        ([_cand(1, unprefilled=3), B], {}, 1.0, [640 + 3 * 640, 640]),  # unknown requests: prompt-sized
        ([_cand(1, queued=900, known=1, unprefilled=3), B], {}, 1.0, [640 + 900 + 2 * 900, 640]),
        ([_cand(1, queued=3, known=1, unprefilled=3), B], {}, 1.0, [640 + 3 + 2 * 640, 640]),
        ([_cand(1, block=32), B], {"127.0.0.1:1": 8, B.id: 99}, 1.0, [640 - 256, 0]),  # never negative
    ],
    ids=["idle-holder", "busy-holder", "light-queue-weight", "unknown-queued", "mean-of-known", "prompt-if-larger", "block-size"],
)
def test_prefill_costs(cands: list[Candidate], matched: dict[str, int], weight: float,
                       expected_costs: list[float]) -> None:
    costs = prefill_costs(cands, 640, PrefixMatch(10, matched), weight)
    assert [costs[c.id] for c in cands] == pytest.approx(expected_costs)


async def _prepared(index: FakeIndex, request: SchedulingRequest, cands: list[Candidate]) -> CycleState:
    state = CycleState()
    await PrefixMatchStep("pm", index, None).prepare(state, request, cands)
    return state


async def test_scorer_ranks_by_least_cost_and_stays_in_range() -> None:
    busy_holder = _cand(1, queued=4000, known=1, unprefilled=1)
    index = FakeIndex(PrefixMatch(10, {busy_holder.id: 8, B.id: 2}))
    scorer = PrefillCostScorer("cost")
    request = SchedulingRequest(model="m", token_ids=tuple(range(640)))
    scores = scorer.score(await _prepared(index, request, [busy_holder, B, C]), request, [busy_holder, B, C])
    # costs: holder 128 + 4000, B 640 - 128 = 512, C 640 -> 1 - cost / 4128
    assert scores == pytest.approx({busy_holder.id: 0.0, B.id: 1 - 512 / 4128, C.id: 1 - 640 / 4128})
    assert len(index.calls) == 1


async def test_scorer_degrades_to_load_and_ties_at_one() -> None:
    scorer = PrefillCostScorer("cost")
    request = SchedulingRequest(model="m", token_ids=tuple(range(100)))
    cands = [_cand(1, unprefilled=1), B]
    scores = scorer.score(await _prepared(FakeIndex(fail=True), request, cands), request, cands)
    assert scores == pytest.approx({"127.0.0.1:1": 0.0, B.id: 0.5})
    empty = SchedulingRequest(model="m")
    assert scorer.score(await _prepared(FakeIndex(), empty, [A, B]), empty, [A, B]) == {A.id: 1.0, B.id: 1.0}


def test_params() -> None:
    assert parse_params(PrefillCostScorerParams, "prefill-cost-scorer", "c", {}).queued_weight == 1.0
    with pytest.raises(ValueError, match="queued_weight"):
        parse_params(PrefillCostScorerParams, "prefill-cost-scorer", "c", {"queued_weight": 0})


def test_datastore_queued_prefill_follows_first_tokens() -> None:
    clock = ManualClock()
    ds = Datastore(clock)
    a = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
    ds.set_endpoints({a.id: a})

    def scrape(waiting: float, running: float, finished: float, first: float | None) -> EndpointMetrics:
        ds.record_scrape(a.id, ScrapeSample(waiting, running, 0.0, 64, finished, first))
        return ds.candidates("m")[0].metrics

    assert scrape(0, 0, 5, 5).queued_prefill_tokens == 0
    for tokens in (1000, 2000, 3000):
        ds.note_pick(a.id, tokens)
    m = ds.candidates("m")[0].metrics
    assert (m.unprefilled_requests, m.queued_prefill_tokens) == (3, 6000)
    m = scrape(1, 2, 5, 6)  # all arrived, the oldest (FCFS) got its first token
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (0, 2, 5000)
    m = scrape(0, 1, 7, 8)
    assert (m.unprefilled_requests, m.queued_prefill_tokens, m.known_unprefilled_requests) == (0, 0, 0)
    # Without the first-token count: waiting + pending, tokens known for the latest picks only.
    ds.note_pick(a.id, 700)
    m = scrape(3, 0, 7, None)
    assert (m.unprefilled_requests, m.known_unprefilled_requests, m.queued_prefill_tokens) == (3, 3, 700 + 3000 + 2000)


async def test_prefill_cost_config_spreads_a_burst_and_keeps_affinity() -> None:
    clock = ManualClock()
    ds = Datastore(clock)
    index = FakeIndex(PrefixMatch(10, {}))
    source, data = resolve_scheduling_config("prefill-cost")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=index), source)
    sched = Scheduler(ds, profile, LiveEndpointFilter("live"))
    eps = [Endpoint(id=EndpointId(f"127.0.0.1:{p}"), url=f"http://127.0.0.1:{p}", model="m") for p in (1, 2)]
    ds.set_endpoints({e.id: e for e in eps})
    for e in eps:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    request = SchedulingRequest(model="m", token_ids=tuple(range(640)))
    targets = [(await sched.pick(request)).target.id for _ in range(4)]
    assert sorted(targets) == sorted([eps[0].id, eps[1].id] * 2)
    for e in eps:  # everything prefilled
        ds.record_scrape(e.id, ScrapeSample(0, 2, 0.0, 64, 0, 2))
    # A follow-up whose 9 of 10 blocks sit on endpoint 2 goes there despite a request queued on it
    # (64 own + 300 queued < 640 own), but not once the queue there outweighs the saving.
    ds.note_pick(eps[1].id, 300)
    index.match = PrefixMatch(10, {eps[1].id: 9})
    assert (await sched.pick(request)).target.id == eps[1].id
    ds.note_pick(eps[1].id, 640)
    assert (await sched.pick(request)).target.id == eps[0].id


async def test_prefix_match_runs_once_per_pick_for_two_consumers() -> None:
    """prefill-cost and precise-prefix both read prefix-match's output: one tokenize, one kv_indexer call."""
    ds = Datastore(ManualClock())
    index = FakeIndex(PrefixMatch(1, {}))
    tokenizer = FakeTokenizer([1, 2, 3])
    source, data = resolve_scheduling_config("prefill-cost")
    handle = PluginHandle(rng=random.Random(0), prefix_index=index, tokenizer=tokenizer)
    sched = Scheduler(ds, build_profile(data, default_registry(), handle, source), LiveEndpointFilter("live"))
    assert sum(isinstance(w.scorer, PrefillCostScorer) for w in sched.profile.scorers) == 1
    assert len(sched.profile.scorers) == 2
    a = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
    ds.set_endpoints({a.id: a})
    ds.record_scrape(a.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    decision = await sched.pick(SchedulingRequest(model="m", prompt="hello"))
    assert (tokenizer.calls, len(index.calls)) == (1, 1)
    assert decision.prompt_tokens == 3 and set(decision.breakdown[0].scores) == {"prefill-cost", "prefix"}
    await sched.pick(SchedulingRequest(model="m", prompt="hello"))
    assert (tokenizer.calls, len(index.calls)) == (2, 2)  # the next pick runs the step again, once
