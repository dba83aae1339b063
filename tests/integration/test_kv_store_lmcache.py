"""kv_store's ``lm://`` listener against the real LMCache client: lmcache 0.5.6 (``make lmcache-venv``).

Matches lmcache 0.5.6's remote-server protocol (``lmcache/v1/protocol.py``, the ``lm://`` server
``python -m lmcache.v1.server`` and its client ``LMCServerConnector``).

* ``python -m lmcache.v1.basic_check --mode test_remote`` with ``LMCACHE_REMOTE_URL=lm://...`` (LMCache's
  own remote-storage check: exists of absent keys, puts, exists, gets with content validation) against
  kv_store, run from ``.venv-lmcache`` as a subprocess;
* ``lmcache_client_check.py`` in the same venv: LMCache's ``LMCServerConnector`` puts and gets KV
  chunks of 4 KiB to 2 MiB (bytes, shape, dtype and format round-trip), a miss, ``exists``; and reads
  two values the test put over gRPC (one with kv_store's LMCache envelope, one raw bytes);
* cross-protocol: every value put over ``lm://`` read back through kv_store's gRPC ``Get`` under
  ``lmcache/<key>``, the envelope plus the payload;
* bad input (no LMCache needed, always runs): an unknown command, a negative length, a truncated
  header or payload each close their connection with a metric; an oversize ``PUT`` (its payload
  skipped), a non-UTF-8 or unparsable key, an unknown format (answered ``FAIL``) are counted and the
  connection kept; ``LIST`` answers the keys held; the listener and gRPC keep serving.

The LMCache cases skip with the reason when ``.venv-lmcache`` is absent, unless ``KVMESH_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import ManagedProcess
from services.kv_store.lmcache_protocol import (
    REPLY_BYTES,
    REQUEST,
    LmCacheKey,
    LmCommand,
    LmRequest,
    LmReturnCode,
    MemoryFormat,
    ValueMeta,
    decode_reply,
    encode_envelope,
    encode_request,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_VENV = ROOT / ".venv-lmcache"
LMCACHE_PYTHON = LMCACHE_VENV / "bin" / "python"
CLIENT_SCRIPT = Path(__file__).with_name("lmcache_client_check.py")
MIB = 1024 * 1024


def lmcache_missing() -> str | None:
    site = LMCACHE_VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not LMCACHE_PYTHON.exists() or not (site / "lmcache").is_dir():
        return f"{LMCACHE_VENV} missing: run `make lmcache-venv` (lmcache 0.5.6, ~2 GB)"
    return None


def require_lmcache() -> None:
    reason = lmcache_missing()
    if reason is None:
        return
    if os.environ.get("KVMESH_REQUIRE_LMCACHE") == "1":
        pytest.fail(f"KVMESH_REQUIRE_LMCACHE=1 but {reason}")
    pytest.skip(reason)


def ports_of(proc: ManagedProcess) -> dict[str, int]:
    """The ports the process wrote to its ``--ports-file`` (the conftest's file beside its log)."""
    ports: dict[str, int] = json.loads(proc.log_path.with_suffix(".json").read_text())
    return ports


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
    return text


def client_key(name: str) -> LmCacheKey:
    """The key ``lmcache_client_check.py`` derives for ``name`` (a bfloat16 CacheEngineKey)."""
    return LmCacheKey("kvmesh-check", 1, 0, int(hashlib.sha256(name.encode()).hexdigest()[:30], 16), "bfloat16")


def lmcache_env(port: int) -> dict[str, str]:
    return {
        **os.environ,
        "LMCACHE_TRACK_USAGE": "false",
        "LMCACHE_DISABLE_BANNER": "1",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.1",  # GB; the default 5 GB takes a minute to set up
        "LMCACHE_REMOTE_URL": f"lm://127.0.0.1:{port}",
    }


def run_lmcache_processes(lm_port: int, outdir: Path, expect: str) -> list[tuple[int, str]]:
    """LMCache's remote check and our client script, both at once (most of each one's time is
    importing torch and lmcache): [(exit status, output)] in that order."""
    env = lmcache_env(lm_port)
    argvs = [
        [str(LMCACHE_PYTHON), "-m", "lmcache.v1.basic_check", "--mode", "test_remote"],
        [str(LMCACHE_PYTHON), str(CLIENT_SCRIPT), "127.0.0.1", str(lm_port), str(outdir), "--expect", expect],
    ]
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=outdir)
        for argv in argvs
    ]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=360)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        results.append((proc.returncode, out))
    return results


