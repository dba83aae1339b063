"""``kvmesh compare --timeline``: per-engine load sampled from real simulator ``/metrics`` (in process, over
its ASGI app) and reduced to the figures that say where a saturated run's time went (issue 9)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from engine_simulator.app import build_service
from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.metrics import EngineMetrics
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import Request
from engine_simulator.server import EngineHttpApi, ServerState
from kvmesh.clock import ScaledClock
from kvmesh_cli.replay import probe_loop_lag
from kvmesh_cli.report import stage_means
from kvmesh_cli.timeline import (
    ROUTER_STAGES,
    ROUTER_TTFT,
    EngineSample,
    EngineSampler,
    TimelinePoint,
    load_samples,
    parse_engine_sample,
    parse_router_sample,
    timeline_line,
    timeline_summary,
    write_timeline,
)


def test_parse_reads_the_simulator_exposition() -> None:
    metrics = EngineMetrics("tiny", {"block_size": "16"}, 512)
    metrics.record_step(running=3, waiting=2, usage=0.5, step_tokens=5, new_preemptions=1, new_generation_tokens=4)
    metrics.record_step_time(model_seconds=0.25, lag_seconds=0.125)
    metrics.record_lost_time(1.5)
    metrics.record_finished(finish_reason="length", prompt_tokens=20, cached_tokens=0, generation_tokens=4,
                            e2e_seconds=1.0, queue_seconds=0.1, prefill_seconds=0.2, decode_seconds=0.7)
    sample = parse_engine_sample(metrics.exposition().decode())
    assert sample == EngineSample(waiting=2, running=3, kv_usage=0.5, preemptions=1, prompt_tokens=20,
                                  generation_tokens=4, step_model_s=0.25, step_lag_s=0.125, step_lost_s=1.5)


def test_parse_sums_labels_defaults_missing_and_rejects_garbage() -> None:
    text = ('vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 3\n'
            "# HELP x y\nvllm:num_requests_running 4 1700000000\n")
    assert parse_engine_sample(text) == EngineSample(5, 4, 0, 0, 0, 0)  # a real vLLM has no kvmesh_sim_*
    with pytest.raises(ValueError, match="unparsable"):
        parse_engine_sample("vllm:num_requests_waiting{engine=\"0\"} many\n")


def _point(t: float, **engines: tuple[float, float]) -> TimelinePoint:
    return TimelinePoint(t, {url: EngineSample(w, r, 0.5, t, 100 * t, 10 * t, t, 0.0, 0.0)
                             for url, (w, r) in engines.items()})


def test_summary_counts_stranded_capacity_and_spread() -> None:
    points = [
        _point(0.0, a=(0, 1), b=(0, 1)),   # both busy, nothing waiting
        _point(1.0, a=(0, 0), b=(3, 5)),   # a idle while b has 3 waiting: stranded
        _point(2.0, a=(1, 4), b=(2, 4)),   # both busy, spread 1
        _point(3.0, a=(0, 0), b=(0, 0)),   # both idle: not stranded
    ]
    s = timeline_summary(points)
    assert s["samples"] == 4
    assert s["stranded_fraction"] == pytest.approx(0.25)
    assert s["waiting_spread_mean"] == pytest.approx((0 + 3 + 1 + 0) / 4)
    b = s["engines"]["b"]  # type: ignore[index]
    assert b["waiting_mean"] == pytest.approx(5 / 4) and b["running_mean"] == pytest.approx(10 / 4)
    assert b["preemptions"] == 3 and b["prompt_tokens"] == 300 and b["generation_tokens"] == 30
    assert "stranded 25.0 %" in timeline_line(s) and "lost 0 %" in timeline_line(s)
    assert timeline_summary(points[:1]) == {} and timeline_line({}) == "engine timeline: too few samples"


def test_sampler_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        EngineSampler(["http://e"], interval_s=0)
    with pytest.raises(ValueError, match="time_scale"):
        EngineSampler(["http://e"], time_scale=0)


async def test_sampler_follows_a_live_simulator(tmp_path: Path) -> None:
    config = SimulatorConfig(model="tiny", max_model_len=512, time_scale=50.0, tokenizer_path=str(tmp_path / "tok"),
                             etcd_endpoints=[])
    sim = build_service(config)
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    api = EngineHttpApi(ServerState(engine, sim.renderer, "tiny", 512, sim.tokenizer_dir, 1700000000))
    sampler = EngineSampler(["http://sim"], interval_s=0.01, time_scale=config.time_scale)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app())) as client:
            queue = engine.submit(Request("r", list(range(3, 200)), max_tokens=40, ignore_eos=True))
            assert not (await queue.get()).finished  # prefilled: the gauges show it running
            busy = await sampler.sample_once(client, asyncio.get_running_loop().time())
            task = asyncio.create_task(sampler.run(client))
            while not (await queue.get()).finished:
                pass
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        async with httpx.AsyncClient() as plain:  # a refused engine is left out of the point
            down = EngineSampler(["http://127.0.0.1:1"], interval_s=0.01)
            assert (await down.sample_once(plain, 0.0)).engines == {}
    finally:
        await engine.stop()
    assert busy.engines["http://sim"].waiting + busy.engines["http://sim"].running == 1
    summary = timeline_summary(sampler.points)
    assert summary["samples"] >= 2
    eng = summary["engines"]["http://sim"]  # type: ignore[index]
    assert eng["generation_tokens"] > 0 and eng["step_model_s"] > 0
    ticks = [p.t_s for p in sampler.points[1:]]  # run()'s own points, from its start
    assert ticks == sorted(ticks)
    out = tmp_path / "timeline.jsonl"
    write_timeline(sampler.points, out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(sampler.points) and set(rows[-1]["engines"]["http://sim"]) >= {"waiting", "running",
                                                                                         "step_lag_s"}


def test_router_stage_means_from_a_prometheus_exposition() -> None:
    """The router's TTFT and stage histograms (names as services/router/metrics.py), rendered by prometheus_client."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    ttft = Histogram(ROUTER_TTFT, "ttft", ["model_name"], registry=registry)
    stages = Histogram(ROUTER_STAGES, "stages", ["stage"], registry=registry)
    ttft.labels(model_name="m").observe(1.0)
    stages.labels(stage="pick").observe(0.5)
    first = parse_router_sample(generate_latest(registry).decode())
    for seconds in (2.0, 4.0):
        ttft.labels(model_name="m").observe(seconds)
    stages.labels(stage="pick").observe(0.25)
    stages.labels(stage="admission").observe(0.125)
    last = parse_router_sample(generate_latest(registry).decode())
    assert first["ttft"].count == 1 and first["pick"].sum == 0.5
    assert stage_means(first, last) == {"ttft": 3.0, "pick": 0.25, "admission": 0.125}
    assert stage_means(first, last, 4.0) == {"ttft": 12.0, "pick": 1.0, "admission": 0.5}  # model seconds
    assert stage_means(last, last) == {}
    with pytest.raises(ValueError, match="unparsable"):
        parse_router_sample(f'{ROUTER_STAGES}_sum{{stage="pick"}} soon\n')


