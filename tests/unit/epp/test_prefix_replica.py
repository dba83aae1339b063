"""epp's event-fed prefix replica against a real kv_indexer servicer over gRPC (127.0.0.1).

kv_indexer side: a real ``BlockIndexer`` (``InMemoryIndex`` + ``EventPool``) behind ``KVIndexerServicer``
on a grpc.aio server; epp side: ``ReplicaPrefixIndex`` following ``KVIndexer/Watch``. After every
change the replica's local score must equal kv_indexer's own ``Score`` for the same prompt, per-medium
counts included (compared with the servicer's ``Score`` answer over gRPC).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from prometheus_client import REGISTRY

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh.channels import insecure_channel
from kvmesh.hashing import KeyScope, block_keys
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch
from kvmesh.prefix_index import PrefixReplica, ReplicaEndpoint, ReplicaGap
from kvmesh.types import KV_SOURCE_LABEL, KV_STORES_LABEL, SHARED_DOMAINS_LABEL, Endpoint, EndpointId
from services.epp.framework.interfaces import PrefixMatch
from services.epp.kv_indexer_client import GrpcPrefixIndex, ReplicaPrefixIndex
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex, InstrumentedIndex
from services.kv_indexer.index.residency import ResidencyLog
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.servicer import add_servicer

A = EndpointId("127.0.0.1:9001")
B = EndpointId("127.0.0.1:9002")
C = EndpointId("127.0.0.1:9003")
BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4


def endpoint(eid: str, instance: str = "boot-1") -> Endpoint:
    return Endpoint(id=EndpointId(eid), url=f"http://{eid}", model="m", block_size_tokens=BS, instance_id=instance)


class NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


def hashes(prefix: int, n: int, start: int = 0) -> list[int]:
    return [prefix * 1000 + i for i in range(start, start + n)]


class Rig:
    def __init__(self, indexer: BlockIndexer, pool: EventPool, address: str) -> None:
        self.indexer = indexer
        self.pool = pool
        self.address = address
        self.seq: dict[str, int] = {}

    async def send(self, eid: str, *events: KVEvent) -> None:
        seq = self.seq.get(eid, 0)
        self.seq[eid] = seq + 1
        payload = encode_batch(EventBatch(ts=1.0, events=list(events), data_parallel_rank=0))
        self.pool.submit(RawMessage(EndpointId(eid), "m", seq, payload))
        await self.pool.drained()

    def truth(self, tokens: list[int] = PROMPT, scope: KeyScope | None = None) -> dict[str, int]:
        answer = self.indexer.score("m", tokens, None, scope or KeyScope())
        return {s.endpoint_id: s.matched_blocks for s in answer.result.scores}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    index = InstrumentedIndex(InMemoryIndex())
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, NoFeed())
    pool.start()
    server = grpc.aio.server()
    add_servicer(server, indexer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Rig(indexer, pool, f"127.0.0.1:{port}")
    finally:
        await server.stop(0)
        await pool.shutdown()


def scores_total(path: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_epp_prefix_index_scores_total", {"path": path}) or 0.0


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def local(replica: ReplicaPrefixIndex, tokens: list[int] = PROMPT, scope: KeyScope | None = None) -> dict[str, int]:
    before = replica.local_scores
    match = await replica.score_scoped("m", tokens, [], scope or KeyScope())
    assert replica.local_scores == before + 1, "scored through the RPC, not the replica"
    return match.matched_blocks


async def converge(rig: Rig, replica: ReplicaPrefixIndex, tokens: list[int] = PROMPT) -> dict[str, int]:
    """Wait until the replica has seen everything the index logged, then compare scores."""
    log = rig.indexer.open_residency()
    assert log is not None
    await until(lambda: replica.replica.synced and replica.replica.seq == log.seq)
    await asyncio.sleep(0.06)  # membership changes wake the Watch stream at once (other state changes: its 0.25 s poll)
    truth = rig.truth(tokens)
    assert await local(replica, tokens) == truth
    return truth


async def test_replica_follows_stores_removals_media_clears_and_incarnations(rig: Rig) -> None:
    rig.indexer.on_membership({A: endpoint(A), B: endpoint(B)}, {})
    rig.indexer.ready = True
    await rig.send(A, BlockStored(block_hashes=hashes(1, 6), parent_block_hash=None, token_ids=PROMPT[:24], block_size=BS))
    replica = ReplicaPrefixIndex(rig.address, 1.0)
    task = asyncio.create_task(replica.run())
    try:
        assert await converge(rig, replica) == {A: 6}  # from the snapshot
        await rig.send(B, BlockStored(block_hashes=hashes(2, 8), parent_block_hash=None, token_ids=PROMPT, block_size=BS))
        assert await converge(rig, replica) == {A: 6, B: 8}
        await rig.send(B, BlockRemoved(block_hashes=hashes(2, 4, start=4)))  # deltas: removals
        assert await converge(rig, replica) == {A: 6, B: 4}
        await rig.send(A, BlockStored(block_hashes=hashes(1, 2), parent_block_hash=None, token_ids=PROMPT[:8],
                                      block_size=BS, medium="CPU"))
        await rig.send(A, BlockRemoved(block_hashes=hashes(1, 6)))  # GPU gone, CPU copy of 2 blocks stays
        assert await converge(rig, replica) == {A: 2, B: 4}
        await rig.send(B, AllBlocksCleared())
        assert await converge(rig, replica) == {A: 2}
        # the same address, a new incarnation: its old entries go, what it stores next counts
        rig.indexer.on_membership({A: endpoint(A, "boot-2")}, {})
        rig.seq[A] = 0
        assert await converge(rig, replica) == {}
        await rig.send(A, BlockStored(block_hashes=hashes(3, 3), parent_block_hash=None, token_ids=PROMPT[:12], block_size=BS))
        assert await converge(rig, replica) == {A: 3}
        # departed (lease gone): not scored, as Score does
        rig.indexer.on_membership({}, {A: endpoint(A, "boot-2")})
        assert await converge(rig, replica) == {}
        # a LoRA scope is its own key space on both sides
        lora = KeyScope("adapter-1", None)
        assert await local(replica, PROMPT, lora) == rig.truth(PROMPT, lora) == {}
        assert replica.rpc_scores == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()


async def test_warming_index_gives_no_prefix_data_then_scores_when_ready(rig: Rig) -> None:
    rig.indexer.on_membership({A: endpoint(A)}, {})
    rig.indexer.ready = False
    await rig.send(A, BlockStored(block_hashes=hashes(1, 8), parent_block_hash=None, token_ids=PROMPT, block_size=BS))
    replica = ReplicaPrefixIndex(rig.address, 1.0)
    task = asyncio.create_task(replica.run())
    try:
        await until(lambda: replica.replica.synced)
        match = await replica.score("m", PROMPT, [])
        assert (match.total_blocks, match.matched_blocks) == (0, {})
        rig.indexer.ready = True
        await until(lambda: replica.replica.ready)
        assert await local(replica) == {A: 8}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()


async def test_stream_down_falls_back_to_score_then_degrades_when_unreachable(rig: Rig) -> None:
    rig.indexer.on_membership({A: endpoint(A)}, {})
    rig.indexer.ready = True
    await rig.send(A, BlockStored(block_hashes=hashes(1, 8), parent_block_hash=None, token_ids=PROMPT, block_size=BS))
    now = [0.0]
    replica = ReplicaPrefixIndex(rig.address, 1.0, stale_seconds=2.0, clock=lambda: now[0])
    task = asyncio.create_task(replica.run())
    try:
        await until(lambda: replica.replica.synced)
        assert await local(replica) == {A: 8}
        now[0] = 10.0  # nothing heard for longer than stale_seconds: Score over gRPC
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        fallback_before = scores_total("rpc_fallback")
        match = await replica.score("m", PROMPT, [])
        assert match.matched_blocks == {A: 8} and replica.rpc_scores == 1
        assert match.matched_blocks_by_medium == {A: {"GPU": 8}}
        assert scores_total("rpc_fallback") == fallback_before + 1
        unreachable = ReplicaPrefixIndex("127.0.0.1:1", 0.2)
        with pytest.raises(grpc.aio.AioRpcError):  # prefix-match then degrades to no match (degraded mode)
            await unreachable.score("m", PROMPT, [])
        await unreachable.close()
    finally:
        await replica.close()


async def test_watcher_behind_the_log_is_reset_and_resyncs(rig: Rig) -> None:
    """A bounded log drops what a slow watcher did not read: the server resets it with a new snapshot."""
    rig.indexer.on_membership({A: endpoint(A)}, {})
    rig.indexer.ready = True
    inner = rig.indexer.index.inner  # type: ignore[attr-defined]
    inner.residency = ResidencyLog(max_keys=8)
    replica = ReplicaPrefixIndex(rig.address, 1.0)
    task = asyncio.create_task(replica.run())
    try:
        await until(lambda: replica.replica.synced)
        for i in range(8):  # 8 chains of 4 blocks in one go, far more than the log keeps
            tokens = [t + 1000 * i for t in PROMPT[:16]]
            rig.pool.submit(RawMessage(A, "m", rig.seq.setdefault(A, 0), encode_batch(EventBatch(
                ts=1.0, data_parallel_rank=0,
                events=[BlockStored(block_hashes=hashes(10 + i, 4), parent_block_hash=None, token_ids=tokens, block_size=BS)],
            ))))
            rig.seq[A] += 1
        await rig.pool.drained()
        for i in range(8):
            tokens = [t + 1000 * i for t in PROMPT[:16]]
            await until(lambda tokens=tokens: replica.replica.synced and rig.truth(tokens) == replica.replica.score(
                "m", tokens).matched_blocks)
            assert rig.truth(tokens) == {A: 4}
        assert replica.snapshots >= 2  # the first one, then at least one reset
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()


def test_replica_refuses_a_message_out_of_sequence() -> None:
    replica = PrefixReplica()
    replica.reset(5)
    replica.set_endpoints([ReplicaEndpoint("a", "m", BS)])
    replica.set_status(True, [])
    replica.advance(5, True)
    replica.check_sequence(5)
    with pytest.raises(ReplicaGap):
        replica.check_sequence(7)


def test_models_with_kv_store_sources_are_left_to_score_only_when_the_reach_is_not_listed() -> None:
    """A kv_indexer from before ``WatchedEndpoint.reach_listed`` sends no reach: the replica cannot fold
    the sources' blocks, so that model is scored by ``Score``; one that lists it is scored locally."""
    replica = ReplicaPrefixIndex("127.0.0.1:1", 0.2)
    replica.replica.set_endpoints([
        ReplicaEndpoint("e", "m", BS), ReplicaEndpoint("store", "m", BS, kv_source=True), ReplicaEndpoint("f", "n", BS),
    ])
    replica.replica.advance(0, True)
    replica._last_message = replica._clock()
    assert not replica.usable("m") and replica.usable("n")
    replica.replica.set_endpoints([
        ReplicaEndpoint("e", "m", BS, kv_stores=("store",), reach_listed=True),
        ReplicaEndpoint("store", "m", BS, kv_source=True, reach_listed=True),
    ])
    assert replica.usable("m")


