"""kv_indexer as a process: real etcd, real ZMQ frames, real gRPC.

Each test starts ``python -m services.kv_indexer`` bound on a free ZMQ port, registers a fake
endpoint in etcd (``LeaseRegistration``), publishes KV events from a PUB socket connected to the
bind endpoint (as vLLM does for a plain ``tcp://host:port``), and checks Score/Lookup/Stats.
PUB sockets drop messages until the connection is up, so idempotent events are re-sent until
their effect shows, always polling with a deadline (``tests.support.wait_until_async``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import zmq

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh.hashing import block_keys
from kvmesh.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_seq,
    make_topic,
)
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.epp.kv_indexer_client import ReplicaPrefixIndex
from tests.support import wait_until_async

MODEL = "tiny"
BLOCK = 4
PROMPT = list(range(100, 116))  # 4 full blocks


class Publisher:
    """vLLM 0.32's publisher as the simulator implements it: PUB connected to the indexer's bound SUB,
    and the replay ROUTER registered as the endpoint's ``replay_endpoint`` (PUB drops messages until
    the connection is up; the indexer replays what it missed)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, ep: Endpoint, model: str = MODEL) -> None:
        self.pub = ZmqEventPublisher(endpoint, make_topic(ep.id, model), replay_endpoint=ep.replay_endpoint)
        self.raw = ctx.socket(zmq.PUB)  # for frames that never reach sequencing (bad shapes)
        self.raw.setsockopt(zmq.LINGER, 0)
        self.raw.connect(endpoint)
        self.topic = self.pub.topic

    def send(self, *events: KVEvent) -> None:
        self.pub.publish(list(events))

    def send_payload(self, payload: bytes) -> None:
        """A well-framed message with the next seq whose payload may be garbage."""
        self.pub.publish_payload(payload)

    def send_raw(self, frames: list[bytes]) -> None:
        self.raw.send_multipart(frames)


def stored(hashes: list[int | bytes], tokens: list[int], parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK, medium=medium)


@pytest.fixture
async def mesh(start_service, etcd: str) -> AsyncIterator[dict]:
    bind = f"tcp://127.0.0.1:{free_port()}"
    proc, address = start_service("kv_indexer", "--events-bind-endpoint", bind, "--event-workers", "2")
    channel = grpc.aio.insecure_channel(address)
    ctx = zmq.Context()
    stub = kv_indexer_pb2_grpc.KVIndexerStub(channel)

    async def state() -> int:
        return (await stub.Score(pb.ScoreRequest(model="warm?", token_ids=PROMPT), timeout=5)).state

    # Warm first: the startup replays (every registered endpoint's replay endpoint asked once, some of
    # them earlier tests' engines that no longer answer, each up to the replay timeout) end WARMING.
    await wait_until_async(state, 30, "the index warm", until=lambda s: s != pb.INDEX_STATE_WARMING)
    yield {"bind": bind, "stub": stub, "ctx": ctx, "etcd": etcd, "proc": proc,
           "address": address}
    await channel.close()
    ctx.destroy(linger=0)


async def register(etcd: str, port: int, ttl: int = 3, instance_id: str = "boot-1") -> tuple[Endpoint, LeaseRegistration]:
    ep = Endpoint(
        id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=MODEL, block_size_tokens=BLOCK,
        instance_id=instance_id, replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=ttl)
    await reg.start()
    return ep, reg


async def score(stub: kv_indexer_pb2_grpc.KVIndexerStub, tokens: list[int] = PROMPT, **kw: Any) -> dict[str, int]:
    reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=tokens, **kw), timeout=5)
    return {s.endpoint_id: s.matched_blocks for s in reply.scores}


async def registered(stub: kv_indexer_pb2_grpc.KVIndexerStub) -> set[str]:
    reply = await stub.Stats(pb.StatsRequest(), timeout=5)
    return {e.endpoint_id for e in reply.per_endpoint}


