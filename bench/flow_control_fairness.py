"""Flow control against a modelled pool: priority isolation under a 10x batch burst, and fairness at 10:1 rates.

The real :class:`FlowController` (bands, fairness and ordering policies, the saturation detector fed
by periodic "scrapes") runs on a ``ManualClock`` in a discrete-event simulation of the pool, so a
minute of load takes seconds on 2 cores and every run is reproducible (``--seed``). The pool model:
``--engines`` engines, each with ``--slots`` concurrent sequences (vLLM's ``max_num_seqs``) and an
FCFS waiting queue (``vllm:num_requests_waiting``); a request's prefill takes ``prompt / prefill_tps``
seconds and then ``output * tpot`` seconds of decode; ``kv_cache_usage_perc`` = running / slots. The
router's pick is least-loaded (waiting + running). Request sizes and the batch burst's arrival
shape come from the Azure LLM inference *code* trace (``/work/shared/data/traces``): prompt and output
tokens are sampled from it, and the burst replays its timestamps compressed to the burst's rate.
(ServeGen's per-client traces are not on this machine; the 10:1 client skew is set explicitly.)

Scenario A (interactive + batch): an interactive tenant (priority 10, Poisson at ``--interactive-load``
of capacity) alone (baseline), then beside a batch tenant (priority 0, band ``max_saturation``) that
bursts at 10x the pool's capacity for ``--burst-seconds``; and the same load with no flow control
(everything dispatched at once, FCFS in the engines). Target: interactive TTFT p99 within 1.2x of the
baseline; batch throughput = the capacity interactive leaves idle.

Scenario B (fairness): two equal-weight tenants sending at 10:1 rates, both above their fair share,
under each fairness policy. Target: Jain's index of served tokens >= 0.95 in every 10 s window while
both are backlogged.

Scenario C (issue 10, engine-bound throughput; printed first): engines that step (an arrival starts at
the next ``--step-seconds``), hold less KV than their slots (``max_num_seqs`` binds) and are read
``--sample-lag`` after each scrape, with GIE's default thresholds; the detector before issue 10's fix
(``PreviousRule``) against the current one (learned and configured ``max_num_seqs``) in one run. C1:
one engine x ``--c1-slots`` with as many closed-loop clients (bench/router_overhead.py
--engine-bound-only's shape): req/s vs no flow control, target >= 0.8. C2: scenario A's load on these
engines: interactive TTFT p99 must not get worse.

    .venv/bin/python bench/flow_control_fairness.py [--duration 60] [--plot out.png]
    .venv/bin/python bench/flow_control_fairness.py --only-c     # scenario C alone (25 s)
"""

from __future__ import annotations

import argparse
import csv
import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.clock import ManualClock
from services.flow_control.bands import BandConfig
from services.flow_control.controller import ControllerLimits, FlowController, Ticket
from services.flow_control.fairness.window import jain_index
from services.flow_control.saturation import EndpointLoad, PoolSnapshot, SaturationDetector, SaturationState
from services.flow_control.types import AdmissionRequest, QueueOutcome, ServedTokens

TRACE = Path("/work/shared/data/traces/AzureLLMInferenceTrace_code.csv")


