"""What the mesh adds to a request's latency: direct to an engine vs through the router.

Starts a mesh (etcd, the five services, one simulated engine running ``--time-scale 1000`` so the
engine's own model time is negligible), then sends the same small non-streamed completions
sequentially, first straight to the engine, then through the router (admission, Pick with the
given policy, proxy). Prints p50/p90/p99 of both and their difference, and the command line.

    .venv/bin/python bench/router_overhead.py --requests 300 --policy precise-prefix [--plot out.png]
"""

from __future__ import annotations

import argparse
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


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _measure(client: httpx.Client, url: str, model: str, n: int, label: str) -> list[float]:
    prompt = [3 + (i * 7919) % 2000 for i in range(256)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    latencies: list[float] = []
    for _ in track(range(n), description=label):
        t0 = time.perf_counter()
        reply = client.post(url, json=body)
        latencies.append(time.perf_counter() - t0)
        reply.raise_for_status()
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--policy", default="precise-prefix")
    parser.add_argument("--plot", type=Path, help="write a latency CDF PNG here")
    ns = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        spec = MeshSpec(run_dir=Path(tmp), engines=1, policy=ns.policy, time_scale=1000.0)
        with Mesh(spec) as mesh, httpx.Client(timeout=30) as client:
            engine = mesh.engine_urls[0]
            _measure(client, f"{engine}/v1/completions", spec.model, 20, "warm-up")
            direct = _measure(client, f"{engine}/v1/completions", spec.model, ns.requests, "direct")
            _measure(client, f"{mesh.router_url}/v1/completions", spec.model, 20, "warm-up")
            routed = _measure(client, f"{mesh.router_url}/v1/completions", spec.model, ns.requests, "router")
    table = Table(title=f"router overhead, {ns.requests} sequential requests, policy {ns.policy} (ms)")
    for column in ("path", "p50", "p90", "p99", "mean"):
        table.add_column(column, justify="right" if column != "path" else "left")
    rows = {"direct to engine": direct, "through router": routed}
    for name, values in rows.items():
        table.add_row(name, *(f"{1000 * v:.2f}" for v in (
            _percentile(values, 50), _percentile(values, 90), _percentile(values, 99), statistics.fmean(values))))
    table.add_row("added by the mesh", *(f"{1000 * (_percentile(routed, q) - _percentile(direct, q)):.2f}" for q in (50, 90, 99)),
                  f"{1000 * (statistics.fmean(routed) - statistics.fmean(direct)):.2f}")
    console.print(table)
    console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    if ns.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, values in rows.items():
            xs = sorted(1000 * v for v in values)
            ax.plot(xs, [i / len(xs) for i in range(1, len(xs) + 1)], label=name)
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("kvmesh router overhead")
        ax.legend()
        fig.tight_layout()
        fig.savefig(ns.plot)
        console.print(f"wrote {ns.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
