"""Healing after a real loss, and the tail probe that finds a lost final message.

A *real* loss is a gap no replay can serve: vLLM 0.32's replay buffer (``buffer_steps``) rolled past
it, the replay failed or timed out, the live buffer overflowed while replaying, or the endpoint has
no replay endpoint. The lost messages may have removed blocks the index still holds (a stale entry
sends a request where its prefix no longer is) and stored blocks it lacks (only a lost hit). The
index forgets the endpoint's entries that predate the loss, applies what follows, and scores the
endpoint again at once. Before, it stayed ``unreliable`` (never scored) until an ``AllBlocksCleared``.

vLLM sends no heartbeat, so a lost *final* message is revealed by no later seq: a quiet endpoint's
replay buffer is asked once for what followed its last applied message (the tail probe).

The publisher is the simulator's ``ZmqEventPublisher`` (vLLM 0.32's wire and replay ROUTER protocol,
``vllm/distributed/kv_events.py``), the client the real ``ZmqReplayer``; which live messages reach
the pool is decided by the test (:meth:`Engine.deliver`), so every loss is exact.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import msgspec
import pytest
import zmq
from prometheus_client import REGISTRY

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.epp.kv_indexer_client import ReplicaPrefixIndex
from services.kv_indexer import snapshot
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex, InstrumentedIndex
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.servicer import add_servicer
from tests.support import wait_until_async
from tests.unit.kv_indexer.test_recovery_holes import A as HOLES_A
from tests.unit.kv_indexer.test_recovery_holes import Engine as RecoveryHolesEngine
from tests.unit.kv_indexer.test_recovery_holes import LossyDuringReplay

A = EndpointId("127.0.0.1:9001")
assert A == HOLES_A  # the shared Engine delivers to this id
_TS = itertools.count(1_700_000_000)

P = list(range(16))  # 4 blocks: engine hashes 11-14
Q = list(range(100, 108))  # 2 blocks: 21-22
R = list(range(200, 208))  # 2 blocks: 31-32
S = list(range(200, 212))  # 3 blocks: 31-33
T = list(range(300, 308))  # 2 blocks: 41-42


def chain(hashes: list[int | bytes], tokens: list[int], parent: int | None = None, medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4, medium=medium)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def losses(cause: str) -> float:
    return metric("kvmesh_kv_indexer_stream_losses_total", cause=cause)


def probes(result: str) -> float:
    return metric("kvmesh_kv_indexer_tail_probes_total", result=result)


class CountingReplayer(LossyDuringReplay):
    """The real replay client of test_recovery_holes: records each request's start seq and, after the
    publisher answered, runs the next ``during`` step (live messages that arrive while the answer travels)."""


class Engine(RecoveryHolesEngine):
    """A vLLM-style publisher (PUB + replay ROUTER, or none) whose messages carry any events; the test
    delivers them by hand (``deliver`` / ``arrive`` as in test_recovery_holes)."""

    def __init__(self, pool: EventPool, buffer_steps: int = 10_000, replay: bool = True, replay_at: str = "") -> None:
        own = f"tcp://127.0.0.1:{free_port()}" if replay and not replay_at else ""
        self.publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", make_topic(A, "m"),
                                           replay_endpoint=own, buffer_steps=buffer_steps)
        self.replay = replay_at or own
        self.pool = pool
        self.sent: dict[int, bytes] = {}

    def publish(self, *events: KVEvent) -> int:  # type: ignore[override]
        seq = self.publisher.next_seq
        self.sent[seq] = encode_batch(EventBatch(ts=float(next(_TS)), events=list(events), data_parallel_rank=0))
        self.publisher.publish_payload(self.sent[seq])
        return seq


Rig = tuple[InMemoryIndex, EventPool, Engine, CountingReplayer]


def rig(buffer_steps: int = 10_000, replay: bool = True, replay_at: str = "", **pool_args: float) -> Rig:
    index = InMemoryIndex()
    replayer = CountingReplayer()
    pool = EventPool(index, workers=1, replayer=replayer, **pool_args)  # type: ignore[arg-type]
    engine = Engine(pool, buffer_steps, replay, replay_at)
    index.register_endpoint(engine.endpoint)
    pool.endpoint_joined(engine.endpoint)
    pool.start()
    return index, pool, engine, replayer


@pytest.fixture
async def cleanup() -> AsyncIterator[list[Rig]]:
    rigs: list[Rig] = []
    yield rigs
    for _, pool, engine, replayer in rigs:
        engine.shutdown()
        await pool.shutdown()
        replayer.close()


@pytest.fixture
def silent_router() -> Iterator[str]:
    """A replay endpoint that takes requests and never answers (a hung engine)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{free_port()}"
    sock.bind(address)
    yield address
    sock.close(linger=0)
    ctx.term()


