"""A service started on an address that is taken exits at once with one clear line and status 1.

``python -m services.<name>`` with its gRPC, HTTP, metrics, ext_proc or ZMQ port held by another
socket: stderr ends with ``<name>: cannot listen ...`` naming the address (and the flag to change),
no traceback anywhere in the output, exit status 1 (not a hang, not 0). Four processes run at a
time (each is a real start-up: config, logging, etcd, the listeners in their order).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Iterator

import pytest

CASES = [
    # (id, service, flag naming the taken port (value appended), listener named in the line, flag hinted)
    ("router-grpc", "router", "--grpc-port", "grpc", "--grpc-port"),
    ("router-http", "router", "--http-port", "http", "--http-port"),
    ("router-metrics", "router", "--metrics-port", "metrics", "--metrics-port"),
    ("epp-grpc", "epp", "--grpc-port", "grpc", "--grpc-port"),
    ("epp-ext-proc", "epp", "--ext-proc-port", "ext-proc", "--ext-proc-port"),
    ("flow_control-grpc", "flow_control", "--grpc-port", "grpc", "--grpc-port"),
    ("kv_indexer-grpc", "kv_indexer", "--grpc-port", "grpc", "--grpc-port"),
    ("kv_indexer-zmq", "kv_indexer", "--events-bind-endpoint", "", ""),
    ("kv_store-grpc", "kv_store", "--grpc-port", "grpc", "--grpc-port"),
    ("kv_store-replay-zmq", "kv_store", "--events-replay-endpoint", "", ""),
]


@pytest.fixture
def taken() -> Iterator[int]:
    """A port some other socket listens on (127.0.0.1)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _args(service: str, flag: str, port: int) -> list[str]:
    value = f"tcp://127.0.0.1:{port}" if "endpoint" in flag else str(port)
    base = ["--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0", "--shutdown-grace-seconds", "0.2"]
    if service == "router":
        base += ["--http-port", "0"]
    if service == "kv_indexer":
        base += ["--events-bind-endpoint", "tcp://127.0.0.1:0"]
    if service == "kv_store" and flag == "--events-replay-endpoint":
        base += ["--events-endpoint", "tcp://127.0.0.1:0", "--events-model", "m"]
    return [*base, flag, value]  # the later flag wins


async def _run(service: str, args: list[str], etcd: str, slots: asyncio.Semaphore) -> tuple[int, str]:
    async with slots:
        return await _run_one(service, args, etcd)


async def _run_one(service: str, args: list[str], etcd: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "faulthandler", "-m", f"services.{service}", *args, "--etcd-endpoints", etcd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert proc.stdout is not None
    chunks: list[bytes] = []

    async def drain() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            chunks.append(chunk)

    reader = asyncio.create_task(drain())
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 60)
    except TimeoutError:  # a hang: SIGABRT makes faulthandler print every thread's stack into the output
        proc.send_signal(signal.SIGABRT)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        await asyncio.wait_for(reader, 10)
        return -1, b"".join(chunks).decode(errors="replace")
    await asyncio.wait_for(reader, 10)
    return proc.returncode or 0, b"".join(chunks).decode(errors="replace")


async def test_port_in_use_is_one_line_and_exit_1(taken: int, etcd: str) -> None:
    slots = asyncio.Semaphore(4)  # a few at once: the machine's cores are shared
    results = await asyncio.gather(*(_run(c[1], _args(c[1], c[2], taken), etcd, slots) for c in CASES))
    for (case, service, _, what, hint), (rc, output) in zip(CASES, results, strict=True):
        last = output.strip().splitlines()[-1] if output.strip() else ""
        assert rc == 1, f"{case}: rc={rc}\n{output[-2000:]}"
        assert "Traceback" not in output, f"{case}:\n{output[-3000:]}"
        assert last.startswith(f"{service}: cannot listen"), f"{case}: {last}"
        assert str(taken) in last and ("in use" in last.lower()), f"{case}: {last}"
        if what:
            assert f"for {what} on 127.0.0.1:{taken}" in last and hint in last, f"{case}: {last}"
