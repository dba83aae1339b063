"""Fixtures shared by the whole test run: a real etcd, a run directory, process starters.

Services start as processes exactly as users start them (``python -m services.<svc>``),
on free 127.0.0.1 ports, and tests wait on their gRPC health, never on a bare sleep.
Tests import nothing from here: constants and helpers live in ``tests/support.py``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh_cli.launcher import ManagedProcess, python_module, start_etcd, wait_grpc_healthy, wait_ports_file


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite golden files (tests/golden/) from the current output instead of comparing",
    )


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvmesh-run")


@pytest.fixture(scope="session")
def etcd(run_dir: Path) -> Iterator[str]:
    """A real single-member etcd for the whole session; yields ``host:port``."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: sudo apt-get install -y etcd-server (make test does it)")
    proc, address = start_etcd(run_dir)
    yield address
    proc.stop()


ServiceStarter = Callable[..., tuple[ManagedProcess, str]]


@pytest.fixture
def start_service(run_dir: Path, etcd: str) -> Iterator[ServiceStarter]:
    """``start_service("kv_indexer", "--events-bind-endpoint", ...)`` -> (process, grpc address).

    Starts ``python -m services.<name>`` on port 0 for gRPC and metrics with this session's etcd,
    reads the ports it bound from its ``--ports-file`` (no port is picked before the bind, so none can
    be taken meanwhile), waits until its gRPC health is SERVING, and stops it after the test.
    """
    started: list[ManagedProcess] = []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> tuple[ManagedProcess, str]:
        index = len(started)
        ports_file = run_dir / f"{name}-{index}-{time.monotonic_ns()}.ports.json"
        proc = ManagedProcess(
            name,
            python_module(
                f"services.{name}",
                "--grpc-port", "0",
                "--metrics-port", "0",
                "--ports-file", str(ports_file),
                "--etcd-endpoints", etcd,
                "--lease-ttl-seconds", "3",
                *args,
            ),
            ports_file.with_suffix(".log"),
            env=env or {},
        ).start()
        started.append(proc)
        try:
            port = wait_ports_file(ports_file, proc, 30.0)["grpc"]
            address = f"127.0.0.1:{port}"
            wait_grpc_healthy(address, 30.0)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{name} did not become healthy:\n{proc.log_tail()}") from exc
        return proc, address

    yield start
    for proc in reversed(started):
        proc.stop()