def matched(index: InMemoryIndex, tokens: list[int]) -> int:
    return next((s.matched_blocks for s in index.score("m", tokens).scores if s.endpoint_id == A), 0)


def held(index: InMemoryIndex) -> set[int]:
    return {int(h) for h in index.held_blocks(A)}


async def test_a_loss_the_replay_buffer_rolled_past_forgets_older_entries_and_is_live_at_once(
    cleanup: list[Rig],
) -> None:
    index, pool, engine, replayer = rig(buffer_steps=2, replay_timeout_seconds=5)
    cleanup.append((index, pool, engine, replayer))
    engine.publish(chain([11, 12, 13, 14], P))
    engine.publish(chain([21, 22], Q))
    engine.deliver(0, 1)
    await pool.drained()
    assert (matched(index, P), matched(index, Q)) == (4, 2)
    before, forgotten = losses("replay_incomplete"), metric("kvmesh_kv_indexer_forgotten_blocks_total")

    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # seq 2: lost
    engine.publish(chain([51], list(range(400, 404))))  # seq 3: lost
    engine.publish(chain([31, 32, 33], S))  # seq 4
    engine.publish(chain([41, 42], T))  # seq 5; the buffer keeps 4-5 only: 2-3 are gone for good
    engine.deliver(4, 5)
    await pool.drained()

    assert replayer.requests == [2]
    assert pool.state(A) is EndpointState.LIVE and pool.stats.per_endpoint[A].losses == 1
    assert matched(index, P) == 0  # 13-14 were removed while lost: never scored (nor 11-12, forgotten)
    assert (matched(index, S), matched(index, T)) == (3, 2)  # stored after the loss: scored at once
    assert held(index) == {31, 32, 33, 41, 42}
    assert losses("replay_incomplete") == before + 1
    assert metric("kvmesh_kv_indexer_forgotten_blocks_total") == forgotten + 6

    # the engine recomputes P's evicted tail on its (still cached, forgotten) head: keyed, not orphaned
    engine.deliver(engine.publish(chain([13, 14], P[8:], parent=12)))
    await pool.drained()
    assert index.orphan_count() == 0 and {13, 14} <= held(index)
    assert [set(loc.holders) for loc in index.lookup("m", P)] == [set(), set(), {A}, {A}]
    assert matched(index, P) == 0  # its head is a lost hit until stored again, never a stale one


async def test_a_loss_by_a_failed_replay_heals(cleanup: list[Rig], silent_router: str) -> None:
    index, pool, engine, replayer = rig(replay=False, replay_at=silent_router, replay_timeout_seconds=0.3)
    cleanup.append((index, pool, engine, replayer))
    before = losses("replay_failed")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # seq 1: lost, and the replay endpoint never answers
    engine.deliver(engine.publish(chain([31, 32, 33], S)))
    await pool.drained()
    assert replayer.requests == [1]
    assert pool.state(A) is EndpointState.LIVE and losses("replay_failed") == before + 1
    assert (matched(index, P), matched(index, S)) == (0, 3)


async def test_a_failed_startup_replay_after_a_snapshot_forgets_its_entries_and_starts_afresh(
    cleanup: list[Rig], silent_router: str
) -> None:
    """The indexer restarted from a snapshot; the engine's replay endpoint does not answer, and no
    live message says whether the engine went on while the indexer was down: a loss."""
    index, pool, engine, replayer = rig(replay=False, replay_at=silent_router, replay_timeout_seconds=0.3)
    cleanup.append((index, pool, engine, replayer))
    before = losses("replay_failed")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    await pool.drained()
    pool.restore(engine.endpoint, 1)  # as the snapshot restores it
    pool.recover(engine.endpoint, "startup")
    await pool.settled()
    assert replayer.requests == [1] and losses("replay_failed") == before + 1
    assert held(index) == set() and pool.state(A) is EndpointState.LIVE and pool.export()[A] == (None, True)
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # what it published while the indexer was down
    engine.deliver(engine.publish(chain([31, 32, 33], S)))  # its next message: a fresh start, not a gap
    await pool.drained()
    assert replayer.requests == [1, 0]  # the fresh start asks its buffer once (in vain here)
    assert (matched(index, P), matched(index, S)) == (0, 3) and pool.export()[A] == (3, True)