def load_trace(path: Path) -> tuple[list[tuple[int, int]], list[float]]:
    """(prompt, output) token pairs and arrival offsets in seconds from the trace's start."""
    sizes: list[tuple[int, int]] = []
    times: list[float] = []
    with path.open() as f:
        for row in csv.DictReader(f):
            sizes.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            times.append(datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
    t0 = times[0]
    return sizes, [t - t0 for t in times]


@dataclass
class Req:
    rid: str
    tenant: str
    priority: int
    prompt: int
    output: int
    arrival: float
    dispatched: float = -1.0
    first_token: float = -1.0
    done: float = -1.0
    ticket: Ticket | None = None
    rejected: str = ""


@dataclass
class Engine:
    slots: int
    running: int = 0
    waiting: list[Req] = field(default_factory=list)


class Sim:
    """The pool. ``step`` > 0: an arrival waits for the engine's next step to start, as in vLLM's
    scheduler (so a scrape between two steps shows it waiting while a slot is free); 0: it starts
    at once. ``kv_per_seq``: the KV fraction one running sequence holds (None: ``1 / slots``, so KV
    is full when the slots are; smaller: the engine is bound by ``max_num_seqs`` before KV).
    ``closed_loop``: each finished request sends a copy at once (wrk's connections). ``sample_lag``:
    seconds between a scrape and flow_control reading it (epp's scrape, then flow_control's poll)."""

    def __init__(self, engines: int, slots: int, prefill_tps: float, tpot: float, controller: FlowController | None,
                 scrape_interval: float, clock: ManualClock, step: float = 0.0, kv_per_seq: float | None = None,
                 closed_loop: bool = False, sample_lag: float = 0.0) -> None:
        self.engines = [Engine(slots) for _ in range(engines)]
        self.prefill_tps, self.tpot = prefill_tps, tpot
        self.controller = controller
        self.scrape_interval = scrape_interval
        self.clock = clock
        self.step = step
        self.kv_per_seq = kv_per_seq
        self.closed_loop = closed_loop
        self.sample_lag = sample_lag
        self.stepping: set[int] = set()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.reqs: dict[str, Req] = {}
        self.finished: list[Req] = []

    def at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    # observer: flow_control dispatched a request -> the router sends it to the least-loaded engine
    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        req = self.reqs[request.request_id]
        if outcome is QueueOutcome.DISPATCHED:
            self.send(req)
        elif outcome is not QueueOutcome.EVICTED_CANCELLED:
            req.rejected = outcome.value

    def on_state(self, queued: int, in_flight: int) -> None:
        pass

    def send(self, req: Req) -> None:
        now = self.clock.now()
        req.dispatched = now
        engine = min(self.engines, key=lambda e: e.running + len(e.waiting))
        if self.step > 0:
            engine.waiting.append(req)
            self.schedule_step(engine, now)
        elif engine.running < engine.slots:
            self.start(engine, req, now)
        else:
            engine.waiting.append(req)

    def schedule_step(self, engine: Engine, now: float) -> None:
        if id(engine) not in self.stepping:
            self.stepping.add(id(engine))
            self.at((int(now / self.step) + 1) * self.step, "step", engine)

    def start(self, engine: Engine, req: Req, now: float) -> None:
        engine.running += 1
        prefill = req.prompt / self.prefill_tps
        req.first_token = now + prefill
        self.at(now + prefill + req.output * self.tpot, "finish", (engine, req))

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(
            EndpointLoad(f"e{i}", "m", len(e.waiting),
                         min(1.0, e.running * self.kv_per_seq if self.kv_per_seq else e.running / e.slots), 0.0, e.running)
            for i, e in enumerate(self.engines)
        ), self.clock.now())

    def run(self, arrivals: list[Req], until: float) -> None:
        for req in arrivals:
            self.reqs[req.rid] = req
            self.at(req.arrival, "arrive", req)
        if self.controller is not None and self.controller.detector is not None:
            self.at(0.0, "scrape", None)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > until:
                break
            self.clock.advance(t - self.clock.now())
            if kind == "arrive":
                req = payload  # type: ignore[assignment]
                assert isinstance(req, Req)
                if self.controller is None:
                    self.send(req)
                else:
                    req.ticket = self.controller.enqueue(AdmissionRequest(
                        req.rid, req.tenant, req.priority, req.prompt, req.output, "m", byte_size=4 * req.prompt))
            elif kind == "finish":
                engine, req = payload  # type: ignore[misc]
                req.done = t
                engine.running -= 1
                self.finished.append(req)
                if engine.waiting:
                    if self.step > 0:
                        self.schedule_step(engine, t)
                    else:
                        self.start(engine, engine.waiting.pop(0), t)
                if self.controller is not None and req.ticket is not None:
                    self.controller.complete(req.ticket, ServedTokens(req.prompt, req.output))
                    self.controller.release(req.ticket)
                if self.closed_loop and t < until:
                    again = Req(f"{req.rid}+", req.tenant, req.priority, req.prompt, req.output, t)
                    self.reqs[again.rid] = again
                    self.at(t, "arrive", again)
            elif kind == "step":
                engine = payload  # type: ignore[assignment]
                assert isinstance(engine, Engine)
                self.stepping.discard(id(engine))
                while engine.waiting and engine.running < engine.slots:
                    self.start(engine, engine.waiting.pop(0), t)
            elif kind == "scrape":
                assert self.controller is not None
                if self.sample_lag > 0:
                    self.at(t + self.sample_lag, "deliver", self.snapshot())
                else:
                    self.controller.update_pool(self.snapshot())
                self.controller.expire_due()
                self.at(t + self.scrape_interval, "scrape", None)
            elif kind == "deliver":
                assert self.controller is not None and isinstance(payload, PoolSnapshot)
                self.controller.update_pool(PoolSnapshot(tuple(replace(e, metrics_age_seconds=t - payload.received_at)
                                                               for e in payload.endpoints), t))


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else float("nan")