async def test_score_lookup_and_all_blocks_cleared(mesh: dict) -> None:
    stub = mesh["stub"]
    ep, reg = await register(mesh["etcd"], free_port())
    other, reg2 = await register(mesh["etcd"], free_port())
    try:
        await registered_includes(stub, {ep.id, other.id})
        pub = Publisher(mesh["ctx"], mesh["bind"], ep)
        pub2 = Publisher(mesh["ctx"], mesh["bind"], other)
        first = stored([11, 12], PROMPT[:8])
        await scores_become(stub, {ep.id: 2}, resend=lambda: pub.send(first))
        pub.send(stored([13], PROMPT[8:12], parent=12))
        await scores_become(stub, {ep.id: 3, other.id: 1}, resend=lambda: pub2.send(stored([21], PROMPT[:4])))

        reply = await stub.Score(pb.ScoreRequest(model=MODEL, token_ids=PROMPT + [1, 2]), timeout=5)
        assert reply.total_blocks == 4 and reply.block_size_tokens == BLOCK
        assert [(s.endpoint_id, s.matched_blocks, s.matched_tokens) for s in reply.scores] == [(ep.id, 3, 12), (other.id, 1, 4)]
        assert dict(reply.scores[0].matched_blocks_by_medium) == {"GPU": 3}
        assert await score(stub, endpoint_ids=[other.id]) == {other.id: 1}
        assert await score(stub, tokens=[7] + PROMPT[1:]) == {}

        lookup = await stub.Lookup(pb.LookupRequest(model=MODEL, token_ids=PROMPT), timeout=5)
        assert [b.block_key for b in lookup.blocks] == block_keys(PROMPT, BLOCK)
        assert [{(h.endpoint_id, h.medium) for h in b.holders} for b in lookup.blocks] == [
            {(ep.id, common_pb2.MEDIUM_GPU), (other.id, common_pb2.MEDIUM_GPU)},
            {(ep.id, common_pb2.MEDIUM_GPU)},
            {(ep.id, common_pb2.MEDIUM_GPU)},
            set(),
        ]

        pub.send(BlockRemoved(block_hashes=[12]))
        await scores_become(stub, {ep.id: 1, other.id: 1})
        pub.send(AllBlocksCleared())
        await scores_become(stub, {other.id: 1})
        stats = await stub.Stats(pb.StatsRequest(), timeout=5)
        per = {e.endpoint_id: e for e in stats.per_endpoint}
        assert per[ep.id].blocks == 0 and per[ep.id].events_applied >= 4 and per[ep.id].last_seq >= 3
    finally:
        await reg.stop()
        await reg2.stop()


async def test_epp_replica_follows_the_real_kv_indexer_over_watch(mesh: dict) -> None:
    """epp's ``ReplicaPrefixIndex`` against the kv_indexer process: snapshot, then deltas from real ZMQ
    events; its local answers equal the process's ``Score`` and no pick needs the RPC."""
    stub = mesh["stub"]
    ep, reg = await register(mesh["etcd"], free_port())
    replica = ReplicaPrefixIndex(mesh["address"], 2.0)
    task = asyncio.create_task(replica.run())
    try:
        await registered_includes(stub, {ep.id})
        pub = Publisher(mesh["ctx"], mesh["bind"], ep)
        await scores_become(stub, {ep.id: 2}, resend=lambda: pub.send(stored([11, 12], PROMPT[:8])))

        async def local() -> dict[str, int]:
            if not replica.usable(MODEL):
                return {"<not synced>": 0}
            return (await replica.score(MODEL, PROMPT, [])).matched_blocks

        await wait_until_async(local, 10.0, "replica has the snapshot", until=lambda got: got == {ep.id: 2})
        pub.send(stored([13, 14], PROMPT[8:16], parent=12))
        await scores_become(stub, {ep.id: 4})
        await wait_until_async(local, 10.0, "replica follows a store", until=lambda got: got == {ep.id: 4})
        pub.send(BlockRemoved(block_hashes=[13]))
        await scores_become(stub, {ep.id: 2})
        await wait_until_async(local, 10.0, "replica follows a removal", until=lambda got: got == {ep.id: 2})
        assert replica.rpc_scores == 0 and replica.local_scores >= 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()
        await reg.stop()


