"""Routed prefill in epp's datastore (each pick's uncached prompt tokens, decayed by a half-life) and
``routed-prefill-scorer``, which places a new session on the endpoint given the least of it lately
(SGLang's and vLLM's router ``cache_aware``: a request matching no worker goes to the smallest tree;
issue 9 item 4)."""

from __future__ import annotations

import math
import random

import pytest

from kvmesh.clock import ManualClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import DEFAULT_ROUTED_HALF_LIFE_SECONDS, Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Candidate, EndpointMetrics, PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.plugins.scorers.routed_prefill import RoutedPrefillScorer
from services.epp.scheduler import Scheduler
from tests.unit.epp.test_plugins import FakeIndex

A = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
B = Endpoint(id=EndpointId("127.0.0.1:2"), url="http://127.0.0.1:2", model="m")
C = Endpoint(id=EndpointId("127.0.0.1:3"), url="http://127.0.0.1:3", model="m")


def _store(*endpoints: Endpoint, half_life: float = 100.0) -> tuple[ManualClock, Datastore]:
    clock = ManualClock()
    ds = Datastore(clock, routed_half_life_seconds=half_life)
    ds.set_endpoints({e.id: e for e in endpoints})
    for e in endpoints:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    return clock, ds


def _routed(ds: Datastore, endpoint: Endpoint = A) -> float:
    return next(c.metrics.routed_prefill_tokens for c in ds.candidates("m") if c.id == endpoint.id)


def test_routed_prefill_adds_uncached_tokens_and_halves_every_half_life() -> None:
    clock, ds = _store(A, B)
    ds.note_pick(A.id, 1000, "r1", prompt_tokens=5000)  # 1,000 of the 5,000 were not cached on A
    assert _routed(ds) == 1000
    assert _routed(ds, B) == 0
    clock.advance(100.0)
    assert _routed(ds) == pytest.approx(500.0)
    ds.note_pick(A.id, 1000, "r2", prompt_tokens=1000)
    assert _routed(ds) == pytest.approx(1500.0)
    clock.advance(200.0)
    assert _routed(ds) == pytest.approx(375.0)
    assert ds.note_completed("r1") and ds.note_completed("r2")  # a completion does not take content back
    assert _routed(ds) == pytest.approx(375.0)


def test_an_undelivered_pick_takes_its_tokens_back_decayed_as_they_were() -> None:
    clock, ds = _store(A, B)
    ds.note_pick(A.id, 800, "kept")
    ds.note_pick(A.id, 4000, "refused")
    clock.advance(100.0)
    assert _routed(ds) == pytest.approx(2400.0)
    assert ds.note_completed("refused", dispatched=False)  # NOT_DISPATCHED: the engine never held it
    assert _routed(ds) == pytest.approx(400.0)


def test_a_re_pick_moves_the_tokens_to_the_new_endpoint() -> None:
    _, ds = _store(A, B)
    ds.note_pick(A.id, 3000, "retried")
    ds.note_pick(B.id, 3000, "retried")  # the router re-dispatched it after a failed attempt on A
    assert _routed(ds) == 0
    assert _routed(ds, B) == 3000


@pytest.mark.parametrize("half_life", [0.0, -1.0, math.nan])
def test_a_half_life_that_is_not_positive_is_refused(half_life: float) -> None:
    with pytest.raises(ValueError, match="routed_half_life_seconds"):
        Datastore(ManualClock(), routed_half_life_seconds=half_life)
    assert DEFAULT_ROUTED_HALF_LIFE_SECONDS > 0


def _candidate(endpoint: Endpoint, routed: float) -> Candidate:
    return Candidate(endpoint, EndpointMetrics(routed_prefill_tokens=routed))


def test_scorer_is_min_max_with_the_least_placed_scoring_one() -> None:
    scorer = RoutedPrefillScorer("spread")
    request = SchedulingRequest(model="m", prompt="x")
    scores = scorer.score(CycleState(), request, [_candidate(A, 30000), _candidate(B, 10000), _candidate(C, 20000)])
    assert scores == {A.id: 0.0, B.id: 1.0, C.id: 0.5}
    even = scorer.score(CycleState(), request, [_candidate(A, 7.0), _candidate(B, 7.0)])
    assert even == {A.id: 1.0, B.id: 1.0}
    assert scorer.score(CycleState(), request, [_candidate(A, 0.0)]) == {A.id: 1.0}


SPREAD_CONFIG = """
plugins:
  - type: prefix-match
  - type: tier-cost-scorer
    name: tier-cost
  - type: session-affinity-scorer
    name: sticky
  - type: routed-prefill-scorer
    name: spread
  - type: max-score-picker
    name: max-score
profiles:
  - name: default
    plugins:
      - ref: prefix-match
      - ref: sticky
        weight: 10
      - ref: tier-cost
        weight: 1
      - ref: spread
        weight: 1
      - ref: max-score
"""


async def test_a_new_session_goes_where_the_thinking_sessions_are_fewest_and_a_follow_up_stays(tmp_path) -> None:
    """The case: A was given three sessions, B one; all are between calls (every queue empty). A new
    session's first call goes to B, not to whichever idle engine comes first; a follow-up of one of A's
    sessions stays on A (the sticky margin outweighs the spread)."""
    _, ds = _store(A, B)
    for i in range(3):
        ds.note_pick(A.id, 16000, f"a{i}", prompt_tokens=16000)
        ds.note_completed(f"a{i}")
    ds.note_pick(B.id, 16000, "b0", prompt_tokens=16000)
    ds.note_completed("b0")
    config = tmp_path / "spread.yaml"
    config.write_text(SPREAD_CONFIG)
    source, data = resolve_scheduling_config(str(config))

    async def pick(match: PrefixMatch | None, request_id: str) -> EndpointId:
        profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=FakeIndex(match)), source)
        request = SchedulingRequest(model="m", token_ids=tuple(range(16000)), request_id=request_id)
        decision = await Scheduler(ds, profile, LiveEndpointFilter("live")).pick(request)
        ds.note_completed(request_id)
        return decision.target.id

    assert await pick(PrefixMatch(250, {}), "new") == B.id
    assert await pick(PrefixMatch(250, {A.id: 240}), "follow-up") == A.id
