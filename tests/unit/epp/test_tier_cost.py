"""``tier-cost-scorer`` (issue 9 item 4): the expected-TTFT cost model, hand-computed, and the profile at work.

Coefficients are the scorer's defaults (the engine simulator's ``llama-3.1-8b-h100`` latency model and
offload links): 3.25e-5 s per prefill token, 6e-3 s per step + 3.25e-5 s per running request, 2,048
tokens per step, 131,072 KV bytes per token, CPU 50e9 B/s + 5e-5 s, DISK/SHARED 7e9 B/s + 2.5e-4 s.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

import pytest

from kvmesh.clock import ManualClock
from kvmesh.hashing import block_keys
from kvmesh.prefix_index import ReplicaEndpoint
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Candidate, EndpointMetrics, PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.framework.registry import parse_params
from services.epp.kv_indexer_client import ReplicaPrefixIndex
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH, PrefixMatchStep
from services.epp.plugins.scorers.tier_cost import TierCostModel, TierCostParams, TierCostScorer, tier_costs
from services.epp.scheduler import Scheduler
from tests.unit.epp.test_plugins import FakeIndex

MODEL = TierCostModel.from_params(TierCostParams())
BLOCK_BYTES = 64 * 131_072  # one 64-token block of Llama-3.1-8B BF16 KV


def _cand(port: int, *, queued: int = 0, known: int = 0, unprefilled: int = 0, running: float = 0) -> Candidate:
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="m")
    metrics = EndpointMetrics(
        block_size_tokens=64, age_seconds=0.0, queued_prefill_tokens=queued, known_unprefilled_requests=known,
        unprefilled_requests=unprefilled, num_requests_running=running,
    )
    return Candidate(endpoint, metrics)


def test_hand_computed_ttft_gpu_cpu_miss() -> None:
    """640-token prompt (10 blocks). A: 8 blocks on GPU, 1,000 queued tokens, 2 running. B: the same
    8 blocks on CPU only, idle. C: nothing cached, idle."""
    a, b, c = _cand(1, queued=1000, known=1, unprefilled=1, running=2), _cand(2), _cand(3)
    match = PrefixMatch(10, {a.id: 8, b.id: 8}, {a.id: {"GPU": 8, "CPU": 8}, b.id: {"CPU": 8}})
    costs = tier_costs([a, b, c], 640, match, MODEL)
    expected_a = (1000 + 128) * 3.25e-5 + 1 * (6e-3 + 2 * 3.25e-5)  # GPU blocks are free
    expected_b = 128 * 3.25e-5 + 6e-3 + (8 * BLOCK_BYTES / 50e9 + 5e-5)  # 8 blocks over PCIe
    expected_c = 640 * 3.25e-5 + 6e-3  # recompute everything
    assert costs == pytest.approx({a.id: expected_a, b.id: expected_b, c.id: expected_c})
    assert (expected_a, expected_b, expected_c) == pytest.approx((0.042725, 0.01155218, 0.0268), abs=1e-7)


@pytest.mark.parametrize(
    ("by_medium", "expected_load"),
    [
        ({"GPU": 8}, 0.0),
        ({}, 0.0),  # the index gave no media: priced as GPU (prefill-cost's view)
        ({"GPU": 4, "CPU": 2, "DISK": 10}, 2 * BLOCK_BYTES / 50e9 + 5e-5 + 2 * BLOCK_BYTES / 7e9 + 2.5e-4),
        ({"SHARED": 8}, 8 * BLOCK_BYTES / 7e9 + 2.5e-4),
        ({"GPU": 6, "CPU": 8}, 2 * BLOCK_BYTES / 50e9 + 5e-5),  # a block on two media counts in both
        ({"GPU": 2, "CPU": 3}, 3 * BLOCK_BYTES / 50e9 + 5e-5),  # 3 blocks no tier claims: as GPU
    ],
    ids=["gpu", "no-media", "cpu-then-disk", "shared", "overlap", "unclaimed"],
)
def test_load_time_cheapest_tier_first(by_medium: dict[str, int], expected_load: float) -> None:
    assert MODEL.load_seconds(8, by_medium, 64) == pytest.approx(expected_load)


def test_steps_scale_with_chunks_and_running_decodes() -> None:
    """5,000 queued + 640 own = 5,640 tokens = 3 chunks of 2,048; each step also decodes 10 requests."""
    busy = _cand(1, queued=5000, known=2, unprefilled=2, running=10)
    cost = MODEL.ttft_seconds(busy, 640, None)
    assert cost == pytest.approx(5640 * 3.25e-5 + 3 * (6e-3 + 10 * 3.25e-5))
    # Requests epp did not pick count as the larger of the known mean (2,500) and the prompt.
    unknown = _cand(1, queued=5000, known=2, unprefilled=3)
    assert MODEL.ttft_seconds(unknown, 640, None) == pytest.approx(8140 * 3.25e-5 + 4 * 6e-3)


def test_weights() -> None:
    sticky = TierCostModel.from_params(TierCostParams(recompute_weight=2.0, queued_weight=0.5))
    cand = _cand(1, queued=1000, known=1, unprefilled=1)
    assert sticky.ttft_seconds(cand, 640, None) == pytest.approx((500 + 1280) * 3.25e-5 + 6e-3)


async def test_scorer_ranks_least_ttft_in_range() -> None:
    a, b, c = _cand(1, queued=1000, known=1, unprefilled=1, running=2), _cand(2), _cand(3)
    index = FakeIndex(PrefixMatch(10, {a.id: 8, b.id: 8}, {a.id: {"GPU": 8}, b.id: {"CPU": 8}}))
    request = SchedulingRequest(model="m", token_ids=tuple(range(640)))
    state = CycleState()
    await PrefixMatchStep("pm", index, None).prepare(state, request, [a, b, c])
    scores = TierCostScorer("t").score(state, request, [a, b, c])
    worst = 0.042725
    assert scores == pytest.approx({a.id: 0.0, b.id: 1 - 0.01155218 / worst, c.id: 1 - 0.0268 / worst}, abs=1e-6)
    assert max(scores, key=lambda k: scores[k]) == b.id


async def test_scorer_prices_offloaded_blocks_through_the_replica() -> None:
    """epp's default prefix index (the ``Watch``-fed replica) gives the per-medium counts ``Score`` gives:
    B's 8 blocks held only on CPU are priced at their PCIe load time, not as GPU hits (the same scores
    as the ``Score``-fed case above); a block on two media counts in both."""
    a, b, c = _cand(1, queued=1000, known=1, unprefilled=1, running=2), _cand(2), _cand(3)
    index = ReplicaPrefixIndex("127.0.0.1:1", 0.2)  # unreachable: a fallback Score call would raise
    replica = index.replica
    replica.reset(0)
    replica.set_endpoints([ReplicaEndpoint(str(e.id), "m", 64) for e in (a, b, c)])
    replica.set_status(True, [])
    tokens = tuple(range(640))
    keys = block_keys(tokens, 64)[:8]
    replica.apply_delta(str(a.id), "GPU", keys, [])
    replica.apply_delta(str(a.id), "CPU", keys[:5], [])
    replica.apply_delta(str(b.id), "CPU", keys, [])
    replica.advance(1, True)
    index._last_message = index._clock()
    request = SchedulingRequest(model="m", token_ids=tokens)
    state = CycleState()
    await PrefixMatchStep("pm", index, None).prepare(state, request, [a, b, c])
    assert index.local_scores == 1 and index.rpc_scores == 0
    match = state.get(PREFIX_MATCH)
    assert match == PrefixMatch(10, {a.id: 8, b.id: 8}, {a.id: {"GPU": 8, "CPU": 5}, b.id: {"CPU": 8}})
    scores = TierCostScorer("t").score(state, request, [a, b, c])
    worst = 0.042725
    assert scores == pytest.approx({a.id: 0.0, b.id: 1 - 0.01155218 / worst, c.id: 1 - 0.0268 / worst}, abs=1e-6)
    assert tier_costs([b], 640, match, MODEL)[b.id] == pytest.approx(128 * 3.25e-5 + 6e-3 + 8 * BLOCK_BYTES / 50e9 + 5e-5)
    await index.close()


def test_params_validated() -> None:
    parsed = parse_params(TierCostParams, "tier-cost-scorer", "t", {})
    assert parsed.bandwidth_bytes_per_second == {"CPU": 50e9, "DISK": 7e9, "SHARED": 7e9}
    for bad in ({"bandwidth_bytes_per_second": {"NVLINK": 1e9}}, {"bandwidth_bytes_per_second": {"CPU": 0}},
                {"latency_seconds": {"CPU": -1}}, {"prefill_seconds_per_token": 0}, {"unknown": 1}):
        with pytest.raises(ValueError):
            parse_params(TierCostParams, "tier-cost-scorer", "t", bad)


def _without_sticky(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tier-cost`` config without its ``session-affinity-scorer``: the cost model's own picks."""
    sticky = {p["name"] for p in data["plugins"] if p["type"] == "session-affinity-scorer"}
    profile = {**data["profiles"][0], "plugins": [r for r in data["profiles"][0]["plugins"] if r["ref"] not in sticky]}
    return {**data, "plugins": [p for p in data["plugins"] if p.get("name") not in sticky], "profiles": [profile]}


