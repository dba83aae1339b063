"""Restarts on either side of the KV-event stream, over real ZMQ sockets (vLLM 0.32's protocol).

The engine side is :class:`engine_simulator.publisher.ZmqEventPublisher`, which behaves like vLLM
0.32's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``): a PUB socket that *connects* to the
indexer's bound SUB and reconnects when it comes back, ``[topic, seq (8-byte big-endian), msgpack
KVEventBatch [ts, events, dp_rank]]`` with seq counting from 0 per process and ``ts`` the engine's
``time.time()``, and the replay ROUTER serving the last ``buffer_steps`` messages. The indexer side
is the real subscriber, pool and replay client. Each case checks that the index ends exactly equal
to what the engine holds, that the stream is ``live``, and how many replays were asked for:

* the indexer restarts (cold, and warm from its positions) while the engine keeps publishing: the
  messages queued in ZMQ while it started are duplicates of the startup replay, not a restart;
* the publisher really restarts (seq from 0 again, newer batches): purged once, then fresh;
* a gap: one replay;
* a replay answered with every message twice: each applied once;
* live messages out of order (and one re-sent): one replay, no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import time
from collections.abc import AsyncIterator, Iterable

import pytest
import zmq
from prometheus_client import REGISTRY

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch, encode_seq, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.events.subscriber import ZmqSubscriber
from services.kv_indexer.index import InMemoryIndex
from tests.support import wait_until_async

A = EndpointId("127.0.0.1:9001")
TOPIC = make_topic(A, "m")
RESTART_LOG = "publisher restarted"


def stored(block: int) -> BlockStored:
    """A one-block chain whose tokens are unique to ``block`` (block_size 4)."""
    return BlockStored(block_hashes=[block], parent_block_hash=None, token_ids=list(range(4 * block, 4 * block + 4)), block_size=4)


class Engine:
    """A vLLM-0.32-like publisher plus the truth: the blocks it holds after what it published."""

    def __init__(self, bind: str, replay: str, publisher: type[ZmqEventPublisher] = ZmqEventPublisher) -> None:
        deadline = time.monotonic() + 10.0
        while True:  # a restart on the same addresses: libzmq releases the old replay port in its I/O thread, soon after close
            try:
                self.publisher = publisher(bind, TOPIC, replay_endpoint=replay, buffer_steps=100_000)
                break
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.held: set[int] = set()

    def store(self, block: int) -> None:
        self.held.add(block)
        self.publisher.publish([stored(block)])

    def step(self, block: int) -> None:
        """Store ``block``; every third step also evicts the oldest held block."""
        events: list[KVEvent] = [stored(block)]
        self.held.add(block)
        if block % 3 == 0:
            oldest = min(self.held)
            self.held.discard(oldest)
            events.append(BlockRemoved(block_hashes=[oldest]))
        self.publisher.publish(events)

    def shutdown(self) -> None:
        self.publisher.shutdown()


class CountingReplayer(ZmqReplayer):
    """The real replay client, recording each request's start seq."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[int] = []

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        self.requests.append(from_seq)
        return await super().replay(endpoint, from_seq, timeout_seconds)


class Indexer:
    """One kv_indexer incarnation: pool + bound SUB + replay client over ``index``, as the pipeline
    wires them (``IndexerPipeline.start``: bind, register, startup recovery; receive loop after)."""

    def __init__(self, index: InMemoryIndex, endpoint: Endpoint) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replayer = CountingReplayer()
        self.pool = EventPool(index, workers=2, replayer=self.replayer, replay_timeout_seconds=5)
        self.subscriber = ZmqSubscriber(self.pool, endpoint.events_endpoint)
        self._receive: asyncio.Task[None] | None = None

    def bind(self, restored: tuple[int | None, bool] | None = None) -> None:
        self.subscriber.start()
        self.pool.start()
        if restored is not None:
            self.pool.restore(self.endpoint, *restored)
        self.index.register_endpoint(self.endpoint)
        self.pool.endpoint_joined(self.endpoint, new_incarnation=restored is None)

    def receive(self) -> None:
        self._receive = asyncio.create_task(self.subscriber.run())

    def applied(self) -> int:
        """The next seq expected (0 before any)."""
        return self.pool.export()[A][0] or 0

    async def caught_up(self, engine: Engine, timeout: float = 10) -> None:
        await wait_until_async(
            lambda: self.applied() == engine.publisher.next_seq and self.pool.state(A) is not EndpointState.RECOVERING,
            timeout, f"the index to catch up with seq {engine.publisher.next_seq}", interval=0.02,
        )
        await self.pool.drained()

    async def stop(self) -> None:
        if self._receive is not None:
            self._receive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receive
        self.subscriber.close()
        await self.pool.shutdown()
        self.replayer.close()


