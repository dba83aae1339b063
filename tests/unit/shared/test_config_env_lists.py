"""A list-of-scalars config field takes, from its env var, the plain comma-separated form its flag takes.

``KVMESH_ROUTER_ETCD_ENDPOINTS=127.0.0.1:2379`` used to fail with ``not valid JSON`` (only
``'["127.0.0.1:2379"]'`` worked) although ``--etcd-endpoints 127.0.0.1:2379`` did (fresh-user report).
A value that starts with ``[`` is still a JSON list; lists of objects (router ``tenants``) stay JSON
only, and their error says a JSON list is expected.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_simulator.config import SimulatorConfig
from kvmesh.config import ProcessConfig, _EnvSource, _list_kind, load_config
from services.epp.config import EppConfig
from services.flow_control.config import FlowControlConfig
from services.kv_indexer.config import KvIndexerConfig
from services.kv_store.config import KvStoreConfig
from services.registration_sidecar.config import SidecarConfig
from services.router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[3]

ALL_CONFIGS: list[type[ProcessConfig]] = [
    RouterConfig, EppConfig, FlowControlConfig, KvIndexerConfig, KvStoreConfig, SidecarConfig, SimulatorConfig,
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("KVMESH_"):
            monkeypatch.delenv(key)


def _err_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("cls", "prefix"), [(RouterConfig, "KVMESH_ROUTER_"), (KvStoreConfig, "KVMESH_KV_STORE_")])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:2379", ["127.0.0.1:2379"]),
        ("etcd-a:2379,etcd-b:2380", ["etcd-a:2379", "etcd-b:2380"]),
        (" etcd-a:2379 , etcd-b:2380 ,", ["etcd-a:2379", "etcd-b:2380"]),
        ('["etcd-a:2379", "etcd-b:2380"]', ["etcd-a:2379", "etcd-b:2380"]),
        ("", []),
    ],
    ids=["single", "comma", "spaces", "json", "empty"],
)
def test_etcd_endpoints_from_env(
    monkeypatch: pytest.MonkeyPatch, cls: type[ProcessConfig], prefix: str, value: str, expected: list[str],
) -> None:
    monkeypatch.setenv(prefix + "ETCD_ENDPOINTS", value)
    assert load_config(cls, [], prog="python -m services.x").etcd_endpoints == expected


def test_other_string_list_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_KV_STORE_SHARED_DOMAINS", "sharedfs:/a,mooncake:m/ns")
    assert load_config(KvStoreConfig, []).shared_domains == ["sharedfs:/a", "mooncake:m/ns"]


def test_env_endpoint_still_validated(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVMESH_ROUTER_ETCD_ENDPOINTS", "a:2379,nope")
    with pytest.raises(SystemExit) as exc_info:
        load_config(RouterConfig, [], prog="python -m services.router")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == [
        "router: KVMESH_ROUTER_ETCD_ENDPOINTS=a:2379,nope: etcd endpoint 'nope' is not host:port (port 1-65535)"
    ]


def test_broken_json_list_of_scalars_says_both_forms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KVMESH_ROUTER_ETCD_ENDPOINTS", '["a:1"')
    with pytest.raises(SystemExit) as exc_info:
        load_config(RouterConfig, [], prog="python -m services.router")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == [
        'router: KVMESH_ROUTER_ETCD_ENDPOINTS=["a:1": not valid JSON; '
        "expected a JSON list ([...]) or comma-separated values"
    ]


@pytest.mark.parametrize("value", ["acme", "a,b"])
def test_object_list_is_json_only_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str,
) -> None:
    monkeypatch.setenv("KVMESH_ROUTER_TENANTS", value)
    with pytest.raises(SystemExit) as exc_info:
        load_config(RouterConfig, [], prog="python -m services.router")
    assert exc_info.value.code == 2
    assert _err_lines(capsys) == [
        f"router: KVMESH_ROUTER_TENANTS={value}: not valid JSON; expected a JSON list of objects ([{{...}}, ...])"
    ]


def test_object_list_json_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_FLOW_CONTROL_BANDS", '[{"priority": 5, "name": "hi"}]')
    config = load_config(FlowControlConfig, [])
    assert [(band.priority, band.name) for band in config.bands] == [(5, "hi")]


def _scalar_list_fields() -> list[tuple[type[ProcessConfig], str]]:
    return [(cls, name) for cls in ALL_CONFIGS for name, info in cls.model_fields.items()
            if _list_kind(info.annotation) == "scalars"]


def test_the_kinds_are_recognised() -> None:
    assert _list_kind(RouterConfig.model_fields["etcd_endpoints"].annotation) == "scalars"
    assert _list_kind(RouterConfig.model_fields["tenants"].annotation) == "objects"
    assert _list_kind(FlowControlConfig.model_fields["bands"].annotation) == "objects"
    assert _list_kind(RouterConfig.model_fields["engine_api_keys"].annotation) is None
    assert _list_kind(list[int] | None) == "scalars"
    # every service has etcd_endpoints; kv_store adds write_through and shared_domains
    assert {(cls.__name__, name) for cls, name in _scalar_list_fields()} >= {
        (cls.__name__, "etcd_endpoints") for cls in ALL_CONFIGS
    } | {("KvStoreConfig", "write_through"), ("KvStoreConfig", "shared_domains")}


@pytest.mark.parametrize(("cls", "field"), _scalar_list_fields(), ids=lambda p: getattr(p, "__name__", p))
def test_every_scalar_list_field_splits_commas_from_env(
    monkeypatch: pytest.MonkeyPatch, cls: type[ProcessConfig], field: str,
) -> None:
    name = str(cls.model_config.get("env_prefix", "")) + field.upper()
    monkeypatch.setenv(name, "x:1,y:2")
    assert _EnvSource(cls)()[field] == ["x:1", "y:2"]
    monkeypatch.setenv(name, '["x:1"]')
    assert _EnvSource(cls)()[field] == ["x:1"]


def test_router_entry_point_reads_plain_env_endpoint() -> None:
    """The reported command: ``KVMESH_ROUTER_ETCD_ENDPOINTS=127.0.0.1:2379 python -m services.router --print-config``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVMESH_")}
    env["KVMESH_ROUTER_ETCD_ENDPOINTS"] = "127.0.0.1:2379"
    proc = subprocess.run([sys.executable, "-m", "services.router", "--print-config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "etcd_endpoints:\n- 127.0.0.1:2379\n" in proc.stdout