def _mesh(n: int, *, sticky: bool = False) -> tuple[ManualClock, Datastore, FakeIndex, Scheduler, list[Endpoint]]:
    clock = ManualClock()
    ds = Datastore(clock)
    index = FakeIndex(PrefixMatch(32, {}))
    source, data = resolve_scheduling_config("tier-cost")
    data = data if sticky else _without_sticky(data)
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=index), source)
    eps = [Endpoint(id=EndpointId(f"127.0.0.1:{p}"), url=f"http://127.0.0.1:{p}", model="m") for p in range(1, n + 1)]
    ds.set_endpoints({e.id: e for e in eps})
    for e in eps:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    return clock, ds, index, Scheduler(ds, profile, LiveEndpointFilter("live")), eps


async def test_burst_spreads_instead_of_piling_on_the_warm_endpoint() -> None:
    """40 picks at once of 2,048-token prompts whose first 30 blocks sit on endpoint 1's GPU: each pick
    adds its own prefill to its target at once, so endpoint 1 takes them while its queue costs less
    than a recompute elsewhere, then the rest spread evenly."""
    _, _, index, sched, eps = _mesh(4)
    index.match = PrefixMatch(32, {eps[0].id: 30}, {eps[0].id: {"GPU": 30}})
    request = SchedulingRequest(model="m", token_ids=tuple(range(2048)))
    targets = [(await sched.pick(SchedulingRequest(model="m", request_id=f"r{i}", token_ids=request.token_ids))).target.id
               for i in range(40)]
    counts = [targets.count(e.id) for e in eps]
    assert 10 <= counts[0] < 40  # affinity kept while it pays
    assert max(counts[1:]) - min(counts[1:]) <= 1  # the overflow spreads
    assert targets[:10] == [eps[0].id] * 10


