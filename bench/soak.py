"""Soak: bounded load on a mesh for ``--minutes`` with a fault every ``--fault-every-seconds`` (issue 14 item 6).

Starts a mesh (etcd, the five services, ``--engines`` simulated engines), keeps ``--concurrency``
closed-loop clients sending small completions (half streamed) through the router, and cycles
through the faults: kill -9 + restart of an engine, kv_indexer, epp, flow_control and the router,
etcd paused (SIGSTOP/SIGCONT), an engine flapping (SIGSTOP 1 s / SIGCONT 1 s). It reports errors by
class (per fault window and overall; a request counts in the window of the fault live when it
ended), each fault's recovery time (from the fault to the end of the last failed request it
caused) and one failure's detail per class, and RSS / open fds per service at start and end
(growth over the run; a restarted service starts again from its restart), as tables, and
optionally a PNG.

    .venv/bin/python bench/soak.py --minutes 3 [--plot soak.png] [--json soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh_cli.fault_load import OK, Load, open_fds, rss_bytes
from kvmesh_cli.mesh import Mesh, MeshSpec

SERVICES = ("router", "epp", "kv_indexer", "flow_control", "kv_store", "engine-0", "engine-1")


@dataclass
class FaultWindow:
    name: str
    started: float
    repaired: float = 0.0
    ended: float = 0.0
    classes: Counter[str] = field(default_factory=Counter)
    recovery_seconds: float = 0.0
    examples: dict[str, str] = field(default_factory=dict)
    """One failure's detail per class (the answer's body or the client's exception)."""


def _faults(mesh: Mesh) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    def kill_restart(name: str) -> Callable[[], Awaitable[None]]:
        async def fault() -> None:
            mesh.kill(name)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(mesh.restart, name)
        return fault

    async def pause_etcd() -> None:
        pid = mesh.member("etcd").process.pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(5.0)
        finally:
            os.killpg(pid, signal.SIGCONT)

    async def flap() -> None:
        pid = mesh.member("engine-1").process.pid
        for _ in range(3):
            os.killpg(pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)
            os.killpg(pid, signal.SIGCONT)
            await asyncio.sleep(1.0)

    return [
        ("kill -9 engine-1", kill_restart("engine-1")),
        ("kill -9 kv_indexer", kill_restart("kv_indexer")),
        ("pause etcd 5s", pause_etcd),
        ("flap engine-1", flap),
        ("kill -9 epp", kill_restart("epp")),
        ("kill -9 flow_control", kill_restart("flow_control")),
        ("kill -9 router", kill_restart("router")),
    ]


def _sample(mesh: Mesh) -> dict[str, tuple[int, int, int]]:
    """name -> (pid, rss bytes, open fds) for the live members."""
    out: dict[str, tuple[int, int, int]] = {}
    for m in mesh.members:
        if m.name in SERVICES and m.process.alive():
            try:
                out[m.name] = (m.process.pid, rss_bytes(m.process.pid), open_fds(m.process.pid))
            except OSError:
                continue
    return out


async def soak(mesh: Mesh, minutes: float, fault_every: float, concurrency: int, console: Console) -> dict[str, object]:
    faults = _faults(mesh)
    windows: list[FaultWindow] = []
    samples: list[tuple[float, dict[str, tuple[int, int, int]]]] = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    async with Load(mesh.router_url, mesh.spec.model, concurrency=concurrency) as load:
        samples.append((0.0, _sample(mesh)))
        next_fault, i = t0 + min(fault_every, 10.0), 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_fault and end - now > 15:
                name, fault = faults[i % len(faults)]
                window = FaultWindow(name, now)
                console.log(f"t={now - t0:6.1f}s fault: {name}")
                await fault()
                window.repaired = time.monotonic()
                windows.append(window)
                i += 1
                next_fault = window.repaired + fault_every
            await asyncio.sleep(1.0)
            if not samples or time.monotonic() - t0 - samples[-1][0] >= 5.0:
                samples.append((time.monotonic() - t0, _sample(mesh)))
        samples.append((time.monotonic() - t0, _sample(mesh)))
    for k, w in enumerate(windows):
        w.ended = windows[k + 1].started if k + 1 < len(windows) else end
        # charged to the fault live when the request *ended*: a request started just before the router
        # is killed dies with the router, not with the fault before it
        mine = [o for o in load.outcomes if w.started <= o.ended < w.ended]
        w.classes = Counter(o.klass for o in mine)
        failed = [o for o in mine if o.klass != OK]
        w.recovery_seconds = round(max(o.ended for o in failed) - w.started, 2) if failed else 0.0
        for o in failed:
            w.examples.setdefault(o.klass, o.detail[:300])
    first_fault = windows[0].started if windows else end
    return {
        "minutes": minutes,
        "requests": len(load.outcomes),
        "classes": dict(Counter(o.klass for o in load.outcomes)),
        "before_first_fault": dict(Counter(o.klass for o in load.outcomes if o.ended < first_fault)),
        "faults": [{"name": w.name, "at_s": round(w.started - t0, 1), "classes": dict(w.classes),
                    "recovery_s": w.recovery_seconds, "examples": w.examples} for w in windows],
        "samples": [{"t_s": round(t, 1), "members": {n: {"pid": p, "rss_mb": round(r / 2**20, 1), "fds": f}
                                                      for n, (p, r, f) in s.items()}} for t, s in samples],
        "timeline": [(round(o.started - t0, 2), o.klass) for o in load.outcomes],
    }


