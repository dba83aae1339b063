"""Per-engine load over time during a replay (``kvmesh compare --timeline DIR``), and what it says.

A replay at saturation is judged by more than its latency percentiles: when a routing policy loses
throughput against round-robin, the question is where the engines' time went. :class:`EngineSampler`
scrapes every engine's ``/metrics`` every ``interval_s`` wall seconds during the replay and keeps, per
engine and sample, vLLM 0.32's gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` and counters ``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``
(prompt tokens of the requests finished) and ``vllm:generation_tokens_total``, and the simulator's
own ``kvmesh_sim_step_model_seconds_total``, ``kvmesh_sim_step_lag_seconds`` and
``kvmesh_sim_step_lost_seconds_total`` (how far the host let the engine fall behind its latency
model: engine_simulator/engine.py), and, given flow_control's ``/metrics`` URL, its
``kvmesh_flow_control_queue_size`` in the same sample. It is the replay's one load sampler:
:func:`load_samples` gives the TTFT breakdown its running / waiting / queue means
(:func:`kvmesh_cli.report.ttft_breakdown`). :func:`timeline_summary` reduces the samples to:

* ``stranded_fraction``: the share of samples in which at least one engine had nothing to do
  (nothing running or waiting) while another had requests waiting: capacity lost to routing,
  whatever the policy (a work-conserving router keeps it near 0);
* ``waiting_spread_mean``: the mean over samples of max - min of the engines' waiting queues;
* ``engine_ttft_mean_s``: the mean TTFT as the engines measure it (``vllm:time_to_first_token_seconds``
  sum over count, requests that got their first token between the first and last sample): against the
  client's TTFT, what was spent before the engine (router, admission, pick);
* per engine: mean waiting, mean running, mean KV usage, preemptions, prompt and generated tokens
  over the replay (deltas of the counters), model seconds of steps, mean lag and lost seconds.

Pure but for :meth:`EngineSampler.run` (HTTP via the replay's client). Model time of a sample is its
wall offset from the sampler's start times the replay's ``time_scale``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvmesh_cli.report import Hist

logger = logging.getLogger(__name__)

SAMPLES = (
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "kvmesh_sim_step_model_seconds_total", "kvmesh_sim_step_lag_seconds", "kvmesh_sim_step_lost_seconds_total",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
)
"""The sample names read, in :class:`EngineSample`'s field order (the simulator's ``kvmesh_sim_*`` are 0
on a real vLLM)."""


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One engine's values at one sample (counters cumulative since the engine started)."""

    waiting: float
    running: float
    kv_usage: float
    preemptions: float
    prompt_tokens: float
    generation_tokens: float
    step_model_s: float = 0.0
    """Model seconds of the steps run (the simulator's ``kvmesh_sim_step_model_seconds_total``; 0 elsewhere)."""
    step_lag_s: float = 0.0
    """Model seconds its last step ended behind schedule (``kvmesh_sim_step_lag_seconds``): the host starving it."""
    step_lost_s: float = 0.0
    """Model seconds of schedule it gave up (``kvmesh_sim_step_lost_seconds_total``): capacity the host did not deliver."""
    ttft_sum_s: float = 0.0
    """``vllm:time_to_first_token_seconds_sum``: TTFT as the engine sees it (arrival there to first token)."""
    ttft_count: float = 0.0


@dataclass(slots=True)
class TimelinePoint:
    """All engines at one sample; ``t_s`` in model seconds from the sampler's start."""

    t_s: float
    engines: dict[str, EngineSample] = field(default_factory=dict)
    flow_control_queue: float | None = None
    """flow_control's ``kvmesh_flow_control_queue_size`` (summed over labels); None without its URL or answer."""


FLOW_CONTROL_QUEUE = "kvmesh_flow_control_queue_size"
"""flow_control's queued requests gauge (services/flow_control), sampled beside the engines."""


def parse_engine_sample(text: str) -> EngineSample:
    """The values of :class:`EngineSample` from an engine's Prometheus text (absent = 0; summed over labels).

    Raises:
        ValueError: when ``text`` is not valid Prometheus text exposition.
    """
    return EngineSample(*sum_samples(text, SAMPLES).values())


def sum_samples(text: str, names: Sequence[str]) -> dict[str, float]:
    """``{name: value}`` for each of ``names`` (in that order) in Prometheus text, summed over label sets
    (absent = 0). One pass over the lines (not ``prometheus_client``'s parser: a 35 KB exposition per engine
    every half second would cost the host the CPU the engines need).

    Raises:
        ValueError: when ``text`` is not valid Prometheus text exposition.
    """
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            raise ValueError(f"unparsable /metrics line: {line[:120]!r}")
        name = line[:name_end]
        if name in sums:
            try:
                rest = line[name_end:]
                sums[name] += float((rest.rsplit("}", 1)[-1] if rest[0] == "{" else rest).split()[0])
            except (ValueError, IndexError):
                raise ValueError(f"unparsable /metrics line: {line[:120]!r}") from None
    return sums