@pytest.mark.parametrize(("reported", "sticky"), [(False, False), (True, False), (False, True)],
                         ids=["no-completion", "router-reported", "sticky-margin"])
async def test_completion_keeps_a_session_on_its_engine(reported: bool, sticky: bool) -> None:
    """Closed-loop session, issue 9's case: call 1 goes to endpoint 1 (24 of 32 blocks on its GPU);
    another request (1,200 uncached tokens) is picked there after it; call 1's answer arrives and
    call 2 (same prefix) is picked before any scrape. Counting call 1 as still queued, endpoint 1
    costs (512 + 1,200 + 512) tokens in 2 steps = 0.0843 s against 2,048 tokens in 1 step = 0.0726 s
    on endpoint 2, and the session would leave its history; with the router's completion, call 1
    (FCFS: and nothing picked after it) is freed: 1,712 tokens, 0.0616 s, and it stays. The shipped
    config's sticky margin (``session-affinity-scorer``: 1,712 queued tokens are within 2 x 1,536 +
    2,048 of the idle endpoint's 0) keeps it even without the completion."""
    _, ds, index, sched, eps = _mesh(2, sticky=sticky)
    index.match = PrefixMatch(32, {eps[0].id: 24}, {eps[0].id: {"GPU": 24}})
    tokens = tuple(range(2048))
    assert (await sched.pick(SchedulingRequest(model="m", request_id="s1-c1", token_ids=tokens))).target.id == eps[0].id
    ds.note_pick(eps[0].id, 1200, "other")
    if reported:
        assert ds.note_completed("s1-c1", eps[0].id)
        m = ds.candidates("m")[0].metrics
        assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (1, 1, 1200)
    call2 = await sched.pick(SchedulingRequest(model="m", request_id="s1-c2", token_ids=tokens))
    assert call2.target.id == (eps[0].id if reported or sticky else eps[1].id)


def _used(port: int, usage: float, **kw: int) -> Candidate:
    cand = _cand(port, **kw)
    return Candidate(cand.endpoint, dataclasses.replace(cand.metrics, kv_cache_usage_perc=usage))


