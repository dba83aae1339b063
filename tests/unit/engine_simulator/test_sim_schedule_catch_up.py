"""The engine loop keeps model time on a schedule: a late wake-up (the host starving the simulator)
delays tokens but costs no throughput; debt beyond ``MAX_CATCH_UP_SECONDS`` is given up and counted;
idle time is never "caught up" (issue 9: Mooncake at 2x/4x on a loaded host)."""

from __future__ import annotations

import asyncio

import pytest

from engine_simulator.engine import MAX_CATCH_UP_SECONDS, AsyncEngine
from engine_simulator.latency_model import LatencyModel
from engine_simulator.metrics import EngineMetrics
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.clock import ManualClock

# step = 10 ms + 1 ms per prefill token, decode free beyond the base
LATENCY = LatencyModel(base_seconds=0.01, prefill_seconds_per_token=0.001, decode_seconds_per_seq=0.0,
                       decode_seconds_per_context_token=0.0)


class StarvedClock(ManualClock):
    """A manual clock whose ``late``-th sleep wakes ``extra`` model seconds late (a starved host)."""

    def __init__(self, late: int, extra: float) -> None:
        super().__init__()
        self.sleeps = 0
        self._late, self._extra = late, extra

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await super().sleep(seconds + (self._extra if self.sleeps == self._late else 0.0))


def _engine(clock: ManualClock) -> tuple[AsyncEngine, EngineMetrics]:
    core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512), PrefixCache(64, 16))
    metrics = EngineMetrics("tiny", {"block_size": "16"}, 512)
    return AsyncEngine(core, LATENCY, clock, NullEventPublisher(), metrics), metrics


async def _generate(engine: AsyncEngine, rid: str, n_out: int) -> Request:
    req = Request(rid, list(range(3, 23)), max_tokens=n_out, ignore_eos=True)  # 20-token prompt
    queue = engine.submit(req)
    outs = [await asyncio.wait_for(queue.get(), 5) for _ in range(n_out)]
    assert outs[-1].finished
    return req


def _sample(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


async def test_late_wake_up_is_caught_up_without_losing_throughput() -> None:
    # schedule: prefill ends 0.030, decodes at 0.040 .. 0.070; the first sleep wakes 25 ms late
    clock = StarvedClock(late=1, extra=0.025)
    engine, metrics = _engine(clock)
    engine.start()
    try:
        req = await _generate(engine, "a", 5)
    finally:
        await engine.stop()
    assert req.first_token_time == pytest.approx(0.055)  # the late token reaches the client late
    assert req.last_token_time == pytest.approx(0.070)  # but the engine is back on its schedule
    assert _sample(metrics, "kvmesh_sim_step_model_seconds_total") == pytest.approx(0.070)
    assert _sample(metrics, "kvmesh_sim_step_lost_seconds_total") == 0.0
    assert _sample(metrics, "kvmesh_sim_step_lag_seconds") == pytest.approx(0.0)


async def test_debt_beyond_the_bound_is_given_up_and_counted() -> None:
    extra = MAX_CATCH_UP_SECONDS + 1.0
    clock = StarvedClock(late=1, extra=extra)
    engine, metrics = _engine(clock)
    engine.start()
    try:
        req = await _generate(engine, "a", 3)
    finally:
        await engine.stop()
    assert req.first_token_time == pytest.approx(0.030 + extra)
    # the next step starts MAX_CATCH_UP_SECONDS behind now: 1 s (+ the 30 ms step) of schedule is lost
    assert _sample(metrics, "kvmesh_sim_step_lost_seconds_total") == pytest.approx(extra - MAX_CATCH_UP_SECONDS)
    assert req.last_token_time == pytest.approx(0.030 + extra)  # the two decodes ran back to back, caught up


async def test_idle_time_is_not_caught_up() -> None:
    """A request arriving after the engine idled starts at its arrival, not at the old schedule."""
    clock = StarvedClock(late=0, extra=0.0)
    engine, metrics = _engine(clock)
    engine.start()
    try:
        first = await _generate(engine, "a", 2)
        assert first.last_token_time == pytest.approx(0.040)
        await asyncio.sleep(0)
        clock.advance(10.0)
        second = await _generate(engine, "b", 2)
    finally:
        await engine.stop()
    # the prompt is cached (one 16-token block): 4 tokens prefilled = 14 ms, then one decode
    assert second.first_token_time == pytest.approx(10.040 + 0.014)
    assert second.last_token_time == pytest.approx(10.040 + 0.014 + 0.010)
    assert _sample(metrics, "kvmesh_sim_step_lost_seconds_total") == 0.0


def test_a_request_joining_a_late_step_is_not_scheduled_before_it_arrived() -> None:
    """A step on a schedule running late starts, in model time, before a request that arrived while the
    loop caught up; its queue time (vLLM's SCHEDULED - ARRIVED) is 0, never negative (fresh-user trial:
    ``make run``'s table showed a queue p50 of -0.002 s)."""
    core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512), PrefixCache(64, 16))
    late = Request("late", list(range(3, 23)), max_tokens=2, ignore_eos=True)
    late.arrival_time = 5.0
    on_time = Request("on-time", list(range(30, 50)), max_tokens=2, ignore_eos=True)
    on_time.arrival_time = 4.0
    core.add_request(on_time)
    core.add_request(late)
    step = core.schedule(4.99)  # the step's model start: 10 ms before "late" arrived
    assert not step.empty
    assert on_time.first_scheduled_time == pytest.approx(4.99)
    assert late.first_scheduled_time == pytest.approx(5.0)


async def test_queue_time_is_never_negative_on_a_starved_engine() -> None:
    clock = StarvedClock(late=2, extra=0.5)  # the second sleep wakes 0.5 model s late
    engine, metrics = _engine(clock)
    engine.start()
    try:
        first = engine.submit(Request("a", list(range(3, 23)), max_tokens=40, ignore_eos=True))
        await asyncio.wait_for(first.get(), 5)
        while clock.sleeps < 2:  # noqa: ASYNC110 - the fake clock counts sleeps; no event to await
            await asyncio.sleep(0)  # the late sleep is under way: the next step starts behind the clock
        clock.advance(0.3)
        req = Request("b", list(range(60, 80)), max_tokens=2, ignore_eos=True)
        queue = engine.submit(req)
        while not (await asyncio.wait_for(queue.get(), 5)).finished:
            pass
    finally:
        await engine.stop()
    assert req.first_scheduled_time is not None and req.first_scheduled_time == pytest.approx(req.arrival_time)
    queue_sum = metrics.registry.get_sample_value("vllm:request_queue_time_seconds_sum", {"model_name": "tiny", "engine": "0"})
    assert queue_sum is not None and queue_sum >= 0.0  # "a" queued 0 s, "b" 0 s (it joined a late step)
