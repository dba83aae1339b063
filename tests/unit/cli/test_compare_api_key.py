"""``kvmesh compare --api-key`` (and ``replay``'s own mesh): the key reaches the mesh's readiness check, which
fails at once, in one line, when the router refuses it; a replay that meets a 401 says so in one line.
The end-to-end runs against a real mesh in API-key mode are in tests/integration/test_cli_usability.py."""

from __future__ import annotations

import http.server
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvmesh_cli.checks import api_key_refusal
from kvmesh_cli.launcher import ManagedProcess
from kvmesh_cli.main import _run_replay, app
from kvmesh_cli.mesh import Member, Mesh, MeshSpec, MeshStartError
from kvmesh_cli.workloads import load_workload

TENANTS = '[{"name":"acme","api_keys":["sk-acme-1234"]}]'


class _KeyedRouter(http.server.BaseHTTPRequestHandler):
    """A router in API-key mode: /v1/models lists m1 to the key sk-acme-1234, 401 otherwise; /health 200."""

    def do_GET(self) -> None:
        keyed = self.headers.get("authorization") == "Bearer sk-acme-1234"
        if self.path == "/v1/models":
            status, body = (200, b'{"object":"list","data":[{"id":"m1"}]}') if keyed else (401, b'{"error":{}}')
        else:
            status, body = 200, b'{"status":"ok"}'
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


@pytest.mark.parametrize("command", ["compare", "replay"])
def test_api_key_is_an_option_of_compare_and_replay(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--api-key" in text and "KVMESH_API_KEY" in text and "readiness check" in text, text


def test_the_given_key_wins_over_the_tenants_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVMESH_ROUTER_TENANTS", raising=False)
    env = {"KVMESH_ROUTER_TENANTS": TENANTS}
    assert Mesh(MeshSpec(run_dir=tmp_path, extra_env=env)).router_api_key() == "sk-acme-1234"
    assert Mesh(MeshSpec(run_dir=tmp_path, extra_env=env, router_api_key="sk-given-1")).router_api_key() == "sk-given-1"
    assert Mesh(MeshSpec(run_dir=tmp_path)).router_api_key() is None


def test_readiness_with_the_given_key_passes(tmp_path: Path, keyed_router: str) -> None:
    mesh = Mesh(MeshSpec(run_dir=tmp_path, model="m1", router_api_key="sk-acme-1234"))
    mesh.router_url = keyed_router
    assert mesh._router_lists_model(_alive_member())


@pytest.mark.parametrize(("spec_key", "tenants", "source"), [
    ("sk-wrong-99", "", r"the given API key \(--api-key or KVMESH_API_KEY\)"),
    (None, '[{"name":"old","api_keys":["sk-old-0000"]}]', "the key from KVMESH_ROUTER_TENANTS"),
], ids=["given", "tenants"])
def test_a_refused_key_fails_the_start_at_once_in_one_line(
    tmp_path: Path, keyed_router: str, spec_key: str | None, tenants: str, source: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a refused key was waited on until the start timed out (2 minutes); the router's tenants are
    fixed at its start, so the first 401 is the answer."""
    monkeypatch.delenv("KVMESH_ROUTER_TENANTS", raising=False)
    mesh = Mesh(MeshSpec(run_dir=tmp_path, model="m1", router_api_key=spec_key,
                         extra_env={"KVMESH_ROUTER_TENANTS": tenants} if tenants else {}))
    mesh.router_url = keyed_router
    started = time.monotonic()
    with pytest.raises(MeshStartError) as caught:
        mesh._wait_until(time.monotonic() + 30, "router to list the model", [_alive_member()], mesh._router_lists_model)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(rf"router {re.escape(keyed_router)} answered GET /v1/models with HTTP 401 to {source}: "
                        r"it does not accept that key", message), message


def test_a_replay_without_a_key_against_a_keyed_router_is_one_line(
    keyed_router: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``compare`` (and ``replay``'s own mesh) meet after a keyless readiness (the router's ``/health``):
    the replay's first call gets 401. Before: httpx's two-line HTTPStatusError text."""
    wl = load_workload(None, "multi-turn", 2, 0, None, 8)
    with pytest.raises(typer.Exit) as caught:
        _run_replay(wl, keyed_router, [], 1.0, 2, None, "t", show_progress=False)
    assert caught.value.exit_code == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: " + api_key_refusal(keyed_router, 401, None), err
    assert err.endswith("HTTP 401: it requires an API key; pass --api-key KEY (or set KVMESH_API_KEY)")
    # with the key the same replay runs (its requests reach the stub, which serves no completions: they fail,
    # but the model was discovered through the key)
    outcome = _run_replay(wl, keyed_router, [], 1.0, 2, None, "t", show_progress=False, api_key="sk-acme-1234")
    assert len(outcome.results) == 2
