"""Where the router's pick stage goes: one pick's timestamps across the router and epp (issue 10, wave 10).

Starts a mesh (``kvmesh_cli.mesh``: etcd, the five services, one simulated engine at
``--time-scale 1000``, ``--policy`` precise-prefix), sends ``--requests`` sequential completions (256-token
prompt, 1 output token, as ``bench/router_overhead.py``) and records, for each request's pick, the
``time.perf_counter_ns()`` (``CLOCK_MONOTONIC``, one clock for every process of the host) at each point
of its path: the router's pick stage starts, the query and ``PickRequest`` are built, the entry is
queued, the writer task wakes and writes, epp reads it, its pick task starts, the decision (prepare:
the prefix match; run: filters, scorers, picker), the response is built, queued and written, the
router reads it, resolves the future, the request's coroutine resumes and the stage ends. The
recording is ``bench/pick_trace_site/sitecustomize.py``, put on the router's and epp's ``PYTHONPATH``
for this run only (it wraps the functions; nothing in the services changes). Prints each step's
median and p90 (µs) and the cumulative median from the stage's start.

``--baseline-env KEY=VALUE`` (repeatable) starts a second mesh with these settings and measures both
interleaved in one run (one request to each in turn), one table per mesh: e.g. ``--baseline-env
PYTHONSAFEPATH=1 --baseline-env PYTHONPATH=/tmp/base`` for a copy of the tree (the tracer is added
to that ``PYTHONPATH``).

    .venv/bin/python bench/pick_stage_trace.py --requests 400 [--baseline-env ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import track
from rich.table import Table

from kvmesh_cli.mesh import Mesh, MeshSpec

SITE = Path(__file__).resolve().parent / "pick_trace_site"
PROMPT_IDS = [3 + (i * 7919) % 2000 for i in range(256)]

STEPS: list[tuple[str, str]] = [
    ("r.stage_start", "router: stage starts (RequestFlow._timed_pick)"),
    ("r.client_pick", "router: PickQuery built (render_fields_json), PickerClient.pick called"),
    ("r.request_built", "router: needs_prompt, PickRequest built (pick_request)"),
    ("r.enqueue", "router: future, trace context, PickEntry, queued (send)"),
    ("r.writer_woke", "router: writer task wakes (Event.set -> task)"),
    ("r.batch_built", "router: PickBatch built"),
    ("r.written", "router: call.write returns (grpc send op)"),
    ("e.received", "epp: entry handed to the session (grpc read, message decoded)"),
    ("e.handled", "epp: request_from_proto, pick task created"),
    ("e.task_start", "epp: pick task runs"),
    ("e.trace_entered", "epp: trace context (_enter_trace: extract, span start, attach)"),
    ("e.decide_start", "epp: deadline (asyncio.timeout); Scheduler.pick called"),
    ("e.prepare_start", "epp: model's candidates, live filter"),
    ("e.prepare_end", "epp: prepare (prefix match: replica Score)"),
    ("e.run_start", "epp: fresh snapshot, live filter"),
    ("e.run_end", "epp: scorers and picker (profile.run)"),
    ("e.decide_end", "epp: note_pick, PickDecision, metrics"),
    ("e.response_start", "epp: after the decision (span end) -> response_to_proto"),
    ("e.response_built", "epp: PickResponse built"),
    ("e.answered", "epp: PickResult queued (outbox)"),
    ("e.write_start", "epp: writer task wakes, PickResults built"),
    ("e.written", "epp: context.write returns (grpc send op)"),
    ("r.read", "router: call.read returns the result (grpc read, decoded)"),
    ("r.resolved", "router: reader resolves the future"),
    ("r.resumed", "router: the pick's coroutine resumes"),
    ("r.client_done", "router: candidates from the response (endpoint_from_proto)"),
    ("r.stage_end", "router: stage ends (back in the request flow)"),
]


def _load(trace_dir: Path) -> dict[str, dict[str, int]]:
    """request id -> point -> ns (the first record of each point)."""
    out: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for path in trace_dir.glob("*.tsv"):
        for line in path.read_text().splitlines():
            point, rid, t = line.split("\t")
            if rid:
                out[rid].setdefault(point, int(t))
    return out


def _q(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _table(console: Console, title: str, picks: dict[str, dict[str, int]]) -> dict[str, float]:
    names = [p for p, _ in STEPS]
    complete = [v for v in picks.values() if all(p in v for p in names)]
    table = Table(title=f"{title}: {len(complete)} picks with every point (µs)")
    for column in ("step (time since the previous point)", "p50", "p90", "cum. p50"):
        table.add_column(column, justify="left" if column.startswith("step") else "right")
    medians: dict[str, float] = {}
    if not complete:
        console.print(f"{title}: no complete pick recorded")
        return medians
    for i, (point, label) in enumerate(STEPS[1:], start=1):
        prev = names[i - 1]
        deltas = [(v[point] - v[prev]) / 1e3 for v in complete]
        cum = [(v[point] - v["r.stage_start"]) / 1e3 for v in complete]
        medians[point] = statistics.median(deltas)
        table.add_row(label, f"{statistics.median(deltas):.0f}", f"{_q(deltas, 90):.0f}", f"{statistics.median(cum):.0f}")
    spans = {
        "router before the write (stage start -> batch built)": ("r.stage_start", "r.batch_built"),
        "router -> epp (batch built -> epp received)": ("r.batch_built", "e.received"),
        "epp (received -> write start)": ("e.received", "e.write_start"),
        "  of which Scheduler.pick": ("e.decide_start", "e.decide_end"),
        "epp -> router (epp write start -> router read)": ("e.write_start", "r.read"),
        "router after the read (read -> stage end)": ("r.read", "r.stage_end"),
        "whole stage": ("r.stage_start", "r.stage_end"),
    }
    for label, (a, b) in spans.items():
        deltas = [(v[b] - v[a]) / 1e3 for v in complete]
        table.add_row(f"[bold]{label}[/bold]", f"{statistics.median(deltas):.0f}", f"{_q(deltas, 90):.0f}", "")
    console.print(table)
    return medians


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--policy", default="precise-prefix")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every mesh process")
    parser.add_argument("--baseline-env", action="append", default=[],
                        help="KEY=VALUE: a second mesh with these settings, measured interleaved")
    return parser


def main() -> int:
    ns = build_parser().parse_args()
    console = Console()
    env = dict(item.split("=", 1) for item in ns.env)
    baseline = dict(item.split("=", 1) for item in ns.baseline_env) if ns.baseline_env else None
    with tempfile.TemporaryDirectory(prefix="kvmesh-pick-trace-") as tmp:
        run = Path(tmp)
        meshes: list[tuple[str, dict[str, str]]] = [("A (this tree" + (", " + " ".join(ns.env) if ns.env else "") + ")", env)]
        if baseline is not None:
            meshes.append(("B (" + " ".join(ns.baseline_env) + ")", {**env, **baseline}))
        specs = []
        for i, (_, extra) in enumerate(meshes):
            trace_dir = run / f"trace{i}"
            trace_dir.mkdir()
            path = os.pathsep.join(p for p in (extra.get("PYTHONPATH", ""), str(SITE)) if p)
            specs.append((MeshSpec(run_dir=run / f"mesh{i}", engines=1, policy=ns.policy, time_scale=1000.0,
                                   extra_env={**extra, "PYTHONPATH": path, "KVMESH_PICK_TRACE_DIR": str(trace_dir)}),
                          trace_dir))
        started = [Mesh(spec) for spec, _ in specs]
        try:
            for mesh in started:
                mesh.__enter__()
            with httpx.Client(timeout=30) as client:
                body = {"model": specs[0][0].model, "prompt": PROMPT_IDS, "max_tokens": 1}
                urls = [m.router_url + "/v1/completions" for m in started]
                for _ in track(range(ns.warmup), description="warm-up", transient=True):
                    for url in urls:
                        client.post(url, json=body).raise_for_status()
                time.sleep(1.5)  # the warm-up's records flushed, then dropped
                for _, trace_dir in specs:
                    for f in trace_dir.glob("*.tsv"):
                        f.unlink()
                latency: list[list[float]] = [[] for _ in urls]
                for _ in track(range(ns.requests), description="sequential, interleaved", transient=True):
                    for i, url in enumerate(urls):
                        t0 = time.perf_counter()
                        client.post(url, json=body).raise_for_status()
                        latency[i].append(time.perf_counter() - t0)
                time.sleep(2.5)  # the tracer flushes once a second
        finally:
            for mesh in reversed(started):
                mesh.__exit__(None, None, None)
        for (label, _), (_, trace_dir), lat in zip(meshes, specs, latency, strict=True):
            _table(console, f"{label}; request p50 {1000 * statistics.median(lat):.2f} ms", _load(trace_dir))
    console.print(f"load average {os.getloadavg()}; command: " + " ".join([sys.executable.rsplit('/', 1)[-1], *sys.argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