async def test_endpoint_leaving_etcd_is_retained_for_its_incarnation_and_purged_for_a_new_one(mesh: dict) -> None:
    stub = mesh["stub"]
    ep, reg = await register(mesh["etcd"], free_port(), ttl=2)
    await registered_includes(stub, {ep.id})
    pub = Publisher(mesh["ctx"], mesh["bind"], ep)
    await scores_become(stub, {ep.id: 4}, resend=lambda: pub.send(stored([1, 2, 3, 4], PROMPT)))

    # A crash: keepalives stop, nobody revokes; etcd expires the lease within its TTL.
    assert reg._task is not None
    reg._task.cancel()
    started = time.monotonic()
    await scores_become(stub, {}, timeout=2 + 3)
    assert time.monotonic() - started < 2 + 3

    # It is no longer scored, but its entries are retained for a rejoin of the same incarnation
    # (a lease lost to an etcd outage is not an engine lost) ...
    assert (await stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=ep.id), timeout=5)).state == "departed"
    reg_again = LeaseRegistration([mesh["etcd"]], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg_again.start()
    try:
        await scores_become(stub, {ep.id: 4})  # the same incarnation: kept
    finally:
        await reg_again.stop()
    # ... while a new incarnation on the same address (a restarted engine) starts from an empty state.
    await scores_become(stub, {}, timeout=3)
    restarted = dataclasses.replace(ep, instance_id="boot-2")
    reg_new = LeaseRegistration([mesh["etcd"]], endpoint_key(restarted), restarted.to_json(), ttl_seconds=3)
    await reg_new.start()
    try:
        await wait_until_async(
            lambda: stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=ep.id), timeout=5), 10,
            "old incarnation purged", until=lambda r: r.state == "live" and list(r.block_hashes) == [],
        )
        assert await score(stub) == {}
    finally:
        await reg_new.stop()