def test_eviction_a_move_causes_is_priced() -> None:
    """A session's 2,048-token call, 24 of its 32 blocks on A's GPU; A has 1,600 tokens queued. B is idle but
    its pool is 90 % in use. Plain TTFT: A (1,600 + 512) = 2,112 tokens in 2 steps = 0.0806 s; B 2,048 in
    1 step = 0.0726 s: the session would move. But B must hold the 24-block history (1,536 tokens) again,
    evicting 0.9 x 1,536 tokens of others' prefixes (0.0449 s of their recompute): B costs 0.1175 s, and
    the session stays. With B's pool empty (nothing to evict) the move is priced as before."""
    a, b = _used(1, 0.5, queued=1600, known=1, unprefilled=1), _used(2, 0.9)
    match = PrefixMatch(32, {a.id: 24}, {a.id: {"GPU": 24}})
    ttft_a, ttft_b = 2112 * 3.25e-5 + 2 * 6e-3, 2048 * 3.25e-5 + 6e-3
    assert MODEL.ttft_seconds(a, 2048, match) == pytest.approx(ttft_a)
    assert MODEL.ttft_seconds(b, 2048, match) == pytest.approx(ttft_b)
    assert ttft_b < ttft_a  # without the eviction term the session leaves its history
    costs = tier_costs([a, b], 2048, match, MODEL)
    evict_b = 0.9 * 1536 * 3.25e-5
    assert costs == pytest.approx({a.id: ttft_a, b.id: ttft_b + evict_b})  # the holder of the history pays none
    assert costs[a.id] < costs[b.id]
    empty = _used(2, 0.0)
    assert tier_costs([a, empty], 2048, match, MODEL)[empty.id] == pytest.approx(ttft_b)
    # eviction_weight 0: the previous model; occupancy_floor: a pool assumed full of live histories
    off = TierCostModel.from_params(TierCostParams(eviction_weight=0.0))
    assert tier_costs([a, b], 2048, match, off)[b.id] == pytest.approx(ttft_b)
    floor = TierCostModel.from_params(TierCostParams(occupancy_floor=1.0))
    assert tier_costs([a, empty], 2048, match, floor)[empty.id] == pytest.approx(ttft_b + 1536 * 3.25e-5)


def test_a_really_busy_engine_still_lets_the_session_move() -> None:
    """The same session when A has 6,000 tokens queued: A costs 6,512 tokens in 4 steps (0.2356 s), more than
    B (holding 16 of the 24 blocks) recomputing 1,024 tokens plus evicting for the 8 blocks it lacks
    (0.0543 s): it moves. A partial holder pays for the blocks it lacks only."""
    a, b = _used(1, 0.9, queued=6000, known=2, unprefilled=2), _used(2, 0.9)
    match = PrefixMatch(32, {a.id: 24, b.id: 16}, {a.id: {"GPU": 24}, b.id: {"GPU": 16}})
    costs = tier_costs([a, b], 2048, match, MODEL)
    assert costs[a.id] == pytest.approx((6000 + 512) * 3.25e-5 + 4 * 6e-3)
    assert costs[b.id] == pytest.approx((2048 - 1024) * 3.25e-5 + 6e-3 + 0.9 * 8 * 64 * 3.25e-5)
    assert costs[b.id] < costs[a.id]


def test_params_take_eviction_knobs() -> None:
    parsed = parse_params(TierCostParams, "tier-cost-scorer", "t", {"eviction_weight": 2, "occupancy_floor": 0.5})
    assert (parsed.eviction_weight, parsed.occupancy_floor) == (2.0, 0.5)
    for bad in ({"eviction_weight": -1}, {"occupancy_floor": 1.5}):
        with pytest.raises(ValueError):
            parse_params(TierCostParams, "tier-cost-scorer", "t", bad)


def _pool(port: int, *, capacity: int | None, active: int = 0, usage: float = 0.0, running: float = 0) -> Candidate:
    cand = _cand(port, running=running)
    return Candidate(cand.endpoint, dataclasses.replace(
        cand.metrics, kv_capacity_tokens=capacity, active_prompt_tokens=active, kv_cache_usage_perc=usage))


