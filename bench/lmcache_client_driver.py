"""Runs in ``.venv-lmcache`` (lmcache 0.5.6), started by ``bench/lmcache_bench.py``: LMCache's own
``lm://`` client (``LMCServerConnector``) timing put and get of KV chunks against several servers,
interleaved request by request (the servers alternate, in a rotating order, so load drifts hit them alike).

    python bench/lmcache_client_driver.py --servers kv_store=PORT,lmcache=PORT --tokens 1024,2048 \
        --iterations 30 --rounds 3

Prints one JSON object: ``{"<server>": {"<bytes>": {"put": [ms...], "get": [ms...]}}}``.

* put: ``connector.put()`` (header + payload sent; the protocol has no reply to a put) then
  ``connector.exists()`` until it answers: the time until the value is visible, as an engine's next
  lookup would see it.
* get: ``connector.get()`` of a stored key: request, reply header, payload received into a
  ``LocalCPUBackend`` buffer (what LMCache's ``RemoteBackend.get_blocking`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import torch
from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

HIDDEN = 128


def rotated(items: list[tuple[str, int]], i: int) -> list[tuple[str, int]]:
    return items[i % len(items) :] + items[: i % len(items)]


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--servers", required=True, help="name=port,...")
    parser.add_argument("--tokens", default="512,1024,2048,4096", help="chunk sizes in tokens (bf16: 512 B/token)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main() -> int:
    args = build_parser().parse_args()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):  # the connector's coroutines run on its loop, as LMCache's RemoteBackend runs them
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)

    config = lmcache_get_or_create_config()
    metadata = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(1, 2, 256, 1, HIDDEN),
    )  # fmt: skip
    backend = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
    servers = [(name, int(port)) for name, port in (item.split("=") for item in args.servers.split(","))]
    conns = {name: LMCServerConnector("127.0.0.1", port, loop, backend) for name, port in servers}
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    values = {}
    for t in tokens:
        obj = backend.allocate(torch.Size([2, 1, t, HIDDEN]), torch.bfloat16, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape, dtype=torch.bfloat16))
        values[t] = obj  # the same bytes go to every server
    results: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name, _ in servers}
    seq = 0
    for round_no in range(args.rounds):
        for t in tokens:
            obj = values[t]
            payload = bytes(obj.byte_array)
            keys: dict[str, list[CacheEngineKey]] = {name: [] for name, _ in servers}
            # request by request, the servers alternate (rotating who goes first): load drifts hit both alike
            for i in range(args.iterations):
                for name, _ in rotated(servers, i):
                    cell = results[name].setdefault(str(len(payload)), {"put": [], "get": []})
                    seq += 1
                    key = CacheEngineKey("bench", 1, 0, seq, torch.bfloat16)
                    start = time.perf_counter()
                    run(conns[name].put(key, obj))
                    while not run(conns[name].exists(key)):
                        pass
                    cell["put"].append((time.perf_counter() - start) * 1e3)
                    keys[name].append(key)
            for i in range(args.iterations):
                for name, _ in rotated(servers, i):
                    key = keys[name][i]
                    start = time.perf_counter()
                    got = run(conns[name].get(key))
                    elapsed = (time.perf_counter() - start) * 1e3
                    if got is None or bytes(got.byte_array) != payload:
                        print(f"{name}: get of {key.to_string()} returned wrong bytes", file=sys.stderr)
                        return 1
                    got.ref_count_down()
                    results[name][str(len(payload))]["get"].append(elapsed)
        print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for conn in conns.values():
        run(conn.close())
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
