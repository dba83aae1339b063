"""What a fresh user met (wave 9): run folders shared by runs started in the same second, output paths checked
only after a long run, config mistakes as tracebacks, CLI limits looser than the simulator's, option names
truncated in ``--help`` at 80 columns, no ``--version``, ``kvmesh flows`` wording."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner, Result

from engine_simulator.config import SimulatorConfig
from kvmesh.server import check_ports_file, write_ports_file
from kvmesh_cli import checks
from kvmesh_cli.checks import check_dir_option, check_output_file, new_run_dir
from kvmesh_cli.main import _write_output, app
from kvmesh_cli.options import MAX_BLOCK_SIZE_TOKENS, MAX_TIME_SCALE, MIN_NUM_GPU_BLOCKS

COMMANDS = ["up", "replay", "compare", "flows"]


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


# --- 1. a run folder of its own -----------------------------------------------------------------


def test_run_folders_made_in_the_same_second_differ(tmp_path: Path) -> None:
    """Same command, same second, same process: each call creates a new folder (exclusively), never one
    another run already holds."""
    made = [new_run_dir("up", tmp_path / ".run") for _ in range(5)]
    assert len(set(made)) == 5 and all(p.is_dir() for p in made)
    assert all(re.fullmatch(rf"up-\d{{8}}-\d{{6}}-{os.getpid()}(-\d+)?", p.name) for p in made), made


def test_run_folders_of_two_processes_started_together_differ(tmp_path: Path) -> None:
    """Two processes (as two ``kvmesh up`` started by one script) racing for a run folder at the same moment."""
    code = ("import sys; from pathlib import Path; from kvmesh_cli.checks import new_run_dir; "
            "print(new_run_dir('compare', Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / ".run")], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    paths = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(paths)) == 3 and all(Path(p).is_dir() for p in paths), paths


def test_a_run_folder_root_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / ".run").write_text("")
    with pytest.raises(typer.BadParameter, match="is not a directory"):
        new_run_dir("up", tmp_path / ".run")


# --- 2, 3. every path option checked before anything starts --------------------------------------


@pytest.mark.parametrize("command", ["up", "replay", "compare"])
def test_run_dir_that_is_a_file_or_under_one_is_one_line_exit_2(tmp_path: Path, command: str) -> None:
    somefile = tmp_path / "somefile"
    somefile.write_text("")
    for run_dir, why in ((somefile, "exists and is not a directory"), (somefile / "sub", "somefile is not a directory")):
        result = _invoke(command, "--run-dir", str(run_dir))
        assert result.exit_code == 2, result.output
        assert "--run-dir" in result.output and why in result.output, result.output
        assert "Traceback" not in result.output and "workload" not in result.output, result.output


@pytest.mark.parametrize(("args", "why"), [
    (["compare", "--json-out", "/nonexistent/dir/r.json"], "the folder /nonexistent/dir does not exist"),
    (["replay", "--json-out", "/nonexistent/dir/r.json"], "the folder /nonexistent/dir does not exist"),
    (["compare", "--plot", "/nonexistent/dir/r.png"], "the folder /nonexistent/dir does not exist"),
    (["compare", "--plot", "{tmp}"], "is a directory; give a file name"),
    (["compare", "--plot", "{tmp}/r.txt"], "matplotlib cannot write '.txt' files"),
    (["compare", "--json-out", "{tmp}"], "is a directory; give a file name"),
    (["compare", "--timeline", "{tmp}/somefile"], "exists and is not a directory"),
    (["compare", "--timeline", "{tmp}/somefile/runs"], "somefile is not a directory"),
], ids=["compare-json", "replay-json", "plot-missing-dir", "plot-dir", "plot-format", "json-dir", "timeline-file",
        "timeline-under-file"])
def test_output_paths_are_checked_before_the_run(tmp_path: Path, args: list[str], why: str) -> None:
    """Exit 2 with the option named, in well under a second: no mesh started, no workload replayed."""
    (tmp_path / "somefile").write_text("")
    result = _invoke(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code == 2, result.output
    assert args[1] in result.output and why in result.output, result.output
    assert "starting mesh" not in result.output and "workload" not in result.output, result.output


def test_check_output_file_accepts_a_new_or_existing_file(tmp_path: Path) -> None:
    assert check_output_file(tmp_path / "r.json", "--json-out") == (tmp_path / "r.json").resolve()
    (tmp_path / "old.json").write_text("{}")
    assert check_output_file(tmp_path / "old.json", "--json-out").is_file()
    later = check_dir_option(tmp_path / "a" / "b", "--timeline")  # checked, made only when the run starts
    assert later.is_absolute() and not later.exists()
    made = check_dir_option(tmp_path / "a" / "b", "--run-dir", create=True)
    assert made.is_dir() and made == later


def test_a_read_only_filesystem_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The statvfs answer of a read-only mount (the real mount is tested in tests/integration/test_cli_paths.py,
    where ``unshare`` can make one)."""
    real = os.statvfs

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(checks.os, "statvfs", lambda p: ReadOnly() if str(p).startswith(str(tmp_path)) else real(p))
    with pytest.raises(typer.BadParameter, match="read-only filesystem"):
        check_output_file(tmp_path / "r.json", "--json-out")
    with pytest.raises(typer.BadParameter, match="read-only filesystem"):
        check_dir_option(tmp_path, "--run-dir")