@pytest.mark.lmcache
@pytest.mark.timeout(420)
async def test_real_lmcache_client_against_kv_store(start_service, tmp_path: Path) -> None:
    require_lmcache()
    proc, address = start_service("kv_store", "--lmcache-port", "0", "--cpu-capacity-bytes", str(256 * MIB))
    ports = ports_of(proc)
    lm_port = ports["lmcache"]

    raw = os.urandom(3000)  # put over gRPC without an envelope: served as BINARY_BUFFER bytes
    kv = os.urandom(2 * 1 * 16 * 128 * 2)  # enveloped over gRPC: served as a bfloat16 KV_2LTD chunk
    kv_meta = ValueMeta(len(kv), MemoryFormat.KV_2LTD, 3, (2, 1, 16, 128))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for name, value in (("grpc-raw", raw), ("grpc-kv", encode_envelope(kv_meta) + kv)):

            async def one(key: str = client_key(name).store_key(), value: bytes = value):  # type: ignore[no-untyped-def]
                yield pb.PutRequest(key=key, total_bytes=len(value), data=value)

            await stub.Put(one())

    expect = ",".join(
        f"{name}={hashlib.sha256(value).hexdigest()}" for name, value in (("grpc-raw", raw), ("grpc-kv", kv))
    )
    (basic_rc, basic_out), (client_rc, client_out) = await asyncio.get_running_loop().run_in_executor(
        None, run_lmcache_processes, lm_port, tmp_path, expect
    )
    basic_lines = [line for line in basic_out.splitlines() if "garbage collected" not in line]
    basic_tail = "\n".join(basic_lines[-40:])

    # LMCache's own remote check: 5 puts, exists false before and true after, 5 gets with correct content
    assert basic_rc == 0, basic_tail
    assert "Test Failed" not in basic_out, basic_tail
    assert "Validation (content correct): 5/5 passed (100.0%)" in basic_out, basic_tail
    rows = {line.split("|")[1].strip(): line for line in basic_lines if line.startswith("| ")}
    for op in ("EXISTS (non-exist)", "PUT", "EXISTS (exist)", "GET"):
        assert "5/5" in rows[op], basic_tail

    # our own client script on LMCache's connector: sizes, metadata, miss, exists, gRPC-put values
    assert client_rc == 0 and "LMCACHE-CLIENT-OK" in client_out.splitlines(), client_out[-4000:]
    assert "read grpc-raw: 3000 bytes fmt=BINARY_BUFFER shape=[3000, 0, 0, 0]" in client_out, client_out[-4000:]
    assert "read grpc-kv: 8192 bytes fmt=KV_2LTD shape=[2, 1, 16, 128]" in client_out, client_out[-4000:]

    # cross-protocol: what LMCache put is in the store under lmcache/<key>: envelope + the same bytes
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [m["bytes"] for m in manifest] == [4096, 256 * 1024, 512 * 1024, MIB, 2 * MIB]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for m in manifest:
            key = LmCacheKey.parse(m["key"]).store_key()
            assert key == "lmcache/" + m["key"]
            got = b"".join([r.data async for r in stub.Get(pb.GetRequest(key=key))])
            payload = (tmp_path / m["file"]).read_bytes()
            assert got == encode_envelope(ValueMeta(m["bytes"], m["fmt"], m["dtype"], tuple(m["shape"]))) + payload

    text = metrics_text(ports["metrics"])
    assert 'kvmesh_kv_store_lmcache_requests_total{command="put",result="stored"} 10.0' in text  # 5 + 5
    assert 'kvmesh_kv_store_lmcache_requests_total{command="get",result="miss"} 1.0' in text
    # the client script's refused put (a key with "@" in its model name) and its exists: counted, connection kept
    assert "refused put: connection kept, next get served" in client_out, client_out[-4000:]
    assert 'kvmesh_kv_store_lmcache_protocol_errors_total{reason="bad_key"} 2.0' in text
    assert 'kvmesh_kv_store_lmcache_requests_total{command="put",result="refused"} 1.0' in text
    assert 'kvmesh_kv_store_lmcache_requests_total{command="exist",result="refused"} 1.0' in text


def _header(
    command: int, length: int = 0, key: bytes = b"m@1@0@ff@half", fmt: int = 1, dtype: int = 2, dim0: int = 0
) -> bytes:
    """A request header built by hand (bad fields, non-canonical keys): ``dim0`` is the shape's first dimension."""
    return REQUEST.pack(command, length, fmt, dtype, 0, dim0, 0, 0, 0, key.ljust(150))


