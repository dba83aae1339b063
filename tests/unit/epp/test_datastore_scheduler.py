"""Datastore (metrics parsing, membership, staleness, pending picks) and the scheduler's outcomes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
from prometheus_client import REGISTRY

from kvmesh.clock import ManualClock
from kvmesh.errors import InvalidRequest, NoEndpointsAvailable, UnknownModel
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample, parse_vllm_metrics
from services.epp.framework.interfaces import PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from tests.support import recording


def metric_value(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def vllm_metrics(waiting: float, running: float, usage: float, block_size: int = 64, engines: int = 1) -> str:
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0',
    ]
    for e in range(engines):
        labels = f'engine="{e}",model_name="m"'
        lines += [
            f"vllm:num_requests_running{{{labels}}} {running}",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            f'vllm:cache_config_info{{block_size="{block_size}",{labels},num_gpu_blocks="100"}} 1.0',
        ]
    return "\n".join(lines) + "\n"


def test_parse_real_vllm_exposition() -> None:
    """vLLM 0.32 CPU /metrics (``metrics_exposition.txt`` in the vendored recordings)."""
    sample = parse_vllm_metrics(recording("metrics_exposition.txt").read_text())
    # 17 requests finished (and first tokens); num_gpu_blocks="16384" of 32 tokens, less vLLM's null block
    assert sample == ScrapeSample(0.0, 0.0, 0.0, 32, 17.0, 17.0, (16384 - 1) * 32)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (vllm_metrics(3, 2, 0.5), ScrapeSample(3.0, 2.0, 0.5, 64, kv_capacity_tokens=99 * 64)),
        # each rank's pool (num_gpu_blocks="100", one null block) summed
        (vllm_metrics(3, 2, 0.5, engines=2), ScrapeSample(6.0, 4.0, 0.5, 64, kv_capacity_tokens=2 * 99 * 64)),
    ],
    ids=["one-engine", "two-dp-ranks"],
)
def test_parse_vllm_metrics(text: str, expected: ScrapeSample) -> None:
    assert parse_vllm_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "missing"),
        (vllm_metrics(1, 1, 1.5), "outside"),
        (vllm_metrics(-1, 1, 0.5), "negative"),
        ("vllm:num_requests_waiting{a=} 1\n", "."),
    ],
    ids=["empty", "usage-over-one", "negative", "malformed"],
)
def test_parse_vllm_metrics_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_vllm_metrics(text)


def ep(port: int, model: str = "m") -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model)


def test_datastore_membership_scrapes_and_pending() -> None:
    clock = ManualClock()
    ds = Datastore(clock)
    a, b = ep(1), ep(2)
    ds.set_endpoints({a.id: a, b.id: b})
    assert [c.metrics.age_seconds for c in ds.candidates("m")] == [None, None]
    ds.record_scrape(a.id, ScrapeSample(1, 2, 0.25, 64))
    clock.advance(0.5)
    ds.note_pick(a.id)
    ds.note_pick(a.id)
    ca = ds.candidates("m")[0]
    assert (ca.metrics.age_seconds, ca.metrics.pending_picks, ca.metrics.queue_depth) == (0.5, 2, 5)
    ds.record_scrape(a.id, ScrapeSample(1, 4, 0.25, 64))
    assert ds.candidates("m")[0].metrics.pending_picks == 0
    ds.record_scrape_failure(b.id, "refused")
    ds.record_scrape_failure(b.id, "refused")
    assert ds.candidates("m")[1].metrics.consecutive_failures == 2
    ds.set_endpoints({a.id: a})
    assert [c.id for c in ds.candidates()] == [a.id]
    ds.record_scrape(b.id, ScrapeSample(0, 0, 0, 64))  # late scrape of a departed endpoint: ignored
    assert [c.id for c in ds.candidates()] == [a.id]
    assert ds.candidates("m")[0].metrics.num_requests_running == 4  # kept across set_endpoints


def test_pending_picks_reconcile_with_the_engines_received_count() -> None:
    """A scrape rendered before a picked request reached the engine must not forget that pick."""
    clock = ManualClock()
    ds = Datastore(clock, pending_pick_ttl_seconds=5.0)
    a = ep(1)
    ds.set_endpoints({a.id: a})

    def scrape(waiting: float, running: float, finished: float) -> int:
        ds.record_scrape(a.id, ScrapeSample(waiting, running, 0.0, 64, finished))
        return ds.candidates("m")[0].metrics.pending_picks

    assert scrape(0, 2, 10) == 0  # baseline: 12 requests received before epp's first pick
    ds.note_pick(a.id)
    ds.note_pick(a.id)
    assert scrape(0, 2, 10) == 2  # neither arrived yet: both stay pending (used to reset to 0)
    assert scrape(1, 2, 10) == 1  # one arrived (waiting)
    assert scrape(0, 1, 13) == 0  # both arrived and everything finished
    ds.note_pick(a.id)
    clock.advance(6.0)  # never delivered (router fell back): expires after the TTL
    assert scrape(0, 1, 13) == 0
    assert scrape(0, 3, 13) == 0  # requests epp did not send: rebaselined, never negative ...
    ds.note_pick(a.id)
    assert scrape(0, 3, 13) == 1  # ... so epp's next pick counts again
    assert scrape(0, 0, 0) == 1  # counter restart: at most the picks of the last TTL stay pending


def _scheduler(
    config: str, clock: ManualClock, handle: PluginHandle | None = None
) -> tuple[Scheduler, Datastore]:
    ds = Datastore(clock)
    source, data = resolve_scheduling_config(config)
    profile = build_profile(data, default_registry(), handle or PluginHandle(rng=random.Random(0)), source)
    return Scheduler(ds, profile, LiveEndpointFilter("live")), ds


class _SlowIndex:
    """kv_indexer stand-in that answers after a real delay (so concurrent picks overlap)."""

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        await asyncio.sleep(0.02)
        return PrefixMatch(len(token_ids) // 64, {})


async def test_concurrent_picks_see_each_other_despite_slow_prefix_scores() -> None:
    """A burst of concurrent picks must spread: the load snapshot is taken after the kv_indexer await."""
    clock = ManualClock()
    sched, ds = _scheduler("precise-prefix", clock, PluginHandle(rng=random.Random(0), prefix_index=_SlowIndex()))
    eps = [ep(1), ep(2), ep(3), ep(4)]
    ds.set_endpoints({e.id: e for e in eps})
    for e in eps:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0))
    request = SchedulingRequest(model="m", token_ids=tuple(range(640)))
    decisions = await asyncio.gather(*(sched.pick(request) for _ in range(8)))
    targets = [d.target.id for d in decisions]
    assert sorted(targets.count(e.id) for e in eps) == [2, 2, 2, 2]


async def test_scheduler_outcomes_and_least_loaded() -> None:
    clock = ManualClock()
    sched, ds = _scheduler("load-only", clock)
    a, b, c = ep(1), ep(2), ep(3, model="other")
    with pytest.raises(InvalidRequest):
        await sched.pick(SchedulingRequest(model=""))
    with pytest.raises(UnknownModel):
        await sched.pick(SchedulingRequest(model="m"))
    ds.set_endpoints({a.id: a, b.id: b, c.id: c})
    # nothing of "m" scraped yet (epp just started): fail open to the not-yet-scraped endpoints
    before = metric_value("kvmesh_epp_picks_without_metrics_total")
    warm = await sched.pick(SchedulingRequest(model="m"))
    assert {warm.target.id, *(f.id for f in warm.fallbacks)} == {a.id, b.id}
    assert metric_value("kvmesh_epp_picks_without_metrics_total") == before + 1
    with pytest.raises(NoEndpointsAvailable, match="2 registered, 2 excluded, 0 without fresh metrics"):
        await sched.pick(SchedulingRequest(model="m", exclude_endpoint_ids=frozenset({a.id, b.id})))
    ds.record_scrape(a.id, ScrapeSample(4, 4, 0.5))
    ds.record_scrape(b.id, ScrapeSample(0, 1, 0.1))
    ds.record_scrape(c.id, ScrapeSample(0, 0, 0.0))
    decision = await sched.pick(SchedulingRequest(model="m"))
    assert (decision.target.id, [f.id for f in decision.fallbacks]) == (b.id, [a.id])
    assert decision.breakdown[0].scores == {"queue": 1.0, "kv-utilization": pytest.approx(0.9)}
    assert decision.profile == "default"
    excluded = await sched.pick(SchedulingRequest(model="m", exclude_endpoint_ids=frozenset({b.id})))
    assert (excluded.target.id, excluded.fallbacks) == (a.id, [])
    with pytest.raises(NoEndpointsAvailable, match="2 excluded"):
        await sched.pick(SchedulingRequest(model="m", exclude_endpoint_ids=frozenset({a.id, b.id})))
    clock.advance(5.0)  # every scrape is now stale
    with pytest.raises(NoEndpointsAvailable):
        await sched.pick(SchedulingRequest(model="m"))


async def test_pending_picks_spread_a_burst() -> None:
    clock = ManualClock()
    sched, ds = _scheduler("load-only", clock)
    a, b = ep(1), ep(2)
    ds.set_endpoints({a.id: a, b.id: b})
    ds.record_scrape(a.id, ScrapeSample(0, 0, 0.0))
    ds.record_scrape(b.id, ScrapeSample(0, 0, 0.0))
    targets = [(await sched.pick(SchedulingRequest(model="m"))).target.id for _ in range(10)]
    assert targets.count(a.id) == 5 and targets.count(b.id) == 5


async def test_round_robin_cycles() -> None:
    clock = ManualClock()
    sched, ds = _scheduler("round-robin", clock)
    eps = [ep(1), ep(2), ep(3)]
    ds.set_endpoints({e.id: e for e in eps})
    for e in eps:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0))
    targets = [(await sched.pick(SchedulingRequest(model="m"))).target.id for _ in range(6)]
    assert targets == [e.id for e in eps] * 2