ROUTER_TTFT = "kvmesh_router_request_ttft_seconds"
ROUTER_STAGES = "kvmesh_router_stage_duration_seconds"


def parse_router_sample(text: str) -> dict[str, Hist]:
    """``{"ttft": Hist, "<stage>": Hist}`` from the router's ``/metrics`` (wall seconds; stages as
    ``kvmesh_router_stage_duration_seconds{stage}``), sums and counts only (no buckets: a one-pass read of the
    ``_sum`` / ``_count`` lines, cheap enough to run every sample); means between two samples by
    :func:`kvmesh_cli.report.stage_means`.

    Raises:
        ValueError: when a wanted line has no number.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((ROUTER_TTFT + "_sum", ROUTER_TTFT + "_count")):
            key = "ttft" + line[len(ROUTER_TTFT):].split("{", 1)[0].split(" ", 1)[0]
        elif line.startswith((ROUTER_STAGES + "_sum{", ROUTER_STAGES + "_count{")) and 'stage="' in line:
            kind = line[len(ROUTER_STAGES):].split("{", 1)[0]
            key = line.split('stage="', 1)[1].split('"', 1)[0] + kind
        else:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1])
        except (ValueError, IndexError):
            raise ValueError(f"unparsable router /metrics line: {line[:120]!r}") from None
    names = dict.fromkeys(key.rsplit("_", 1)[0] for key in out)  # in the exposition's order
    return {name: Hist((), out.get(name + "_sum", 0.0), out.get(name + "_count", 0.0)) for name in names}


class EngineSampler:
    """Scrapes ``engine_urls`` every ``interval_s`` wall seconds until cancelled; ``points`` grows.
    With ``router_metrics_url`` (the full ``.../metrics`` URL), the router's metrics too (``router_first`` / ``router_last``, for
    :func:`kvmesh_cli.report.stage_means`); with ``flow_control_metrics_url``, flow_control's queue size in
    each point (:attr:`TimelinePoint.flow_control_queue`).

    Raises:
        ValueError: when ``interval_s`` <= 0 or ``time_scale`` <= 0.
    """

    def __init__(self, engine_urls: Sequence[str], interval_s: float = 0.5, time_scale: float = 1.0,
                 router_metrics_url: str | None = None, flow_control_metrics_url: str | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine_urls = list(engine_urls)
        self.interval_s = interval_s
        self.time_scale = time_scale
        self.points: list[TimelinePoint] = []
        self.router_metrics_url = router_metrics_url
        self.flow_control_metrics_url = flow_control_metrics_url
        self.router_first: dict[str, Hist] | None = None
        self.router_last: dict[str, Hist] | None = None

    async def sample_router(self, client: httpx.AsyncClient) -> None:
        """One scrape of the router (kept as ``router_first`` the first time, else ``router_last``)."""
        if self.router_metrics_url is None:
            return
        try:
            reply = await client.get(self.router_metrics_url, timeout=5.0)
            reply.raise_for_status()
            sample = parse_router_sample(reply.text)
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("timeline: cannot sample router %s: %s", self.router_metrics_url, exc)
            return
        if self.router_first is None:
            self.router_first = sample
        else:
            self.router_last = sample

    async def sample_once(self, client: httpx.AsyncClient, started: float) -> TimelinePoint:
        """One scrape of every engine and flow_control (an engine that does not answer is left out of the point;
        flow_control not answering leaves ``flow_control_queue`` None)."""

        async def one(url: str) -> tuple[str, EngineSample] | None:
            try:
                reply = await client.get(f"{url}/metrics", timeout=5.0)
                reply.raise_for_status()
                return url, parse_engine_sample(reply.text)
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("timeline: cannot sample %s: %s", url, exc)
                return None

        async def queue(url: str | None) -> float | None:
            if url is None:
                return None
            try:
                reply = await client.get(url, timeout=5.0)
                reply.raise_for_status()
                return sum_samples(reply.text, (FLOW_CONTROL_QUEUE,))[FLOW_CONTROL_QUEUE]
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("timeline: cannot sample flow_control %s: %s", url, exc)
                return None

        t = (time.monotonic() - started) * self.time_scale
        got, fc = await asyncio.gather(asyncio.gather(*(one(u) for u in self.engine_urls)),
                                       queue(self.flow_control_metrics_url))
        point = TimelinePoint(t, dict(g for g in got if g is not None), fc)
        self.points.append(point)
        return point

    async def run(self, client: httpx.AsyncClient) -> None:
        """Sample until cancelled, one point per ``interval_s`` (a slow scrape delays the next)."""
        started = time.monotonic()
        while True:
            began = time.monotonic()
            await self.sample_once(client, started)
            await self.sample_router(client)
            await asyncio.sleep(max(0.0, began + self.interval_s - time.monotonic()))


def load_samples(points: Sequence[TimelinePoint]) -> list[tuple[float, float, float | None]]:
    """``(running, waiting, flow_control queue or None)`` per point that has an engine, running and waiting
    averaged over the engines that answered it: :func:`kvmesh_cli.report.ttft_breakdown`'s ``load``."""
    return [(sum(s.running for s in p.engines.values()) / len(p.engines),
             sum(s.waiting for s in p.engines.values()) / len(p.engines), p.flow_control_queue)
            for p in points if p.engines]