def endpoint(bind: str, replay: str) -> Endpoint:
    return Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, events_endpoint=bind, replay_endpoint=replay)


def addresses() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def sequence_resets() -> float:
    return REGISTRY.get_sample_value("kvmesh_kv_indexer_incarnations_total", {"signal": "sequence_reset"}) or 0.0


def held(index: InMemoryIndex) -> set[int]:
    return {int(h) for h in index.held_blocks(A)}


@contextlib.asynccontextmanager
async def publishing(engine: Engine, blocks: Iterable[int], every_seconds: float = 0.002) -> AsyncIterator[None]:
    """Publish one step per ``every_seconds`` in the background while the body runs."""

    async def run() -> None:
        for block in blocks:
            engine.step(block)
            await asyncio.sleep(every_seconds)

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm-from-positions"])
async def test_indexer_restarted_while_the_engine_keeps_publishing_replays_once_and_reads_no_restart(
    warm: bool, caplog: pytest.LogCaptureFixture
) -> None:
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    engine = Engine(bind, replay)
    index = InMemoryIndex()
    first = Indexer(index, ep)
    first.bind()
    first.receive()
    resets = sequence_resets()
    blocks = itertools.count(1)
    second: Indexer | None = None
    try:
        async with publishing(engine, blocks):
            await wait_until_async(first.applied, 10, "the first indexer to apply 50 messages", until=lambda n: n >= 50)
            await first.stop()  # the engine keeps publishing: these messages are lost on the wire
            position = first.pool.export()[A]
            await asyncio.sleep(0.2)
            # a restarted indexer: warm keeps the index and its positions (what a snapshot restores),
            # cold starts empty with no position
            second = Indexer(index if warm else InMemoryIndex(), ep)
            second.bind(position if warm else None)
            await asyncio.sleep(0.5)  # the engine's PUB reconnects; live messages queue in ZMQ meanwhile
            second.pool.recover(ep, "startup")
            await second.pool.settled()
            second.receive()  # the queued messages are older than what the replay applied
            await asyncio.sleep(0.3)
        await second.caught_up(engine)
        assert held(second.index) == engine.held
        assert second.pool.state(A) is EndpointState.LIVE
        startup_from = position[0] if warm else 0
        assert second.replayer.requests[0] == startup_from
        # one replay for the restart; any other request would be for a real gap further on
        assert startup_from not in second.replayer.requests[1:]
        assert all(start > startup_from for start in second.replayer.requests[1:])
        assert second.pool.stats.dropped["duplicate"] > 0  # the queued messages were read as duplicates
        assert sequence_resets() == resets
        assert RESTART_LOG not in caplog.text
    finally:
        if second is not None:
            await second.stop()
        engine.shutdown()


async def test_publisher_restart_purges_once_and_starts_afresh(caplog: pytest.LogCaptureFixture) -> None:
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    indexer = Indexer(InMemoryIndex(), ep)
    indexer.bind()
    indexer.receive()
    engine = Engine(bind, replay)
    try:
        old = itertools.count(1)
        await wait_until_async(indexer.applied, 10, "the first engine's events", until=lambda n: n > 0,
                               interval=0.02, before_each=lambda: engine.store(next(old)))
        for _ in range(20):
            engine.store(next(old))
        await indexer.caught_up(engine)
        assert held(indexer.index) == engine.held
        before = indexer.applied()
        engine.shutdown()
        resets = sequence_resets()
        asked = len(indexer.replayer.requests)  # at most the first start's
        caplog.clear()
        # the engine restarts on the same addresses: seq counts from 0 again, batches are newer
        engine = Engine(bind, replay)
        new = itertools.count(1001)
        await wait_until_async(lambda: 1001 in held(indexer.index) or indexer.pool.state(A) is EndpointState.RECOVERING,
                               10, "the restarted engine's events", interval=0.02,
                               before_each=lambda: engine.store(next(new)))
        for _ in range(5):
            engine.store(next(new))
        await indexer.caught_up(engine)
        assert engine.publisher.next_seq < before  # the new count is below the old position
        assert held(indexer.index) == engine.held  # the old incarnation's blocks are gone
        assert min(engine.held) == 1001
        assert indexer.pool.state(A) is EndpointState.LIVE
        assert sequence_resets() == resets + 1
        assert caplog.text.count(RESTART_LOG) == 1
        # seq 0 seen: nothing to replay; a later first seq (PUB still connecting): one replay from 0
        assert indexer.replayer.requests[asked:] in ([], [0])
    finally:
        await indexer.stop()
        engine.shutdown()


