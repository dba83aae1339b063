"""A bad config value is one stderr line per error naming the flag, env var or file key and the constraint.

Exit 2, no argparse usage dump, no pydantic traceback or errors.pydantic.dev URL (fresh-user report, wave 11).
The subprocess cases run the real ``python -m services.<svc>`` entry points.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig, load_config

ROOT = Path(__file__).resolve().parents[3]


class DemoConfig(GrpcServiceConfig):
    """Demo service configuration."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_DEMO_")

    ratio: float = Field(0.5, ge=0, le=1)
    """A fraction."""
    mapping: dict[str, int] = Field(default_factory=dict)
    """A mapping."""


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_flag_error_is_one_line_naming_flag_and_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, ["--grpc-port", "99999"], prog="python -m services.demo")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == ["demo: --grpc-port 99999: must be <= 65535"]


def test_env_var_error_names_the_env_var(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVMESH_DEMO_RATIO", "lots")
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, [], prog="python -m services.demo")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == ["demo: KVMESH_DEMO_RATIO=lots: must be a number"]


def test_env_mapping_that_is_not_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVMESH_DEMO_MAPPING", "{nope")
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, [], prog="python -m services.demo")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == ["demo: KVMESH_DEMO_MAPPING={nope: not valid JSON"]


def test_yaml_key_errors_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text("ratio: 2\nlog_level: LOUD\nbogus: 1\n")
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, ["--config", str(path)], prog="python -m services.demo")
    assert exc_info.value.code == 2
    lines = _err_lines(capsys)
    assert sorted(lines) == sorted([
        f"demo: --config {path}: ratio 2: must be <= 1.0",
        f"demo: --config {path}: log_level LOUD: must be one of 'DEBUG', 'INFO', 'WARNING' or 'ERROR'",
        f"demo: --config {path}: bogus 1: is not a known option",
    ])


def test_unknown_flag_is_one_line_without_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, ["--port", "99999"], prog="python -m services.demo")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == ["demo: unrecognized arguments: --port 99999 (see --help)"]


