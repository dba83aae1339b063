"""ServiceConfig loading: precedence flags > env > file > defaults, and clear errors."""

from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import ServiceConfig, load_config


class DemoConfig(ServiceConfig):
    """Demo service configuration."""

    model_config = SettingsConfigDict(
        env_prefix="KVMESH_DEMO_", extra="forbid", use_attribute_docstrings=True, populate_by_name=True
    )

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
        (["--queue-ttl-seconds", "-1"], "greater than 0"),
        (["--grpc-port", "70000"], "less than or equal to 65535"),
        (["--log-level", "LOUD"], "log_level"),
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