async def test_loop_lag_probe_sees_a_blocked_client() -> None:
    lags: list[float] = []
    task = asyncio.create_task(probe_loop_lag(lags, interval_s=0.01))
    await asyncio.sleep(0.03)
    busy_until = time.monotonic() + 0.2  # the client's loop busy (parsing 64 streams on a starved host)
    while time.monotonic() < busy_until:
        pass
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert max(lags) >= 0.15 and len(lags) >= 2


def test_load_samples_average_the_engines_that_answered_each_point() -> None:
    points = [
        TimelinePoint(0.0, {"a": EngineSample(1, 2, 0, 0, 0, 0), "b": EngineSample(3, 4, 0, 0, 0, 0)}, 5.0),
        TimelinePoint(1.0, {}, 7.0),  # no engine answered: not a load sample
        TimelinePoint(2.0, {"a": EngineSample(0, 6, 0, 0, 0, 0)}, None),
    ]
    assert load_samples(points) == [(3.0, 2.0, 5.0), (6.0, 0.0, None)]


async def test_one_sampler_reads_the_engines_and_flow_controls_queue(tmp_path: Path) -> None:
    """The replay's one load sampler: engines and flow_control (its real metrics, services/flow_control/metrics.py)
    in the same point, so the TTFT breakdown needs no second scrape of the engines."""
    from prometheus_client import CollectorRegistry, generate_latest

    from services.flow_control.metrics import PrometheusObserver

    registry = CollectorRegistry()
    PrometheusObserver(registry).on_state(queued=4, in_flight=2)
    config = SimulatorConfig(model="tiny", max_model_len=512, time_scale=50.0, tokenizer_path=str(tmp_path / "tok"),
                             etcd_endpoints=[])
    sim = build_service(config)
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    engine_app = EngineHttpApi(ServerState(engine, sim.renderer, "tiny", 512, sim.tokenizer_dir, 1700000000)).app()

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]  # http://fc/metrics is flow_control's
        if scope["type"] == "http" and dict(scope["headers"]).get(b"host") == b"fc":
            found = scope["path"] == "/metrics"
            body = generate_latest(registry) if found else b"not found"
            await send({"type": "http.response.start", "status": 200 if found else 404,
                        "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
            await send({"type": "http.response.body", "body": body})
            return
        await engine_app(scope, receive, send)

    sampler = EngineSampler(["http://sim"], interval_s=0.01, time_scale=config.time_scale,
                            flow_control_metrics_url="http://fc/metrics")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            queue = engine.submit(Request("r", list(range(3, 200)), max_tokens=40, ignore_eos=True))
            assert not (await queue.get()).finished
            point = await sampler.sample_once(client, 0.0)
            sampler.flow_control_metrics_url = "http://fc/missing"  # flow_control not answering: None
            missing = await sampler.sample_once(client, 0.0)
            while not (await queue.get()).finished:
                pass
    finally:
        await engine.stop()
    assert point.flow_control_queue == 4.0 and missing.flow_control_queue is None
    assert load_samples([point]) == [(point.engines["http://sim"].running, point.engines["http://sim"].waiting, 4.0)]
    assert point.engines["http://sim"].running + point.engines["http://sim"].waiting == 1
    out = tmp_path / "timeline.jsonl"
    write_timeline([point, missing], out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["flow_control_queue"] == 4.0 and "flow_control_queue" not in rows[1]