def _run(module: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("module", "args", "env", "expected"),
    [
        ("services.router", ["--http-port", "99999"], {}, "router: --http-port 99999: must be <= 65535"),
        ("services.router", [], {"KVMESH_ROUTER_HTTP_PORT": "abc"}, "router: KVMESH_ROUTER_HTTP_PORT=abc: must be an integer"),
        ("services.epp", ["--log-level", "LOUD"], {},
         "epp: --log-level LOUD: must be one of 'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
        ("services.kv_store", ["--lease-ttl-seconds", "1"], {}, "kv_store: --lease-ttl-seconds 1: must be >= 2"),
        ("services.router", ["--port", "99999"], {}, "router: unrecognized arguments: --port 99999 (see --help)"),
    ],
    ids=["router-flag", "router-env", "epp-enum", "kv_store-bound", "router-unknown-flag"],
)
def test_service_entry_points_print_one_line(module: str, args: list[str], env: dict[str, str], expected: str) -> None:
    proc = _run(module, *args, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [expected]
    assert "pydantic.dev" not in proc.stderr and "usage:" not in proc.stderr


def test_service_yaml_key_error(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("http_port: 70000\n")
    proc = _run("services.router", "--config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"router: --config {path}: http_port 70000: must be <= 65535"]


def test_a_check_of_two_fields_together_is_its_own_message() -> None:
    proc = _run("engine_simulator", "--max-model-len", "256", "--long-prefill-token-threshold", "257")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "engine_simulator: long_prefill_token_threshold (257) cannot be greater than the max_model_len (256)."]


@pytest.mark.parametrize(
    "module",
    ["services.router", "services.epp", "services.kv_indexer", "services.kv_store", "services.flow_control",
     "engine_simulator", "services.registration_sidecar"],
)
def test_every_entry_point_prints_its_help(module: str) -> None:
    """``--help`` lists every field (argparse %-formats help text: a docstring's "80 %" once crashed it)."""
    proc = _run(module, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout and "--print-config" in proc.stdout and "Traceback" not in proc.stderr


def test_a_percent_sign_in_a_docstring_is_printed_as_is(capsys: pytest.CaptureFixture[str]) -> None:
    class Pct(GrpcServiceConfig):
        """Demo at 50 % load."""

        model_config = SettingsConfigDict(env_prefix="KVMESH_PCT_")
        share: float = Field(0.8, gt=0)
        """Fraction of the link (~80 %), 100% at most."""

    with pytest.raises(SystemExit) as exit_info:
        load_config(Pct, ["--help"], prog="pct")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "Demo at 50 % load." in out and "(~80 %), 100% at most" in out


# An env var with a service's prefix that names no setting (wave 13's fresh user: a typo did nothing, silently).


def test_a_mistyped_env_var_is_named_with_the_closest_setting() -> None:
    proc = _run("services.router", "--print-config", env={"KVMESH_ROUTER_HTTP_PROT": "9000"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "router: KVMESH_ROUTER_HTTP_PROT is not a setting (did you mean KVMESH_ROUTER_HTTP_PORT?); ignored"]
    assert "http_port: 0\n" in proc.stdout  # ignored indeed: the default port


def test_unknown_env_vars_one_line_each_as_written_even_without_a_close_setting() -> None:
    # pydantic-settings reads env names case-insensitively: a lower-case one with the prefix is checked too
    proc = _run("services.epp", "--print-config", env={"kvmesh_epp_log_levle": "DEBUG", "KVMESH_EPP_ZZZ": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "epp: KVMESH_EPP_ZZZ is not a setting; ignored",
        "epp: kvmesh_epp_log_levle is not a setting (did you mean KVMESH_EPP_LOG_LEVEL?); ignored",
    ]
    assert "log_level: INFO\n" in proc.stdout


def test_the_warning_comes_before_a_validation_error() -> None:
    proc = _run("services.router", env={"KVMESH_ROUTER_HTTP_PROT": "9000", "KVMESH_ROUTER_HTTP_PORT": "abc"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "router: KVMESH_ROUTER_HTTP_PROT is not a setting (did you mean KVMESH_ROUTER_HTTP_PORT?); ignored",
        "router: KVMESH_ROUTER_HTTP_PORT=abc: must be an integer",
    ]


@pytest.mark.parametrize(
    ("module", "env"),
    [
        # fields, in any case; the otlp field's prefixed name (populate_by_name) and its standard alias
        ("services.router", {"KVMESH_ROUTER_TENANTS": "[]", "kvmesh_router_http_port": "0",
                             "KVMESH_ROUTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "",
                             "KVMESH_EPP_GRPC_PROT": "1"}),  # another service's prefix: not the router's business
        # compose/docker-compose.yml's published host ports share the prefix; compose reads them, not epp
        ("services.epp", {"KVMESH_EPP_PORT": "60052", "KVMESH_FLOW_CONTROL_PORT": "60054"}),
        ("services.flow_control", {"KVMESH_FLOW_CONTROL_PORT": "60054"}),
    ],
    ids=["router-fields", "epp-compose-port", "flow_control-compose-port"],
)
def test_settings_and_names_read_elsewhere_do_not_warn(module: str, env: dict[str, str]) -> None:
    proc = _run(module, "--print-config", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_every_prefixed_name_the_repository_mentions_is_a_setting_or_read_elsewhere() -> None:
    """The docs, compose, k8s manifests, benches and CLI name env vars; none with a service's prefix may make
    that service warn (a documented name that warned would be a stale doc, or belongs in READ_ELSEWHERE)."""
    import importlib
    import re

    from kvmesh.config import unknown_env_lines

    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "services").glob("*/README.md"),
             *(ROOT / "services").glob("*/*.py"), *(ROOT / "compose").rglob("*.y*ml"), *(ROOT / "deploy").rglob("*.yaml"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "kvmesh_cli").glob("*.py")]
    names = {name for path in files for name in re.findall(r"\bKVMESH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    assert "KVMESH_ROUTER_TENANTS" in names and "KVMESH_EPP_PORT" in names  # the scan sees what it should
    configs = [("services.router.config", "RouterConfig"), ("services.epp.config", "EppConfig"),
               ("services.kv_indexer.config", "KvIndexerConfig"), ("services.kv_store.config", "KvStoreConfig"),
               ("services.flow_control.config", "FlowControlConfig"),
               ("services.registration_sidecar.config", "SidecarConfig"), ("engine_simulator.config", "SimulatorConfig")]
    for module, name in configs:
        cls = getattr(importlib.import_module(module), name)
        assert unknown_env_lines(cls, dict.fromkeys(names, "1")) == [], name
