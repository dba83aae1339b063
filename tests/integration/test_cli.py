"""The ``kvmesh`` CLI as users run it: ``compare`` and ``up`` as subprocesses, no orphans left.

Every process the CLI starts is a child of it (in its own session). While the CLI runs, a sampler
records its children from ``/proc`` (pid plus start time, so a reused pid is not mistaken for a
survivor); after the CLI exits, none of them may still be alive.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh_cli.peers import peer_missing_reason
from kvmesh_cli.report import EXTRA_KEYS, SUMMARY_KEYS
from tests.support import wait_until

pytestmark = pytest.mark.integration

ProcId = tuple[int, str]  # pid, start time (field 22 of /proc/<pid>/stat)


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces; it is wrapped in parentheses
    return [str(pid), raw[raw.index("(") : raw.rindex(")") + 1], *raw[raw.rindex(")") + 2 :].split()]


def children_of(pid: int) -> set[ProcId]:
    out: set[ProcId] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None and st[3] == str(pid):
            out.add((int(entry), st[21]))
    return out


def survivors(seen: set[ProcId]) -> list[str]:
    """Processes of ``seen`` still alive (zombies count as gone), with their command lines."""
    alive = []
    for pid, start in seen:
        st = _stat(pid)
        if st is None or st[21] != start or st[2] == "Z":
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        alive.append(f"{pid}: {cmd}")
    return alive


class ChildSampler:
    """Samples a process's children every 50 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: set[ProcId] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen |= children_of(self.pid)
            self._stop.wait(0.05)

    def stop(self) -> set[ProcId]:
        self._stop.set()
        self._thread.join()
        return self.seen


def drain(lines: queue.Queue[str], into: list[str]) -> list[str]:
    """Move every line already in ``lines`` to ``into``; returns ``into``."""
    while True:
        try:
            into.append(lines.get_nowait())
        except queue.Empty:
            return into


def kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh_cli.main", *args]


ENV = {**os.environ, "COLUMNS": "240", "PYTHONUNBUFFERED": "1"}
PIPED_ENV = {k: v for k, v in ENV.items() if k not in ("COLUMNS", "LINES")}
"""As a user's ``kvmesh up | tee``: not a terminal and no COLUMNS, so rich defaults to 80 columns."""