def _growth(doc: dict[str, object]) -> list[tuple[str, str, str, str, str, str]]:
    samples: list[dict[str, object]] = doc["samples"]  # type: ignore[assignment]
    rows = []
    for name in SERVICES:
        series = [(s["t_s"], s["members"][name]) for s in samples if name in s["members"]]  # type: ignore[index, operator]
        if not series:
            continue
        last_pid = series[-1][1]["pid"]
        same = [m for _, m in series if m["pid"] == last_pid]
        first, final = same[0], same[-1]
        rows.append((name, str(len({m["pid"] for _, m in series})), f"{first['rss_mb']:.1f}", f"{final['rss_mb']:.1f}",
                     f"{first['fds']}", f"{final['fds']}"))
    return rows


def _plot(doc: dict[str, object], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timeline: list[tuple[float, str]] = doc["timeline"]  # type: ignore[assignment]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    horizon = int(max((t for t, _ in timeline), default=0)) + 1
    ok = [0] * horizon
    bad = [0] * horizon
    for t, klass in timeline:
        (ok if klass == OK else bad)[int(t)] += 1
    ax1.plot(range(horizon), ok, label="ok / s", color="#3a9e5c")
    ax1.plot(range(horizon), bad, label="not ok / s", color="#c0392b")
    for f in doc["faults"]:  # type: ignore[attr-defined]
        ax1.axvline(f["at_s"], color="#888888", linestyle=":")
        ax1.text(f["at_s"], max(ok or [1]), f["name"], rotation=90, fontsize=7, va="top")
    ax1.legend(fontsize=8)
    ax1.set_ylabel("requests started / s")
    samples: list[dict[str, object]] = doc["samples"]  # type: ignore[assignment]
    for name in SERVICES:
        pts = [(s["t_s"], s["members"][name]["rss_mb"]) for s in samples if name in s["members"]]  # type: ignore[index, operator]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax2.set_ylabel("RSS (MiB)")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--minutes", type=float, default=3.0, help="soak length (default 3; the issue's long run is 30)")
    parser.add_argument("--fault-every-seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--policy", default="precise-prefix")
    parser.add_argument("--lease-ttl-seconds", type=int, default=3)
    parser.add_argument("--plot", type=Path, help="write a PNG (request rate and RSS over time) here")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    return parser


def main() -> int:
    ns = build_parser().parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="kvmesh-soak-") as tmp:
        spec = MeshSpec(run_dir=Path(tmp), engines=ns.engines, policy=ns.policy, time_scale=20.0,
                        lease_ttl_seconds=ns.lease_ttl_seconds)
        console.log(f"starting mesh: {ns.engines} engines, policy {ns.policy}")
        with Mesh(spec) as mesh:
            doc = asyncio.run(soak(mesh, ns.minutes, ns.fault_every_seconds, ns.concurrency, console))
    table = Table(title=f"soak {ns.minutes} min: {doc['requests']} requests, {ns.concurrency} clients")
    for col in ("fault", "at (s)", "requests in window by class", "recovery (s)"):
        table.add_column(col)
    table.add_row("(none: before the first fault)", "0", json.dumps(doc["before_first_fault"]), "-")
    for f in doc["faults"]:  # type: ignore[attr-defined]
        table.add_row(f["name"], f"{f['at_s']}", json.dumps(f["classes"]), f"{f['recovery_s']}")
    table.add_row("all", "-", json.dumps(doc["classes"]), "-")
    console.print(table)
    growth = Table(title="per process: restarts, RSS and open fds (first and last sample of its last pid)")
    for col in ("process", "pids", "RSS start (MiB)", "RSS end (MiB)", "fds start", "fds end"):
        growth.add_column(col)
    for row in _growth(doc):
        growth.add_row(*row)
    console.print(growth)
    console.print(f"command: {' '.join(sys.argv)}")
    if ns.json:
        ns.json.write_text(json.dumps({k: v for k, v in doc.items() if k != "timeline"}, indent=1))
    if ns.plot:
        console.print(f"plot: {ns.plot}" if _plot(doc, ns.plot) else "matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
