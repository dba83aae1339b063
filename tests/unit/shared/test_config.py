"""Config loading: precedence flags > env > file > defaults, clear errors, and the process/gRPC split."""

import importlib
from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig, ProcessConfig, load_config
from kvmesh.types import EndpointRole


class DemoConfig(GrpcServiceConfig):
    """Demo service configuration."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_DEMO_")

    queue_ttl_seconds: float = Field(30.0, gt=0)
    """How long a request may wait."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Per-scorer weights."""


def test_defaults() -> None:
    config = load_config(DemoConfig, [])
    assert config.host == "127.0.0.1"
    assert config.queue_ttl_seconds == 30.0
    assert config.etcd_endpoints == ["127.0.0.1:2379"]


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text("queue_ttl_seconds: 5\ngrpc_port: 7000\nlog_level: DEBUG\n")
    monkeypatch.setenv("KVMESH_DEMO_GRPC_PORT", "7001")
    monkeypatch.setenv("KVMESH_DEMO_LOG_LEVEL", "WARNING")
    config = load_config(DemoConfig, ["--config", str(path), "--log-level", "ERROR"])
    assert config.queue_ttl_seconds == 5  # file
    assert config.grpc_port == 7001  # env beats file
    assert config.log_level == "ERROR"  # flag beats env


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--queue-ttl-seconds", "-1"], "--queue-ttl-seconds -1: must be > 0"),
        (["--grpc-port", "70000"], "--grpc-port 70000: must be <= 65535"),
        (["--log-level", "LOUD"], "--log-level LOUD: must be one of"),
        (["--no-such-flag", "1"], "unrecognized arguments"),
        (["--weights", "{bad"], "weights"),
        (["--etcd-endpoints", "garbage"], "is not host:port"),
        (["--etcd-endpoints", "127.0.0.1:0"], "is not host:port"),
    ],
    ids=["bound", "port-range", "literal", "unknown-flag", "bad-yaml", "etcd-no-port", "etcd-port-0"],
)
def test_bad_values_exit_with_a_message(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, argv)
    assert exc_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_lists_and_mappings_from_flags() -> None:
    config = load_config(DemoConfig, ["--etcd-endpoints", "127.0.0.1:1,127.0.0.1:2", "--weights", '{"a": 2}'])
    assert config.etcd_endpoints == ["127.0.0.1:1", "127.0.0.1:2"]
    assert config.weights == {"a": 2.0}


def test_otlp_endpoint_from_standard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert load_config(DemoConfig, []).otlp_endpoint == "http://127.0.0.1:4317"


def test_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, ["--print-config", "--grpc-port", "1234"])
    assert exc_info.value.code == 0
    assert "grpc_port: 1234" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("grpc_port: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "expected a mapping"),
        ("grpc_port: 1\nno_such_field: 2\n", "no_such_field"),
    ],
    ids=["unparsable", "list", "unknown-field"],
)
def test_bad_config_file(tmp_path: Path, content: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit) as exc_info:
        load_config(DemoConfig, ["--config", str(path)])
    assert exc_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_config_path_must_be_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--config", str(tmp_path)])
    assert "not a regular file" in capsys.readouterr().err


# (module, class, env prefix, arguments it needs, serves gRPC)
CONFIGS = [
    ("services.router.config", "RouterConfig", "KVMESH_ROUTER_", [], True),
    ("services.epp.config", "EppConfig", "KVMESH_EPP_", [], True),
    ("services.kv_indexer.config", "KvIndexerConfig", "KVMESH_KV_INDEXER_", [], True),
    ("services.kv_store.config", "KvStoreConfig", "KVMESH_KV_STORE_", [], True),
    ("services.flow_control.config", "FlowControlConfig", "KVMESH_FLOW_CONTROL_", [], True),
    ("services.registration_sidecar.config", "SidecarConfig", "KVMESH_REGISTRATION_SIDECAR_",
     ["--engine-url", "http://127.0.0.1:8011", "--model", "tiny"], False),
    ("engine_simulator.config", "SimulatorConfig", "KVMESH_ENGINE_SIMULATOR_", [], False),
]
CONFIG_IDS = [c[1] for c in CONFIGS]


