"""The engine simulator's offload connector against real kv_store, kv_indexer and etcd processes.

``python -m engine_simulator --offload cpu+kv_store --kv-stores <kv_store>``: blocks the engine fills are
put to kv_store (gRPC ``Put`` with the block's vLLM 0.32 ``BlockStored``), kv_store publishes them to
kv_indexer, and a conversation evicted from the engine's GPU pool (and from its one-block CPU tier) comes
back with its prefix loaded from kv_store (``cached_tokens``) instead of recomputed. Before a load the engine
confirms the blocks with kv_store's batched ``Lookup`` (vLLM 0.32's deferred lookup, ``LookupResult.RETRY``):
blocks kv_store lost are recomputed and written again, and kv_store down means recompute, never a hang.
Offload semantics: vLLM 0.32's OffloadingConnector (see ``engine_simulator/offload.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import pytest

from engine_simulator.offload import kv_store_key
from engine_simulator.tokenizer import ensure_tokenizer
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as ipb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as spb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from kvmesh_cli.report import parse_prometheus_counter
from tests.support import wait_until_async

pytestmark = pytest.mark.integration

MODEL = "tiny"
B = 16
A = list(range(3, 3 + 4 * B + 3))  # 4 full blocks + 3 tokens
OTHER = list(range(1000, 1000 + 4 * B + 3))
BIG = list(range(1500, 1500 + 6 * B + 8))  # 7 blocks: all the usable GPU pool, so every other block is evicted


def start_engine(run_dir: Path, store: str, etcd: str = "", events: str = "") -> tuple[ManagedProcess, str]:
    """A simulator with an 8-block GPU pool, a one-block CPU tier and kv_store at ``store``."""
    port = free_port()
    extra = [*(("--etcd-endpoints", etcd, "--lease-ttl-seconds", "5") if etcd else ()),
             *(("--events-endpoint", events) if events else ())]
    engine = ManagedProcess(
        f"engine-offload-{port}",
        python_module(
            "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
            "--block-size-tokens", str(B), "--num-gpu-blocks", "8", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--max-model-len", "2048", *extra,
            "--tokenizer-path", str(ensure_tokenizer(str(run_dir / "tokenizer"))),
            "--offload", "cpu+kv_store", "--kv-stores", store, "--offload-cpu-blocks", "1",
        ),
        run_dir / f"engine-offload-{port}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health", 30.0)
    return engine, url


async def counter(client: httpx.AsyncClient, url: str, name: str) -> float:
    return parse_prometheus_counter((await client.get(f"{url}/metrics")).text, name)


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> int:
    r = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_evicted_prefix_is_loaded_from_kv_store_and_visible_to_routing(
    start_service, etcd: str, run_dir: Path
) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    _, indexer = start_service("kv_indexer", "--events-bind-endpoint", bind, "--event-workers", "1")
    _, store = start_service("kv_store", "--events-endpoint", bind, "--events-model", MODEL,
                             "--events-block-size-tokens", str(B))
    port = free_port()
    engine = ManagedProcess(
        f"engine-offload-{port}",
        python_module(
            "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
            "--block-size-tokens", str(B), "--num-gpu-blocks", "8", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--max-model-len", "2048", "--events-endpoint", bind,
            "--etcd-endpoints", etcd, "--lease-ttl-seconds", "5",
            "--tokenizer-path", str(ensure_tokenizer(str(run_dir / "tokenizer"))),
            "--offload", "cpu+kv_store", "--kv-stores", store, "--offload-cpu-blocks", "1",
        ),
        run_dir / f"engine-offload-{port}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    hashes = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(A, B)]
    keys = [kv_store_key(MODEL, B, h) for h in hashes]
    channel_s = grpc.aio.insecure_channel(store)
    channel_i = grpc.aio.insecure_channel(indexer)
    try:
        wait_http_ok(f"{url}/health", 30.0)
        kv = kv_store_pb2_grpc.KVStoreStub(channel_s)
        index = kv_indexer_pb2_grpc.KVIndexerStub(channel_i)
        async with httpx.AsyncClient(timeout=30) as client:
            assert await complete(client, url, A) == 0
            # the engine's blocks reach kv_store in the background, under the connector's keys
            await wait_until_async(lambda: kv.Lookup(spb.LookupRequest(keys=keys)), 15, "A's blocks in kv_store",
                                   until=lambda r: r.prefix_hits == 4)
            assert await complete(client, url, OTHER) == 0  # a 7-block GPU pool: A's blocks are evicted
            # A comes back: the GPU and the one-block CPU tier miss, kv_store holds all 4 full blocks
            assert await complete(client, url, A) == 4 * B
            assert await complete(client, url, A) == 4 * B  # now a GPU hit again

        # routing sees the engine's prefix on its GPU and through its kv_store (the kv_stores label)
        async def score() -> dict[str, tuple[int, dict[str, int]]]:
            r = await index.Score(ipb.ScoreRequest(model=MODEL, token_ids=A))
            return {s.endpoint_id: (s.matched_blocks, dict(s.matched_blocks_by_medium)) for s in r.scores}

        got = await wait_until_async(score, 15, "the engine's GPU and kv_store copies in Score",
                                     until=lambda s: s.get(f"127.0.0.1:{port}", (0, {}))[1].get("CPU") == 4)
        assert got[f"127.0.0.1:{port}"][0] == 4
        assert got[f"127.0.0.1:{port}"][1].get("GPU") == 4
        assert store not in got  # a kv_store is a source, never scored
    finally:
        await channel_s.close()
        await channel_i.close()
        engine.stop()


async def test_blocks_kv_store_lost_are_recomputed_and_written_again(start_service, etcd: str, run_dir: Path) -> None:
    """kv_store drops A's blocks (as an eviction or a restart would): the engine, having put them, asks kv_store
    before loading, finds them gone, recomputes A (0 cached tokens, not a phantom hit) and writes them again."""
    _, store = start_service("kv_store", "--events-model", MODEL, "--events-block-size-tokens", str(B))
    engine, url = start_engine(run_dir, store, etcd)
    keys = [kv_store_key(MODEL, B, external_hash_to_int(d)) for d in sha256_cbor_block_hashes(A, B)]
    channel = grpc.aio.insecure_channel(store)
    kv = kv_store_pb2_grpc.KVStoreStub(channel)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert await complete(client, url, A) == 0
            await wait_until_async(lambda: kv.Lookup(spb.LookupRequest(keys=keys)), 15, "A's blocks in kv_store",
                                   until=lambda r: r.prefix_hits == 4)
            assert await complete(client, url, BIG) == 0  # A leaves the GPU (and the one-block CPU tier)
            for key in keys:
                await kv.Delete(spb.DeleteRequest(key=key))
            assert await complete(client, url, A) == 0  # recomputed: kv_store said they are gone
            assert await counter(client, url, "kvmesh_sim_offload_remote_missing_blocks_total") == 4
            assert await counter(client, url, "vllm:external_prefix_cache_hits_total") == 0
            await wait_until_async(lambda: kv.Lookup(spb.LookupRequest(keys=keys)), 15, "A written to kv_store again",
                                   until=lambda r: r.prefix_hits == 4)
            assert await complete(client, url, [t + 200 for t in BIG]) == 0  # evicts A again
            assert await complete(client, url, A) == 4 * B  # and loaded from there once more
    finally:
        await channel.close()
        engine.stop()


async def test_kv_store_down_means_recompute_not_a_hang(start_service, etcd: str, run_dir: Path) -> None:
    """kv_store stops after taking A's blocks: A's next turn is recomputed within the lookup deadline, counted."""
    store_proc, store = start_service("kv_store", "--events-model", MODEL, "--events-block-size-tokens", str(B))
    engine, url = start_engine(run_dir, store, etcd)
    keys = [kv_store_key(MODEL, B, external_hash_to_int(d)) for d in sha256_cbor_block_hashes(A, B)]
    channel = grpc.aio.insecure_channel(store)
    kv = kv_store_pb2_grpc.KVStoreStub(channel)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert await complete(client, url, A) == 0
            await wait_until_async(lambda: kv.Lookup(spb.LookupRequest(keys=keys)), 15, "A's blocks in kv_store",
                                   until=lambda r: r.prefix_hits == 4)
            assert await complete(client, url, BIG) == 0
            store_proc.stop()
            t0 = time.monotonic()
            assert await complete(client, url, A) == 0
            assert time.monotonic() - t0 < 10.0
            assert await counter(client, url, "kvmesh_sim_offload_remote_lookup_failures_total") >= 1
            assert (await client.get(f"{url}/health")).status_code == 200
    finally:
        await channel.close()
        engine.stop()