def source_endpoint(eid: str, domains: str) -> Endpoint:
    labels = {KV_SOURCE_LABEL: "kv_store", SHARED_DOMAINS_LABEL: domains}
    return Endpoint(id=EndpointId(eid), url=f"grpc://{eid}", model="m", block_size_tokens=BS, labels=labels)


def engine_endpoint(eid: str, stores: str) -> Endpoint:
    return Endpoint(id=EndpointId(eid), url=f"http://{eid}", model="m", block_size_tokens=BS,
                    labels={KV_STORES_LABEL: stores} if stores else {})


async def wire_score_reached(address: str, tokens: list[int] = PROMPT) -> dict[str, tuple[int, dict[str, int], int]]:
    async with insecure_channel(address) as channel:
        reply = await kv_indexer_pb2_grpc.KVIndexerStub(channel).Score(
            kv_indexer_pb2.ScoreRequest(model="m", token_ids=tokens), timeout=5.0)
    return {s.endpoint_id: (s.matched_blocks, dict(s.matched_blocks_by_medium), s.reached_blocks) for s in reply.scores}


async def test_replica_folds_kv_store_blocks_as_score_does(rig: Rig) -> None:
    """kv_store sources in the replica: an engine's match runs over the blocks it holds *or* reaches
    (its named kv_store's every medium, SHARED blocks of any source on the same shared domain), each
    block counted on every medium it is available on, and the blocks past its own run are its
    ``reached_blocks``, all equal to kv_indexer's ``Score`` (``services/kv_indexer/reach.py``), scored
    locally (no RPC). E holds blocks 0-1 and names S1; F names S2; G reaches nothing; S1 and S2 mount
    one shared domain."""
    e, f, g = "127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"
    s1, s2 = "127.0.0.1:7101", "127.0.0.1:7102"
    members = [engine_endpoint(e, s1), engine_endpoint(f, s2), engine_endpoint(g, ""),
               source_endpoint(s1, "sharedfs:/lustre/kv"), source_endpoint(s2, "sharedfs:/lustre/kv")]
    rig.indexer.on_membership({EndpointId(m.id): m for m in members}, {})
    rig.indexer.ready = True
    keys = hashes(5, 8)

    def stored(first: int, last: int, medium: str = "GPU") -> KVEvent:
        return BlockStored(block_hashes=keys[first:last], parent_block_hash=keys[first - 1] if first else None,
                           token_ids=PROMPT[first * BS:last * BS], block_size=BS, medium=medium)

    await rig.send(e, stored(0, 2))
    await rig.send(g, stored(0, 3))
    await rig.send(s1, stored(0, 4, "CPU"))
    replica = ReplicaPrefixIndex(rig.address, 1.0)
    task = asyncio.create_task(replica.run())
    log = rig.indexer.open_residency()
    assert log is not None

    async def converge() -> dict[str, tuple[int, dict[str, int], int]]:
        await until(lambda: replica.replica.synced and replica.replica.seq == rig.indexer.open_residency().seq)  # type: ignore[union-attr]
        await asyncio.sleep(0.06)
        truth = await wire_score_reached(rig.address)
        before = replica.rpc_scores
        match = await replica.score_scoped("m", PROMPT, [], KeyScope())
        assert replica.rpc_scores == before, "scored through the RPC, not the replica"
        local = {x: (n, match.matched_blocks_by_medium.get(x, {}), match.reached_blocks.get(x, 0))
                 for x, n in match.matched_blocks.items()}
        assert local == truth
        return truth

    try:
        assert await converge() == {e: (4, {"GPU": 2, "CPU": 4}, 2), g: (3, {"GPU": 3}, 0)}
        # S2 writes blocks 0-4 through to the shared namespace: F reaches them, and E through S1's domain
        await rig.send(s2, stored(0, 5, "SHARED"))
        assert await converge() == {
            e: (5, {"GPU": 2, "CPU": 4, "SHARED": 5}, 3), f: (5, {"SHARED": 5}, 5), g: (3, {"GPU": 3}, 0)}
        # E holds blocks 0-6 itself: its own run is longer, the sources' copies still count per medium
        await rig.send(e, stored(2, 7))
        assert await converge() == {
            e: (7, {"GPU": 7, "CPU": 4, "SHARED": 5}, 0), f: (5, {"SHARED": 5}, 5), g: (3, {"GPU": 3}, 0)}
        # S1 departs (its stream ends): E keeps its own run and the shared copies it reaches through
        # S1's domain no longer count (S1 is gone; F still reaches S2)
        rig.indexer.on_membership({}, {EndpointId(s1): source_endpoint(s1, "sharedfs:/lustre/kv")})
        assert await converge() == {e: (7, {"GPU": 7}, 0), f: (5, {"SHARED": 5}, 5), g: (3, {"GPU": 3}, 0)}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()