def _closed(port: int, frame: bytes, close_write: bool = False) -> bool:
    """Send ``frame``; True when the server closed the connection (EOF or reset) without a reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        try:
            return sock.recv(64) == b""
        except ConnectionResetError:
            return True


def _exchange(sock: socket.socket, frame: bytes, payload: int = 0) -> tuple[bytes, bytes]:
    sock.sendall(frame)
    data = b""
    while len(data) < REPLY_BYTES + payload:
        chunk = sock.recv(REPLY_BYTES + payload - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data[:REPLY_BYTES], data[REPLY_BYTES:]


async def test_bad_lm_frames_are_counted_and_the_service_stays_up(start_service) -> None:
    proc, address = start_service("kv_store", "--lmcache-port", "0", "--cpu-capacity-bytes", str(4 * MIB))
    ports = ports_of(proc)
    port = ports["lmcache"]

    def run_checks() -> None:
        # framing lost: the connection is closed
        assert _closed(port, _header(9))  # unknown command
        assert _closed(port, _header(1, length=-5))  # negative length
        assert _closed(port, _header(2)[:100], close_write=True)  # truncated header
        assert _closed(port, _header(1, length=1000) + b"x" * 10, close_write=True)  # truncated payload
        # framing intact: refused (a PUT's payload skipped, a GET answered FAIL), the connection kept
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(_header(1, length=6 * MIB) + bytes(6 * MIB))  # a PUT larger than the first tier (4 MiB)
            for bad in (
                _header(2, key=b"\xff\xfe@1@0@ff@half"),  # key not UTF-8
                _header(2, key=b"no-at-signs"),  # key does not parse
                _header(2, fmt=99),  # unknown memory format
            ):
                refused, _ = _exchange(sock, bad)
                assert decode_reply(refused).code is LmReturnCode.FAIL
            health, _ = _exchange(sock, _header(5))
            assert decode_reply(health).code is LmReturnCode.SUCCESS

        key = LmCacheKey.parse("m@1@0@00FF@half")
        assert key.canonical() == "m@1@0@ff@half"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            health, _ = _exchange(sock, encode_request(LmRequest(LmCommand.HEALTH, key, ValueMeta(0))))
            assert decode_reply(health).code is LmReturnCode.SUCCESS
            meta = ValueMeta(5, MemoryFormat.BINARY, 6, (5, 0, 0, 0))
            sock.sendall(_header(1, length=5, key=b"m@1@0@00FF@half", fmt=4, dtype=6, dim0=5) + b"hello")  # no reply to PUT
            hit, payload = _exchange(sock, encode_request(LmRequest(LmCommand.GET, key, ValueMeta(0))), 5)
            assert (decode_reply(hit).code, decode_reply(hit).meta, payload) == (LmReturnCode.SUCCESS, meta, b"hello")
            exist, _ = _exchange(sock, encode_request(LmRequest(LmCommand.EXIST, key, ValueMeta(0))))
            assert decode_reply(exist).code is LmReturnCode.SUCCESS
            # LIST: SUCCESS + the "\n"-joined key strings (upstream's commented-out reply; its server sends none)
            listing = b"m@1@0@ff@half"
            listed, names = _exchange(sock, encode_request(LmRequest(LmCommand.LIST, key, ValueMeta(0))), len(listing))
            assert (decode_reply(listed).code, decode_reply(listed).meta.length, names) == (
                LmReturnCode.SUCCESS, len(listing), listing,
            )  # fmt: skip

    await asyncio.get_running_loop().run_in_executor(None, run_checks)
    async with grpc.aio.insecure_channel(address) as channel:  # gRPC unaffected; the lm:// PUT is visible
        stub = pb_grpc.KVStoreStub(channel)
        got = b"".join([r.data async for r in stub.Get(pb.GetRequest(key="lmcache/m@1@0@ff@half"))])
        assert got == encode_envelope(ValueMeta(5, MemoryFormat.BINARY, 6, (5, 0, 0, 0))) + b"hello"

    text = metrics_text(ports["metrics"])
    for reason, count in (("bad_command", 1), ("bad_length", 1), ("oversize", 1), ("bad_key", 2), ("bad_field", 1)):
        assert f'kvmesh_kv_store_lmcache_protocol_errors_total{{reason="{reason}"}} {count}.0' in text, text
    assert 'kvmesh_kv_store_lmcache_protocol_errors_total{reason="truncated"} 2.0' in text
    assert 'kvmesh_kv_store_lmcache_requests_total{command="list",result="ok"} 1.0' in text
    assert proc.proc is not None and proc.proc.poll() is None
