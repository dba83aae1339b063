"""The only engine of a mesh killed (kill -9; its etcd lease lives on): the router's ``/health`` stops
counting it as soon as a request finds its connection refused, instead of answering
``200 "ok", "endpoints": 1`` until the lease expires (docs/degraded-modes.md, "an engine refuses").

A stream running at the kill ends with the in-stream error; the next request gets a 503 that names
the engine in plain words (no ``ClientConnectorError`` / ``ssl:default`` of the HTTP client); within
a second ``/health`` is 503 naming the refusing endpoint; the engine restarted on its address, the
router counts it again and serves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh_cli.mesh import Mesh, MeshSpec
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-refused"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # a lease far longer than the test: only the refused connect can tell the router the engine is gone
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("refused"), engines=1, policy="round-robin",
                    model=MODEL, lease_ttl_seconds=60, num_gpu_blocks=128)
    with Mesh(spec) as m:
        yield m


def _health(mesh: Mesh) -> tuple[int, dict[str, object]]:
    reply = httpx.get(f"{mesh.router_url}/health", timeout=5)
    return reply.status_code, reply.json()


def _complete(mesh: Mesh, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra}
    return httpx.post(f"{mesh.router_url}/v1/completions", json=body, timeout=30)


def test_killed_only_engine_makes_health_unavailable_at_once_and_recovers(mesh: Mesh) -> None:
    wait_until(lambda: _health(mesh), 30, "router ready", until=lambda h: h[0] == 200 and h[1]["endpoints"] == 1)
    assert _complete(mesh).status_code == 200
    engine_id = f"127.0.0.1:{mesh.member('engine-0').ports['http']}"

    # a stream running when the engine dies ends with the in-stream error (the user's first step)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{mesh.router_url}/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        mesh.kill("engine-0")
        rest = [line for line in lines if line]
    assert rest and rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]

    refused = _complete(mesh)
    checked_at = time.monotonic()
    assert refused.status_code == 503, refused.text
    message = refused.json()["error"]["message"]
    assert "ssl:default" not in message and "ClientConnector" not in message and "Errno" not in message, message
    assert f"engine {engine_id} at http://{engine_id} refused the connection" in message, message

    _, health = wait_until(lambda: _health(mesh), 5, "/health 503 after the refused connect",
                              until=lambda h: h[0] == 503)
    assert time.monotonic() - checked_at < 1.5, "not at once"
    assert health["status"] == "unavailable" and health["endpoints"] == 0, health
    assert health["unreachable_endpoints"] == [engine_id], health
    assert f"registered but refusing connections: {engine_id}" in health["error"]["message"], health  # type: ignore[index]
    log = Path(mesh.member("router").log_path).read_text(errors="replace")
    assert "refused the connection cause=ClientConnectorError" in log  # the transport's words stay in the log

    mesh.restart("engine-0")  # registers again (a new instance): counted at once
    _, health = wait_until(lambda: _health(mesh), 20, "/health ok with the engine back",
                              until=lambda h: h[0] == 200 and h[1]["status"] == "ok")
    assert health["endpoints"] == 1 and "unreachable_endpoints" not in health, health
    assert _complete(mesh).status_code == 200
