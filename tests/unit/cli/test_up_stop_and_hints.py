"""Wave-13 fresh user's findings on ``kvmesh up`` and ``kvmesh flows``, with real processes, signals and HTTP:

1. the printed request hints (curl, ``kvmesh replay``) carry the router's API key: pasted, they are not refused;
2. Ctrl-C (or any stop signal) during start-up exits 130 after stopping what started; a KeyboardInterrupt outside
   a command's guarded blocks is one line and 130, not click's "Aborted!" and 1;
3. a member that dies is reported with its exit code or signal name and its log;
4. two of the mesh's configured ports the same: refused before anything starts, one line naming both (exit 2);
5. ``kvmesh flows`` fits an 80-column terminal;
6. the mesh stops its members in parallel (one shared deadline), etcd last; a second Ctrl-C kills the rest.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as fc
from kvmesh_cli import main as cli
from kvmesh_cli.launcher import ManagedProcess, stop_all
from kvmesh_cli.mesh import Member, Mesh, MeshSpec, MeshStartError
from tests.support import OutputLines, SilentServer

REPO = Path(__file__).resolve().parents[3]
KEY = "sk-acme-1234"


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """An interrupted command ignores further signals on its way out; give the test process its handlers back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


# --- 1. the hints carry the key ----------------------------------------------------------------------------------