async def test_malformed_batches_are_dropped_and_service_keeps_answering(mesh: dict) -> None:
    stub = mesh["stub"]
    ep, reg = await register(mesh["etcd"], free_port())
    try:
        await registered_includes(stub, {ep.id})
        pub = Publisher(mesh["ctx"], mesh["bind"], ep)
        await scores_become(stub, {ep.id: 1}, resend=lambda: pub.send(stored([1], PROMPT[:4])))
        before = (await stub.Stats(pb.StatsRequest(), timeout=5)).batches_dropped
        pub.send_raw([pub.topic, encode_seq(100)])  # two frames
        pub.send_raw([b"kv@tiny", encode_seq(101), b"\x93"])  # vLLM's bare topic: no endpoint
        pub.send_raw([pub.topic, b"\x00\x01", b"\x90"])  # bad sequence frame
        # bad payloads on the engine's topic, with the seq it will use next and one far ahead: dropped
        # before sequencing, so neither moves its seq (docs/kv-index.md, "Malformed and forged messages")
        pub.send_raw([pub.topic, encode_seq(pub.pub.next_seq), b"\xc1not msgpack"])
        pub.send_raw([pub.topic, encode_seq(10**12), b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type\xa4Nope\x00"])
        await wait_until_async(lambda: dropped(stub), 10, "5 more batches dropped", until=lambda n: n >= before + 5)
        pub.send(stored([2], PROMPT[4:8], parent=1))  # the engine's next seq: in order, nothing purged
        await scores_become(stub, {ep.id: 2})
        per = {e.endpoint_id: e for e in (await stub.Stats(pb.StatsRequest(), timeout=5)).per_endpoint}[ep.id]
        assert (per.state, per.last_seq) == ("live", pub.pub.next_seq - 1)
        assert mesh["proc"].alive
    finally:
        await reg.stop()


async def test_a_model_the_index_holds_nothing_for_is_a_ready_empty_answer_not_an_error(mesh: dict) -> None:
    """The proto's rule, and what epp (Score's client) needs: a model with no registered endpoint, or
    whose endpoints sent no event yet, is not an error: ``INDEX_STATE_READY`` with no scores (the
    index's best knowledge: nothing cached), so an epp picking for it right after it registers (epp
    and kv_indexer learn membership from etcd separately) does not count a degraded Score. Only a
    missing ``model`` is refused (``INVALID_ARGUMENT``)."""
    from services.epp.kv_indexer_client import GrpcPrefixIndex

    stub = mesh["stub"]
    never = await stub.Score(pb.ScoreRequest(model="nope", token_ids=PROMPT), timeout=5)
    assert never.state == pb.INDEX_STATE_READY
    assert (list(never.scores), list(never.unknown_endpoint_ids)) == ([], [])
    assert list((await stub.Lookup(pb.LookupRequest(model="nope", token_ids=PROMPT), timeout=5)).blocks) == []

    port = free_port()
    quiet = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="quiet",
                     block_size_tokens=BLOCK, instance_id="boot-1")
    reg = LeaseRegistration([mesh["etcd"]], endpoint_key(quiet), quiet.to_json(), ttl_seconds=3)
    await reg.start()
    try:
        await registered_includes(stub, {quiet.id})
        reply = await stub.Score(pb.ScoreRequest(model="quiet", token_ids=PROMPT), timeout=5)
        assert reply.state == pb.INDEX_STATE_READY and list(reply.scores) == []
        assert (reply.total_blocks, reply.block_size_tokens) == (4, BLOCK)
        client = GrpcPrefixIndex(mesh["address"], 5.0)
        try:
            for model in ("nope", "quiet"):  # epp reads both as "no prefix match", not a failed call
                assert (await client.score(model, PROMPT, [])).matched_blocks == {}
        finally:
            await client.close()
    finally:
        await reg.stop()
    with pytest.raises(grpc.aio.AioRpcError) as exc_info:
        await stub.Score(pb.ScoreRequest(model="", token_ids=PROMPT), timeout=5)
    assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def registered_includes(stub: kv_indexer_pb2_grpc.KVIndexerStub, ids: set[str]) -> None:
    await wait_until_async(lambda: registered(stub), 10, f"endpoints {sorted(ids)} registered", until=ids.issubset)


async def scores_become(
    stub: kv_indexer_pb2_grpc.KVIndexerStub,
    expected: dict[str, int],
    timeout: float = 10.0,
    resend: Callable[[], None] | None = None,
) -> None:
    """Wait until Score of PROMPT is ``expected``; ``resend`` re-publishes (PUB drops until connected)."""
    await wait_until_async(
        lambda: score(stub), timeout, f"scores {expected}", until=lambda got: got == expected, before_each=resend
    )


async def dropped(stub: kv_indexer_pb2_grpc.KVIndexerStub) -> int:
    return (await stub.Stats(pb.StatsRequest(), timeout=5)).batches_dropped


async def test_a_real_loss_heals_and_a_lost_final_message_is_found_by_the_tail_probe(mesh: dict) -> None:
    """The process with its defaults (tail probe after 2 s of quiet). A publisher whose replay buffer
    keeps one message (vLLM's ``buffer_steps=1``): a removal lost with the buffer rolled past it is a
    real loss, healed (the stale blocks not scored, what was stored after scored, the stream live);
    then the engine's last batch before it goes idle is lost, and only the tail probe can find it."""
    stub = mesh["stub"]
    ep, reg = await register(mesh["etcd"], free_port())
    pub = ZmqEventPublisher(mesh["bind"], make_topic(ep.id, MODEL), replay_endpoint=ep.replay_endpoint, buffer_steps=1)
    other = list(range(500, 512))  # 3 blocks
    try:
        await registered_includes(stub, {ep.id})
        await scores_become(stub, {ep.id: 4}, resend=lambda: pub.publish([stored([11, 12, 13, 14], PROMPT)]))
        pub.drop_next(2)  # numbered and buffered, never sent; the buffer keeps the newest message only
        pub.publish([BlockRemoved(block_hashes=[13, 14])])
        pub.publish([stored([51], list(range(600, 604)))])
        pub.publish([stored([31, 32, 33], other)])  # reveals the gap; the replay starts past it: a loss
        await wait_until_async(lambda: score(stub, tokens=other), 10, "the store after the loss scored",
                               until=lambda got: got == {ep.id: 3})  # live again: healed
        assert await score(stub) == {}  # 13-14 removed while lost: not scored (11-12 forgotten with them)
        stats = await stub.Stats(pb.StatsRequest(), timeout=5)
        assert {e.endpoint_id: e.state for e in stats.per_endpoint}[ep.id] == "live"

        pub.drop_next(1)  # the last batch before the engine goes idle: no later seq reveals it
        pub.publish([BlockRemoved(block_hashes=[33])])
        await wait_until_async(lambda: score(stub, tokens=other), 10, "the tail probe finds the lost removal",
                               until=lambda got: got == {ep.id: 2})
    finally:
        pub.shutdown()
        await reg.stop()