async def overflow_while_replaying(engine: Engine, replayer: CountingReplayer) -> None:
    """seq 0 applied, seq 1 lost, seq 2 the gap; while the answer travels, seqs 3-7 arrive live, more
    than a live buffer of 2 holds (3-5 dropped from it)."""
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # seq 1: lost, replayed
    engine.deliver(engine.publish(chain([31, 32, 33], S)))  # seq 2: the gap

    async def meanwhile() -> None:
        first = engine.publish(BlockRemoved(block_hashes=[31, 32, 33]))  # seq 3: S evicted
        engine.publish(chain([41, 42], T))
        engine.publish(chain([61], list(range(600, 604))))
        engine.publish(chain([62], list(range(610, 614))))
        last = engine.publish(chain([63], list(range(620, 624))))
        await engine.arrive(*range(first, last + 1))  # the live buffer keeps the newest 2: 3-5 dropped

    replayer.during = iter([meanwhile])
    await engine.pool.drained()


async def test_messages_an_overflowed_live_buffer_dropped_are_asked_for_again(cleanup: list[Rig]) -> None:
    """The dropped messages are still in the publisher's replay buffer: a second round serves them, no loss."""
    index, pool, engine, replayer = rig(recovery_buffer_messages=2, replay_timeout_seconds=5)
    cleanup.append((index, pool, engine, replayer))
    before = losses("live_buffer_overflow")
    await overflow_while_replaying(engine, replayer)
    assert replayer.requests == [1, 3]  # the gap, then the seqs the overflow dropped
    assert pool.state(A) is EndpointState.LIVE and losses("live_buffer_overflow") == before
    assert pool.stats.per_endpoint[A].losses == 0
    assert (matched(index, P), matched(index, S), matched(index, T)) == (2, 0, 2)  # exact: 13-14 and S removed
    assert held(index) == {11, 12, 41, 42, 61, 62, 63} and pool.export()[A] == (8, True)


async def test_an_overflowed_live_buffer_the_replay_buffer_rolled_past_is_a_loss_healed(cleanup: list[Rig]) -> None:
    index, pool, engine, replayer = rig(buffer_steps=2, recovery_buffer_messages=2, replay_timeout_seconds=5)
    cleanup.append((index, pool, engine, replayer))
    before = losses("live_buffer_overflow")
    await overflow_while_replaying(engine, replayer)  # the publisher keeps 2 messages: 3-5 are gone for good
    assert replayer.requests == [1, 3]
    assert pool.state(A) is EndpointState.LIVE and losses("live_buffer_overflow") == before + 1
    assert matched(index, S) == 0  # its removal was dropped with the overflow: the stale S is forgotten
    assert (matched(index, P), matched(index, T)) == (0, 0)
    assert held(index) == {62, 63} and pool.export()[A] == (8, True)


async def test_a_lost_final_message_is_found_by_the_tail_probe(cleanup: list[Rig]) -> None:
    index, pool, engine, replayer = rig(tail_probe_quiet_seconds=0.2, tail_probe_idle_max_seconds=0)
    cleanup.append((index, pool, engine, replayer))
    found = probes("found")
    recovered = metric("kvmesh_kv_indexer_recoveries_total", trigger="tail_probe", result="recovered")
    engine.publish(chain([11, 12, 13, 14], P))
    engine.publish(chain([21, 22], Q))
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # the last batch before the engine goes idle: lost
    engine.deliver(0, 1)
    await pool.drained()
    assert matched(index, P) == 4  # no later seq reveals the loss
    await wait_until_async(lambda: matched(index, P), 5, "the tail probe's find applied", until=lambda n: n == 2)
    assert replayer.requests[0] == 2 and probes("found") == found + 1
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (3, True)
    assert metric("kvmesh_kv_indexer_recoveries_total", trigger="tail_probe", result="recovered") == recovered + 1
    await asyncio.sleep(0.8)  # several quiet periods: the new tail is confirmed once, then left alone
    await pool.drained()
    assert replayer.requests == [2, 3]