class _KeyedCompletions(http.server.BaseHTTPRequestHandler):
    """A router in API-key mode: ``POST /v1/completions`` answers 401 without ``Bearer sk-acme-1234``."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        keyed = self.headers.get("authorization") == f"Bearer {KEY}"
        status, body = (200, b'{"choices":[{"text":"hi"}]}') if keyed else (401, b'{"error":{}}')
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keyed_router() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _mesh(router_url: str) -> SimpleNamespace:
    return SimpleNamespace(spec=SimpleNamespace(model="sim-model", time_scale=None, engines=1, policy="round-robin"),
                           router_url=router_url, epp_address="127.0.0.1:9001", etcd_address="127.0.0.1:2379",
                           members=[])


def _curl(hint: str) -> int:
    """Run the printed curl command as a user pastes it (through a shell); its HTTP status."""
    command = hint.removeprefix("send a request: ").split("  (")[0]
    out = subprocess.run(["bash", "-c", command + " -o /dev/null -w '%{http_code}'"], capture_output=True,
                         text=True, timeout=30, check=True)
    return int(out.stdout)


def test_the_pasted_curl_hint_is_not_refused_when_a_key_is_in_use(keyed_router: str) -> None:
    """Before: ``kvmesh up`` printed no key in its hints, so the pasted command got 401 in API-key mode."""
    mesh = _mesh(keyed_router)
    keyed = cli.request_hint(mesh, KEY)  # type: ignore[arg-type]
    assert keyed.startswith("send a request: curl ") and f"Bearer {KEY}" in keyed, keyed
    assert _curl(keyed) == 200
    assert _curl(cli.request_hint(mesh)) == 401  # the premise: this router refuses a keyless request  # type: ignore[arg-type]
    replay = cli.ready_lines(mesh, KEY)[1]  # type: ignore[arg-type]
    argv = shlex.split(replay.removeprefix("replay against it: "))
    assert argv[argv.index("--api-key") + 1] == KEY and argv[argv.index("--router") + 1] == keyed_router, replay


def test_a_key_the_cli_does_not_know_is_a_placeholder_saying_so(keyed_router: str) -> None:
    mesh = _mesh(keyed_router)
    hint = cli.request_hint(mesh, None, key_required=True)  # type: ignore[arg-type]
    assert "Bearer KEY" in hint and "put one of its tenants' keys for KEY" in hint, hint
    assert " --api-key KEY" in cli.ready_lines(mesh, None, key_required=True)[1]  # type: ignore[arg-type]
    open_mode = cli.request_hint(mesh)  # type: ignore[arg-type]
    assert "authorization" not in open_mode and "--api-key" not in cli.ready_lines(mesh)[1]  # type: ignore[arg-type]
    body = json.loads(shlex.split(open_mode)[-1])
    assert body == {"model": "sim-model", "prompt": "Hello", "max_tokens": 16}


def test_up_takes_api_key_for_its_probe_and_hints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def start(self: Mesh) -> Mesh:
        seen.append(self.spec.router_api_key)
        raise MeshStartError("stop here")

    monkeypatch.setattr(Mesh, "start", start)
    result = CliRunner().invoke(cli.app, ["up", "--run-dir", str(tmp_path / "run")],
                                env={"COLUMNS": "200", "KVMESH_API_KEY": KEY})
    assert result.exit_code == 1 and seen == [KEY], result.output


# --- 2. interrupted: 130 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_interrupted_during_start_up_exits_130(tmp_path: Path, signum: int) -> None:
    """A real ``kvmesh up`` whose start waits on an etcd that never answers; the signal lands there. Before: it
    printed "stopping mesh ... kvmesh stopped" and exited 0, as if it had served and stopped."""
    silent = SilentServer()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh_cli.main", "up", "--etcd", silent.address,
                                 "--run-dir", str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "COLUMNS": "240", "PYTHONUNBUFFERED": "1"})
        lines = OutputLines(proc)
        try:
            assert silent.spoken.wait(30), lines.text()  # the etcd check is in flight (its deadline is 5 s)
            time.sleep(0.2)
            assert proc.poll() is None, lines.text()
            proc.send_signal(signum)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        text = lines.rest()
    finally:
        silent.close()
    assert proc.returncode == 130, text
    assert f"interrupted (signal {signum}) during start-up: what had started is stopped; logs in " in text, text
    assert "kvmesh stopped" not in text and "Traceback" not in text and "Aborted" not in text, text
    assert (tmp_path / "run" / "mesh.lock").read_text() == ""  # the run folder was given back


@pytest.mark.parametrize("command", [["replay", "--requests", "2"], ["compare", "--requests", "2"]])
def test_ctrl_c_outside_a_commands_guarded_blocks_is_130_not_aborted(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signals_restored: None
) -> None:
    """Ctrl-C while the workload loads (before any mesh): before, click printed "Aborted!" and exited 1."""

    def slow_load(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_workload", slow_load)
    result = CliRunner().invoke(cli.app, [*command, "--run-dir", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 130, result.output
    assert f"interrupted (Ctrl-C): kvmesh {command[0]} stopped" in result.output
    assert "Aborted" not in result.output


# --- 3. how a member died ---------------------------------------------------------------------------------------


def _process(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log").start()


def test_a_dead_member_is_reported_with_its_exit_code_or_signal_and_its_log(tmp_path: Path) -> None:
    crashed = _process(tmp_path, "engine-0", "import sys; print('boom'); sys.exit(3)")
    killed = _process(tmp_path, "engine-1", "import time; time.sleep(60)")
    running = _process(tmp_path, "epp", "import time; time.sleep(60)")
    try:
        killed.kill()
        assert crashed.proc is not None and crashed.proc.wait(10) == 3
        members = [Member(p.name, p) for p in (crashed, killed, running)]
        seen: set[str] = set()
        assert cli.exit_lines(members, seen) == [
            f"engine-0 exited: exit code 3; log {tmp_path / 'engine-0.log'}",
            f"engine-1 exited: killed by SIGKILL; log {tmp_path / 'engine-1.log'}",
        ]
        assert cli.exit_lines(members, seen) == []  # each said once
        assert running.exit_reason() == "still running"
        with pytest.raises(RuntimeError, match=r"engine-0 exited: exit code 3; log .*engine-0\.log\nboom"):
            crashed.check_alive()
    finally:
        running.kill()


def test_a_member_dying_during_start_up_names_its_exit_code(tmp_path: Path) -> None:
    mesh = Mesh(MeshSpec(run_dir=tmp_path))
    member = Member("epp", _process(tmp_path, "epp", "import sys; print('bad config'); sys.exit(2)"))
    with pytest.raises(MeshStartError, match=r"^epp exited during start-up: exit code 2; log .*epp\.log\nbad config"):
        mesh._await([member], time.monotonic() + 30, lambda m: False)


# --- 4. duplicate ports -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "names"), [
    (["--router-port", "18000", "--router-grpc-port", "18000"], ("--router-port", "--router-grpc-port")),
    (["--router-grpc-port", "2379", "--etcd", "127.0.0.1:2379"], ("--router-grpc-port", "--etcd")),
])
def test_two_equal_ports_are_refused_before_anything_starts(
    args: list[str], names: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the router failed late (after etcd and four services started) with a bind error."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, ["up", *args, "--run-dir", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and f"'{names[0]}' / '{names[1]}'" in error[0] and "both are " in error[0], result.output
    assert "starting mesh" not in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / ".run").exists()


def test_a_mesh_spec_with_equal_ports_is_refused_before_its_run_folder_is_made(tmp_path: Path) -> None:
    spec = MeshSpec(run_dir=tmp_path / "run", router_http_port=18001, router_grpc_port=18001)
    with pytest.raises(MeshStartError, match="router_http_port and router_grpc_port are both 18001"):
        Mesh(spec).start()
    assert not (tmp_path / "run").exists()
    # a remote etcd's port is another machine's: no clash
    assert cli.port_clash(cli.configured_ports(MeshSpec(run_dir=tmp_path, etcd="10.1.2.3:2379",
                                                        router_http_port=2379))) is None


# --- 5. kvmesh flows at 80 columns ------------------------------------------------------------------------------


def _stats() -> fc.StatsResponse:
    return fc.StatsResponse(
        in_flight=12, max_in_flight=64, queued=340, queued_bytes=12345678, dispatched_total=1234567,
        rejected_total=4321, jain_index=0.987, fairness_window_seconds=10.0,
        saturation=fc.Saturation(enabled=True, saturated=True, saturation=0.93, headroom=123, unseen_dispatches=17),
        bands=[fc.BandStats(priority=10, name="interactive", queued=120, queued_bytes=4567890, in_flight=8, flows=3),
               fc.BandStats(priority=0, name="batch", queued=220, queued_bytes=7777788, in_flight=4, flows=12)],
        flows=[fc.FlowStats(flow_id=f"tenant-acme-production-{i}", priority=10, queued=40, in_flight=3,
                            oldest_wait_seconds=12.345, served_tokens=12345678, share=0.123) for i in range(3)])


def _render(width: int, fit: int | None) -> str:
    buf = io.StringIO()
    out = Console(file=buf, width=width, force_terminal=True, color_system=None)
    for table in cli.flows_tables(_stats(), fit):
        out.print(table)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 60])
def test_flows_fits_a_narrow_terminal_without_cutting_or_wrapping(width: int) -> None:
    """Before, at 80 columns: headers wrapped over two lines, the saturation cell over six, and every fairness
    id was cut to ``tenant-ac…`` (three flows that looked the same)."""
    text = _render(width, width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    assert "…" not in text, text
    for i in range(3):  # every fairness id whole, on one line
        assert any(f"tenant-acme-production-{i} " in line for line in lines), text
    body = [line for line in lines if line.startswith("│")]
    summary_rows = 1 if width == 80 else 7  # at 60 columns the summary turns into "header value" lines, all 7
    assert len(body) == summary_rows + 2 + 3, text  # one line per row: the summary, two bands, three flows
    assert "pool: saturation 0.93 SATURATED (headroom 123, unseen dispatches 17)" in " ".join(text.split()), text
    for header in ("in flight", "queued", "saturation", "Jain (10 s)", "priority" if width == 80 else "prio",
                   "fairness id", "share", "0.93 SATURATED", "0.987", "4321", "12/64"):
        assert header in text, (header, text)


def test_flows_shows_every_column_when_there_is_room() -> None:
    text = _render(200, 200)
    for header in ("queued bytes", "dispatched", "oldest wait s", "served tokens", "12345678", "12.35"):
        assert header in text, (header, text)
    assert _render(200, None) == text


# --- 6. the stop: parallel, etcd last -----------------------------------------------------------------------------

SLOW_STOP = textwrap.dedent("""
    import signal, sys, time
    stamps = open(sys.argv[1], "a")
    def on_term(*_):
        stamps.write(f"term {time.time()}\\n"); stamps.flush()
        time.sleep(float(sys.argv[2]))  # its own shutdown
        stamps.write(f"exit {time.time()}\\n"); stamps.flush()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term if sys.argv[2] != "ignore" else signal.SIG_IGN)
    stamps.write("ready\\n"); stamps.flush()
    while True:
        time.sleep(0.05)