@pytest.mark.parametrize(("module", "name", "prefix", "argv", "grpc"), CONFIGS, ids=CONFIG_IDS)
def test_each_env_prefix_sets_its_config(
    module: str, name: str, prefix: str, argv: list[str], grpc: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = getattr(importlib.import_module(module), name)
    monkeypatch.setenv(f"{prefix}LOG_LEVEL", "DEBUG")
    monkeypatch.setenv(f"{prefix}METRICS_PORT", "9123")
    monkeypatch.setenv("KVMESH_SOMEONE_ELSE_LOG_LEVEL", "ERROR")
    config = load_config(cls, argv)
    assert (config.log_level, config.metrics_port) == ("DEBUG", 9123)
    if grpc:
        monkeypatch.setenv(f"{prefix}GRPC_PORT", "7005")
        assert load_config(cls, argv).grpc_port == 7005


@pytest.mark.parametrize(("module", "name", "prefix", "argv", "grpc"), CONFIGS, ids=CONFIG_IDS)
def test_subclasses_set_only_the_env_prefix(module: str, name: str, prefix: str, argv: list[str], grpc: bool) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert cls.model_config["env_prefix"] == prefix
    # extra="forbid", attribute docstrings and populate_by_name come from ProcessConfig.
    assert cls.model_config["extra"] == "forbid" and cls.model_config["populate_by_name"]
    assert all(info.description for info in cls.model_fields.values())
    assert issubclass(cls, GrpcServiceConfig) is grpc and issubclass(cls, ProcessConfig)


@pytest.mark.parametrize(("module", "name", "prefix", "argv", "grpc"), [c for c in CONFIGS if not c[4]],
                         ids=[c[1] for c in CONFIGS if not c[4]])
def test_processes_without_grpc_carry_no_grpc_flags(
    module: str, name: str, prefix: str, argv: list[str], grpc: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert "grpc_port" not in cls.model_fields and "instance_id" not in cls.model_fields
    assert {"lease_ttl_seconds", "etcd_endpoints", "log_level"} <= set(cls.model_fields)
    with pytest.raises(SystemExit) as exc_info:
        load_config(cls, [*argv, "--grpc-port", "1"])
    assert exc_info.value.code == 2 and "unrecognized arguments: --grpc-port" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["SidecarConfig", "SimulatorConfig"])
def test_role_is_the_one_endpoint_role(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    cls = {c[1]: getattr(importlib.import_module(c[0]), c[1]) for c in CONFIGS}[name]
    argv = next(c[3] for c in CONFIGS if c[1] == name)
    config = load_config(cls, [*argv, "--role", "prefill"])
    assert config.role is EndpointRole.PREFILL
    with pytest.raises(SystemExit):
        load_config(cls, [*argv, "--print-config"])
    assert "role: both" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        load_config(cls, [*argv, "--role", "middle"])
    assert "'both', 'prefill' or 'decode'" in capsys.readouterr().err


def test_flow_control_limits_come_from_the_config() -> None:
    from services.flow_control.config import FlowControlConfig

    config = FlowControlConfig()
    limits = config.limits()
    assert (limits.max_in_flight, limits.queue_ttl_seconds, limits.max_queue_size) == (
        config.max_in_flight, config.queue_ttl_seconds, config.max_queue_size)


SERVICE_CONFIGS = [
    ("services.router.config", "RouterConfig"),
    ("services.kv_store.config", "KvStoreConfig"),
    ("services.kv_indexer.config", "KvIndexerConfig"),
    ("services.registration_sidecar.config", "SidecarConfig"),
    ("services.flow_control.config", "FlowControlConfig"),
    ("services.epp.config", "EppConfig"),
]


@pytest.mark.parametrize(("module", "name"), [("", "DemoConfig"), *SERVICE_CONFIGS])
@pytest.mark.parametrize("argv", [["--port", "8123"], ["--print"], ["--conf", "x.yaml"], ["--etcd", "h:1"]])
def test_an_abbreviated_flag_is_refused_not_taken_for_a_longer_one(
    module: str, name: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse matches unambiguous prefixes by default: ``--port 8123`` silently meant ``--ports-file
    8123`` (kv_store), ``--print`` meant ``--print-config``. Every service's flags are exact."""
    cls = DemoConfig if not module else getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as exc_info:
        load_config(cls, argv)
    assert exc_info.value.code == 2
    assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err


def test_the_kvmesh_cli_refuses_abbreviated_options_too() -> None:
    """The CLI's parsers (click, via typer) never match prefixes: every subcommand says no such option."""
    from typer.testing import CliRunner

    from kvmesh_cli.main import app

    runner = CliRunner()
    for argv in (["replay", "--req", "5"], ["compare", "--polic", "x"], ["up", "--engin", "1"],
                 ["flows", "--wat", "1"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, (argv, result.output)
        assert f"No such option: {argv[1]}" in result.output, (argv, result.output)