def timeline_summary(points: Sequence[TimelinePoint]) -> dict[str, object]:
    """Reduce samples (module docstring); ``{}`` for fewer than two points.

    Returns ``{"samples", "stranded_fraction", "waiting_spread_mean", "engines": {url: {...}}}``
    where each engine has ``waiting_mean``, ``running_mean``, ``kv_usage_mean``, ``preemptions``,
    ``prompt_tokens`` and ``generation_tokens`` (counter deltas first to last sample it answered).
    """
    full = [p for p in points if p.engines]
    if len(full) < 2:
        return {}
    urls = sorted({u for p in full for u in p.engines})
    stranded = spread = 0.0
    counted = 0
    for p in full:
        if len(p.engines) < 2:
            continue
        counted += 1
        waits = [s.waiting for s in p.engines.values()]
        idle = any(s.waiting == 0 and s.running == 0 for s in p.engines.values())
        if idle and max(waits) > 0:
            stranded += 1
        spread += max(waits) - min(waits)
    engines: dict[str, dict[str, float]] = {}
    for url in urls:
        samples = [p.engines[url] for p in full if url in p.engines]
        first, last = samples[0], samples[-1]
        n = len(samples)
        engines[url] = {
            "waiting_mean": sum(s.waiting for s in samples) / n,
            "running_mean": sum(s.running for s in samples) / n,
            "kv_usage_mean": sum(s.kv_usage for s in samples) / n,
            "preemptions": last.preemptions - first.preemptions,
            "prompt_tokens": last.prompt_tokens - first.prompt_tokens,
            "generation_tokens": last.generation_tokens - first.generation_tokens,
            "step_model_s": last.step_model_s - first.step_model_s,
            "step_lag_mean_s": sum(s.step_lag_s for s in samples) / n,
            "step_lost_s": last.step_lost_s - first.step_lost_s,
            "engine_ttft_sum_s": last.ttft_sum_s - first.ttft_sum_s,
            "engine_ttft_count": last.ttft_count - first.ttft_count,
        }
    ttft_n = sum(e["engine_ttft_count"] for e in engines.values())
    return {
        "samples": len(full),
        "engine_ttft_mean_s": sum(e["engine_ttft_sum_s"] for e in engines.values()) / ttft_n if ttft_n else None,
        "stranded_fraction": stranded / counted if counted else 0.0,
        "waiting_spread_mean": spread / counted if counted else 0.0,
        "engines": engines,
    }


def timeline_line(summary: dict[str, object]) -> str:
    """One console line: stranded share, waiting spread, and per engine (by port) wait/run/preemptions/prefill
    and the simulator's mean lag behind its schedule (``lag``) and share of model time given up (``lost``)."""
    if not summary:
        return "engine timeline: too few samples"
    engines: dict[str, dict[str, float]] = summary["engines"]  # type: ignore[assignment]
    parts = [f"{url.rsplit(':', 1)[-1]}: wait {e['waiting_mean']:.1f} run {e['running_mean']:.1f} "
             f"kv {100 * e['kv_usage_mean']:.0f} % preempt {e['preemptions']:.0f} prefill {e['prompt_tokens'] / 1e3:.0f}k"
             f" lag {e['step_lag_mean_s']:.2f} s lost {100 * _lost(e):.0f} %"
             for url, e in engines.items()]
    ttft = summary.get("engine_ttft_mean_s")
    engine_ttft = f"engine-side TTFT mean {float(ttft):.2f} s, " if isinstance(ttft, float) else ""
    return (f"engine timeline ({summary['samples']} samples): {engine_ttft}stranded {100 * float(summary['stranded_fraction']):.1f} %"  # type: ignore[arg-type]
            f" of samples, waiting spread {float(summary['waiting_spread_mean']):.1f}; " + "; ".join(parts))  # type: ignore[arg-type]


def _lost(engine: dict[str, float]) -> float:
    busy = engine.get("step_model_s", 0.0) + engine.get("step_lost_s", 0.0)
    return engine.get("step_lost_s", 0.0) / busy if busy > 0 else 0.0


def write_timeline(points: Sequence[TimelinePoint], path: Path) -> None:
    """JSON lines: one per sample, ``{"t_s": model s, "engines": {url: {waiting, running, ...}}}`` and
    ``"flow_control_queue"`` where sampled."""
    with path.open("w") as f:
        for p in points:
            row: dict[str, object] = {"t_s": round(p.t_s, 3), "engines": {u: asdict(s) for u, s in p.engines.items()}}
            if p.flow_control_queue is not None:
                row["flow_control_queue"] = p.flow_control_queue
            f.write(json.dumps(row) + "\n")