""")


def _slow(tmp_path: Path, name: str, stop_s: str) -> ManagedProcess:
    script = tmp_path / "slow_stop.py"
    script.write_text(SLOW_STOP)
    stamps = tmp_path / f"{name}.stamps"
    proc = ManagedProcess(name, [sys.executable, str(script), str(stamps), stop_s], tmp_path / f"{name}.log").start()
    deadline = time.monotonic() + 30
    while not (stamps.exists() and "ready" in stamps.read_text()):
        assert time.monotonic() < deadline and proc.alive(), proc.log_tail()
        time.sleep(0.02)
    return proc


def _stamp(tmp_path: Path, name: str, what: str) -> float:
    return next(float(line.split()[1]) for line in (tmp_path / f"{name}.stamps").read_text().splitlines()
                if line.startswith(what))


def test_stop_all_takes_the_slowest_not_the_sum_and_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    procs = [_slow(tmp_path, f"svc-{i}", "1.0") for i in range(4)]
    stubborn = _slow(tmp_path, "stubborn", "ignore")
    t0 = time.monotonic()
    killed = stop_all([*procs, stubborn], timeout_seconds=2.0)
    elapsed = time.monotonic() - t0
    assert killed == [stubborn]
    assert stubborn.exit_reason() == "killed by SIGKILL"
    assert all(p.exit_reason() == "exit code 0" for p in procs)
    assert 1.9 <= elapsed < 3.5, elapsed  # one shared 2 s deadline (one by one: 4 x 1 s + 2 s)


def test_mesh_stop_sigterms_all_at_once_and_etcd_after_them(tmp_path: Path) -> None:
    """Four members that each take 1 s to stop: before, one stage after another (router, engines, epp, ...),
    about the sum; now about 1 s, and etcd (where the services revoke their leases) only once they are gone."""
    mesh = Mesh(MeshSpec(run_dir=tmp_path / "run", stop_timeout_seconds=10.0))
    names = ["etcd", "kv_indexer", "epp", "engine-0", "router"]
    mesh.members = [Member(n, _slow(tmp_path, n, "0.2" if n == "etcd" else "1.0")) for n in names]
    t0 = time.monotonic()
    mesh.stop()
    elapsed = time.monotonic() - t0
    assert all(not m.process.alive() for m in mesh.members)
    terms = {n: _stamp(tmp_path, n, "term") for n in names}
    others = [n for n in names if n != "etcd"]
    assert max(terms[n] for n in others) - min(terms[n] for n in others) < 0.5, terms  # at once
    assert terms["etcd"] >= max(_stamp(tmp_path, n, "exit") for n in others), terms  # etcd after them
    assert elapsed < 2.5, elapsed  # 1 s + etcd's 0.2 s (one by one: 4.2 s)


def test_a_second_ctrl_c_while_the_mesh_stops_kills_the_rest_at_once(tmp_path: Path) -> None:
    mesh = Mesh(MeshSpec(run_dir=tmp_path / "run", stop_timeout_seconds=30.0))
    mesh.members = [Member("router", _slow(tmp_path, "router", "ignore")), Member("etcd", _slow(tmp_path, "etcd", "0"))]

    def second_ctrl_c(*_: object) -> None:
        raise KeyboardInterrupt("signal 2")

    previous = signal.signal(signal.SIGALRM, second_ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            mesh.stop()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 5.0  # not the 30 s deadline
    assert [m.process.exit_reason() for m in mesh.members] == ["killed by SIGKILL", "killed by SIGKILL"]