async def engine_arrives(pool: EventPool, payload: bytes) -> None:
    """Seq 0 of a restarted publisher reaches the worker (not waiting for its fresh-start replay)."""
    before = pool.stats.per_endpoint[A].messages
    pool.submit(RawMessage(A, "m", 0, payload))
    for _ in range(1000):
        if pool.stats.per_endpoint[A].messages > before:
            return
        await asyncio.sleep(0)
    raise AssertionError("the pool did not take the restarted publisher's seq 0")


async def test_a_tail_probe_answered_by_an_incarnation_that_restarted_meanwhile_is_dropped(
        cleanup: list[Rig]) -> None:
    """The probe's answer comes from the publisher as it was before it restarted; the restarted one's
    first message (seq 0, a batch never applied) arrives while the answer travels: the answer is stale
    (its seq 2 is past the new incarnation's 1, which would read as a loss and forget the new entries)."""
    index, pool, engine, replayer = rig(tail_probe_quiet_seconds=0.2, tail_probe_idle_max_seconds=0)
    cleanup.append((index, pool, engine, replayer))
    superseded = probes("superseded")
    engine.publish(chain([11, 12, 13, 14], P))
    engine.publish(chain([21, 22], Q))
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # lost: the probe's answer will carry it
    engine.deliver(0, 1)
    await pool.drained()
    restarted = encode_batch(EventBatch(ts=float(next(_TS)), events=[chain([31, 32], R)], data_parallel_rank=0))

    async def the_new_incarnation_arrives() -> None:
        await engine_arrives(pool, restarted)

    replayer.during = iter([the_new_incarnation_arrives])
    await wait_until_async(lambda: probes("superseded"), 5, "the stale answer dropped", until=lambda n: n == superseded + 1)
    await pool.drained()
    assert matched(index, R) == 2 and matched(index, P) == 0  # the new incarnation's view, the old one purged
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (1, True)


async def test_a_quiet_endpoint_with_nothing_lost_is_probed_once_per_position(cleanup: list[Rig]) -> None:
    index, pool, engine, replayer = rig(tail_probe_quiet_seconds=0.2, tail_probe_idle_max_seconds=0)
    cleanup.append((index, pool, engine, replayer))
    nothing = probes("nothing_lost")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    await wait_until_async(lambda: replayer.requests, 5, "a tail probe")
    await pool.drained()
    await asyncio.sleep(0.8)
    assert replayer.requests == [1] and probes("nothing_lost") == nothing + 1 and matched(index, P) == 4
    engine.deliver(engine.publish(chain([21, 22], Q)))  # new activity: its tail is probed in turn
    await wait_until_async(lambda: len(replayer.requests) == 2, 5, "a second tail probe")
    assert replayer.requests == [1, 2]


async def test_an_idle_endpoint_is_probed_again_and_a_message_lost_later_is_found(cleanup: list[Rig]) -> None:
    """The tail was confirmed, then the engine woke for one batch that was lost: no position changed
    on the indexer's side, so only the idle re-probe (doubling from twice the quiet time, capped) finds it."""
    index, pool, engine, replayer = rig(tail_probe_quiet_seconds=0.1, tail_probe_idle_max_seconds=0.4)
    cleanup.append((index, pool, engine, replayer))
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    await wait_until_async(lambda: replayer.requests, 5, "the first tail probe")
    await pool.drained()
    assert matched(index, P) == 4
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # lost
    await wait_until_async(lambda: matched(index, P), 5, "an idle re-probe finds it", until=lambda n: n == 2)
    assert replayer.requests[0] == 1 and 1 in replayer.requests[1:] and pool.export()[A] == (2, True)


async def test_a_tail_the_replay_buffer_rolled_past_is_a_loss_healed(cleanup: list[Rig]) -> None:
    index, pool, engine, replayer = rig(buffer_steps=2, tail_probe_quiet_seconds=0.2, tail_probe_idle_max_seconds=0)
    cleanup.append((index, pool, engine, replayer))
    before = losses("replay_incomplete")
    healed = metric("kvmesh_kv_indexer_recoveries_total", trigger="tail_probe", result="healed")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    await pool.drained()
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # seq 1-3 lost; the buffer keeps 2-3
    engine.publish(chain([31, 32, 33], S))
    engine.publish(chain([41, 42], T))
    await wait_until_async(lambda: matched(index, S), 5, "the tail probe's find applied", until=lambda n: n == 3)
    assert replayer.requests[0] == 1 and losses("replay_incomplete") == before + 1
    assert metric("kvmesh_kv_indexer_recoveries_total", trigger="tail_probe", result="healed") == healed + 1
    assert (matched(index, P), matched(index, S), matched(index, T)) == (0, 3, 2)
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (4, True)


