"""kv_store checks its Mooncake tier at start (wave-11 fresh user: ``--mooncake-master nothost`` without the
``mooncake`` module started silently and advertised the tier): one ERROR line naming the option, a degraded
start (the service stays up), as ``--shared-path``'s check (docs/degraded-modes.md, kv_store rows)."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.kv_store.app import check_mooncake, mooncake_client_missing
from services.kv_store.config import KvStoreConfig

ROOT = Path(__file__).resolve().parents[3]
NO_MOONCAKE = mooncake_client_missing() is not None


def _config(**fields: str) -> KvStoreConfig:
    return KvStoreConfig(etcd_endpoints=[], **fields)  # type: ignore[arg-type]


def test_no_mooncake_tier_no_check(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert check_mooncake(_config()) == []
    assert not caplog.records


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"mooncake_master": "nothost"}, "--mooncake-master nothost: not host:port"),
        ({"mooncake_master": "127.0.0.1:99999"}, "--mooncake-master 127.0.0.1:99999: port '99999' is not 1-65535"),
        ({"mooncake_master": ":50051"}, "--mooncake-master :50051: not host:port"),
        ({"mooncake_master": "127.0.0.1:50051", "mooncake_master_http": "127.0.0.1"},
         "--mooncake-master-http 127.0.0.1: not host:port"),
    ],
    ids=["no-port", "port-range", "no-host", "http-no-port"],
)
def test_a_bad_master_address_is_one_error_line(
    fields: dict[str, str], fragment: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        problems = check_mooncake(_config(**fields))
    assert any(fragment in p for p in problems), problems
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "degraded mode tier=mooncake" in errors[0] and fragment in errors[0], errors


@pytest.mark.skipif(not NO_MOONCAKE, reason="this interpreter has the mooncake client (the .venv has not)")
def test_missing_client_module_is_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        problems = check_mooncake(_config(mooncake_master="127.0.0.1:50051"))
    assert problems == [f"--mooncake-master 127.0.0.1:50051: {mooncake_client_missing()}"]
    assert "make mooncake-venv" in caplog.text


@pytest.mark.skipif(not NO_MOONCAKE, reason="this interpreter has the mooncake client (the .venv has not)")
def test_the_service_starts_degraded_with_one_error_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.kv_store", "--mooncake-master", "nothost", "--etcd-endpoints", "",
         "--ports-file", str(tmp_path / "ports.json")],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ports.json").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "kv_store did not start"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1, err
    assert "degraded mode tier=mooncake --mooncake-master nothost: not host:port" in errors[0]
    assert "mooncake client is not installed" in errors[0]
    assert "serving grpc=" in err
