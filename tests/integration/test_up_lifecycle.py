"""Ports, signals and disconnects of a running mesh (issue 14, item 4).

* Ports cannot collide: every kvmesh process binds port 0 and reports it in its ports file, so
  several meshes started back to back (all alive at once) get pairwise distinct ports, and no
  kvmesh process was handed a port by the harness.
* ``kvmesh up`` started in the background from a script (where the shell sets SIGINT to *ignored*)
  stops cleanly on SIGINT and on SIGTERM, leaving no process behind.
* A client that disconnects mid-request is logged as such by the router and the simulator, never
  as an unhandled exception.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvmesh_cli.mesh import Mesh, MeshSpec
from tests.integration.test_cli import ChildSampler, children_of, survivors
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-life"


def _spec(run_dir: Path, engines: int = 1) -> MeshSpec:
    return MeshSpec(run_dir=run_dir, engines=engines, policy="round-robin", time_scale=20.0, model=MODEL,
                    num_gpu_blocks=64, start_timeout_seconds=90)


def test_meshes_started_repeatedly_never_share_a_port(tmp_path: Path) -> None:
    """Three meshes alive at once, started one after another: every listening port is distinct, and
    every kvmesh process was started with port 0 (it chose nothing racy; the kernel did)."""
    meshes: list[Mesh] = []
    try:
        for i in range(3):
            meshes.append(Mesh(_spec(tmp_path / f"m{i}", engines=2)).start())
        ports: list[int] = []
        for mesh in meshes:
            for member in mesh.members:
                if member.name == "etcd":
                    continue
                argv = list(member.process.argv)
                for flag in ("--grpc-port", "--metrics-port", "--port", "--http-port"):
                    if flag in argv:
                        assert argv[argv.index(flag) + 1] == "0", (member.name, flag, argv)
                assert member.ports, member.name
                ports += member.ports.values()
            reply = httpx.post(f"{mesh.router_url}/v1/completions",
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
            assert reply.status_code == 200, reply.text
        assert len(ports) == len(set(ports)), sorted(ports)
        assert len(ports) >= 3 * (5 * 2 + 1 + 2)  # 5 services x (grpc, metrics) + router http + 2 engines
    finally:
        for mesh in meshes:
            mesh.stop()


def _background_up(tmp_path: Path) -> tuple[subprocess.Popen[str], int, Path]:
    """``kvmesh up &`` from a non-interactive shell script (SIGINT ignored in the job); returns the
    shell, kvmesh's pid and its output file."""
    out = tmp_path / "up.out"
    script = (
        f'"{sys.executable}" -m kvmesh_cli.main up --engines 1 --run-dir "{tmp_path / "run"}" > "{out}" 2>&1 &\n'
        'echo $!\n'
        'wait $!\n'
        'echo "exit=$?"\n'
    )
    shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert shell.stdout is not None
    pid = int(shell.stdout.readline())
    return shell, pid, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_background_up_stops_on_signal(tmp_path: Path, signum: int) -> None:
    shell, pid, out = _background_up(tmp_path)
    try:
        sampler = ChildSampler(pid)
        ready = wait_until(lambda: re.search(r"kvmesh ready: router (\S+)", out.read_text() if out.exists() else ""),
                           120, "the 'kvmesh ready' line", interval=0.2)
        router = ready.group(1)
        assert httpx.get(f"{router}/v1/models", timeout=10).status_code == 200
        if signum == signal.SIGINT:  # the premise: a script's background job starts with SIGINT ignored
            probe = subprocess.run(["bash", "-c", "sleep 2 & grep SigIgn /proc/$!/status"], capture_output=True,
                                   text=True, check=True)
            assert int(probe.stdout.split()[1], 16) & (1 << (signal.SIGINT - 1)), probe.stdout
        seen = sampler.stop() | children_of(pid)
        assert len(seen) >= 7
        os.kill(pid, signum)
        tail, _ = shell.communicate(timeout=60)
        # Ctrl-C's SIGINT exits 130 (128 + SIGINT, as a shell reports it); SIGTERM is a service manager's
        # normal stop of a ready mesh: 0
        assert f"exit={130 if signum == signal.SIGINT else 0}" in tail, (tail, out.read_text()[-3000:])
        text = out.read_text()
        assert "kvmesh stopped" in text and "Traceback" not in text, text[-3000:]
        assert survivors(seen) == []
    finally:
        if shell.poll() is None:
            os.kill(pid, signal.SIGKILL)
            shell.kill()
            shell.wait(10)


def _upload_then_vanish(base: str) -> None:
    """Send request headers announcing a 100 kB body, 10 bytes of it, then close the connection."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100000\r\n\r\n{\"model\": ")
        time.sleep(0.2)


async def test_client_disconnects_are_logged_not_raised(tmp_path: Path) -> None:
    """Clients that go away mid-stream, while waiting for a non-streamed answer, and while still
    sending their body, at the router and directly at the engine: each is one log line saying so;
    no log holds a traceback or an ASGI error."""
    spec = MeshSpec(run_dir=tmp_path / "run", engines=1, policy="round-robin", time_scale=1.0, model=MODEL,
                    num_gpu_blocks=64)
    with Mesh(spec) as mesh:
        engine = mesh.engine_urls[0]
        for base in (mesh.router_url, engine):
            for stream in (True, False):
                body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 400, "ignore_eos": True, "stream": stream}
                async with httpx.AsyncClient(timeout=30) as client:
                    if stream:
                        async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
                            assert reply.status_code == 200
                            async for _ in reply.aiter_bytes():
                                break  # first bytes in, then the client goes away
                    else:
                        with pytest.raises(httpx.ReadTimeout):
                            await client.post(f"{base}/v1/completions", json=body, timeout=0.5)
            await asyncio.to_thread(_upload_then_vanish, base)
        router_log = mesh.member("router").log_path
        engine_log = mesh.member("engine-0").log_path

        def logged() -> bool:
            return (router_log.read_text().count("client disconnected") >= 3
                    and engine_log.read_text().count("client disconnected") >= 5)  # 3 direct + 2 via the router

        wait_until(logged, 15, "disconnect lines in the router and engine logs")
        for path in (router_log, engine_log):
            text = path.read_text(errors="replace")
            assert "while sending the request" in text, (path, text[-2000:])
            assert "Traceback" not in text and "Exception in ASGI application" not in text, (path, text[-4000:])
