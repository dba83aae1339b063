"""Runs in ``.venv-lmcache`` (lmcache 0.5.6), driven by ``test_kv_store_lmcache.py``: LMCache's own
``lm://`` client (``LMCServerConnector``, the class its ``RemoteBackend`` builds for ``lm://`` URLs)
against a server given as ``HOST PORT``; puts and gets KV chunks of several sizes, checks a miss and
``exists``, checks bytes, shape, dtype and format round-trip, and writes each payload and its metadata
to ``OUTDIR`` (``manifest.json`` + ``<i>.bin``) so the test can read the same values over gRPC.

``--expect NAME=SHA256,...``: also ``get`` those keys (put by the test over gRPC), check their bytes and
print the format and shape that came back.
Exit status 0 and a last line ``LMCACHE-CLIENT-OK`` on success.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import threading
from pathlib import Path

import torch
from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

HIDDEN = 128  # bfloat16: a chunk of T tokens is 2 * T * 128 * 2 bytes
TOKENS = (8, 512, 1024, 2048, 4096)  # 4 KiB, 256 KiB, 512 KiB, 1 MiB, 2 MiB


def key(name: str) -> CacheEngineKey:
    return CacheEngineKey("kvmesh-check", 1, 0, int(hashlib.sha256(name.encode()).hexdigest()[:30], 16), torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--expect", default="")
    args = parser.parse_args()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):  # the connector's coroutines run on its loop, as LMCache's RemoteBackend runs them
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    config = lmcache_get_or_create_config()
    metadata = LMCacheMetadata(
        model_name="kvmesh-check", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(1, 2, 256, 1, HIDDEN),
    )  # fmt: skip
    backend = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
    conn = LMCServerConnector(args.host, args.port, loop, backend)
    failures: list[str] = []

    manifest = []
    torch.manual_seed(0)
    for i, tokens in enumerate(TOKENS):
        shape = torch.Size([2, 1, tokens, HIDDEN])
        obj = backend.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert obj is not None, "LocalCPUBackend could not allocate"
        obj.tensor.copy_(torch.randn(shape, dtype=torch.bfloat16))
        payload = bytes(obj.byte_array)
        k = key(f"chunk-{i}")
        if run(conn.exists(k)):
            failures.append(f"exists {i} before put: True")
        run(conn.put(k, obj))
        if not run(conn.exists(k)):
            failures.append(f"exists {i} after put: False")
        got = run(conn.get(k))
        if got is None:
            failures.append(f"get {i}: miss after put")
            continue
        if bytes(got.byte_array) != payload:
            failures.append(f"get {i}: bytes differ")
        if (got.get_shape(), got.get_dtype(), got.get_memory_format()) != (shape, torch.bfloat16, MemoryFormat.KV_2LTD):
            failures.append(f"get {i}: metadata {got.get_shape()} {got.get_dtype()} {got.get_memory_format()}")
        (args.outdir / f"{i}.bin").write_bytes(payload)
        manifest.append(
            {"key": k.to_string(), "file": f"{i}.bin", "bytes": len(payload), "fmt": MemoryFormat.KV_2LTD.value,
             "dtype": 3, "shape": list(shape)}
        )  # fmt: skip
        print(f"round trip {len(payload)} bytes ok")
    if run(conn.get(key("never-put"))) is not None:
        failures.append("get of a key never put: not a miss")
    if run(conn.exists(key("never-put"))):
        failures.append("exists of a key never put: True")
    (args.outdir / "manifest.json").write_text(json.dumps(manifest))
    # a put kv_store refuses (a model name with "@": the key string does not parse, upstream's server
    # fails on it too): counted, its payload skipped, and this same connection keeps serving
    bad = CacheEngineKey("kvmesh@bad", 1, 0, 1, torch.bfloat16)
    obj = backend.allocate(torch.Size([2, 1, 8, HIDDEN]), torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None, "LocalCPUBackend could not allocate"
    run(conn.put(bad, obj))
    if run(conn.exists(bad)):
        failures.append("exists of a refused key: True")
    got = run(conn.get(key("chunk-0")))
    if got is None or bytes(got.byte_array) != (args.outdir / "0.bin").read_bytes():
        failures.append("get after a refused put on the same connection: wrong or missing")
    else:
        print("refused put: connection kept, next get served")
    for item in filter(None, args.expect.split(",")):
        name, digest = item.split("=")
        got = run(conn.get(key(name)))
        if got is None:
            failures.append(f"get {name}: miss")
            continue
        data = bytes(got.byte_array)
        print(f"read {name}: {len(data)} bytes fmt={got.get_memory_format().name} shape={list(got.get_shape())}")
        if hashlib.sha256(data).hexdigest() != digest:
            failures.append(f"get {name}: bytes differ")
    run(conn.close())
    for failure in failures:
        print("FAIL", failure)
    if failures:
        return 1
    print("LMCACHE-CLIENT-OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