def test_admission_waits_for_kv_room_under_full_prompt_admission() -> None:
    """vLLM 0.32 admits a request only when its whole prompt fits the pool. A 65,472-token pool (1,024 blocks of
    64, less the null block) with 56,000 tokens held by 3 in-flight requests has no room for a 16,000-token
    prompt: 6,528 tokens must be freed first, 6,528 / 56,000 of a residency (64 decode steps of 6 ms + 3
    running decodes). An engine with room, or with the term off, or with no known capacity, pays nothing."""
    admit = TierCostModel.from_params(TierCostParams(admission_wait_weight=1.0, output_tokens_per_request=64))
    full = _pool(1, capacity=65_472, active=56_000, running=3)
    room = _pool(2, capacity=65_472, active=40_000, running=3)
    step = 6e-3 + 3 * 3.25e-5
    assert admit.admission_seconds(full, 16_000) == pytest.approx((6528 / 56_000) * 64 * step)
    assert admit.admission_seconds(room, 16_000) == 0.0
    # the engine's own usage counts when it is higher than epp's picks (requests another router sent)
    busy = _pool(3, capacity=65_472, active=0, usage=0.9)
    over = 0.9 * 65_472 + 16_000 - 65_472
    assert admit.admission_seconds(busy, 16_000) == pytest.approx(over / (0.9 * 65_472) * 64 * (6e-3 + 3.25e-5))
    # near one residency when nearly all that is held must be freed (at most one: over <= held as P <= capacity)
    assert admit.admission_seconds(_pool(4, capacity=65_472, active=65_000, running=3), 65_472) == pytest.approx(
        64 * step)
    for cand in (_pool(5, capacity=None, active=56_000), _pool(6, capacity=10_000, active=5_000)):
        assert admit.admission_seconds(cand, 16_000) == 0.0  # capacity unknown; a prompt that can never fit
    assert MODEL.admission_seconds(full, 16_000) == 0.0  # off by default
    # in the cost: a first call (no match anywhere) goes where it can start, not to the full engine
    costs = tier_costs([full, room], 16_000, None, admit)
    assert costs[full.id] - costs[room.id] == pytest.approx((6528 / 56_000) * 64 * step)
    assert tier_costs([full, room], 16_000, None, MODEL)[full.id] == pytest.approx(costs[room.id])


def test_params_take_admission_knobs() -> None:
    parsed = parse_params(TierCostParams, "tier-cost-scorer", "t",
                          {"admission_wait_weight": 0.5, "output_tokens_per_request": 128})
    assert (parsed.admission_wait_weight, parsed.output_tokens_per_request) == (0.5, 128)
    for bad in ({"admission_wait_weight": -1}, {"output_tokens_per_request": 0}):
        with pytest.raises(ValueError):
            parse_params(TierCostParams, "tier-cost-scorer", "t", bad)