async def test_a_failed_tail_probe_is_retried_a_bounded_number_of_times_and_changes_nothing(
    cleanup: list[Rig], silent_router: str
) -> None:
    index, pool, engine, replayer = rig(replay=False, replay_at=silent_router, tail_probe_quiet_seconds=0.1,
                                        tail_probe_timeout_seconds=0.2, tail_probe_attempts=2,
                                        tail_probe_idle_max_seconds=30)
    cleanup.append((index, pool, engine, replayer))
    failed = probes("failed")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    await wait_until_async(lambda: len(replayer.requests) == 2, 5, "two tail probes")
    await pool.drained()
    await asyncio.sleep(0.6)
    assert replayer.requests == [1, 1] and probes("failed") == failed + 2
    assert pool.state(A) is EndpointState.LIVE and matched(index, P) == 4  # a failed probe is no evidence of loss


async def test_an_endpoint_without_replay_endpoint_is_never_probed_and_its_gaps_heal(cleanup: list[Rig]) -> None:
    """The limit of the kind: without a replay endpoint a lost final message stays unseen until the
    next message reveals the gap, which then heals like any loss."""
    index, pool, engine, replayer = rig(replay=False, tail_probe_quiet_seconds=0.1)
    cleanup.append((index, pool, engine, replayer))
    before = losses("no_replay_endpoint")
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)))
    engine.publish(BlockRemoved(block_hashes=[13, 14]))  # lost, final for now
    await pool.drained()
    await asyncio.sleep(0.5)
    assert replayer.requests == [] and matched(index, P) == 4
    engine.deliver(engine.publish(chain([31, 32, 33], S)))  # the next message reveals the gap
    await pool.drained()
    assert replayer.requests == [] and losses("no_replay_endpoint") == before + 1
    assert pool.state(A) is EndpointState.LIVE and (matched(index, P), matched(index, S)) == (0, 3)


class NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


async def test_a_snapshot_taken_after_healing_restores_the_healed_view(tmp_path: Path) -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)  # no replayer: the gap is a loss
    indexer = BlockIndexer(index, pool, NoFeed())
    ep = Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, instance_id="boot-1")
    indexer.on_membership({A: ep}, {})
    pool.start()
    try:
        payloads = [encode_batch(EventBatch(ts=float(next(_TS)), events=[e], data_parallel_rank=0)) for e in (
            chain([11, 12, 13, 14], P), BlockRemoved(block_hashes=[13, 14]), chain([31, 32, 33], S))]
        pool.submit(RawMessage(A, "m", 0, payloads[0]))
        pool.submit(RawMessage(A, "m", 2, payloads[2]))  # seq 1 lost
        await pool.drained()
        assert indexer.stats().states == {A: "live"} and pool.stats.per_endpoint[A].losses == 1
        path = tmp_path / "kv.snap"
        snapshot.save(indexer, path)
    finally:
        await pool.shutdown()

    index2 = InMemoryIndex()
    pool2 = EventPool(index2, workers=1)
    indexer2 = BlockIndexer(index2, pool2, NoFeed())
    assert snapshot.load(indexer2, path) == {A}
    assert index2.held_blocks(A) == index.held_blocks(A) and pool2.export() == {A: (3, True)}
    assert indexer2.stats().states == {A: "live"}
    assert (matched(index2, P), matched(index2, S)) == (0, 3)

    # a snapshot an older kvmesh saved while the endpoint was unreliable: its entries are not restored
    snap = msgspec.msgpack.decode(path.read_bytes(), type=snapshot._Snapshot)
    snap.endpoints[0].reliable = False
    path.write_bytes(msgspec.msgpack.encode(snap))
    before = losses("snapshot")
    index3 = InMemoryIndex()
    pool3 = EventPool(index3, workers=1)
    indexer3 = BlockIndexer(index3, pool3, NoFeed())
    assert snapshot.load(indexer3, path) == {A}
    assert index3.held_blocks(A) == {} and pool3.export() == {A: (3, True)} and losses("snapshot") == before + 1
    assert indexer3.stats().states == {A: "live"}


