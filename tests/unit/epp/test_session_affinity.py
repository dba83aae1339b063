"""``session-affinity-scorer`` (issue 9 item 4): sessions stay on the endpoint holding their history
until it is really busy, counted in prefill tokens; hand-computed cases and the profile at work."""

from __future__ import annotations

import random

import pytest

from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Candidate, EndpointMetrics, PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile
from services.epp.framework.registry import parse_params
from services.epp.plugins import default_registry
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH, TOKEN_IDS
from services.epp.plugins.scorers.session_affinity import (
    SessionAffinityParams,
    SessionAffinityScorer,
    queued_tokens,
)
from tests.unit.epp.test_plugins import FakeIndex

PROMPT = tuple(range(2048))  # 32 blocks of 64 tokens


def _cand(port: int, *, queued: int = 0, known: int = 0, unprefilled: int = 0) -> Candidate:
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="m")
    return Candidate(endpoint, EndpointMetrics(block_size_tokens=64, age_seconds=0.0, queued_prefill_tokens=queued,
                                               known_unprefilled_requests=known, unprefilled_requests=unprefilled))


def _score(scorer: SessionAffinityScorer, match: PrefixMatch | None, cands: list[Candidate]) -> dict[EndpointId, float]:
    state = CycleState()
    state.set(TOKEN_IDS, PROMPT)
    if match is not None:
        state.set(PREFIX_MATCH, match)
    return scorer.score(state, SchedulingRequest(model="m", token_ids=PROMPT), cands)


def test_holder_stays_within_the_margin_and_leaves_past_it() -> None:
    """Holder A has 24 of 32 blocks (1,536 tokens of history): margin = 2 x 1,536 + 2,048 = 5,120 queued
    tokens beyond the least-loaded candidate's. B is idle."""
    scorer = SessionAffinityScorer("s")
    b = _cand(2)
    match = lambda a: PrefixMatch(32, {a.id: 24})  # noqa: E731
    at_margin = _cand(1, queued=5120, known=1, unprefilled=1)
    assert _score(scorer, match(at_margin), [at_margin, b]) == {at_margin.id: 1.0, b.id: 0.0}
    past = _cand(1, queued=5121, known=1, unprefilled=1)
    assert _score(scorer, match(past), [past, b]) == {past.id: 0.0, b.id: 0.0}
    # The margin is relative to the least-loaded candidate: an evenly busy pool keeps the session.
    b_busy = _cand(2, queued=4000, known=1, unprefilled=1)
    assert _score(scorer, match(past), [past, b_busy])[past.id] == 1.0


def test_below_the_match_threshold_or_without_a_match_nobody_is_a_holder() -> None:
    scorer = SessionAffinityScorer("s")
    a, b = _cand(1), _cand(2)
    assert _score(scorer, PrefixMatch(32, {a.id: 15}), [a, b]) == {a.id: 0.0, b.id: 0.0}  # 15 < 16
    assert _score(scorer, PrefixMatch(32, {a.id: 16, b.id: 20}), [a, b]) == {a.id: 1.0, b.id: 1.0}
    assert _score(scorer, None, [a, b]) == {a.id: 0.0, b.id: 0.0}
    assert _score(scorer, PrefixMatch(0, {}), [a, b]) == {a.id: 0.0, b.id: 0.0}
    lax = SessionAffinityScorer("s", SessionAffinityParams(min_match_fraction=0.25))
    assert _score(lax, PrefixMatch(32, {a.id: 8}), [a, b]) == {a.id: 1.0, b.id: 0.0}


def test_requests_epp_did_not_pick_count_at_a_guessed_size() -> None:
    """Two known requests of 3,000 tokens in all plus one unknown: it counts as max(1,500, 2,048)."""
    assert queued_tokens(_cand(1, queued=3000, known=2, unprefilled=3), 2048) == 3000 + 2048


def test_params_validated() -> None:
    assert parse_params(SessionAffinityParams, "session-affinity-scorer", "s", {}) == SessionAffinityParams()
    for bad in ({"min_match_fraction": 0}, {"min_match_fraction": 1.5}, {"busy_history_factor": -1},
                {"busy_tokens": -5}, {"unknown": 1}):
        with pytest.raises(ValueError):
            parse_params(SessionAffinityParams, "session-affinity-scorer", "s", bad)