async def test_gap_is_replayed_once() -> None:
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    indexer = Indexer(InMemoryIndex(), ep)
    indexer.bind()
    indexer.receive()
    engine = Engine(bind, replay)
    try:
        blocks = itertools.count(1)
        await wait_until_async(indexer.applied, 10, "the engine's events", until=lambda n: n > 0,
                               interval=0.02, before_each=lambda: engine.step(next(blocks)))
        await indexer.caught_up(engine)
        asked = list(indexer.replayer.requests)  # at most the fresh start's
        gap_from = engine.publisher.next_seq
        engine.publisher.drop_next(4)  # numbered and buffered, never sent on PUB
        for _ in range(10):
            engine.step(next(blocks))
        await indexer.caught_up(engine)
        assert indexer.replayer.requests == [*asked, gap_from]
        assert held(indexer.index) == engine.held
        assert indexer.pool.state(A) is EndpointState.LIVE
        assert indexer.pool.stats.per_endpoint[A].sequence_gaps == 4
    finally:
        await indexer.stop()
        engine.shutdown()


class DoublingPublisher(ZmqEventPublisher):
    """A publisher whose replay answer carries every buffered message twice."""

    def _buffered_since(self, start: int) -> list[tuple[int, bytes]]:
        return [pair for pair in super()._buffered_since(start) for _ in range(2)]


async def test_replay_answered_with_duplicates_applies_each_message_once() -> None:
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    indexer = Indexer(InMemoryIndex(), ep)
    indexer.bind()
    indexer.receive()
    engine = Engine(bind, replay, DoublingPublisher)
    try:
        blocks = itertools.count(1)
        await wait_until_async(indexer.applied, 10, "the engine's events", until=lambda n: n > 0,
                               interval=0.02, before_each=lambda: engine.store(next(blocks)))
        await indexer.caught_up(engine)
        applied_before = indexer.index.stats().per_endpoint[0].events_applied
        seq_before = engine.publisher.next_seq
        engine.publisher.drop_next(5)
        for _ in range(8):
            engine.store(next(blocks))
        await indexer.caught_up(engine)
        assert indexer.replayer.requests[-1] == seq_before
        assert indexer.index.stats().per_endpoint[0].events_applied - applied_before == 8  # each once
        assert held(indexer.index) == engine.held
        assert indexer.pool.state(A) is EndpointState.LIVE
    finally:
        await indexer.stop()
        engine.shutdown()


async def test_out_of_order_and_resent_live_messages_replay_once_and_are_no_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hand-driven PUB sends vLLM 0.32 frames in the order 0 (until connected), 1, 3, 2, 4, 5; the
    engine's replay buffer (a vLLM-0.32-like ROUTER) holds 0-5."""
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    indexer = Indexer(InMemoryIndex(), ep)
    indexer.bind()
    indexer.receive()
    buffer = ZmqEventPublisher("tcp://127.0.0.1:*", TOPIC, replay_endpoint=replay)  # its PUB has no subscriber
    payloads = [encode_batch(EventBatch(ts=1_700_000_000.0 + seq, events=[stored(seq + 1)], data_parallel_rank=0))
                for seq in range(6)]
    for p in payloads:
        buffer.publish_payload(p)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(bind)
    topic = TOPIC.encode()

    def send(seq: int) -> None:
        pub.send_multipart([topic, encode_seq(seq), payloads[seq]])

    try:
        await wait_until_async(indexer.applied, 10, "seq 0 applied", until=lambda n: n == 1, interval=0.02,
                               before_each=lambda: send(0))  # re-sent until connected: duplicates after the first
        for seq in (1, 3, 2, 4, 5, 3):
            send(seq)
        await wait_until_async(indexer.applied, 10, "seq 5 applied", until=lambda n: n == 6, interval=0.02)
        await asyncio.sleep(0.2)  # let the late ones arrive
        await indexer.pool.drained()
        assert held(indexer.index) == {1, 2, 3, 4, 5, 6}
        assert indexer.index.stats().per_endpoint[0].events_applied == 6  # each once
        assert indexer.replayer.requests == [2]  # seq 3 before 2: one replay, from 2
        assert indexer.pool.state(A) is EndpointState.LIVE
        assert RESTART_LOG not in caplog.text
    finally:
        pub.close()
        ctx.term()
        buffer.shutdown()
        await indexer.stop()