async def wire_score(address: str, tokens: list[int] = PROMPT) -> dict[str, tuple[int, dict[str, int]]]:
    """kv_indexer's ``Score`` over gRPC, as ``{endpoint: (matched_blocks, matched_blocks_by_medium)}``."""
    async with insecure_channel(address) as channel:
        reply = await kv_indexer_pb2_grpc.KVIndexerStub(channel).Score(
            kv_indexer_pb2.ScoreRequest(model="m", token_ids=tokens), timeout=5.0)
    assert reply.state == kv_indexer_pb2.INDEX_STATE_READY
    return {s.endpoint_id: (s.matched_blocks, dict(s.matched_blocks_by_medium)) for s in reply.scores}


def as_wire(match: PrefixMatch) -> dict[str, tuple[int, dict[str, int]]]:
    return {e: (n, match.matched_blocks_by_medium.get(e, {})) for e, n in match.matched_blocks.items()}


async def converge_media(rig: Rig, replica: ReplicaPrefixIndex, tokens: list[int] = PROMPT) -> dict[str, tuple[int, dict[str, int]]]:
    """Wait until the replica has seen everything logged; its per-endpoint per-medium counts must equal
    the servicer's ``Score`` answer (over gRPC) and ``GrpcPrefixIndex``'s reading of it (the ``rpc`` path)."""
    log = rig.indexer.open_residency()
    assert log is not None
    await until(lambda: replica.replica.synced and replica.replica.seq == log.seq)
    await asyncio.sleep(0.06)
    truth = await wire_score(rig.address, tokens)
    before = replica.local_scores
    match = await replica.score_scoped("m", tokens, [], KeyScope())
    assert replica.local_scores == before + 1, "scored through the RPC, not the replica"
    assert as_wire(match) == truth
    rpc = GrpcPrefixIndex(rig.address, 5.0)
    try:
        assert as_wire(await rpc.score("m", tokens, [])) == truth
    finally:
        await rpc.close()
    return truth