def test_compare_tiny_writes_json_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    proc = subprocess.Popen(
        kvmesh("compare", "--workload", "multi-turn", "--engines", "2", "--requests", "20", "--num-gpu-blocks", "256",
               "--time-scale", "2", "--policies", "round-robin,precise-prefix+cpu", "--json-out", str(out),
               "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
    )
    sampler = ChildSampler(proc.pid)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        seen = sampler.stop()
        if proc.poll() is None:
            proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert len(seen) >= 2 * (1 + 5 + 2), f"expected etcd, 5 services, 2 engines per policy; saw {len(seen)}"
    assert survivors(seen) == []

    doc = json.loads(out.read_text())
    assert doc["workload"] == "multi-turn" and doc["engines"] == 2 and doc["requests"] == 20
    # per-column offload (issue 9): round-robin's engines without, precise-prefix's with a CPU tier
    assert list(doc["policies"]) == ["round-robin", "precise-prefix+cpu"]
    assert doc["offload"] == {"round-robin": "off", "precise-prefix+cpu": "cpu"}
    assert [e["offload"] for e in doc["policies"].values()] == ["off", "cpu"]
    assert (tmp_path / "run" / "0-1-precise-prefix+cpu" / "engine-0.log").is_file()
    for name, entry in doc["policies"].items():
        # GPU and offloaded hits apart, from vllm:external_prefix_cache_hits_total (0 without offload)
        assert entry["offload_hit_rate"] is not None and entry["offload_hit_rate"] >= 0.0, name
        assert entry["total_hit_rate"] == pytest.approx(entry["prefix_hit_rate"] + entry["offload_hit_rate"])
        assert set(SUMMARY_KEYS) <= set(entry), name
        assert entry["requests"] == 20 and entry["errors"] == 0, (name, text[-3000:])
        assert 0 < entry["ttft_p50_s"] <= entry["ttft_p90_s"] <= entry["ttft_p99_s"]
        assert entry["e2e_p50_s"] >= entry["ttft_p50_s"]
        assert entry["output_tokens_per_s"] > 0
        assert 0.0 < entry["prefix_hit_rate"] <= 1.0  # shared system prompts hit under any policy
    assert doc["policies"]["round-robin"]["offload_hit_rate"] == 0.0
    assert "prefix-cache hit rate" in text
    # the TTFT breakdown (issue 9), measured from the engines' vLLM histograms and the router's stages
    for name, entry in doc["policies"].items():
        parts = ("mesh_pre_dispatch_mean_s", "mesh_admission_mean_s", "mesh_pick_mean_s", "engine_ttft_mean_s",
                 "engine_queue_mean_s", "engine_prefill_mean_s", "engine_running_mean", "engine_waiting_mean")
        assert all(entry[k] is not None and entry[k] >= 0.0 for k in parts), (name, {k: entry[k] for k in parts})
        assert entry["engine_queue_p50_s"] is not None and entry["engine_queue_p50_bucket_s"][0] >= 0.0
        assert entry["engine_ttft_mean_s"] == pytest.approx(entry["engine_queue_mean_s"] + entry["engine_prefill_mean_s"],
                                                            rel=0.05, abs=1e-3), name
        # the parts are inside the client's TTFT (up to the routers' and clients' clock skew: 10 %)
        assert entry["mesh_pre_dispatch_mean_s"] + entry["engine_ttft_mean_s"] <= 1.1 * entry["ttft_mean_s"], name
        # the router measures pre_dispatch itself (wave 9): admission and pick overlap (the early pick), so the
        # measured stage is at most their sum, and the overlap is what the sum over-counts
        stages = entry["mesh_admission_mean_s"] + entry["mesh_pick_mean_s"]
        assert entry["mesh_pre_dispatch_mean_s"] <= stages * 1.05 + 1e-4, name
        assert entry["mesh_stage_overlap_mean_s"] == pytest.approx(max(0.0, stages - entry["mesh_pre_dispatch_mean_s"]),
                                                                   abs=1e-9), name
    assert "engine queue mean / p50" in text and "mesh before dispatch" in text


def test_compare_repeat_runs_every_column_each_round_and_reports_medians(tmp_path: Path) -> None:
    """``--repeat 2``: each column runs twice on fresh meshes (run dirs ``-r1``/``-r2``), the JSON keeps the
    rounds, each column's figures are their medians, and a second table gives each metric's range."""
    out = tmp_path / "compare.json"
    done = subprocess.run(
        kvmesh("compare", "--workload", "multi-turn", "--engines", "1", "--requests", "10", "--num-gpu-blocks", "256",
               "--time-scale", "2", "--policies", "round-robin,precise-prefix", "--repeat", "2", "--json-out", str(out),
               "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, timeout=300, check=False,
    )
    text = done.stdout.decode(errors="replace")
    assert done.returncode == 0, text[-4000:]
    doc = json.loads(out.read_text())
    assert doc["repeat"] == 2 and list(doc["policies"]) == ["round-robin", "precise-prefix"]
    for name, rounds in doc["rounds"].items():
        assert len(rounds) == 2 and all(r["requests"] == 10 and r["errors"] == 0 for r in rounds), name
        p50s = sorted(r["ttft_p50_s"] for r in rounds)
        assert doc["policies"][name]["ttft_p50_s"] == pytest.approx(sum(p50s) / 2), name  # the median of two
    for run in ("0-0-round-robin-r1", "0-0-round-robin-r2", "0-1-precise-prefix-r1", "0-1-precise-prefix-r2"):
        assert (tmp_path / "run" / run / "engine-0.log").is_file(), run
    assert "over 2 rounds" in text and "median (min-max)" in text
    # round 2 starts with the other column (rotated order): its first mesh is precise-prefix's
    assert text.index("precise-prefix (round 2/2)") < text.index("round-robin (round 2/2)")


def test_compare_sweep_agentic_with_peer_tiny(tmp_path: Path) -> None:
    """A load sweep of closed-loop agentic sessions: two rate scales, kvmesh's round-robin and (when
    ``make peers-env`` installed it) vllm-router in front of the same simulated engines; JSON, table, PNG."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    peer = [] if peer_missing_reason("vllm-router-round-robin") else ["--peers", "vllm-router-round-robin"]
    proc = subprocess.run(
        kvmesh("compare", "--workload", "agentic-synthetic", "--policies", "round-robin", *peer, "--engines", "2",
               "--requests", "12", "--sessions", "3", "--max-input-tokens", "4096", "--max-output-tokens", "16",
               "--time-scale", "4", "--sweep", "1,8", "--slo-ttft", "2", "--json-out", str(out),
               "--plot", str(png), "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, timeout=400, check=False,
    )
    text = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    doc = json.loads(out.read_text())
    assert doc["workload"] == "agentic-synthetic" and doc["requests"] == 12 and doc["slo_ttft_s"] == 2.0
    names = ["round-robin"] + (["vllm-router-round-robin"] if peer else [])
    assert list(doc["policies"]) == [f"{n} x{s}" for s in (1, 8) for n in names]
    for name, entry in doc["policies"].items():
        assert set(entry) == set(SUMMARY_KEYS) | set(EXTRA_KEYS), name
        assert entry["requests"] == 12 and entry["errors"] == 0, (name, text[-3000:])
        assert len(entry["engine_requests"]) == 2 and sum(entry["engine_requests"]) == 12
        assert 0 < entry["oracle_hit_rate"] < 1 and entry["load_imbalance"] >= 1.0
        assert entry["prefix_hit_rate"] <= entry["oracle_hit_rate"] + 1e-9
        # TTFT breakdown: the engines' parts for every column, the mesh's stages only behind kvmesh's router
        assert entry["engine_ttft_mean_s"] >= 0.0 and entry["engine_queue_mean_s"] >= 0.0, name
        assert (entry["mesh_pre_dispatch_mean_s"] is None) == name.startswith("vllm-router"), name
    for name in names:
        curve = doc["sweep"][name]
        assert [p["rate_scale"] for p in curve["points"]] == [1.0, 8.0]
        assert curve["goodput_rps"] is None or curve["goodput_rps"] > 0
        assert isinstance(curve["slo_crossed"], bool)
    assert "load sweep" in text and "goodput" in text and png.stat().st_size > 1000


@pytest.fixture
def up_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str]]]:
    proc = subprocess.Popen(
        kvmesh("up", "--engines", "1", "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=PIPED_ENV,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    yield proc, lines
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_up_serves_then_stops_on_sigterm_without_orphans(
    up_process: tuple[subprocess.Popen[str], queue.Queue[str]], tmp_path: Path,
) -> None:
    proc, lines = up_process
    sampler = ChildSampler(proc.pid)
    transcript: list[str] = []

    def ready_router() -> str | None:
        drain(lines, transcript)
        ready = next((line for line in transcript if line.startswith("kvmesh ready: router ")), None)
        if ready is None:
            assert proc.poll() is None, "".join(transcript)
            return None
        return ready.split()[3]

    router = wait_until(ready_router, 120, "the 'kvmesh ready' line", interval=0.2)
    text = "".join(transcript)
    for service in ("etcd", "kv_indexer", "kv_store", "flow_control", "epp", "router", "engine-0"):
        assert service in text, text
    # Piped at 80 columns, the table still keeps every address on one line.
    assert len(re.findall(r"http://127\.0\.0\.1:\d+/metrics\b", text)) >= 6, text
    ready = next(line for line in transcript if line.startswith("kvmesh ready: "))
    epp = re.search(r" epp (127\.0\.0\.1:\d+) ", ready)
    etcd = re.search(r" etcd (127\.0\.0\.1:\d+) ", ready)
    assert epp and etcd, ready
    epp_row = next(line for line in transcript if " epp " in line and "│" in line)
    assert epp.group(1) in epp_row, text
    flow_control = re.search(r" flow_control (127\.0\.0\.1:\d+) kv_indexer 127\.0\.0\.1:\d+ kv_store 127\.0\.0\.1:\d+ ", ready)
    assert flow_control, ready
    # `kvmesh flows` finds this mesh's flow_control through etcd (as printed), or takes it from the ready line
    for how in (["--etcd", etcd.group(1)], ["--flow-control", flow_control.group(1)]):
        flows = subprocess.run(kvmesh("flows", "--json", *how), capture_output=True, text=True, env=ENV, timeout=60,
                               check=False)
        assert flows.returncode == 0 and '"bands"' in flows.stdout, (how, flows.stdout, flows.stderr)

    models = httpx.get(f"{router}/v1/models", timeout=10).json()
    model = models["data"][0]["id"]
    reply = httpx.post(
        f"{router}/v1/completions",
        json={"model": model, "prompt": "hello mesh", "max_tokens": 4, "ignore_eos": True},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4

    seen = sampler.stop() | {(pid, st) for pid, st in children_of(proc.pid)}
    assert len(seen) >= 7
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == 0
    rest: list[str] = []
    wait_until(lambda: "".join(drain(lines, rest)), 10, "'kvmesh stopped'", until=lambda text: "kvmesh stopped" in text)
    assert survivors(seen) == [], "".join(rest)
    # the etcd it started is gone with its data (~123 MB of preallocated WAL per run), the logs stay
    assert not (tmp_path / "run" / "etcd").exists() and (tmp_path / "run" / "etcd.log").is_file()


def test_up_with_an_unreachable_etcd_fails_at_once_naming_it(tmp_path: Path) -> None:
    """`kvmesh up --etcd` of an etcd that does not answer: one error line naming it within seconds
    (before: 2 min of silence, then "timed out waiting for epp to list all engines"), nothing started."""
    dead = "127.0.0.1:1"
    started = time.monotonic()
    proc = subprocess.run(kvmesh("up", "--engines", "1", "--etcd", dead, "--run-dir", str(tmp_path / "run")),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=PIPED_ENV, timeout=60,
                          check=False)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout
    assert f"error: the mesh did not start: etcd {dead} refused the connection" in proc.stdout, proc.stdout
    assert "leave --etcd out" in proc.stdout and "Traceback" not in proc.stdout, proc.stdout
    assert took < 30, took
    assert not list((tmp_path / "run").glob("*.log")), "nothing should have started"


def test_up_member_start_failure_is_one_clean_error_and_no_orphans(tmp_path: Path) -> None:
    """epp refuses its environment at start (a bad ``--policy`` file is refused before anything starts,
    ``tests/unit/cli/test_up_preflight.py``; epp's own env vars are not): exit 1, its log tail, no traceback."""
    proc = subprocess.Popen(
        kvmesh("up", "--engines", "1", "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**PIPED_ENV, "KVMESH_EPP_LOG_LEVEL": "LOUD"},
    )
    sampler = ChildSampler(proc.pid)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        seen = sampler.stop()
        if proc.poll() is None:
            proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode == 1, text
    assert "error: the mesh did not start: epp exited during start-up:" in text, text
    assert "KVMESH_EPP_LOG_LEVEL=LOUD: must be one of" in text, text  # epp's log tail
    assert "Traceback" not in text, text
    assert len(seen) >= 2, "expected etcd and kv_indexer at least"
    assert survivors(seen) == []


def _interrupt_compare(run: Path, out: Path, args: list[str], ready: str, what: str) -> str:
    """``kvmesh compare ARGS --json-out OUT --run-dir RUN``, SIGINT once ``RUN/<ready>`` exists; its output,
    having checked exit 130, no traceback, nothing written to ``out`` and no process of it left."""
    proc = subprocess.Popen(kvmesh("compare", *args, "--json-out", str(out), "--run-dir", str(run)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    sampler = ChildSampler(proc.pid)
    try:
        wait_until(lambda: next(run.glob(ready), None), 180, what, interval=0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        seen = sampler.stop()
        if proc.poll() is None:
            proc.kill()
    text = output.decode(errors="replace")
    assert proc.returncode == 130, text
    assert not out.exists() and "Traceback" not in text, text
    assert survivors(seen) == []
    return text


def test_compare_interrupted_says_so_writes_nothing_and_exits_130(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) while a column's mesh runs: one line saying it was interrupted, how many runs
    finished and that --json-out was not written; exit status 130; every process it started gone."""
    out = tmp_path / "never.json"
    text = _interrupt_compare(tmp_path / "run", out, ["--workload", "agentic-synthetic", "--policies",
                              "round-robin,precise-prefix", "--engines", "1", "--requests", "400"],
                              "*/router.ports.json", "the first column's router up")
    assert "interrupted (signal 2): 0 of 2 runs finished (none), every mesh stopped; no table printed, " \
           f"nothing written to {out}" in text, text


def test_compare_interrupted_after_a_finished_run_shows_its_table(tmp_path: Path) -> None:
    """SIGINT once the first column finished, while the second's mesh runs: the finished column's table is
    printed (a fresh user lost a finished run's figures to "0 of 2 runs finished"), nothing written, exit 130."""
    out = tmp_path / "never.json"
    text = _interrupt_compare(tmp_path / "run", out, ["--policies", "round-robin,precise-prefix", "--engines", "1",
                              "--requests", "20"], "0-1-*/router.ports.json", "the second column's router up")
    assert "interrupted (signal 2): 1 of 2 runs finished (round-robin), every mesh stopped; their table is above " \
           f"(not the comparison), nothing written to {out}" in text, text
    table = text.split("finished runs only", 1)[-1]  # the title (it may wrap), then the finished column
    assert "finished runs only" in text and "round-robin" in table and "precise-prefix" not in table, text
