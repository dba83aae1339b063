"""etcd killed under a running mesh (docs/degraded-modes.md, the etcd row), with real processes.

kill -9 etcd while requests flow: every request is still served (last known membership), every
kvmesh service says so on its ``/metrics`` (``kvmesh_etcd_up 0``, ``kvmesh_etcd_failures_total``
growing), the router's ``/health`` is 200 ``"degraded"`` naming etcd, and the etcd warnings are
rate-limited (at most one line per 10 s per operation, the suppressed ones counted); etcd restarted on
its ports and data: ``kvmesh_etcd_up 1`` everywhere, ``/health`` ``"ok"``, one recovery line per process.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh_cli.launcher import ManagedProcess, free_port, start_etcd
from kvmesh_cli.mesh import Mesh, MeshSpec
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-etcd-down"
SERVICES = ("router", "epp", "kv_indexer", "flow_control", "kv_store")


@pytest.fixture(scope="module")
def etcd_ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, etcd_ports: tuple[int, int]) -> Iterator[EtcdMesh]:
    """A mesh on an etcd of its own (pinned ports and data dir, so the test can restart it)."""
    etcd_dir = tmp_path_factory.mktemp("etcd")
    proc, address = start_etcd(etcd_dir, client_port=etcd_ports[0], peer_port=etcd_ports[1])
    assert proc.alive(), proc.log_tail()
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("etcd-down"), engines=2, policy="round-robin",
                    time_scale=50.0, model=MODEL, lease_ttl_seconds=3, etcd=address)
    holder = EtcdMesh(None, etcd_dir, proc)  # type: ignore[arg-type]
    try:
        with Mesh(spec) as m:
            holder.mesh = m
            yield holder
    finally:
        holder.etcd.kill()


@dataclass
class EtcdMesh:
    mesh: Mesh
    etcd_dir: Path
    etcd: ManagedProcess


def _metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url, timeout=5).text
    found = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            found = (found or 0.0) + float(value)
    return found


def _etcd_up(mesh: Mesh) -> dict[str, float | None]:
    return {name: _metric(mesh.member(name).metrics or "", "kvmesh_etcd_up") for name in SERVICES}


def _health(mesh: Mesh) -> tuple[int, dict[str, Any]]:
    reply = httpx.get(f"{mesh.router_url}/health", timeout=5)
    return reply.status_code, reply.json()


async def _burst(mesh: Mesh, n: int) -> collections.Counter[int]:
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"request {i} hello", "max_tokens": 4}
            try:
                return (await client.post(f"{mesh.router_url}/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return 599

        return collections.Counter(await asyncio.gather(*(one(i) for i in range(n))))


def _log(mesh: Mesh, name: str) -> str:
    return Path(mesh.member(name).log_path).read_text(errors="replace")


def _etcd_lines(mesh: Mesh, name: str) -> list[str]:
    text = _log(mesh, name)
    return [line for line in text.splitlines() if "dependency=etcd" in line]


async def test_etcd_killed_is_a_visible_degraded_mode_then_recovers(
    mesh: EtcdMesh, etcd_ports: tuple[int, int]
) -> None:
    m = mesh.mesh
    assert _etcd_up(m) == dict.fromkeys(SERVICES, 1.0)
    code, body = _health(m)
    assert code == 200 and body["status"] == "ok" and body["dependencies"]["etcd"] == "SERVING", body

    mesh.etcd.kill()
    killed_at = time.monotonic()
    assert (await _burst(m, 10)) == {200: 10}  # served from the last known membership
    wait_until(lambda: _etcd_up(m), 15, "kvmesh_etcd_up 0 in every service",
               until=lambda up: set(up.values()) == {0.0})
    code, body = wait_until(lambda: _health(m), 10, "router /health degraded",
                            until=lambda h: h[1]["status"] == "degraded")
    assert code == 200 and body["degraded"] == ["etcd"] and body["dependencies"]["etcd"] == "UNAVAILABLE", body
    assert body["endpoints"] == 2, body
    # Let the outage run past one log interval: the retries go on every second per key.
    await asyncio.sleep(max(0.0, 12.0 - (time.monotonic() - killed_at)))
    assert (await _burst(m, 10)) == {200: 10}
    for name in SERVICES:
        url = m.member(name).metrics or ""
        failures = sum(_metric(url, "kvmesh_etcd_failures_total", operation=op) or 0.0
                       for op in ("register", "keepalive", "watch"))
        assert failures >= 5, (name, failures)
        lines = _etcd_lines(m, name)
        # at most one line per operation per 10 s of outage (the first, then one every 10 s counting the
        # rest): bounded by the time elapsed since the kill, however late this check runs on a busy host
        down_for = time.monotonic() - killed_at
        per_operation = collections.Counter(re.search(r"operation=(\w+)", line).group(1) for line in lines)  # type: ignore[union-attr]
        assert lines and max(per_operation.values()) <= 1 + math.ceil(down_for / 10), (name, down_for, lines)
        assert any("more" in line and "failures in the last 10s" in line for line in lines) or failures <= len(lines), lines
        # each line says what its client does: a watcher serves its last view, a registration retries
        assert all(("serving from the last known membership" in line) == ("operation=watch" in line)
                   for line in lines), lines
        assert all("registering again in 1s" in line for line in lines
                   if "operation=register" in line or "operation=keepalive" in line), lines

    restarted, _ = start_etcd(mesh.etcd_dir, client_port=etcd_ports[0], peer_port=etcd_ports[1])
    mesh.etcd = restarted
    assert restarted.alive(), restarted.log_tail()
    wait_until(lambda: _etcd_up(m), 30, "kvmesh_etcd_up 1 again everywhere",
               until=lambda up: set(up.values()) == {1.0})
    wait_until(lambda: _health(m), 15, "router /health ok again",
               until=lambda h: h[0] == 200 and h[1]["status"] == "ok" and h[1]["endpoints"] == 2)
    assert (await _burst(m, 10)) == {200: 10}
    for name in SERVICES:
        text = _log(m, name)
        assert "etcd reachable again after" in text, name
        assert "Traceback" not in text, name