def make_controller(clock: ManualClock, fairness: str, bands: tuple[BandConfig, ...], detector: SaturationDetector,
                    sim_holder: list[Sim]) -> FlowController:
    limits = ControllerLimits(max_in_flight=100_000, queue_ttl_seconds=3600.0, max_queue_size=1_000_000, bands=bands,
                              fairness_policy=fairness, fairness_window_seconds=10.0)

    class Forward:
        def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
            sim_holder[0].on_outcome(request, outcome, queue_seconds)

        def on_state(self, queued: int, in_flight: int) -> None:
            pass

    return FlowController(limits, clock, observer=Forward(), detector=detector)


def scenario_a(args: argparse.Namespace, sizes: list[tuple[int, int]], times: list[float]) -> list[dict[str, object]]:
    rng = random.Random(args.seed)
    mean_service = statistics.fmean(p / args.prefill_tps + o * args.tpot for p, o in sizes)
    capacity = args.engines * args.slots / mean_service  # requests/s the pool completes
    duration = args.duration
    interactive: list[tuple[float, int, int]] = []
    t = 0.0
    while t < duration:
        t += rng.expovariate(args.interactive_load * capacity)
        interactive.append((t, *sizes[rng.randrange(len(sizes))]))
    # batch: the trace's arrival pattern (its bursts), compressed to 10x capacity over the burst window
    burst_n = int(10 * capacity * args.burst_seconds)
    n = len(times)
    whole = times[-1] + (times[-1] - times[-2] if n > 1 else 1.0)
    offsets = [times[i % n] + (i // n) * whole for i in range(burst_n)]  # the trace repeated when the burst is longer
    span = offsets[-1] or 1.0
    burst_start = duration * 0.2
    batch = [(burst_start + offsets[i] / span * args.burst_seconds, *sizes[i % n]) for i in range(burst_n)]
    rows = []
    for mode in ("baseline (interactive only)", "no flow control", "flow control"):
        clock = ManualClock(0.0)
        controller = None
        holder: list[Sim] = []
        if mode != "no flow control":
            detector = SaturationDetector(queue_depth_threshold=1, kv_cache_util_threshold=0.95,
                                          metrics_staleness_seconds=1.0, dispatch_visibility_seconds=0.0)
            bands = (BandConfig(10, "interactive"), BandConfig(0, "batch", max_saturation=args.batch_max_saturation))
            controller = make_controller(clock, "round-robin-fairness-policy", bands, detector, holder)
        sim = Sim(args.engines, args.slots, args.prefill_tps, args.tpot, controller, args.scrape_interval, clock)
        holder.append(sim)
        reqs = [Req(f"i{i}", "interactive", 10, p, o, a) for i, (a, p, o) in enumerate(interactive)]
        if mode != "baseline (interactive only)":
            reqs += [Req(f"b{i}", "batch", 0, p, o, a) for i, (a, p, o) in enumerate(batch)]
        sim.run(reqs, until=duration * 3)
        inter = [r for r in sim.finished if r.tenant == "interactive"]
        ttfts = [r.first_token - r.arrival for r in inter]
        window = (burst_start, duration)
        batch_done = [r for r in sim.finished if r.tenant == "batch" and window[0] <= r.done <= window[1]]
        inter_done = [r for r in inter if window[0] <= r.done <= window[1]]
        busy = sum(min(r.done, window[1]) - max(r.first_token - r.prompt / args.prefill_tps, window[0])
                   for r in sim.finished if r.done >= window[0] and r.first_token - r.prompt / args.prefill_tps <= window[1])
        rows.append({
            "mode": mode, "interactive_ttft_p50": statistics.median(ttfts), "interactive_ttft_p99": p99(ttfts),
            "interactive_done": len(inter), "interactive_sent": len(interactive),
            "batch_per_s": len(batch_done) / (window[1] - window[0]),
            "interactive_per_s": len(inter_done) / (window[1] - window[0]),
            "utilization": busy / ((window[1] - window[0]) * args.engines * args.slots),
            "capacity_per_s": capacity,
        })
    return rows


class PreviousRule(SaturationDetector):
    """The detector before issue 10's fix (wave 5), for the A/B: unseen dispatches counted against the
    queue allowance ``queue_depth_threshold - waiting``, plus the sequences that fit under the KV
    threshold only while nothing waits (a queue that is one engine step from starting turned that
    off); GIE's literal gate on the observed queue; saturation = mean roofline + each unseen dispatch
    weighted by one running request's KV share; no credit for sampled requests that finished."""

    _unit_prev = 0.2

    def note_done(self, dispatched_at: float, now: float | None = None) -> None:
        super().note_done(dispatched_at)

    def state(self, now: float) -> SaturationState:
        state = super().state(now)
        if state.stale:
            return state
        unseen = state.unseen_dispatches
        n = len(self._fresh)
        saturation = (self._load_sum + unseen * self._unit_prev) / n
        return replace(state, saturation=saturation, headroom=max(self._spare - unseen, 0.0),
                       saturated=self._spare - unseen <= 0)

    def update(self, snapshot: PoolSnapshot) -> None:
        super().update(snapshot)
        q, kv = self.queue_depth_threshold, self.kv_cache_util_threshold
        fresh = [e for e in snapshot.endpoints if e.metrics_age_seconds is not None
                 and 0 <= e.metrics_age_seconds <= self.metrics_staleness_seconds]
        shares = {e.endpoint_id: e.kv_cache_usage_perc / e.num_requests_running
                  for e in fresh if e.num_requests_running > 0 and e.kv_cache_usage_perc > 0}
        mean_share = statistics.fmean(shares.values()) if shares else 0.0
        spare = 0.0
        for e in fresh:
            if e.kv_cache_usage_perc >= kv:
                continue
            spare += max(0.0, q - e.num_requests_waiting)
            share = shares.get(e.endpoint_id, mean_share)
            if e.num_requests_waiting == 0 and share > 0:
                spare += (kv - e.kv_cache_usage_perc) / share
        self._spare = spare
        self._load_sum = sum(max(e.num_requests_waiting / q, e.kv_cache_usage_perc / kv) for e in fresh)
        self._unit_prev = max(mean_share / kv, 1e-3) if shares else 1.0 / q


def gie_detector(rule: str, slots: int) -> SaturationDetector:
    """GIE's default thresholds (queue 5, KV 0.8), flow_control's default visibility grace (0.05 s)."""
    kind = PreviousRule if rule == "previous" else SaturationDetector
    return kind(queue_depth_threshold=5, kv_cache_util_threshold=0.8, metrics_staleness_seconds=1.0,
                dispatch_visibility_seconds=0.05, max_num_seqs=slots if rule == "configured" else 0)


C_MODES = (("no flow control", ""), ("previous rule", "previous"), ("running slots, learned max_num_seqs", "learned"),
           ("running slots, configured max_num_seqs", "configured"))


def scenario_c(args: argparse.Namespace, sizes: list[tuple[int, int]], times: list[float]) -> list[dict[str, object]]:
    """Engines that step (``--step-seconds``) and hold less KV than their slots (``max_num_seqs`` binds), GIE's
    default thresholds. C1: closed-loop clients, one per slot of the pool (wrk's 64 connections in front of
    max_num_seqs 64): completed req/s per rule vs no flow control. C2: scenario A's interactive + batch burst
    on these engines: interactive TTFT p99 per rule."""
    rows: list[dict[str, object]] = []
    kv_per_seq = args.kv_at_full_batch / args.slots
    mean_service = statistics.fmean(p / args.prefill_tps + o * args.tpot for p, o in sizes)
    capacity = args.engines * args.slots / mean_service
    # C1 has bench/router_overhead.py --engine-bound-only's shape: one engine, max_num_seqs 64, a 256-token
    # prompt, 16 output tokens at --c1-tpot (211 req/s direct on a quiet machine: 64 / 211 / 16 = 19 ms)
    rng = random.Random(args.seed + 2)  # wrk's connections drift apart: start them over one request's time
    clients = [Req(f"c{i}", "wrk", 0, 256, 16, rng.uniform(0, 16 * args.c1_tpot)) for i in range(args.c1_slots)]
    window = (2.0, args.duration)  # after the start-up ramp
    for mode, rule in C_MODES:
        clock = ManualClock(0.0)
        holder: list[Sim] = []
        controller = None if not rule else make_controller(clock, "round-robin-fairness-policy", (BandConfig(0, "standard"),),
                                                           gie_detector(rule, args.c1_slots), holder)
        sim = Sim(1, args.c1_slots, args.prefill_tps, args.c1_tpot, controller, args.scrape_interval, clock,
                  step=args.step_seconds, kv_per_seq=args.kv_at_full_batch / args.c1_slots, closed_loop=True,
                  sample_lag=args.sample_lag)
        holder.append(sim)
        sim.run([Req(r.rid, r.tenant, r.priority, r.prompt, r.output, r.arrival) for r in clients], until=args.duration)
        done = [r for r in sim.finished if window[0] <= r.done <= window[1]]
        rows.append({"part": "C1", "mode": mode, "req_per_s": len(done) / (window[1] - window[0]),
                     "ttft_p99": p99([r.first_token - r.arrival for r in done])})
    burst_a = scenario_a_arrivals(args, sizes, times, capacity)
    for mode, rule in C_MODES:
        clock = ManualClock(0.0)
        holder = []
        controller = None
        if rule:
            bands = (BandConfig(10, "interactive"), BandConfig(0, "batch", max_saturation=args.batch_max_saturation))
            controller = make_controller(clock, "round-robin-fairness-policy", bands, gie_detector(rule, args.slots), holder)
        sim = Sim(args.engines, args.slots, args.prefill_tps, args.tpot, controller, args.scrape_interval, clock,
                  step=args.step_seconds, kv_per_seq=kv_per_seq, sample_lag=args.sample_lag)
        holder.append(sim)
        interactive, batch, burst_start = burst_a
        reqs = [Req(f"i{i}", "interactive", 10, p, o, a) for i, (a, p, o) in enumerate(interactive)]
        reqs += [Req(f"b{i}", "batch", 0, p, o, a) for i, (a, p, o) in enumerate(batch)]
        sim.run(reqs, until=args.duration * 3)
        inter = [r for r in sim.finished if r.tenant == "interactive"]
        batch_done = [r for r in sim.finished if r.tenant == "batch" and burst_start <= r.done <= args.duration]
        rows.append({"part": "C2", "mode": mode, "ttft_p99": p99([r.first_token - r.arrival for r in inter]),
                     "ttft_p50": statistics.median([r.first_token - r.arrival for r in inter]),
                     "req_per_s": len(batch_done) / (args.duration - burst_start)})
    return rows


def scenario_a_arrivals(args: argparse.Namespace, sizes: list[tuple[int, int]], times: list[float],
                        capacity: float) -> tuple[list[tuple[float, int, int]], list[tuple[float, int, int]], float]:
    """Scenario A's interactive (Poisson) and batch (the trace's burst shape at 10x capacity) arrivals."""
    rng = random.Random(args.seed)
    interactive: list[tuple[float, int, int]] = []
    t = 0.0
    while t < args.duration:
        t += rng.expovariate(args.interactive_load * capacity)
        interactive.append((t, *sizes[rng.randrange(len(sizes))]))
    burst_n = int(10 * capacity * args.burst_seconds)
    n = len(times)
    whole = times[-1] + (times[-1] - times[-2] if n > 1 else 1.0)
    offsets = [times[i % n] + (i // n) * whole for i in range(burst_n)]
    span = offsets[-1] or 1.0
    burst_start = args.duration * 0.2
    batch = [(burst_start + offsets[i] / span * args.burst_seconds, *sizes[i % n]) for i in range(burst_n)]
    return interactive, batch, burst_start


def scenario_b(args: argparse.Namespace, sizes: list[tuple[int, int]]) -> tuple[list[dict[str, object]], dict[str, list[float]]]:
    rng = random.Random(args.seed + 1)
    mean_service = statistics.fmean(p / args.prefill_tps + o * args.tpot for p, o in sizes)
    capacity = args.engines * args.slots / mean_service
    light_rate = 0.6 * capacity  # above its fair half: both tenants stay backlogged
    heavy_rate = 10 * light_rate
    arrivals: list[tuple[str, float, int, int]] = []
    for tenant, rate in (("heavy", heavy_rate), ("light", light_rate)):
        t = 0.0
        while t < args.duration:
            t += rng.expovariate(rate)
            arrivals.append((tenant, t, *sizes[rng.randrange(len(sizes))]))
    rows = []
    series: dict[str, list[float]] = {}
    for fairness in ("global-strict-fairness-policy", "round-robin-fairness-policy", "least-attained-service-fairness-policy"):
        clock = ManualClock(0.0)
        holder: list[Sim] = []
        detector = SaturationDetector(queue_depth_threshold=1, kv_cache_util_threshold=0.95,
                                      metrics_staleness_seconds=1.0, dispatch_visibility_seconds=0.0)
        controller = make_controller(clock, fairness, (BandConfig(0, "standard"),), detector, holder)
        sim = Sim(args.engines, args.slots, args.prefill_tps, args.tpot, controller, args.scrape_interval, clock)
        holder.append(sim)
        reqs = [Req(f"{tn}{i}", tn, 0, p, o, a) for i, (tn, a, p, o) in enumerate(arrivals)]
        sim.run(reqs, until=args.duration)
        jains = []
        for start in range(10, int(args.duration) - 9, 10):  # skip the first window (filling up)
            tokens = {"heavy": 0, "light": 0}
            for r in sim.finished:
                if start <= r.done < start + 10:
                    tokens[r.tenant] += r.prompt + r.output
            jains.append(jain_index(list(tokens.values())))
        series[fairness] = jains
        served = {tn: sum(r.prompt + r.output for r in sim.finished if r.tenant == tn) for tn in ("heavy", "light")}
        rows.append({"fairness": fairness, "jain_min": min(jains), "jain_mean": statistics.fmean(jains),
                     "light_share": served["light"] / max(1, sum(served.values())), "windows": len(jains)})
    return rows, series


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prefill-tps", type=float, default=16000.0, help="prefill tokens/s per sequence slot")
    parser.add_argument("--tpot", type=float, default=0.03, help="seconds per output token")
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    parser.add_argument("--duration", type=float, default=60.0, help="model seconds of load")
    parser.add_argument("--burst-seconds", type=float, default=20.0)
    parser.add_argument("--interactive-load", type=float, default=0.3, help="interactive rate as a fraction of capacity")
    parser.add_argument("--batch-max-saturation", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--step-seconds", type=float, default=0.02,
                        help="scenario C: engine step (an arrival starts at the next step)")
    parser.add_argument("--kv-at-full-batch", type=float, default=0.4,
                        help="scenario C: KV use with every slot running (< 0.8: max_num_seqs binds before KV)")
    parser.add_argument("--only-c", action="store_true", help="run scenario C alone (issue 10's A/B)")
    parser.add_argument("--c1-slots", type=int, default=64, help="scenario C1: max_num_seqs of its one engine = clients")
    parser.add_argument("--sample-lag", type=float, default=0.1,
                        help="scenario C: seconds from a scrape to flow_control reading it (epp scrape + poll)")
    parser.add_argument("--c1-tpot", type=float, default=0.019, help="scenario C1: seconds per output token")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--plot", type=Path)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    sizes, times = load_trace(args.trace)
    console = Console()
    rows_c = scenario_c(args, sizes, times)
    c1 = {str(r["mode"]): r for r in rows_c if r["part"] == "C1"}
    c2 = {str(r["mode"]): r for r in rows_c if r["part"] == "C2"}
    free = float(c1["no flow control"]["req_per_s"])  # type: ignore[arg-type]
    table = Table(title=(f"C: engines that step every {args.step_seconds} s, KV {args.kv_at_full_batch:.0%} at a full batch"
                         f" (max_num_seqs binds), GIE defaults (queue 5, KV 0.8, visibility 0.05 s); C1: 1 engine x"
                         f" {args.c1_slots} slots, {args.c1_slots} closed-loop clients, 256+16 tokens; C2: as A"))
    for col in ("rule", "C1 closed loop req/s", "/ no flow control", "target >= 0.8", "C2 interactive TTFT p50 s",
                "C2 TTFT p99 s", "C2 batch req/s"):
        table.add_column(col)
    for mode, _ in C_MODES:
        ratio = float(c1[mode]["req_per_s"]) / free if free else 0.0  # type: ignore[arg-type]
        table.add_row(mode, f"{c1[mode]['req_per_s']:.1f}", f"{ratio:.2f}",
                      "-" if mode == "no flow control" else ("met" if ratio >= 0.8 else "MISSED"),
                      f"{c2[mode]['ttft_p50']:.3f}", f"{c2[mode]['ttft_p99']:.3f}", f"{c2[mode]['req_per_s']:.1f}")
    console.print(table)
    if args.only_c:
        return
    rows_a = scenario_a(args, sizes, times)
    base = rows_a[0]["interactive_ttft_p99"]
    table = Table(title=f"A: interactive beside a 10x-capacity batch burst ({args.engines} engines x {args.slots} slots,"
                        f" capacity {rows_a[0]['capacity_per_s']:.1f} req/s)")
    for col in ("mode", "interactive TTFT p50 s", "TTFT p99 s", "p99 / baseline", "interactive req/s", "batch req/s",
                "pool busy", "target <= 1.2x"):
        table.add_column(col)
    for r in rows_a:
        ratio = float(r["interactive_ttft_p99"]) / float(base)  # type: ignore[arg-type]
        table.add_row(str(r["mode"]), f"{r['interactive_ttft_p50']:.3f}", f"{r['interactive_ttft_p99']:.3f}", f"{ratio:.2f}",
                      f"{r['interactive_per_s']:.1f}", f"{r['batch_per_s']:.1f}", f"{float(r['utilization']):.0%}",  # type: ignore[arg-type]
                      "-" if r is rows_a[0] else ("yes" if ratio <= 1.2 else "NO"))
    console.print(table)
    rows_b, series = scenario_b(args, sizes)
    table = Table(title="B: two equal-weight tenants at 10:1 rates, both backlogged (Jain's index of served tokens per 10 s)")
    for col in ("fairness policy", "Jain min", "Jain mean", "light tenant's token share", "windows", "target min >= 0.95"):
        table.add_column(col)
    for r in rows_b:
        table.add_row(str(r["fairness"]), f"{r['jain_min']:.3f}", f"{r['jain_mean']:.3f}", f"{float(r['light_share']):.2f}",  # type: ignore[arg-type]
                      str(r["windows"]), "yes" if float(r["jain_min"]) >= 0.95 else "NO")  # type: ignore[arg-type]
    console.print(table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.bar([str(r["mode"]).split(" (")[0] for r in rows_a], [float(r["interactive_ttft_p99"]) for r in rows_a])  # type: ignore[arg-type]
        ax1.axhline(1.2 * float(base), color="red", linestyle="--", label="1.2x baseline")  # type: ignore[arg-type]
        ax1.set_ylabel("interactive TTFT p99 (model s)")
        ax1.set_yscale("log")
        ax1.legend()
        ax1.set_title("A: 10x batch burst")
        for name, values in series.items():
            ax2.plot([10 * (i + 1) for i in range(len(values))], values, marker="o", label=name.removesuffix("-fairness-policy"))
        ax2.axhline(0.95, color="red", linestyle="--", label="target 0.95")
        ax2.set_xlabel("window start (model s)")
        ax2.set_ylabel("Jain's index (10 s)")
        ax2.set_title("B: tenants at 10:1 rates")
        ax2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