async def test_replica_per_medium_counts_equal_score(rig: Rig) -> None:
    """Blocks on GPU, CPU, DISK and SHARED, a prefix split across media, a block on two media, GPU
    evictions leaving offloaded copies: after each change the replica's ``matched_blocks_by_medium``
    equals kv_indexer's ``Score`` (a block counts once on every medium holding it; no preference order)."""
    rig.indexer.on_membership({A: endpoint(A), B: endpoint(B), C: endpoint(C)}, {})
    rig.indexer.ready = True
    await rig.send(A, BlockStored(block_hashes=hashes(1, 8), parent_block_hash=None, token_ids=PROMPT, block_size=BS))
    replica = ReplicaPrefixIndex(rig.address, 1.0)
    task = asyncio.create_task(replica.run())
    replica_before, rpc_before = scores_total("replica"), scores_total("rpc")
    try:
        # one medium (the replica's no-walk case), from the snapshot
        assert await converge_media(rig, replica) == {A: (8, {"GPU": 8})}
        # A offloads its first 4 blocks to CPU (GPU copies stay) and its first 2 to DISK
        await rig.send(A, BlockStored(block_hashes=hashes(1, 4), parent_block_hash=None, token_ids=PROMPT[:16],
                                      block_size=BS, medium="CPU"))
        await rig.send(A, BlockStored(block_hashes=hashes(1, 2), parent_block_hash=None, token_ids=PROMPT[:8],
                                      block_size=BS, medium="DISK"))
        # B: 6 blocks on CPU only; C: a prefix split, blocks 0-3 on GPU and 4-7 on CPU
        await rig.send(B, BlockStored(block_hashes=hashes(2, 6), parent_block_hash=None, token_ids=PROMPT[:24],
                                      block_size=BS, medium="CPU"))
        await rig.send(C, BlockStored(block_hashes=hashes(3, 4), parent_block_hash=None, token_ids=PROMPT[:16],
                                      block_size=BS))
        await rig.send(C, BlockStored(block_hashes=hashes(3, 4, start=4), parent_block_hash=hashes(3, 4)[-1],
                                      token_ids=PROMPT[16:], block_size=BS, medium="CPU"))
        assert await converge_media(rig, replica) == {
            A: (8, {"GPU": 8, "CPU": 4, "DISK": 2}),
            B: (6, {"CPU": 6}),
            C: (8, {"GPU": 4, "CPU": 4}),
        }
        # A's GPU evicts blocks 2-7: its match is the 4 CPU blocks (2 of them also on DISK);
        # B's first 3 blocks also land on a SHARED tier
        await rig.send(A, BlockRemoved(block_hashes=hashes(1, 6, start=2)))
        await rig.send(B, BlockStored(block_hashes=hashes(2, 3), parent_block_hash=None, token_ids=PROMPT[:12],
                                      block_size=BS, medium="SHARED"))
        assert await converge_media(rig, replica) == {
            A: (4, {"GPU": 2, "CPU": 4, "DISK": 2}),
            B: (6, {"CPU": 6, "SHARED": 3}),
            C: (8, {"GPU": 4, "CPU": 4}),
        }
        # every GPU copy of A and C goes, and B's CPU copies: only the offloaded media remain
        await rig.send(A, BlockRemoved(block_hashes=hashes(1, 2)))
        await rig.send(C, BlockRemoved(block_hashes=hashes(3, 4)))
        await rig.send(B, BlockRemoved(block_hashes=hashes(2, 6), medium="CPU"))
        assert await converge_media(rig, replica) == {
            A: (4, {"CPU": 4, "DISK": 2}),
            B: (3, {"SHARED": 3}),
        }
        # a prompt diverging after 3 blocks: counts cover the matched prefix only
        short = PROMPT[:12] + [7] * 20
        assert await converge_media(rig, replica, short) == {A: (3, {"CPU": 3, "DISK": 2}), B: (3, {"SHARED": 3})}
        assert replica.rpc_scores == 0
        assert scores_total("replica") == replica_before + 5 and scores_total("rpc") == rpc_before + 5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()