def _saturated_split(rate: float, requests: int, seed: int = 0, abandoned: float = 0.0) -> tuple[list[int], list[int]]:
    """A model-time mesh: 4 of the engine simulator's own cores (``EngineCore`` + ``PrefixCache``, 512 blocks
    of 64 tokens, ``llama-3.1-8b-h100`` step times) behind epp's real ``Datastore`` (scraped every 0.1 model
    s: waiting, running, usage, finished, first tokens; picks noted with their uncached tokens; completions
    reported as the router does) and ``tier_costs`` (argmin, random among ties). Requests shaped like the
    Mooncake conversation trace's (prompts lognormal ~4k tokens, half behind one of 8 shared 1k-token
    prefixes, 20-300 output tokens), Poisson at ``rate`` per model s. Returns (requests served per engine,
    preemptions per engine)."""
    from engine_simulator.latency_model import get_profile
    from engine_simulator.prefix_cache import PrefixCache
    from engine_simulator.scheduler import EngineCore, Request, ScheduledStep, SchedulerConfig

    rng = random.Random(seed)
    latency = get_profile("llama-3.1-8b-h100")
    n, block = 4, 64
    # first-chunk admission, as the simulated engines of the live runs had (the simulator's default then; vLLM's
    # default full-ISL reservation preempts far less, and this test uses preemptions as its proof of saturation)
    cores = [EngineCore(SchedulerConfig(64, 2048, 131072, scheduler_reserve_full_isl=False), PrefixCache(512, block))
             for _ in range(n)]
    eps = [Endpoint(id=EndpointId(f"127.0.0.1:{i + 1}"), url=f"http://127.0.0.1:{i + 1}", model="m") for i in range(n)]
    clock = ManualClock()
    ds = Datastore(clock)
    ds.set_endpoints({e.id: e for e in eps})
    finished, first, served = [0] * n, [0] * n, [0] * n

    def scrape() -> None:
        for i, c in enumerate(cores):
            ds.record_scrape(eps[i].id, ScrapeSample(c.num_waiting, c.num_running, c.cache.usage,
                                                     block, finished[i], first[i]))

    shared = [list(range(5000 + 1000 * k, 5000 + 1000 * k + 1024)) for k in range(8)]
    arrivals: list[tuple[float, list[int], int]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        prompt = (shared[rng.randrange(8)] if rng.random() < 0.5 else [])
        prompt = prompt + [rng.randrange(3, 2000) for _ in range(min(12_000, int(rng.lognormvariate(8.1, 0.5))))]
        arrivals.append((t, prompt, rng.randint(20, 300)))
    step: list[ScheduledStep | None] = [None] * n
    busy_until = [0.0] * n
    next_scrape, done, k = 0.0, 0, 0
    while done < requests:
        now = min([next_scrape, *(a[0] for a in arrivals[k:k + 1]),
                   *(busy_until[i] for i in range(n) if step[i] is not None)])
        clock.advance(now - clock.now())
        if now >= next_scrape:
            scrape()
            next_scrape += 0.1
        if k < len(arrivals) and arrivals[k][0] <= now:
            _, prompt, out = arrivals[k]
            req = Request(f"r{k}", prompt, max_tokens=out, ignore_eos=True, arrival_time=now)
            k += 1
            hashes = req.block_hashes((len(prompt) - 1) // block, block)
            matched = {eps[i].id: len(c.cache.lookup(hashes)) for i, c in enumerate(cores)}
            match = PrefixMatch(len(hashes), {e: m for e, m in matched.items() if m},
                                {e: {"GPU": m} for e, m in matched.items() if m})
            for attempt in (0, 1):
                costs = tier_costs(ds.candidates("m"), len(prompt), match, MODEL)
                best = min(costs.values())
                target = rng.choice(sorted(e for e, c in costs.items() if c == best))
                ds.note_pick(target, max(0, len(prompt) - matched[target] * block), req.request_id)
                if attempt or rng.random() >= abandoned:
                    break
                # the router's early pick, made while flow_control queued the request, is dropped and the
                # request picked again at dispatch (services/router/config.py ``early_pick``)
            i = [e.id for e in eps].index(target)
            served[i] += 1
            cores[i].add_request(req)
        for i, c in enumerate(cores):
            current = step[i]
            if current is not None and busy_until[i] <= now:
                for o in c.update(current):
                    if o.request.first_token_time is None:
                        o.request.first_token_time = now
                        first[i] += 1
                    if o.finished:
                        finished[i] += 1
                        done += 1
                        ds.note_completed(o.request.request_id, str(eps[i].id))
                step[i] = None
            if step[i] is None and c.has_work():
                nxt = c.schedule(now)
                if not nxt.empty:
                    step[i] = nxt
                    busy_until[i] = now + latency.step_seconds(nxt.prefill_tokens, nxt.decode_seqs,
                                                               nxt.decode_context_tokens)
    return served, [c.num_preemptions for c in cores]


@pytest.mark.parametrize(("rate", "abandoned"), [(24.0, 0.0), (48.0, 0.0), (48.0, 0.3)],
                         ids=["x2", "x4", "x4-dropped-early-picks"])
def test_request_split_stays_even_past_saturation(rate: float, abandoned: float) -> None:
    """Issue 9 (BENCHMARKS, Mooncake at 2x / 4x): live, tier-cost split 600 requests 121/167/195/117 and
    174/173/170/83 over 4 engines. The same cost model and datastore on simulated engines driven in model
    time, ~2x and ~4x past what 4 engines serve here (every engine preempting), split evenly, also when 30 %
    of the picks are early picks the router drops and picks again (phantom picks that never get a first
    token on their target): the live skew was not reproduced in model time (docs/scoring.md, "tier-cost
    under saturation"); this test keeps the model's split even."""
    served, preemptions = _saturated_split(rate, 240, abandoned=abandoned)
    assert sum(served) == 240 and min(preemptions) > 0  # really saturated: KV pools full, requests preempted
    mean = sum(served) / len(served)
    assert min(served) >= 0.75 * mean and max(served) <= 1.25 * mean, served
