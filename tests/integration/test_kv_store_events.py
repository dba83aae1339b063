"""kv_store visible to routing: real etcd, kv_indexer and kv_store processes, vLLM 0.32 KV events.

kv_store publishes its residency (``CPU``, ``DISK``, ``SHARED``) on vLLM 0.32's ZMQ wire with
sequence numbers and a replay ROUTER, registers under ``/kvmesh/v1/kv_sources/``; kv_indexer
subscribes, and Score/Lookup count the kv_store's blocks for the engine whose ``kv_stores`` label
names it (and, for SHARED blocks, for engines of another kv_store on the same shared path).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import msgspec
import pytest

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as ipb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as spb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc
from kvmesh.kv_events import BlockStored
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import KV_STORES_LABEL, Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.epp.kv_indexer_client import GrpcPrefixIndex
from tests.support import wait_until_async

MODEL = "tiny"
B = 4
BLOCKS = 6
TOKENS = list(range(1000, 1000 + BLOCKS * B))
VALUE = 1000  # bytes per block value


def block_event(i: int) -> bytes:
    event = BlockStored(
        block_hashes=[500 + i], parent_block_hash=None if i == 0 else 499 + i,
        token_ids=TOKENS[i * B : (i + 1) * B], block_size=B,
    )
    return msgspec.msgpack.encode(event)


async def put(stub: kv_store_pb2_grpc.KVStoreStub, i: int) -> None:
    async def requests() -> AsyncIterator[spb.PutRequest]:
        yield spb.PutRequest(key=f"vllm:{MODEL}:{B}:{500 + i:016x}", total_bytes=VALUE, data=bytes([i]) * VALUE,
                             block_stored_event=block_event(i))
    await stub.Put(requests())


def engine(port: int, stores: str) -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=MODEL,
                    block_size_tokens=B, labels={KV_STORES_LABEL: stores}, instance_id="boot")


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "lustre"
    path.mkdir()
    yield path


async def scores(stub: kv_indexer_pb2_grpc.KVIndexerStub) -> dict[str, tuple[int, dict[str, int]]]:
    response = await stub.Score(ipb.ScoreRequest(model=MODEL, token_ids=TOKENS))
    return {s.endpoint_id: (s.matched_blocks, dict(s.matched_blocks_by_medium)) for s in response.scores}


async def test_kv_store_residency_reaches_scores_per_medium(start_service, etcd: str, tmp_path: Path, shared: Path) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    _, indexer_address = start_service("kv_indexer", "--events-bind-endpoint", bind, "--event-workers", "1")
    common = ("--events-endpoint", bind, "--events-model", MODEL, "--events-block-size-tokens", str(B),
              "--shared-path", str(shared))
    # CPU holds 3 values, disk 2, then the shared FS: puts of 6 blocks spill down the tiers
    store_a, address_a = start_service(
        "kv_store", *common, "--cpu-capacity-bytes", str(3 * VALUE),
        "--disk-path", str(tmp_path / "nvme"), "--disk-capacity-bytes", str(2 * VALUE), "--instance-id", "a")
    _, address_b = start_service("kv_store", *common, "--instance-id", "b")
    e1, e2, e3 = engine(free_port(), address_a), engine(free_port(), address_b), engine(free_port(), "")
    regs = [LeaseRegistration([etcd], endpoint_key(e), e.to_json(), ttl_seconds=5) for e in (e1, e2, e3)]
    for reg in regs:
        await reg.start()
    channel_i = grpc.aio.insecure_channel(indexer_address)
    channel_a = grpc.aio.insecure_channel(address_a)
    index = kv_indexer_pb2_grpc.KVIndexerStub(channel_i)
    store = kv_store_pb2_grpc.KVStoreStub(channel_a)
    try:
        for i in range(BLOCKS):
            await put(store, i)
        # blocks 0 fell off the disk to the shared FS, 1-2 on disk, 3-5 in CPU
        want_a = (BLOCKS, {"CPU": 3, "DISK": 2, "SHARED": 1})
        got = await wait_until_async(lambda: scores(index), 20, "kv_store A's residency in Score",
                                     until=lambda s: s.get(e1.id) == want_a)
        assert address_a not in got and address_b not in got  # sources are never scored
        assert e3.id not in got  # reaches no kv_store
        # E2's kv_store B mounts the same shared path: block 0 (SHARED) is reachable, block 1 is not
        assert got[e2.id] == (1, {"SHARED": 1})
        # the engines hold none of it themselves: every matched block is one only a kv_store holds
        response = await index.Score(ipb.ScoreRequest(model=MODEL, token_ids=TOKENS))
        assert {s.endpoint_id: s.reached_blocks for s in response.scores} == {e1.id: BLOCKS, e2.id: 1}
        epp_view = GrpcPrefixIndex(indexer_address, 5.0)  # epp's reading of it
        try:
            match = await epp_view.score(MODEL, TOKENS, [])
        finally:
            await epp_view.close()
        assert match.reached_blocks == {e1.id: BLOCKS, e2.id: 1} and match.held(e1.id) == 0

        lookup = await index.Lookup(ipb.LookupRequest(model=MODEL, token_ids=TOKENS))
        assert {h.endpoint_id for h in lookup.blocks[0].holders} == {e1.id, e2.id}
        assert {h.endpoint_id for h in lookup.blocks[5].holders} == {e1.id}

        # a hit on disk is promoted: a store on CPU then a removal from DISK, never a lost block
        got_value = [m async for m in store.Get(spb.GetRequest(key=f"vllm:{MODEL}:{B}:{501:016x}"))]
        assert got_value[0].total_bytes == VALUE
        # the index agrees with the store's own view of where each block is (its Lookup)
        held = await store.Lookup(spb.LookupRequest(keys=[f"vllm:{MODEL}:{B}:{500 + i:016x}" for i in range(BLOCKS)]))
        media = [common_pb2.Medium.Name(m).removeprefix("MEDIUM_") for m in held.medium]
        want: dict[str, int] = {}
        for name in media:
            want[name] = want.get(name, 0) + 1
        # a swap: the hit (block 1) is on CPU now and CPU's oldest (block 3) took its place on disk, so the
        # per-medium counts are what they were; the index must agree block by block
        assert held.prefix_hits == BLOCKS and media[1] == "CPU" and media[3] == "DISK" and want == want_a[1]

        async def media_in_index() -> list[str]:
            found = await index.Lookup(ipb.LookupRequest(model=MODEL, token_ids=TOKENS))
            return [next((common_pb2.Medium.Name(h.medium).removeprefix("MEDIUM_")
                          for h in block.holders if h.endpoint_id == e1.id), "") for block in found.blocks]

        await wait_until_async(media_in_index, 10, "promotion seen block by block", until=lambda got: got == media)
        assert (await scores(index)).get(e1.id) == (BLOCKS, want)
        stats = await index.Stats(ipb.StatsRequest())
        states = {p.endpoint_id: p.state for p in stats.per_endpoint}
        assert states[address_a] == "live" and states[address_b] == "live"

        # kv_store A stops: its lease goes, its blocks stop counting at once
        store_a.stop()
        await wait_until_async(lambda: scores(index), 20, "a departed kv_store's blocks no longer count",
                               until=lambda s: e1.id not in s)
    finally:
        for reg in regs:
            await reg.stop()
        await channel_i.close()
        await channel_a.close()


async def test_a_malformed_block_event_is_invalid_argument_and_nothing_is_stored(start_service) -> None:
    _, address = start_service("kv_store", "--events-block-size-tokens", str(B))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kv_store_pb2_grpc.KVStoreStub(channel)
        wrong_size = msgspec.msgpack.encode(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 8, block_size=8))
        for bad in (b"\x01\x02garbage", wrong_size):
            async def requests(event: bytes = bad) -> AsyncIterator[spb.PutRequest]:
                yield spb.PutRequest(key="k", total_bytes=3, data=b"abc", block_stored_event=event)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Put(requests())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (await stub.Contains(spb.ContainsRequest(keys=["k"]))).present[0]


async def test_a_restarted_kv_store_republishes_its_rescanned_disk_blocks(start_service, etcd: str, tmp_path: Path) -> None:
    """kill -9 the kv_store, restart it on the same port and disk path: kv_indexer drops the old
    incarnation's blocks, then counts the rescanned DISK blocks again (the CPU ones died with it)."""
    from kvmesh_cli.launcher import wait_grpc_healthy

    bind = f"tcp://127.0.0.1:{free_port()}"
    _, indexer_address = start_service("kv_indexer", "--events-bind-endpoint", bind, "--event-workers", "1")
    port = free_port()  # fixed, so the restart comes back at the address the engine's label names
    proc, address = start_service(
        "kv_store", "--grpc-port", str(port), "--events-endpoint", bind, "--events-model", MODEL, "--events-block-size-tokens", str(B),
        "--cpu-capacity-bytes", str(2 * VALUE), "--disk-path", str(tmp_path / "nvme"), "--instance-id", "a")
    e1 = engine(free_port(), address)
    reg = LeaseRegistration([etcd], endpoint_key(e1), e1.to_json(), ttl_seconds=5)
    await reg.start()
    channel_i = grpc.aio.insecure_channel(indexer_address)
    index = kv_indexer_pb2_grpc.KVIndexerStub(channel_i)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            store = kv_store_pb2_grpc.KVStoreStub(channel)
            for i in range(BLOCKS):
                await put(store, i)
        assert address == f"127.0.0.1:{port}"
        await wait_until_async(lambda: scores(index), 20, "the first incarnation's residency",
                               until=lambda s: s.get(e1.id) == (BLOCKS, {"CPU": 2, "DISK": 4}))
        proc.kill()
        await wait_until_async(lambda: scores(index), 20, "the killed kv_store's blocks no longer count",
                               until=lambda s: e1.id not in s)
        proc.start()
        try:
            wait_grpc_healthy(address, 30.0)
        except TimeoutError as exc:
            raise RuntimeError(f"the restarted kv_store did not come up:\n{proc.log_tail()}") from exc
        got = await wait_until_async(lambda: scores(index), 20, "the restarted kv_store's rescanned blocks",
                                     until=lambda s: s.get(e1.id) == (4, {"DISK": 4}))
        assert got[e1.id] == (4, {"DISK": 4})
        async with grpc.aio.insecure_channel(address) as channel:
            store = kv_store_pb2_grpc.KVStoreStub(channel)
            value = [m async for m in store.Get(spb.GetRequest(key=f"vllm:{MODEL}:{B}:{500:016x}"))]
            assert value[0].medium == common_pb2.MEDIUM_DISK and b"".join(m.data for m in value) == bytes([0]) * VALUE
        # the hit was promoted: a store on CPU then a removal from DISK reach the index too
        await wait_until_async(lambda: scores(index), 10, "the promotion after the restart",
                               until=lambda s: s.get(e1.id) == (4, {"CPU": 1, "DISK": 3}))
    finally:
        await reg.stop()
        await channel_i.close()
