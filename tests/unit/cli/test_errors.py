"""Bad options and runtime failures end in one clean error (exit 2 for usage, 1 at runtime), never a traceback."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from kvmesh_cli import main as cli
from kvmesh_cli.checks import EPP_CONFIGS_DIR, check_router_url, known_policies, resolve_policy
from kvmesh_cli.mesh import MeshStartError

KNOWN = ("load-only", "precise-prefix", "round-robin")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def test_known_policies_are_the_config_files() -> None:
    assert known_policies() == sorted(p.stem for p in EPP_CONFIGS_DIR.glob("*.yaml"))
    assert set(KNOWN) <= set(known_policies())


def test_resolve_policy_name_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_policy("round-robin") == "round-robin"
    (tmp_path / "mine.yaml").write_text((EPP_CONFIGS_DIR / "round-robin.yaml").read_text())  # epp must accept it
    monkeypatch.chdir(tmp_path)
    assert resolve_policy("mine.yaml") == str(tmp_path / "mine.yaml")  # absolute: epp runs elsewhere
    with pytest.raises(typer.BadParameter, match="neither a named scheduling config"):
        resolve_policy("mine")
    with pytest.raises(typer.BadParameter):
        resolve_policy("")


@pytest.mark.parametrize("value", ["notaurl", "127.0.0.1:8000", "localhost:8000", "ftp://h:1", "http://"])
def test_check_router_url_rejects(value: str) -> None:
    with pytest.raises(typer.BadParameter, match="not an http"):
        check_router_url(value)


def test_check_router_url_accepts() -> None:
    assert check_router_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_router_url("https://router.example") == "https://router.example"


@pytest.mark.parametrize(
    "args",
    [["up", "--policy", "nosuch"], ["compare", "--policies", "round-robin,bogus"], ["replay", "--policy", "nosuch"]],
    ids=["up", "compare", "replay"],
)
def test_unknown_policy_is_usage_error_before_starting(args: list[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out = invoke(*args, "--run-dir", str(run))
    assert code == 2, out
    assert "neither a named scheduling config" in out
    for name in KNOWN:
        assert name in out
    assert not run.exists()  # nothing started


@pytest.mark.parametrize("router", ["notaurl", "127.0.0.1:8000"])
def test_replay_router_not_a_url_is_usage_error(router: str) -> None:
    code, out = invoke("replay", "--router", router, "--requests", "1")
    assert code == 2, out
    assert "not an http(s) URL" in out


def test_replay_router_unreachable_is_runtime_error() -> None:
    code, out = invoke("replay", "--router", "http://127.0.0.1:1", "--requests", "1")
    assert code == 1, out
    assert "error: router http://127.0.0.1:1 is unreachable" in out


def test_replay_bad_trace_names_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}
    trace.write_text(json.dumps(good) + "\n" + "not json\n")
    code, out = invoke("replay", "--trace", str(trace), "--router", "http://127.0.0.1:1")
    assert code == 2, out
    assert re.search(r"bad\.jsonl:2: not a Mooncake trace row", out.replace("\n", " ").replace("│", "")), out
    trace.write_bytes(b"\xff\xfe\x00")
    code, out = invoke("replay", "--trace", str(trace), "--router", "http://127.0.0.1:1")
    assert code == 2 and "not UTF-8" in out, out


class FailingMesh:
    """Stands in for :class:`Mesh` whose start failed (a real one has stopped its members by then)."""

    def __init__(self, spec: object, progress: object = None) -> None:
        self.spec = spec

    def __enter__(self) -> NoReturn:
        raise MeshStartError("epp exited during start-up:\nepp: [bad] config /x.yaml: plugins: too few")

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.mark.parametrize("args", [["compare", "--requests", "2"], ["up"], ["replay", "--requests", "2"]],
                         ids=["compare", "up", "replay"])
def test_mesh_start_error_is_one_clean_message(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "Mesh", FailingMesh)
    code, out = invoke(*args, "--run-dir", str(tmp_path / "run"))
    assert code == 1, out
    assert "error: the mesh did not start: epp exited during start-up:" in out
    assert "epp: [bad] config /x.yaml: plugins: too few" in out  # the log tail, verbatim (no rich markup)


def fake_mesh() -> SimpleNamespace:
    rows = [
        {"service": f"engine-{i}", "pid": str(40000 + i), "grpc": f"127.0.0.1:{41000 + i}",
         "http": f"http://127.0.0.1:{42000 + i}", "metrics": f"http://127.0.0.1:{43000 + i}/metrics",
         "log": f"/tmp/some/quite/long/run/directory/for/kvmesh/up-20250101-000000/engine-{i}.log"}
        for i in range(3)
    ]
    return SimpleNamespace(
        spec=SimpleNamespace(engines=3, policy="precise-prefix", model="sim-model", time_scale=None),
        describe=lambda: rows, router_url="http://127.0.0.1:8000", epp_address="127.0.0.1:9001",
        etcd_address="127.0.0.1:2379",
        members=[SimpleNamespace(name=name, grpc=f"127.0.0.1:{port}") for name, port in
                 (("etcd", 2379), ("kv_indexer", 9003), ("kv_store", 9005), ("epp", 9001), ("flow_control", 9004),
                  ("router", 9000))],
    )


def test_table_keeps_addresses_whole_when_piped() -> None:
    buf = io.StringIO()
    out = Console(file=buf, width=80, force_terminal=False)
    mesh = fake_mesh()
    cli.print_table(out, cli.mesh_table(mesh))  # type: ignore[arg-type]
    lines = buf.getvalue().splitlines()
    for row in mesh.describe():
        for key in ("grpc", "http", "metrics", "log"):
            assert any(row[key] in line for line in lines), (row[key], buf.getvalue())
        assert any(row["grpc"] in line and row["metrics"] in line for line in lines)


def test_table_on_a_narrow_terminal_keeps_addresses_whole() -> None:
    buf = io.StringIO()
    out = Console(file=buf, width=130, force_terminal=True, color_system=None)
    mesh = fake_mesh()
    cli.print_table(out, cli.mesh_table(mesh))  # type: ignore[arg-type]
    text = buf.getvalue()
    assert all(len(line) <= 130 for line in text.splitlines()), text
    for row in mesh.describe():
        assert row["metrics"] in text and row["http"] in text, text


def test_ready_lines_name_router_epp_and_etcd() -> None:
    first, hint, _flows = cli.ready_lines(fake_mesh())  # type: ignore[arg-type]
    assert first.startswith("kvmesh ready: router ") and first.split()[3] == "http://127.0.0.1:8000"
    assert "epp 127.0.0.1:9001" in first and "etcd 127.0.0.1:2379" in first
    assert "--router http://127.0.0.1:8000 --epp 127.0.0.1:9001" in hint and "--time-scale" not in hint
    # every service's address, so `kvmesh flows --flow-control` and grpcurl need no guessing
    assert "flow_control 127.0.0.1:9004 kv_indexer 127.0.0.1:9003 kv_store 127.0.0.1:9005 (Ctrl-C" in first
    assert cli.ready_lines(fake_mesh())[2] == "admission state: kvmesh flows --etcd 127.0.0.1:2379"  # type: ignore[arg-type]
    scaled = fake_mesh()
    scaled.spec.time_scale = 20.0
    assert cli.ready_lines(scaled)[1].endswith(" --time-scale 20")  # type: ignore[arg-type]  # replay's must match