def test_a_write_failure_at_the_end_says_where_and_keeps_the_results(tmp_path: Path) -> None:
    """The folder vanished during a long run: the failure is a line naming the path, and the results go to
    the fallback (the run folder) instead."""
    gone, fallback = tmp_path / "gone" / "r.json", tmp_path / "run" / "compare.json"
    fallback.parent.mkdir()
    assert _write_output(gone, lambda p: p.write_text('{"ok": 1}'), "the results", fallback=fallback) is False
    assert json.loads(fallback.read_text()) == {"ok": 1}
    assert _write_output(tmp_path / "r.json", lambda p: p.write_text("x"), "the results") is True


def test_ports_file_checked_before_serving(tmp_path: Path) -> None:
    (tmp_path / "somefile").write_text("")
    check_ports_file("")
    check_ports_file(str(tmp_path / "p.json"))
    for path, why in ((tmp_path / "missing" / "p.json", "does not exist"), (tmp_path, "is a directory"),
                      (tmp_path / "somefile" / "p.json", "does not exist")):
        with pytest.raises(ValueError, match=f"--ports-file {re.escape(str(path))}: .*{why}"):
            check_ports_file(str(path))
    with pytest.raises(OSError, match=r"--ports-file .*cannot write it"):
        write_ports_file(str(tmp_path / "missing" / "p.json"), {"grpc": 1})


# --- 5. limits are the simulator's ---------------------------------------------------------------


def test_cli_limits_are_the_simulators() -> None:
    fields = SimulatorConfig.model_fields
    assert MIN_NUM_GPU_BLOCKS == next(m.ge for m in fields["num_gpu_blocks"].metadata if hasattr(m, "ge")) == 2
    assert MAX_TIME_SCALE == next(m.le for m in fields["time_scale"].metadata if hasattr(m, "le")) == 10000
    assert next(m.le for m in fields["block_size_tokens"].metadata if hasattr(m, "le")) == MAX_BLOCK_SIZE_TOKENS


@pytest.mark.parametrize(("args", "flag"), [
    (["up", "--num-gpu-blocks", "1"], "--num-gpu-blocks"),
    (["compare", "--num-gpu-blocks", "1"], "--num-gpu-blocks"),
    (["replay", "--num-gpu-blocks", "1"], "--num-gpu-blocks"),
    (["up", "--time-scale", "1e308"], "--time-scale"),
    (["replay", "--time-scale", "10001"], "--time-scale"),
    (["compare", "--time-scale", "1e308"], "--time-scale"),
    (["up", "--block-size-tokens", "4097"], "--block-size-tokens"),
    (["compare", "--block-size-tokens", "4097"], "--block-size-tokens"),
    (["up", "--model", ""], "--model"),
    (["up", "--model", "  "], "--model"),
    (["replay", "--model", ""], "--model"),
])
def test_values_the_simulator_refuses_are_refused_at_parse_time(args: list[str], flag: str) -> None:
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert flag in result.output and "starting mesh" not in result.output, result.output


# --- 6. help at 80 columns ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_at_80_columns_shows_every_option_name_whole(command: str) -> None:
    root = get_command(app)
    cmd = root if not command else root.commands[command]  # type: ignore[attr-defined]
    result = CliRunner().invoke(app, [*([command] if command else []), "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    names = [name for p in cmd.params for name in (*p.opts, *p.secondary_opts) if name.startswith("--")]
    assert names
    for name in names:
        assert re.search(rf"(^|[\s,/]){re.escape(name)}([\s,=/]|$)", result.output, re.M), (name, result.output)
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output


# --- 7. --version --------------------------------------------------------------------------------


def test_version() -> None:
    result = _invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"kvmesh {version('kvmesh')}"


# --- 8. kvmesh flows says what it met -------------------------------------------------------------


def test_flows_against_another_grpc_service_says_it_is_not_a_flow_control() -> None:
    """A real gRPC server that serves only grpc.health.v1 (as every kvmesh service does): Stats is UNIMPLEMENTED."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = _invoke("flows", "--flow-control", f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    assert result.exit_code == 1, result.output
    assert f"127.0.0.1:{port} is a gRPC server but not a flow_control" in result.output, result.output


def test_flows_names_a_host_that_does_not_resolve_and_a_port_nobody_listens_on() -> None:
    result = _invoke("flows", "--flow-control", "notahost.invalid:50054")
    assert result.exit_code == 1, result.output
    assert "the host name 'notahost.invalid' did not resolve" in result.output, result.output
    from kvmesh_cli.launcher import free_port

    result = _invoke("flows", "--flow-control", f"127.0.0.1:{free_port()}")
    assert result.exit_code == 1 and "nothing listens there (connection refused)" in result.output, result.output
