"""LMCache's own client against kv_store's ``lm://`` listener vs against LMCache's own server, one run.

    .venv/bin/python bench/lmcache_bench.py [--tokens 512,1024,2048,4096] [--iterations 30] [--rounds 3] \
        [--plot docs/img/lmcache_bench.png]

Needs ``make lmcache-venv``. Starts, side by side on 127.0.0.1:

* kv_store (``python -m services.kv_store --lmcache-port 0``, CPU tier), and
* LMCache 0.5.6's server (``python -m lmcache.v1.server 127.0.0.1 PORT cpu`` from ``.venv-lmcache``),

then runs ``bench/lmcache_client_driver.py`` in ``.venv-lmcache``: LMCache's ``LMCServerConnector``
(the class its remote backend uses for ``lm://`` URLs) puts and gets the same bfloat16 KV chunks
(``KV_2LTD``, 256 KiB to 2 MiB) against both, in interleaved rounds. Prints p50/p99 of get and put
latency per size and server, the ratio kv_store/LMCache (target: kv_store's get p50 lower), the
machine's load average, and writes a bar chart with ``--plot``.

Put latency is ``put()`` plus ``exists()`` until the value is visible (the protocol does not
acknowledge a put); get latency is ``get()`` with the payload received into LMCache's buffer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh_cli.launcher import ManagedProcess, python_module, wait_ports_file

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
DRIVER = Path(__file__).with_name("lmcache_client_driver.py")
LMCACHE_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",  # GB of LMCache's local buffer in the client
    "LMCACHE_LOG_LEVEL": "WARNING",
}


def listening(port: int) -> bool:
    """Whether some socket listens on TCP ``port`` (``/proc/net/tcp``; connecting to probe could
    self-connect from the same ephemeral port and take it before the server binds)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def unused_port() -> int:
    """A port nothing is bound to. Not :func:`kvmesh_cli.launcher.free_port`: that one leaves the port in
    TIME_WAIT for servers that set ``SO_REUSEADDR``, and LMCache's server does not (its bind would fail)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, proc: ManagedProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        if listening(port):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name} not listening on {port} after {timeout_s} s")


def handler_means(metrics_port: int) -> dict[str, float]:
    """kv_store's own time per lm:// request by command, in ms (its ``request_seconds`` histogram):
    from the request complete in its buffer to the reply handed to the socket (put: stored)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            prefix = f"kvmesh_kv_store_lmcache_request_seconds{suffix}{{command=\""
            if line.startswith(prefix):
                command, value = line[len(prefix) :].split('"} ')
                into[command] = float(value)
    return {c: sums[c] / counts[c] * 1e3 for c in sums if counts.get(c)}


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tokens", default="512,1024,2048,4096", help="chunk sizes in tokens (bf16 KV: 512 B/token)")
    parser.add_argument("--iterations", type=int, default=30, help="puts and gets per size, server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not LMCACHE_PYTHON.exists():
        sys.exit(f"{LMCACHE_PYTHON} missing: run `make lmcache-venv`")

    with tempfile.TemporaryDirectory(prefix="lmcache-bench-") as tmp:
        run_dir = Path(tmp)
        ports_file = run_dir / "kv_store.ports.json"
        # LMCache's server cannot bind port 0 and report it: pick a free port, start it first, retry on a race
        for attempt in range(3):
            lm_port = unused_port()
            lmcache = ManagedProcess(
                "lmcache.v1.server",
                [str(LMCACHE_PYTHON), "-m", "lmcache.v1.server", "127.0.0.1", str(lm_port), "cpu"],
                run_dir / f"lmcache_server.{attempt}.log",
                env=LMCACHE_ENV,
            ).start()
            try:
                wait_listening(lm_port, lmcache, 180.0)
                break
            except (RuntimeError, TimeoutError):
                lmcache.stop()
                if attempt == 2:
                    raise
        kv_store = ManagedProcess(
            "kv_store",
            python_module(
                "services.kv_store", "--grpc-port", "0", "--metrics-port", "0", "--ports-file", str(ports_file),
                "--lmcache-port", "0", "--cpu-capacity-bytes", str(4 << 30), "--log-level", "WARNING",
            ),
            run_dir / "kv_store.log",
        ).start()  # fmt: skip
        try:
            kv_port = wait_ports_file(ports_file, kv_store, 60.0)["lmcache"]
            print(f"kv_store lm://127.0.0.1:{kv_port}  LMCache server lm://127.0.0.1:{lm_port}", flush=True)
            load_before = os.getloadavg()
            done = subprocess.run(
                [
                    str(LMCACHE_PYTHON), str(DRIVER), "--servers", f"kv_store={kv_port},lmcache={lm_port}",
                    "--tokens", args.tokens, "--iterations", str(args.iterations), "--rounds", str(args.rounds),
                ],
                env={**os.environ, **LMCACHE_ENV}, stdout=subprocess.PIPE, text=True, timeout=1800, check=False,
            )  # fmt: skip
            load_after = os.getloadavg()
            handler = handler_means(wait_ports_file(ports_file, kv_store, 5.0)["metrics"])
        finally:
            kv_store.stop()
            lmcache.stop()
        if done.returncode != 0:
            sys.exit(f"driver failed ({done.returncode}); kv_store log:\n{kv_store.log_tail()}")
    results = json.loads(done.stdout.strip().splitlines()[-1])

    print(
        f"\nLMCache 0.5.6 LMCServerConnector, {args.rounds} rounds x {args.iterations} per size; "
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} ({os.cpu_count()} CPUs)"
    )
    header = f"{'size':>8} {'op':>4} | {'kv_store p50':>12} {'p99':>9} | {'LMCache p50':>11} {'p99':>9} | {'p50 ratio':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    for size in sorted(results["kv_store"], key=int):
        for op in ("get", "put"):
            ours, theirs = results["kv_store"][size][op], results["lmcache"][size][op]
            row = (int(size), op, pct(ours, 0.5), pct(ours, 0.99), pct(theirs, 0.5), pct(theirs, 0.99))
            rows.append(row)
            print(
                f"{int(size) // 1024:>5} KiB {op:>4} | {row[2]:>9.3f} ms {row[3]:>6.2f} ms | "
                f"{row[4]:>8.3f} ms {row[5]:>6.2f} ms | {row[2] / row[4]:>9.3f}"
            )
    gets = [r for r in rows if r[1] == "get"]
    met = all(r[2] < r[4] for r in gets)
    print(
        f"\ntarget kv_store get p50 < LMCache server get p50 at every size: {'MET' if met else 'MISSED'} "
        f"(median ratio {statistics.median(r[2] / r[4] for r in gets):.3f})"
    )
    print(
        "profile: kv_store's own time per request (mean, from request complete to reply written): "
        + ", ".join(f"{c} {ms * 1e3:.0f} us" for c, ms in sorted(handler.items()))
    )
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


def plot(rows: list[tuple[int, str, float, float, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("get", "put"), strict=True):
        sel = [r for r in rows if r[1] == op]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r[2] for r in sel], 0.4, label="kv_store lm:// (p50)")
        ax.bar([x + 0.2 for x in xs], [r[4] for r in sel], 0.4, label="LMCache server (p50)")
        ax.errorbar([x - 0.2 for x in xs], [r[3] for r in sel], fmt="v", color="k", label="p99")
        ax.errorbar([x + 0.2 for x in xs], [r[5] for r in sel], fmt="v", color="k")
        ax.set_xticks(list(xs), [f"{r[0] // 1024} KiB" for r in sel])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"LMCache client {op} latency")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
