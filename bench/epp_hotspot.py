"""Why does a routing policy hot-spot? Replay a workload through a fresh mesh and record the evidence.

Usage::

    .venv/bin/python bench/epp_hotspot.py --policy precise-prefix --requests 400 --num-gpu-blocks 7000 \
        [--trace ../shared/data/traces/conversation_trace.jsonl] [--time-scale 2] [--out bench/hotspot.json]

While the replay runs, every engine's ``/metrics`` is sampled every ``--sample-interval`` wall seconds
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``). The router
reaches epp through a recording gRPC proxy in this process (:class:`RecordingPicker`), which forwards every
``EndpointPicker`` call and keeps each ``PickResponse``: target, profile and the per-scorer ``breakdown``
(no log parsing; the proxy adds one loopback hop to each pick). Prints: TTFT percentiles and hit rate,
per-engine request count / hit rate / mean and max of running, waiting and KV usage, how often epp's target
was not the engine with the shortest scraped queue, how often every prefix score was 0 (a kv_indexer timeout
or no match), pick round-trip times, and the share of picks per engine over time (10 windows).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh_cli.mesh import Member, Mesh, MeshSpec
from kvmesh_cli.replay import replay
from kvmesh_cli.report import hit_rate, per_engine, summarize
from kvmesh_cli.workloads import load_workload

_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def pick_record(reply: epp_pb2.PickResponse, rtt_ms: float) -> dict:
    """One pick as this script reports it: target id, round trip (ms), and per candidate its total and scores."""
    return {
        "target": reply.target.id,
        "profile": reply.profile,
        "rtt_ms": rtt_ms,
        "cands": {b.endpoint_id: {"total": b.total, **b.scores} for b in reply.breakdown},
    }


class RecordingPicker(epp_pb2_grpc.EndpointPickerServicer):
    """Forwards ``EndpointPicker`` calls to epp at ``upstream`` and keeps every successful pick's response."""

    def __init__(self, upstream: str) -> None:
        self._channel = grpc.insecure_channel(upstream)
        self._stub = epp_pb2_grpc.EndpointPickerStub(self._channel)
        self._lock = threading.Lock()
        self.picks: list[dict] = []

    def _forward(self, call: grpc.UnaryUnaryMultiCallable, request: object, context: grpc.ServicerContext) -> object:
        try:
            return call(request, timeout=context.time_remaining(), metadata=context.invocation_metadata())
        except grpc.RpcError as exc:  # the router must see epp's status (UNAVAILABLE, NOT_FOUND, ...)
            context.abort(exc.code(), exc.details() or "")
            raise  # not reached: abort raises

    def Pick(self, request: epp_pb2.PickRequest, context: grpc.ServicerContext) -> epp_pb2.PickResponse:
        started = time.perf_counter()
        reply = self._forward(self._stub.Pick, request, context)
        assert isinstance(reply, epp_pb2.PickResponse)
        record = pick_record(reply, (time.perf_counter() - started) * 1e3)
        with self._lock:
            self.picks.append(record)
        return reply

    def ListEndpoints(self, request: epp_pb2.ListEndpointsRequest, context: grpc.ServicerContext) -> object:
        return self._forward(self._stub.ListEndpoints, request, context)

    def GetPickerInfo(self, request: epp_pb2.GetPickerInfoRequest, context: grpc.ServicerContext) -> object:
        return self._forward(self._stub.GetPickerInfo, request, context)

    def serve(self) -> tuple[grpc.Server, str]:
        """Start a loopback server for this proxy (with a SERVING health service); returns it and its address."""
        server = grpc.server(ThreadPoolExecutor(max_workers=32))
        epp_pb2_grpc.add_EndpointPickerServicer_to_server(self, server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, f"127.0.0.1:{port}"

    def close(self) -> None:
        self._channel.close()


class RecordingMesh(Mesh):
    """A mesh whose router reaches epp through a :class:`RecordingPicker`; everything else as configured."""

    def __init__(self, spec: MeshSpec) -> None:
        super().__init__(spec)
        self.recorder: RecordingPicker | None = None
        self._proxy: grpc.Server | None = None

    def _service(self, name: str, *flags: str, grpc_port: int | None = None) -> Member:
        if name == "router":
            self.recorder = RecordingPicker(self.epp_address)
            self._proxy, proxy_address = self.recorder.serve()
            flags = tuple(proxy_address if i and flags[i - 1] == "--epp-address" else f for i, f in enumerate(flags))
        return super()._service(name, *flags, grpc_port=grpc_port)

    def stop(self) -> None:
        super().stop()
        if self._proxy is not None:
            self._proxy.stop(grace=None)
        if self.recorder is not None:
            self.recorder.close()


def _gauges(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        for g in _GAUGES:
            if line.startswith(g):
                out[g] = out.get(g, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def sample_engines(urls: list[str], interval: float, stop: threading.Event, into: list[dict]) -> None:
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            t = time.monotonic()
            row: dict[str, object] = {"t": t}
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    row[url] = _gauges(client.get(f"{url}/metrics").text)
            into.append(row)
            stop.wait(max(0.0, interval - (time.monotonic() - t)))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--policy", default="precise-prefix")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--workload", default="multi-turn")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--num-gpu-blocks", type=int, default=7000)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--sample-interval", type=float, default=0.25)
    parser.add_argument("--run-dir", type=Path, default=Path(".run/hotspot"))
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()

    wl = load_workload(args.trace, args.workload, args.requests, 0, None, 512)
    run_dir = (args.run_dir / f"{Path(args.policy).stem}-{args.num_gpu_blocks}-{int(time.time())}").resolve()
    spec = MeshSpec(run_dir=run_dir, engines=args.engines, policy=args.policy, time_scale=args.time_scale,
                    num_gpu_blocks=args.num_gpu_blocks)
    samples: list[dict] = []
    stop = threading.Event()
    with RecordingMesh(spec) as mesh:
        urls = list(mesh.engine_urls)
        sampler = threading.Thread(target=sample_engines, args=(urls, args.sample_interval, stop, samples))
        sampler.start()
        try:
            outcome = asyncio.run(replay(wl, router_url=mesh.router_url, engine_urls=urls,
                                         time_scale=args.time_scale, concurrency_limit=64))
        finally:
            stop.set()
            sampler.join()
        cpu = {m.name: _cpu_seconds(m.process.pid) for m in mesh.members if m.process.proc is not None}
        assert mesh.recorder is not None
        picks = list(mesh.recorder.picks)
        epp_log = next(m.log_path for m in mesh.members if m.name == "epp")
        epp_log_text = epp_log.read_text(errors="replace")

    summary = summarize(outcome.results, wall_duration_s=outcome.wall_duration_s, time_scale=args.time_scale,
                        prefix_hit_rate=hit_rate(outcome.counters_before, outcome.counters_after))
    print(f"policy={args.policy} blocks={args.num_gpu_blocks} requests={args.requests} run_dir={run_dir}")
    ttft = " / ".join(f"{summary[k]:.2f}" for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))
    print(f"TTFT p50/p90/p99 = {ttft} s, hit rate {summary['prefix_hit_rate']}")
    engines = per_engine(outcome.counters_before, outcome.counters_after)
    port = {u: u.rsplit(":", 1)[-1] for u in urls}
    print("engine  reqs  hits   run(mean/max)  wait(mean/max)  kv(mean/max)")
    for u in urls:
        rows = [s[u] for s in samples if u in s]
        n, rate = engines.get(u, (0, None))

        def mm(key: str, rows: list = rows) -> str:
            vals = [r.get(key, 0.0) for r in rows] or [0.0]
            return f"{statistics.fmean(vals):6.1f}/{max(vals):5.1f}"

        print(f"{port[u]:>6} {n:5} {100 * (rate or 0):5.1f}%  {mm(_GAUGES[0])}   {mm(_GAUGES[1])}   "
              f"{statistics.fmean([r.get(_GAUGES[2], 0) for r in rows] or [0]):.2f}/"
              f"{max([r.get(_GAUGES[2], 0) for r in rows] or [0]):.2f}")
    if picks:
        not_least = 0
        all_zero = 0
        prefix_decided = 0
        for p in picks:
            c = p["cands"]
            if "queue" in next(iter(c.values())):
                best_q = max(v["queue"] for v in c.values())
                if c[p["target"]]["queue"] < best_q:
                    not_least += 1
            if "prefix" in next(iter(c.values())):
                if all(v["prefix"] == 0 for v in c.values()):
                    all_zero += 1
                if c[p["target"]]["prefix"] > min(v["prefix"] for v in c.values()):
                    prefix_decided += 1
        print(f"picks recorded {len(picks)}; target not the best queue score {not_least}; "
              f"all prefix scores 0 {all_zero}; target had more prefix than the worst {prefix_decided}; "
              f"pick round trip ms p50 {statistics.median(p['rtt_ms'] for p in picks):.1f} "
              f"max {max(p['rtt_ms'] for p in picks):.1f}")
        windows = 10
        size = max(1, len(picks) // windows)
        ids = sorted({p["target"] for p in picks})
        ports = " ".join(i.rsplit(":", 1)[-1] for i in ids)
        print(f"share of picks per engine over time (windows of {size} picks): {ports}")
        for w in range(0, len(picks), size):
            chunk = picks[w:w + size]
            print("  " + " ".join(f"{sum(p['target'] == i for p in chunk) / len(chunk):5.2f}" for i in ids))
    print("CPU seconds per process (whole life): " + ", ".join(f"{k}={v:.1f}" for k, v in cpu.items()))
    print("kv_indexer score warnings in epp log:", epp_log_text.count("kv_indexer score failed"))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "samples": samples, "picks": picks}) + "\n")


if __name__ == "__main__":
    main()
