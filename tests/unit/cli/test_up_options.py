"""``kvmesh up`` checks its own port options before it starts anything, ``--num-gpu-blocks``'s help says it
caps the context length, the readiness probe finds a tenant's API key and says when it ends on 401, and
``kvmesh replay --api-key`` sends the key to the router only (wave-11 fresh user)."""

import asyncio
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvmesh_cli.launcher import ManagedProcess
from kvmesh_cli.main import app
from kvmesh_cli.mesh import Member, Mesh, MeshSpec, MeshStartError
from kvmesh_cli.replay import RouterKey


@pytest.mark.parametrize("option", ["--router-port", "--router-grpc-port"])
@pytest.mark.parametrize("value", ["99999", "0", "-1"])
def test_up_refuses_a_port_out_of_range_before_starting_anything(
    tmp_path: Path, option: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["up", option, value, "--run-dir", str(tmp_path / "run")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert "starting mesh" not in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / ".run").exists()


@pytest.mark.parametrize("command", ["up", "replay", "compare"])
def test_num_gpu_blocks_help_says_it_caps_the_context_length(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "max_model_len" in text and "4,032 tokens" in text and "context-length" in text, text


@pytest.mark.parametrize(
    ("tenants", "key"),
    [
        ('[{"name":"acme","api_keys":["sk-acme-1234"]}]', "sk-acme-1234"),
        ("- name: acme\n  api_keys: [sk-yaml-1]\n", "sk-yaml-1"),
        ('[{"name":"nokeys"},{"name":"b","api_keys":["sk-b"]}]', "sk-b"),
        ("{not json", None),
        ("", None),
    ],
    ids=["json", "yaml", "second-tenant", "unparsable", "open-mode"],
)
def test_readiness_probe_uses_a_configured_tenants_key(
    tmp_path: Path, tenants: str, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVMESH_ROUTER_TENANTS", raising=False)
    mesh = Mesh(MeshSpec(run_dir=tmp_path, extra_env={"KVMESH_ROUTER_TENANTS": tenants} if tenants else {}))
    assert mesh.router_api_key() == key


class _KeyedRouter(http.server.BaseHTTPRequestHandler):
    """A router in API-key mode whose pool is not up yet: /v1/models 401 without the key, /health 503."""

    def do_GET(self) -> None:
        keyed = self.headers.get("authorization") == "Bearer sk-acme-1234"
        if self.path == "/v1/models":
            status, body = (200, b'{"object":"list","data":[]}') if keyed else (401, b'{"error":{}}')
        else:
            status, body = 503, b'{"status":"unready"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def keyed_router() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedRouter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _alive_member() -> Member:
    proc = ManagedProcess("router", ["true"], Path("/dev/null"))
    proc.alive = lambda: True  # type: ignore[method-assign]
    return Member("router", proc)


def test_a_wait_that_ends_on_401_says_so(
    tmp_path: Path, keyed_router: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVMESH_ROUTER_TENANTS", raising=False)
    mesh = Mesh(MeshSpec(run_dir=tmp_path))
    mesh.router_url = keyed_router
    with pytest.raises(MeshStartError, match=r"router to list the model \(last: GET /v1/models answered HTTP 401 "
                                             r"\(API-key mode; no key in KVMESH_ROUTER_TENANTS\)\)"):
        mesh._wait_until(time.monotonic() + 0.5, "router to list the model", [_alive_member()],
                         mesh._router_lists_model)


def test_with_the_tenants_key_the_probe_gets_past_401(tmp_path: Path, keyed_router: str) -> None:
    tenants = '[{"name":"acme","api_keys":["sk-acme-1234"]}]'
    mesh = Mesh(MeshSpec(run_dir=tmp_path, model="m1", extra_env={"KVMESH_ROUTER_TENANTS": tenants}))
    mesh.router_url = keyed_router
    assert not mesh._router_lists_model(_alive_member())  # 200, but the model is not listed yet
    assert mesh._router_refusal == "GET /v1/models lists [], not 'm1'"


def test_replay_sends_the_key_to_the_router_only() -> None:
    auth = RouterKey("http://127.0.0.1:8000", "sk-acme-1234")
    to_router = next(auth.auth_flow(httpx.Request("POST", "http://127.0.0.1:8000/v1/completions")))
    to_engine = next(auth.auth_flow(httpx.Request("GET", "http://127.0.0.1:8001/metrics")))
    assert to_router.headers["authorization"] == "Bearer sk-acme-1234"
    assert "authorization" not in to_engine.headers


def test_replay_discovers_the_model_through_a_keyed_router(keyed_router: str) -> None:
    async def go(key: str | None) -> int:
        async with httpx.AsyncClient(auth=RouterKey(keyed_router, key) if key else None) as client:
            return (await client.get(f"{keyed_router}/v1/models")).status_code

    assert asyncio.run(go(None)) == 401
    assert asyncio.run(go("sk-acme-1234")) == 200
