"""The wave-9 fresh user's cases, as subprocesses against real components: two ``kvmesh up`` started in the same
second, a read-only filesystem (a real read-only tmpfs mounted in a private mount namespace with ``unshare``),
an unwritable ``--ports-file``, ``kvmesh replay``'s exit status and Ctrl-C, ``kvmesh flows --watch`` across a
flow_control that dies, Ctrl-C while a command's first call waits on an address that never answers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import OutputLines, SilentServer, wait_until

pytestmark = pytest.mark.integration

ENV = {**os.environ, "COLUMNS": "240", "PYTHONUNBUFFERED": "1"}
REPO = Path(__file__).resolve().parents[2]


def kvmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh_cli.main", *args]


def test_two_ups_started_in_the_same_second_each_get_their_own_run_folder(tmp_path: Path) -> None:
    """Before: both used ``.run/up-<second>``; the second's etcd failed on the first's lock. Now both serve."""
    procs = [subprocess.Popen(kvmesh("up", "--engines", "1"), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**ENV, "PYTHONPATH": str(REPO)})
             for _ in range(2)]
    outs = [OutputLines(p) for p in procs]
    try:
        for out in outs:
            wait_until(lambda out=out: "kvmesh ready: router " in out.text() or out.proc.poll() is not None, 180,
                       "both meshes ready", interval=0.3)
            assert "kvmesh ready: router " in out.text(), out.text()
        folders = sorted(p.name for p in (tmp_path / ".run").iterdir())
        assert len(folders) == 2 and all(f.startswith("up-") for f in folders), folders
        assert {f"{p.pid}" for p in procs} == {f.split("-")[3] for f in folders}, folders
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o.text() for o in outs]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -m` (a private mount namespace) to mount a "
                                                 "read-only tmpfs")
def test_a_read_only_filesystem_is_one_line_and_exit_2_for_every_path_option(tmp_path: Path) -> None:
    """``kvmesh up --run-dir``, ``up`` in a read-only working folder (its default run folder), ``compare
    --json-out/--plot/--timeline`` and a service's ``--ports-file`` on a real read-only mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    cases = {
        "up-run-dir": (kvmesh("up", "--run-dir", str(ro / "run")), None),
        "up-default-run-dir": (kvmesh("up"), str(ro)),
        "compare-json-out": (kvmesh("compare", "--json-out", str(ro / "r.json")), None),
        "compare-plot": (kvmesh("compare", "--plot", str(ro / "r.png")), None),
        "compare-timeline": (kvmesh("compare", "--timeline", str(ro / "tl")), None),
        "replay-json-out": (kvmesh("replay", "--json-out", str(ro / "r.json")), None),
        "router-ports-file": (python_module("services.router", "--ports-file", str(ro / "x.json")), None),
    }
    driver = textwrap.dedent(f"""
        import json, subprocess, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", {str(ro)!r}], check=True)
        out = {{}}
        for name, (argv, cwd) in json.loads(sys.argv[1]).items():
            p = subprocess.run(argv, cwd=cwd or {str(REPO)!r}, capture_output=True, text=True, timeout=120)
            out[name] = [p.returncode, p.stdout + p.stderr]
        print(json.dumps(out))
    """)
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", driver,
                           json.dumps(cases)], capture_output=True, text=True, timeout=600, check=False,
                          env={**ENV, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    for name, (rc, text) in results.items():
        assert rc == 2, (name, text)
        assert "read-only filesystem" in text and "Traceback" not in text, (name, text)
        assert "starting mesh" not in text and "workload" not in text, (name, text)
    assert results["router-ports-file"][1].strip() == (
        f"router: --ports-file {ro / 'x.json'}: its folder {ro} is on a read-only filesystem")


@pytest.mark.parametrize("module", ["services.router", "services.flow_control", "engine_simulator"])
def test_a_service_with_an_unwritable_ports_file_fails_in_one_line_before_serving(tmp_path: Path, module: str) -> None:
    """The services' common ``--ports-file`` (one ``kvmesh.server.main`` for all of them, the simulator included)."""
    path = tmp_path / "no" / "x.json"
    proc = subprocess.run(python_module(module, "--ports-file", str(path), "--etcd-endpoints", "127.0.0.1:1"),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith(f"--ports-file {path}: its folder {path.parent} does not exist"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def simulator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A real engine simulator (no etcd, no events) as the replay's ``--router``; ``max_model_len`` from the
    test's ``max_model_len`` marker value (param)."""
    port = free_port()
    proc = ManagedProcess("engine", python_module(
        "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", "m", "--events-endpoint", "",
        "--etcd-endpoints", "", "--max-model-len", str(request.param)), tmp_path / "engine.log").start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.mark.parametrize("simulator", [32], indirect=True)
def test_replay_exits_1_when_requests_failed_after_writing_its_results(simulator: str, tmp_path: Path) -> None:
    """Every prompt is longer than the engine's 32-token context: each request gets HTTP 400."""
    out = tmp_path / "r.json"
    proc = subprocess.run(kvmesh("replay", "--router", simulator, "--requests", "3", "--json-out", str(out)),
                          capture_output=True, text=True, timeout=120, env=ENV, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: 3 of 3 requests failed" in proc.stderr, proc.stderr
    assert "replay of multi-turn" in proc.stdout and json.loads(out.read_text())["requests"] == 3


def _served(engine: str) -> float:
    """The engine's finished requests (``vllm:request_success_total``, every finished_reason)."""
    text = httpx.get(f"{engine}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@pytest.mark.parametrize("simulator", [4096], indirect=True)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_replay_interrupted_says_what_was_not_written_and_exits_130(
    simulator: str, tmp_path: Path, signum: signal.Signals
) -> None:
    """Ctrl-C (or SIGTERM) while requests are in flight: the one interrupted line, exit 130, and nothing else:
    no traceback, no "Task exception was never retrieved" (the signal used to be raised inside whichever
    request task was running), the progress line not repeated after the interrupted line."""
    out = tmp_path / "never.json"
    proc = subprocess.Popen(kvmesh("replay", "--router", simulator, "--requests", "400", "--json-out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines = OutputLines(proc)
    try:
        wait_until(lambda: _served(simulator), 60, "the engine serving the replay's first requests",
                   interval=0.2)
        proc.send_signal(signum)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = lines.rest()  # the pipe drained after the exit
    assert proc.returncode == 130, text
    for noise in ("Traceback", "never retrieved", "KeyboardInterrupt", "ERROR"):
        assert noise not in text, text
    after = text.split("interrupted (signal")[-1].splitlines()[1:]
    assert not [line for line in after if line.strip()], text  # the interrupted line is the last one
    said = re.search(rf"interrupted \(signal {int(signum)}\): the replay stopped before its end \((\d+) of 400 requests finished, "
                     r"(\d+) failed\); no table printed, nothing written to (\S+)", text)
    assert said and 0 < int(said.group(1)) < 400 and said.group(2) == "0" and said.group(3) == str(out), text
    assert not out.exists() and "Traceback" not in text


def test_flows_watch_shows_flow_control_down_and_keeps_watching(tmp_path: Path, etcd: str) -> None:
    """``--watch`` across a flow_control that dies: a DOWN line, still running; Ctrl-C ends it with 130, as replay
    and compare (128 + SIGINT), with one interrupted line and no traceback. Also
    ``--flow-control`` naming etcd (another gRPC service): not a flow_control."""
    ports = tmp_path / "fc.ports.json"
    fc = ManagedProcess("flow_control", python_module(
        "services.flow_control", "--grpc-port", "0", "--metrics-port", "0", "--ports-file", str(ports),
        "--etcd-endpoints", etcd), tmp_path / "fc.log").start()
    watch: subprocess.Popen[str] | None = None
    try:
        address = f"127.0.0.1:{wait_until(lambda: ports.is_file() and json.loads(ports.read_text()), 30, 'ports')['grpc']}"
        watch = subprocess.Popen(kvmesh("flows", "--flow-control", address, "--watch", "0.2"), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=ENV)
        lines = OutputLines(watch)
        wait_until(lambda: "bands (highest first)" in lines.text(), 60, "the first tables", interval=0.2)
        fc.stop()
        wait_until(lambda: "DOWN: flow_control at" in lines.text(), 30, "the DOWN line", interval=0.2)
        time.sleep(1.0)
        assert watch.poll() is None, lines.text()
        watch.send_signal(signal.SIGINT)
        watch.wait(30)
        time.sleep(0.2)
        assert watch.returncode == 130, lines.text()
        assert "interrupted (signal 2): the watch stopped" in lines.text(), lines.text()
        assert "Traceback" not in lines.text() and "never retrieved" not in lines.text(), lines.text()
    finally:
        fc.stop()
        if watch is not None and watch.poll() is None:
            watch.kill()
    other = subprocess.run(kvmesh("flows", "--flow-control", etcd), capture_output=True, text=True, timeout=60,
                           env=ENV, check=False)
    assert other.returncode == 1 and f"{etcd} is a gRPC server but not a flow_control" in other.stderr, other.stderr


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("second", [False, True], ids=["one-sigint", "second-sigint-while-unwinding"])
@pytest.mark.parametrize("case", ["flows", "flows-watch", "flows-json", "replay-epp"])
def test_interrupted_while_the_first_call_waits_on_a_silent_address_exits_130(
    silent: SilentServer, case: str, second: bool
) -> None:
    """Ctrl-C while a command's first call waits on an address that never answers (``flows``' first Stats fetch,
    one-shot, --json or --watch; ``replay --router --epp``'s ListEndpoints before any request): its one
    interrupted line and 130, never click's bare exit or a traceback. Before, those calls ran outside the
    guarded block. A second SIGINT 20 ms later (while it unwinds) changes nothing: ignored."""
    args = {
        "flows": ["flows", "--flow-control", silent.address],
        "flows-watch": ["flows", "--flow-control", silent.address, "--watch", "0.5"],
        "flows-json": ["flows", "--flow-control", silent.address, "--json"],
        "replay-epp": ["replay", "--router", "http://127.0.0.1:9", "--epp", silent.address, "--requests", "5"],
    }[case]
    proc = subprocess.Popen(kvmesh(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines = OutputLines(proc)
    try:
        assert silent.spoken.wait(30), lines.text()  # the call is in flight: connected, waiting for a reply
        time.sleep(0.3)
        assert proc.poll() is None, lines.text()  # still waiting (its deadline is 5 s)
        proc.send_signal(signal.SIGINT)
        if second:
            time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = lines.rest()  # the pipe drained after the exit
    assert proc.returncode == 130, text
    want = {"flows": f"interrupted (signal 2): no answer from flow_control at {silent.address}",
            "flows-json": f"interrupted (signal 2): no answer from flow_control at {silent.address}",
            "flows-watch": "interrupted (signal 2): the watch stopped",
            "replay-epp": "interrupted (signal 2): the replay stopped before its end; no table printed"}[case]
    assert text.count("interrupted (") == 1 and want in text.splitlines(), text
    assert text.rstrip().endswith(want), text  # the last line
    for noise in ("Traceback", "never retrieved", "KeyboardInterrupt", "Aborted", "Exception ignored"):
        assert noise not in text, text


def test_up_reaches_ready_when_the_router_requires_an_api_key(tmp_path: Path) -> None:
    """Wave-11 fresh user: with ``KVMESH_ROUTER_REQUIRE_API_KEY=true`` the readiness probe's keyless
    ``GET /v1/models`` got 401 for 2 minutes and ``up`` gave up. Now it sends a tenant's key and reaches ready."""
    env = {**ENV, "PYTHONPATH": str(REPO), "KVMESH_ROUTER_REQUIRE_API_KEY": "true",
           "KVMESH_ROUTER_TENANTS": '[{"name":"acme","api_keys":["sk-acme-1234"]}]'}
    proc = subprocess.Popen(kvmesh("up", "--engines", "1"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    out = OutputLines(proc)
    try:
        wait_until(lambda: "kvmesh ready: router " in out.text() or proc.poll() is not None, 120,
                   "mesh ready in API-key mode", interval=0.3)
        assert "kvmesh ready: router " in out.text(), out.text()
        assert "still waiting for router" not in out.text(), out.text()
        match = re.search(r"kvmesh ready: router (http://\S+)", out.text())
        assert match, out.text()
        url = match.group(1).rstrip(",;")
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401  # the router does require a key
        models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer sk-acme-1234"}, timeout=5)
        assert models.status_code == 200 and models.json()["data"], models.text
        # kvmesh replay against it: without a key, one line saying a key is needed; with --api-key, it runs
        base = {k: v for k, v in env.items() if not k.startswith("KVMESH_")}
        keyless = subprocess.run(kvmesh("replay", "--router", url, "--requests", "4"), cwd=tmp_path, env=base,
                                 capture_output=True, text=True, timeout=60)
        assert keyless.returncode == 1, keyless.stdout + keyless.stderr
        assert "HTTP 401: it requires an API key; pass --api-key KEY" in keyless.stdout + keyless.stderr
        keyed = subprocess.run(kvmesh("replay", "--router", url, "--requests", "4", "--api-key", "sk-acme-1234"),
                               cwd=tmp_path, env=base, capture_output=True, text=True, timeout=120)
        assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, out.text()


TENANTS = '[{"name":"acme","api_keys":["sk-acme-1234"]}]'


def _keyed_env_the_cli_cannot_read() -> dict[str, str]:
    """A router in API-key mode whose tenants the CLI cannot see: the router reads its environment without
    regard to case (pydantic-settings), ``tenant_api_key`` looks for ``KVMESH_ROUTER_TENANTS`` only."""
    from kvmesh_cli.mesh import tenant_api_key

    base = {k: v for k, v in ENV.items() if not k.upper().startswith("KVMESH_")}
    env = {**base, "PYTHONPATH": str(REPO), "KVMESH_ROUTER_REQUIRE_API_KEY": "true", "kvmesh_router_tenants": TENANTS}
    keyless = {k: v for k, v in os.environ.items() if k != "KVMESH_ROUTER_TENANTS"}
    assert tenant_api_key({**keyless, **env}) is None  # the premise: `kvmesh up` has no key to send
    return env


def test_up_without_a_key_to_send_is_ready_once_health_and_epp_say_so(tmp_path: Path) -> None:
    """The keyless readiness fallback on a real mesh: the router answers 401 to the probe's ``/v1/models``, so
    ``kvmesh up`` waits for the router's ``/health`` and epp's endpoints instead, and the mesh then serves."""
    proc = subprocess.Popen(kvmesh("up", "--engines", "1", "--time-scale", "20"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_keyed_env_the_cli_cannot_read())
    out = OutputLines(proc)
    try:
        wait_until(lambda: "kvmesh ready: router " in out.text() or proc.poll() is not None, 120,
                   "mesh ready in API-key mode with no key to send", interval=0.3)
        match = re.search(r"kvmesh ready: router (http://\S+)", out.text())
        assert match, out.text()
        url = match.group(1)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401  # the probe's path was refused
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        served = httpx.post(f"{url}/v1/completions", headers={"authorization": "Bearer sk-acme-1234"}, timeout=30,
                            json={"model": "sim-llama-3.1-8b", "prompt": "hello", "max_tokens": 2})
        assert served.status_code == 200, served.text  # ready meant serving
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, out.text()


def test_compare_sends_api_key_to_its_meshs_router_and_a_401_is_one_line(tmp_path: Path) -> None:
    """``compare --api-key``: the key reaches the readiness check and the replay of the mesh it starts. Without
    one (and none the CLI can read) the mesh gets ready through ``/health`` and the replay's first 401 is one
    error line, exit 1."""
    env = _keyed_env_the_cli_cannot_read()
    args = ("compare", "--policies", "round-robin", "--engines", "1", "--requests", "4", "--workload", "multi-turn",
            "--time-scale", "20")
    keyed = subprocess.run(kvmesh(*args, "--api-key", "sk-acme-1234", "--run-dir", str(tmp_path / "keyed")),
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    assert "round-robin" in keyed.stdout and "request 0 failed" not in keyed.stdout, keyed.stdout
    keyless = subprocess.run(kvmesh(*args, "--run-dir", str(tmp_path / "keyless")), cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=180)
    assert keyless.returncode == 1, keyless.stdout + keyless.stderr
    errors = [line for line in keyless.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and re.fullmatch(
        r"error: router http://127\.0\.0\.1:\d+ answered GET /v1/models with HTTP 401: it requires an API key; "
        r"pass --api-key KEY \(or set KVMESH_API_KEY\)", errors[0]), keyless.stderr
    assert "Traceback" not in keyless.stdout + keyless.stderr


def _etcd(address: str, put: tuple[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    """Every key under ``/`` of the etcd at ``address`` (after writing ``put``, without a lease, if given)."""
    import asyncio

    import aetcd

    async def go() -> dict[bytes, bytes]:
        host, port = address.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            if put is not None:
                await client.put(*put)
            return {kv.key: kv.value for kv in await client.get_prefix(b"/")}

    return asyncio.run(go())


def test_up_after_a_sigkilled_up_in_the_same_run_dir_starts_its_etcd_empty(tmp_path: Path) -> None:
    """A SIGKILLed ``kvmesh up`` leaves its etcd data in its run folder; before, the next ``up --run-dir`` there
    started etcd on it (the old registrations on leases a restarted etcd renews, the old revisions). Now the
    next one deletes it first, and a second ``up`` while the first runs is refused and deletes nothing."""
    from tests.integration.test_cli import children_of, survivors

    run = tmp_path / "run"
    env = {**ENV, "PYTHONPATH": str(REPO)}
    argv = kvmesh("up", "--engines", "1", "--time-scale", "20", "--run-dir", str(run))

    started: list[subprocess.Popen[str]] = []

    def start() -> tuple[subprocess.Popen[str], OutputLines, str]:
        # its own process group (a shell job's): SIGKILL to the group is `kill -9 %1`
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        started.append(proc)
        out = OutputLines(proc)
        wait_until(lambda: "kvmesh ready: router " in out.text() or proc.poll() is not None, 120, "mesh ready",
                   interval=0.3)
        match = re.search(r"kvmesh ready: .* etcd (\S+) ", out.text())
        assert match, out.text()
        return proc, out, match.group(1)

    try:
        first, _, etcd1 = start()
        before = _etcd(etcd1, put=(b"/kvmesh-test/marker", b"first mesh"))
        assert any(k.startswith(b"/kvmesh/v1/services/") for k in before), before
        busy = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert busy.returncode == 1, busy.stdout + busy.stderr
        assert f"{run} is in use by a running mesh (pid {first.pid})" in busy.stderr, busy.stderr
        assert _etcd(etcd1)[b"/kvmesh-test/marker"] == b"first mesh"  # the running mesh's data is untouched

        children = children_of(first.pid)
        assert len(children) >= 7, children  # etcd, 5 services, the engine
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: survivors(children) == [], 15, "the killed mesh's processes gone (PDEATHSIG)")
        assert (run / "etcd" / "member").is_dir()  # what the killed run left
        assert (run / "mesh.lock").read_text().strip() == str(first.pid)

        second, out2, etcd2 = start()
        after = _etcd(etcd2)
        assert b"/kvmesh-test/marker" not in after, after
        assert not {k for k, v in before.items() if after.get(k) == v}, (before, after)  # no old registration
        assert f"deleted the etcd data a mesh that did not stop (pid {first.pid}) left in {run}" in out2.text()
        second.send_signal(signal.SIGTERM)
        second.wait(60)
        assert second.returncode == 0, out2.text()
        assert not (run / "etcd").exists() and (run / "mesh.lock").read_text() == ""  # a clean stop
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_etcd_data_a_running_etcd_holds_is_never_deleted(tmp_path: Path) -> None:
    """The second guard, on a real etcd: its WAL lock keeps its data from the start-up clean-up and from the
    ``.run/`` sweep even when no mesh holds the folder's lock (an etcd no kvmesh lock names); once it is gone,
    the sweep deletes the data."""
    from kvmesh_cli.launcher import start_etcd
    from kvmesh_cli.rundir import LOCK_NAME, RunDirBusy, clear_stale_etcd_data, etcd_wal_in_use, sweep_stale_etcd_data

    run = tmp_path / ".run" / "up-1-1"
    run.mkdir(parents=True)
    (run / LOCK_NAME).write_text("")  # a lock file nobody holds
    proc, _ = start_etcd(run)
    try:
        assert etcd_wal_in_use(run / "etcd")
        with pytest.raises(RunDirBusy, match="an etcd still runs on"):
            clear_stale_etcd_data(run, wait_s=0.2)
        assert sweep_stale_etcd_data(tmp_path / ".run") == []
        assert (run / "etcd" / "member").is_dir()
    finally:
        proc.kill()
    assert sweep_stale_etcd_data(tmp_path / ".run") == [run / "etcd"]
    assert not (run / "etcd").exists()


# --- wave 13: the fresh user's `kvmesh up` on a real mesh ---------------------------------------------------------


def _table_pid(text: str, service: str) -> int:
    """The pid in ``kvmesh up``'s table row of ``service``."""
    row = next(line for line in text.splitlines() if line.startswith("│") and line.split("│")[1].strip() == service)
    return int(row.split("│")[2])


def test_up_in_api_key_mode_hints_work_pasted_deaths_say_how_and_ctrl_c_stops_all_fast_with_130(
    tmp_path: Path,
) -> None:
    """One real mesh in API-key mode (tenants in the environment, as a user sets them):

    * the printed curl command and ``kvmesh replay`` command, pasted, are served (before: no key in them, 401);
    * ``kvmesh flows`` on an 80-column terminal: no line longer than 80;
    * an engine SIGKILLed: ``engine-1 exited: killed by SIGKILL; log <its log>`` (before: ``engine-1 exited``);
    * Ctrl-C after ready: every process gone, exit 130 (before: 0), the stop in parallel (before: ~12 s)."""
    import shlex

    from tests.integration.test_cli import ChildSampler, children_of, survivors

    env = {**ENV, "PYTHONPATH": str(REPO), "KVMESH_ROUTER_REQUIRE_API_KEY": "true", "KVMESH_ROUTER_TENANTS": TENANTS}
    proc = subprocess.Popen(kvmesh("up", "--engines", "2", "--time-scale", "20", "--run-dir", str(tmp_path / "run")),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = OutputLines(proc)
    sampler = ChildSampler(proc.pid)
    try:
        wait_until(lambda: "send a request: " in out.text() or proc.poll() is not None, 120, "mesh ready",
                   interval=0.3)
        text = out.text()
        curl = next(line for line in text.splitlines() if line.startswith("send a request: curl "))
        assert "authorization: Bearer sk-acme-1234" in curl, curl
        served = subprocess.run(["bash", "-c", curl.removeprefix("send a request: ") + " -w '\\n%{http_code}'"],
                                capture_output=True, text=True, timeout=60, check=True)
        assert served.stdout.rsplit("\n", 1)[-1] == "200", served.stdout
        replay = next(line for line in text.splitlines() if line.startswith("replay against it: "))
        assert " --api-key sk-acme-1234" in replay, replay
        base = {k: v for k, v in env.items() if not k.startswith("KVMESH_")}  # the pasted command alone carries the key
        pasted = subprocess.run(shlex.split(replay.removeprefix("replay against it: ").replace(
            "kvmesh ", f"{shlex.quote(sys.executable)} -m kvmesh_cli.main ", 1)) + ["--requests", "3"],
            cwd=tmp_path, env=base, capture_output=True, text=True, timeout=120)
        assert pasted.returncode == 0, pasted.stdout + pasted.stderr
        etcd = re.search(r"admission state: kvmesh flows --etcd (\S+)", text)
        assert etcd, text
        flows = subprocess.run(kvmesh("flows", "--etcd", etcd.group(1)), capture_output=True, text=True, timeout=60,
                               env={**base, "COLUMNS": "80", "TTY_COMPATIBLE": "1", "NO_COLOR": "1"})
        assert flows.returncode == 0 and "bands (highest first)" in flows.stdout, flows.stdout + flows.stderr
        shown = re.sub(r"\x1b\[[0-9;]*m", "", flows.stdout)  # a terminal's styles (bold headers) take no column
        assert max(len(line) for line in shown.splitlines()) <= 80, shown
        assert "…" not in shown, shown

        os.kill(_table_pid(text, "engine-1"), signal.SIGKILL)
        said = f"engine-1 exited: killed by SIGKILL; log {tmp_path / 'run' / 'engine-1.log'}"
        wait_until(lambda: said in out.text(), 10, "the engine's death, with its signal and log", interval=0.2)

        seen = sampler.stop() | children_of(proc.pid)
        assert len(seen) >= 8, seen  # etcd, 5 services, 2 engines
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = out.rest()
    assert proc.returncode == 130, text[-3000:]
    assert "stopping mesh ..." in text and text.rstrip().endswith("kvmesh stopped"), text[-3000:]
    assert "Traceback" not in text, text
    assert survivors(seen) == []
    assert stop_s < 8.0, stop_s  # in parallel, ~2-3 s on an idle host (one service after another: ~12 s)


def test_up_interrupted_while_its_services_start_stops_them_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C once the services are started but before ready: what started is stopped (no process left), one
    ``interrupted (signal 2) during start-up`` line, exit 130. Before: "kvmesh stopped" and exit 0."""
    from tests.integration.test_cli import ChildSampler, survivors

    proc = subprocess.Popen(kvmesh("up", "--engines", "4", "--run-dir", str(tmp_path / "run")), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**ENV, "PYTHONPATH": str(REPO)})
    out = OutputLines(proc)
    sampler = ChildSampler(proc.pid)
    try:
        out.wait_for("services started; waiting", 120)
        proc.send_signal(signal.SIGINT)  # at once: 4 engines' health takes seconds more
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    seen = sampler.stop()
    text = out.rest()
    assert proc.returncode == 130, text
    assert f"interrupted (signal 2) during start-up: what had started is stopped; logs in {tmp_path / 'run'}" in text
    assert "kvmesh ready" not in text and "Traceback" not in text, text
    assert len(seen) >= 6, seen
    assert survivors(seen) == []