async def test_epps_replica_follows_the_heal(tmp_path: Path) -> None:
    """The replica fed by ``KVIndexer/Watch`` (real gRPC) sees the heal as one ``cleared`` record of
    the endpoint (every medium) and the stores after it, and scores exactly as ``Score`` does."""
    index = InstrumentedIndex(InMemoryIndex())
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, NoFeed())
    indexer.on_membership({A: Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, instance_id="b")}, {})
    pool.start()
    server = grpc.aio.server()
    add_servicer(server, indexer, watch_status_poll_seconds=0.05)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    replica = ReplicaPrefixIndex(f"127.0.0.1:{port}", 1.0)
    task = asyncio.create_task(replica.run())
    seq = itertools.count()
    log = indexer.open_residency()
    assert log is not None

    async def send(*events: KVEvent, skip: int = 0) -> None:
        for _ in range(skip):
            next(seq)  # lost on the wire
        batch = encode_batch(EventBatch(ts=float(next(_TS)), events=list(events), data_parallel_rank=0))
        pool.submit(RawMessage(A, "m", next(seq), batch))
        await pool.drained()

    async def compare(tokens: list[int]) -> dict[str, int]:
        await wait_until_async(lambda: replica.replica.synced and replica.replica.seq == log.seq, 5, "replica in step")
        await asyncio.sleep(0.2)  # endpoint states reach the stream at its 0.05 s poll
        truth: dict[str, int] = {s.endpoint_id: s.matched_blocks for s in indexer.score("m", tokens).result.scores}
        match = await replica.score("m", tokens, [])
        assert match.matched_blocks == truth
        return truth

    try:
        await send(chain([11, 12, 13, 14], P))
        await send(chain([11, 12], P[:8], medium="CPU"))  # offloaded copies of the head
        assert await compare(P) == {A: 4}
        await send(chain([31, 32, 33], S), skip=1)  # seq 2 (P's removal from GPU and CPU) lost for good
        assert await compare(P) == {}  # no medium of the stale P is scored, in the index or the replica
        assert await compare(S) == {A: 3}
        assert indexer.stats().states == {A: "live"} and replica.rpc_scores == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replica.close()
        await server.stop(0)
        await pool.shutdown()


async def test_a_departed_endpoints_messages_wait_for_its_rejoin_to_say_which_incarnation(cleanup: list[Rig]) -> None:
    """Its lease gone (retained), an endpoint's messages that continue its stream are applied (the same
    incarnation publishing through an etcd pause); a restarted publisher's first batch (a kv_store's
    rescan, seq 0) that arrives before its new registration is held, not sequenced on the old stream,
    and applied to the new incarnation at its join. Details: test_departed_and_resets.py."""
    index, pool, engine, replayer = rig()
    cleanup.append((index, pool, engine, replayer))
    engine.deliver(engine.publish(chain([11, 12, 13, 14], P)), engine.publish(chain([21, 22], Q)))
    await pool.drained()
    pool.endpoint_departed(A)
    engine.deliver(engine.publish(BlockRemoved(block_hashes=[21, 22])))  # the same incarnation, still publishing
    await pool.drained()
    assert matched(index, Q) == 0 and pool.export()[A] == (3, True)  # applied while departed
    pool.endpoint_joined(engine.endpoint, new_incarnation=False)
    await pool.drained()
    assert matched(index, Q) == 0 and pool.export()[A] == (3, True)  # the rejoin carries on

    pool.endpoint_departed(A)
    restarted = encode_batch(EventBatch(ts=float(next(_TS)), events=[chain([31, 32], R)], data_parallel_rank=0))
    pool.submit(RawMessage(A, "m", 0, restarted))  # the new incarnation's seq 0, before its registration
    await pool.drained()
    assert matched(index, R) == 0
    index.apply(A, AllBlocksCleared())  # what BlockIndexer.join does for a new instance id
    pool.endpoint_joined(engine.endpoint, new_incarnation=True)
    await pool.drained()
    assert matched(index, R) == 2 and pool.export()[A] == (1, True)