def test_replica_media_counts_follow_the_held_keys() -> None:
    """The per-endpoint media bookkeeping (the no-walk shortcut) stays exact: duplicate adds, removals
    of keys not held, a medium emptied, a clear and a reset."""
    replica = PrefixReplica()
    replica.reset(0)
    replica.set_endpoints([ReplicaEndpoint("a", "m", BS)])
    replica.set_status(True, [])
    replica.advance(0, True)
    keys = block_keys(PROMPT, BS)
    replica.apply_delta("a", "GPU", keys, [])
    replica.apply_delta("a", "GPU", keys[:2], [])  # already held: no change
    replica.apply_delta("a", "CPU", [], keys[:3])  # never on CPU: ignored
    assert replica.score("m", PROMPT).matched_blocks_by_medium == {"a": {"GPU": 8}}
    replica.apply_delta("a", "CPU", keys[:3], [])
    assert replica.score("m", PROMPT).matched_blocks_by_medium == {"a": {"GPU": 8, "CPU": 3}}
    replica.apply_delta("a", "GPU", [], keys)  # GPU emptied: CPU only again (no walk needed)
    assert replica._held["a"] == {replica._media["CPU"]: 3}
    assert replica.score("m", PROMPT).matched_blocks_by_medium == {"a": {"CPU": 3}}
    replica.apply_delta("a", "DISK", keys, [], cleared=True)
    assert replica.score("m", PROMPT).matched_blocks_by_medium == {"a": {"DISK": 8}}
    replica.reset(1)
    assert replica._held == {} and replica.score("m", PROMPT).matched_blocks == {}
