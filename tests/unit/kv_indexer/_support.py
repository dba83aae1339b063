"""The event-pool tests' engine: endpoint ``A``'s KV-event publisher, fed to the pool by hand.

The publisher is the simulator's ``ZmqEventPublisher`` (vLLM 0.32's PUB wire and replay ROUTER,
``vllm/distributed/kv_events.py``; seq counts from 0 per publisher process); the replay client the
tests pair it with is the real ``ZmqReplayer``. A test decides which live messages reach the pool
(:meth:`Engine.deliver`); the others were lost on the PUB socket and only the replay can serve them.
"""

from __future__ import annotations

import errno
import itertools
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

import zmq

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.kv_events import BlockStored, EventBatch, encode_batch, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex

A = EndpointId("127.0.0.1:9001")
_TS = itertools.count(1_700_000_000)


def bind_publisher(replay: str, **publisher_args: int) -> ZmqEventPublisher:
    """Endpoint ``A``'s publisher: PUB on a free port, replay ROUTER at ``replay`` (``""``: none).

    A restart binds the replay address its predecessor held, which that socket's own thread frees a
    moment after ``shutdown()``: ``EADDRINUSE`` is retried for up to 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", make_topic(A, "m"), replay_endpoint=replay,
                                     **publisher_args)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def one_block(h: int) -> bytes:
    """A batch storing block ``h`` alone (no parent, tokens ``4h .. 4h+3``), stamped with the next ts."""
    stored = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(4 * h, 4 * h + 4)),
                         block_size=4)
    return encode_batch(EventBatch(ts=float(next(_TS)), events=[stored], data_parallel_rank=0))


class Engine:
    """One publisher process of endpoint ``A`` (block size 4, model ``m``): a replay ROUTER at
    ``replay`` (a free port when ``None``, none when ``""``), registered with ``instance_id``.

    :meth:`send` publishes a payload (kept for :meth:`deliver`); :meth:`publish` stores one block per
    hash given, one message each."""

    instance_id = ""  # for a subclass whose own __init__ does not set it (test_loss_healing's)

    def __init__(self, pool: EventPool, replay: str | None = None, instance_id: str = "",
                 **publisher_args: int) -> None:
        self.pool = pool
        self.instance_id = instance_id
        self.replay = f"tcp://127.0.0.1:{free_port()}" if replay is None else replay
        self.publisher = bind_publisher(self.replay, **publisher_args)
        self.sent: dict[int, bytes] = {}

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, instance_id=self.instance_id,
                        replay_endpoint=self.replay)

    def send(self, payload: bytes) -> int:
        """Publish one message (buffered for replay); its seq."""
        seq = self.publisher.next_seq
        self.sent[seq] = payload
        self.publisher.publish_payload(payload)
        return seq

    def publish(self, *hashes: int) -> list[int]:
        """One message per hash, storing that block (:func:`one_block`); their seqs."""
        return [self.send(one_block(h)) for h in hashes]

    def deliver(self, *seqs: int) -> None:
        """These seqs reach the pool live."""
        for seq in seqs:
            self.pool.submit(RawMessage(A, "m", seq, self.sent[seq]))

    def shutdown(self) -> None:
        self.publisher.shutdown()


E = TypeVar("E", bound=Engine)
R = TypeVar("R", bound=ZmqReplayer)


class Rig(NamedTuple, Generic[E, R]):
    """A started pool fed by one engine whose endpoint registered and joined (:func:`open_rig`)."""

    index: InMemoryIndex
    pool: EventPool
    engine: E
    replayer: R

    async def close(self) -> None:
        self.engine.shutdown()
        await self.pool.shutdown()
        self.replayer.close()


def open_rig(made: list[Rig[E, R]], index: InMemoryIndex, replayer: R, engine: Callable[[EventPool], E],
             replay_timeout_seconds: float = 5.0, **pool_args: float) -> Rig[E, R]:
    """A one-worker pool on ``index`` and ``replayer`` (``pool_args`` on top), fed by ``engine(pool)``,
    whose endpoint is registered with the index and has joined the pool; appended to ``made`` (the
    ``rigs`` fixture of conftest.py closes them after the test)."""
    pool = EventPool(index, workers=1, replayer=replayer, replay_timeout_seconds=replay_timeout_seconds,
                     **pool_args)  # type: ignore[arg-type]
    feeder = engine(pool)
    index.register_endpoint(feeder.endpoint)
    pool.endpoint_joined(feeder.endpoint)
    pool.start()
    made.append(Rig(index, pool, feeder, replayer))
    return made[-1]


def held(index: InMemoryIndex) -> set[int]:
    """The blocks the index holds for ``A``."""
    return {int(h) for h in index.held_blocks(A)}
