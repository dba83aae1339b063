"""One entry-point shape for every process: ``__main__`` calls ``kvmesh.server.main``; ``app.build_service`` builds.

Each process's ``build_service`` must build from its default config without serving (no port,
no etcd, no event loop), and every ``__main__.py`` must be the same three lines over it.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic_settings import SettingsConfigDict

from kvmesh import server
from kvmesh.config import GrpcServiceConfig, ProcessConfig
from kvmesh.server import GrpcService

REPO = Path(__file__).resolve().parents[3]

# (package, config class name, arguments the config needs beyond its defaults)
PROCESSES = [
    ("services.router", "RouterConfig", {}),
    ("services.epp", "EppConfig", {}),
    ("services.kv_indexer", "KvIndexerConfig", {}),
    ("services.kv_store", "KvStoreConfig", {}),
    ("services.flow_control", "FlowControlConfig", {}),
    ("services.registration_sidecar", "SidecarConfig", {"engine_url": "http://127.0.0.1:8011", "model": "tiny"}),
    ("engine_simulator", "SimulatorConfig", {}),
]
GRPC_SERVICES = {"services.router", "services.epp", "services.kv_indexer", "services.kv_store", "services.flow_control"}


@pytest.fixture
def global_registry() -> Iterator[None]:
    """Unregister what a build added to prometheus_client's global REGISTRY (one process per service in production)."""
    before = set(REGISTRY._collector_to_names)  # private, but the only way to list collectors
    yield
    for collector in set(REGISTRY._collector_to_names) - before:
        REGISTRY.unregister(collector)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``main`` replaces the root handlers (as a process does); put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize(("package", "config_name", "args"), PROCESSES, ids=[p[0] for p in PROCESSES])
def test_build_service_builds_from_the_default_config(
    package: str, config_name: str, args: dict[str, Any], tmp_path: Path, global_registry: None
) -> None:
    config_cls = getattr(importlib.import_module(f"{package}.config"), config_name)
    if package == "engine_simulator":
        args = {"tokenizer_path": str(tmp_path / "tok")}
    config = config_cls(**args)
    built = importlib.import_module(f"{package}.app").build_service(config)
    assert callable(built.run)
    if package in GRPC_SERVICES:
        assert isinstance(built, GrpcService) and isinstance(config, GrpcServiceConfig)
        assert built.grpc_port == 0 and built._server is None  # built, not started
        assert built.spec.service_names and all(name.startswith("kvmesh.") for name in built.spec.service_names)
    else:
        assert isinstance(config, ProcessConfig) and not isinstance(config, GrpcServiceConfig)


@pytest.mark.parametrize(("package", "config_name", "args"), PROCESSES, ids=[p[0] for p in PROCESSES])
def test_every_main_is_the_shared_entry_point(package: str, config_name: str, args: dict[str, Any]) -> None:
    path = REPO / package.replace(".", "/") / "__main__.py"
    tree = ast.parse(path.read_text())
    imports = {(node.module, alias.name) for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert imports == {("kvmesh.server", "main"), (f"{package}.app", "build_service"), (f"{package}.config", config_name)}
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and len(guard.body) == 1
    call = guard.body[0].value  # type: ignore[attr-defined]
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "main"
    assert [a.id for a in call.args] == [config_name, "build_service"]  # type: ignore[attr-defined]
    assert {k.arg for k in call.keywords} == {"prog", "name"}


class _DemoConfig(ProcessConfig):
    """A demo process."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_DEMO_MAIN_")


class _Process:
    def __init__(self) -> None:
        self.ran = False

    async def run(self) -> None:
        self.ran = True


def _run_main(build: Callable[[_DemoConfig], Any], argv: list[str]) -> None:
    server.main(_DemoConfig, build, prog="demo", name="demo", argv=argv)


def test_main_logs_the_config_once_then_runs(capsys: pytest.CaptureFixture[str], root_logging: None) -> None:
    process = _Process()
    _run_main(lambda config: process, ["--etcd-endpoints", "", "--log-level", "INFO"])
    assert process.ran
    lines = [line for line in capsys.readouterr().err.splitlines() if " config {" in line]
    assert len(lines) == 1 and "[demo] kvmesh.server: config " in lines[0]
    assert json.loads(lines[0].split(" config ", 1)[1])["etcd_endpoints"] == []


def test_main_turns_a_build_value_error_into_exit_2(capsys: pytest.CaptureFixture[str], root_logging: None) -> None:
    def build(config: _DemoConfig) -> _Process:
        raise ValueError("profiles[0]: unknown plugin type 'x'")

    with pytest.raises(SystemExit) as exc:
        _run_main(build, [])
    assert exc.value.code == 2
    assert "demo: profiles[0]: unknown plugin type 'x'" in capsys.readouterr().err


def test_main_print_config_exits_before_building(capsys: pytest.CaptureFixture[str]) -> None:
    def build(config: _DemoConfig) -> _Process:
        raise AssertionError("must not build")

    with pytest.raises(SystemExit) as exc:
        _run_main(build, ["--print-config"])
    assert exc.value.code == 0 and "host: 127.0.0.1" in capsys.readouterr().out
