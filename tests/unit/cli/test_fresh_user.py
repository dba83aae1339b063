"""What a first-time user meets: `kvmesh flows`'s address, the missing-trace line, `up --etcd` dead."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import typer

from kvmesh_cli import main as cli
from kvmesh_cli.launcher import free_port
from kvmesh_cli.mesh import MeshStartError, check_etcd
from kvmesh_cli.workloads import load_workload

REPO = Path(__file__).resolve().parents[3]


def test_flows_default_is_compose_flow_control_port() -> None:
    compose = (REPO / "compose" / "docker-compose.yml").read_text()
    published = re.search(r'KVMESH_FLOW_CONTROL_PORT:-(\d+)\}:(\d+)', compose)
    assert published, "compose publishes flow_control's gRPC port"
    assert f"127.0.0.1:{published.group(1)}" == cli.DEFAULT_FLOW_CONTROL
    assert cli.flow_control_address(None, None) == cli.DEFAULT_FLOW_CONTROL
    assert cli.flow_control_address("10.0.0.1:7", "127.0.0.1:1") == "10.0.0.1:7"  # given wins, etcd not asked


def test_flows_with_a_dead_etcd_is_one_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(typer.Exit) as caught:
        cli.flow_control_address(None, dead)
    assert caught.value.exit_code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: etcd {dead} refused the connection") and "--flow-control" in err, err


def test_up_etcd_check_names_the_address() -> None:
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(MeshStartError, match=rf"^etcd {dead} refused the connection .*leave --etcd out"):
        check_etcd(dead, timeout_s=1.0)
    # something listens and never answers: that one did time out (after the whole 1 s), and says so
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        said = rf"^etcd {address} accepted the connection but did not answer within 1s .*leave --etcd out"
        with pytest.raises(MeshStartError, match=said):
            check_etcd(address, timeout_s=1.0)
    with pytest.raises(MeshStartError, match="is a URL"):
        check_etcd("http://127.0.0.1:2379")


def test_missing_agentic_traces_say_which_path_was_looked_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "traces.tar.gz"
    monkeypatch.setattr("kvmesh_cli.workloads.DEFAULT_AGENTIC_ARCHIVE", missing)
    monkeypatch.setattr(cli, "DEFAULT_AGENTIC_ARCHIVE", missing)
    wl = load_workload(None, "agentic", 5, 0, None, 16)
    assert wl.name == "agentic-synthetic"
    text = cli._workload_line(wl, wl.name, "agentic")
    assert f"no kv-cache-tester traces at {missing}" in text and "--trace FILE" in text
    assert "no kv-cache-tester" not in cli._workload_line(wl, wl.name, "agentic-synthetic")  # asked for: no excuse