def test_profile_keeps_the_session_against_a_lighter_queue_then_sheds_it() -> None:
    """In the llm-d blend alone (prefix 3, queue 2, kv-utilization 2), a holder of 19 of 32 blocks whose
    engine has the longer queue and a 90 % pool loses to an idle one (3 x 0.59 + 2 x 0.1 < 2 + 2); with the
    sticky scorer (weight 10) it keeps the session until its queued prefill passes the margin
    (2 x 1,216 + 2,048 tokens beyond the idle one's 0)."""
    data = {
        "plugins": [{"type": "prefix-match"}, {"type": "session-affinity-scorer", "name": "sticky"}, {"type": "precise-prefix-cache-scorer",
                    "name": "prefix"}, {"type": "queue-scorer", "name": "queue"},
                    {"type": "kv-cache-utilization-scorer", "name": "kv"}, {"type": "max-score-picker", "name": "pick"}],
        "profiles": [{"name": "default", "plugins": [{"ref": "prefix-match"}, {"ref": "sticky", "weight": 10}, {"ref": "prefix", "weight": 3},
                                                     {"ref": "queue", "weight": 2}, {"ref": "kv", "weight": 2},
                                                     {"ref": "pick"}]}],
    }
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=FakeIndex(PrefixMatch(0, {}))), "test")

    def holder(queued: int) -> Candidate:
        endpoint = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
        return Candidate(endpoint, EndpointMetrics(block_size_tokens=64, age_seconds=0.0, num_requests_running=4,
                                                   kv_cache_usage_perc=0.9, queued_prefill_tokens=queued,
                                                   known_unprefilled_requests=1, unprefilled_requests=1))

    idle = Candidate(Endpoint(id=EndpointId("127.0.0.1:2"), url="http://127.0.0.1:2", model="m"),
                     EndpointMetrics(block_size_tokens=64, age_seconds=0.0))
    for queued, stays in ((1000, True), (2 * 19 * 64 + 2048, True), (2 * 19 * 64 + 2049, False)):
        h = holder(queued)
        state = CycleState()
        state.set(TOKEN_IDS, PROMPT)
        state.set(PREFIX_MATCH, PrefixMatch(32, {h.id: 19}))  # 19/32 = 0.59
        ranked = profile.run(state, SchedulingRequest(model="m", token_ids=PROMPT), [h, idle]).ranked
        assert ranked[0].id == (h.id if stays else idle.id), queued


def test_a_history_every_endpoint_can_load_from_a_kv_store_keeps_its_own_holder() -> None:
    """The case (measured with ``+cpu+kv_store`` engines: 2 % GPU hits, sessions everywhere): kv_indexer
    folds a kv_store's blocks into every engine reaching it, so every engine "matches" the whole history.
    Only the engine holding it itself (``matched - reached``) is the session's holder; the siblings:
    the precise prefix share counts held blocks only, and the same without folding is unchanged."""
    from services.epp.plugins.scorers.precise_prefix_cache import PrecisePrefixCacheScorer

    scorer = SessionAffinityScorer("s")
    a, b, c = _cand(1), _cand(2), _cand(3)
    folded = PrefixMatch(32, {a.id: 32, b.id: 32, c.id: 32}, reached_blocks={b.id: 32, c.id: 20})
    assert _score(scorer, folded, [a, b, c]) == {a.id: 1.0, b.id: 0.0, c.id: 0.0}  # c holds 12 < 16
    assert folded.held(a.id) == 32 and folded.held(b.id) == 0 and folded.held(c.id) == 12
    state = CycleState()
    state.set(PREFIX_MATCH, folded)
    prefix = PrecisePrefixCacheScorer("p").score(state, SchedulingRequest(model="m", token_ids=PROMPT), [a, b, c])
    assert prefix == {a.id: 1.0, b.id: 0.0, c.id: 12 / 32}
    plain = PrefixMatch(32, {a.id: 32, c.id: 12})
    assert _score(scorer, plain, [a, b, c]) == {a.id: 1.0, b.id: 0.0, c.id: 0.0}