async def test_positions_saved_during_a_recovery_restore_reliable_and_the_restart_replays_the_gap() -> None:
    """A snapshot taken while a gap is being replayed (the publisher's ROUTER has not answered yet)
    saves the position before the gap as reliable: the restarted indexer's startup replay covers the
    gap again, and the stream is live (not unreliable for a gap nobody lost)."""
    bind, replay = addresses()
    engine = Engine(bind, replay)  # its PUB connects nowhere that listens: the messages go through its buffer only
    for block in range(1, 11):
        engine.step(block)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # a replay endpoint that takes the request and never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent_address = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(silent_address)
    index = InMemoryIndex()
    hanging = ZmqReplayer()
    first = EventPool(index, workers=1, replayer=hanging, replay_timeout_seconds=3)
    slow = endpoint(bind, silent_address)
    index.register_endpoint(slow)
    first.endpoint_joined(slow)
    first.start()
    second: EventPool | None = None
    try:
        for seq, payload in engine.publisher._buffered_since(0)[:4]:
            first.submit(RawMessage(A, "m", seq, payload))
        seq, payload = engine.publisher._buffered_since(7)[0]
        first.submit(RawMessage(A, "m", seq, payload))  # 4-6 missed: the replay hangs
        await wait_until_async(lambda: first.state(A), 5, "the gap's recovery", until=lambda s: s is EndpointState.RECOVERING)
        position = first.export()[A]
        assert position == (4, True)
        await first.shutdown()
        # the restarted indexer: the index and positions as the snapshot restores them, the engine's real replay
        second = EventPool(index, workers=1, replayer=ZmqReplayer(), replay_timeout_seconds=5)
        ep = endpoint(bind, replay)
        second.restore(ep, *position)
        index.register_endpoint(ep)
        second.endpoint_joined(ep, new_incarnation=False)
        second.start()
        second.recover(ep, "startup")
        await second.settled()
        assert second.state(A) is EndpointState.LIVE
        assert second.export()[A] == (10, True)
        assert held(index) == engine.held
    finally:
        if second is not None:
            await second.shutdown()
        silent.close()
        ctx.term()
        engine.shutdown()
        hanging.close()


async def test_fresh_start_on_an_idle_engine_asks_again_once_its_first_message_follows_lost_ones() -> None:
    """The startup replay of an idle engine finds its buffer empty; the engine's first messages are
    then lost on the wire (its PUB still reconnecting): the first one that arrives is not taken as the
    start while the buffer has what came before it: one more replay from 0 brings them."""
    bind, replay = addresses()
    ep = endpoint(bind, replay)
    indexer = Indexer(InMemoryIndex(), ep)
    indexer.bind()
    engine = Engine(bind, replay)
    try:
        indexer.pool.recover(ep, "startup")
        await indexer.pool.settled()
        assert indexer.replayer.requests == [0] and indexer.pool.export()[A] == (None, True)
        indexer.receive()
        engine.publisher.drop_next(3)  # seq 0-2: buffered, never sent
        blocks = itertools.count(1)
        for _ in range(3):
            engine.step(next(blocks))
        await wait_until_async(indexer.applied, 10, "the engine's events", until=lambda n: n > 0,
                               interval=0.02, before_each=lambda: engine.step(next(blocks)))
        await indexer.caught_up(engine)
        assert indexer.replayer.requests == [0, 0]
        assert held(indexer.index) == engine.held  # seq 0-2 included
        assert indexer.pool.state(A) is EndpointState.LIVE
    finally:
        await indexer.stop()
        engine.shutdown()
