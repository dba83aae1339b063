"""A publisher restart read whatever state the stream is in: during a recovery, and an old incarnation's
late message after the new stream began.

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) numbers its messages from 0 per
process, and its publisher thread appends each message to the replay buffer right after sending it,
in the same thread that serves replay requests: an answer holds every message the answering process
published before it answered. The publisher here is the simulator's ``ZmqEventPublisher`` (the same
wire and replay ROUTER; it buffers before sending), the client the real ``ZmqReplayer``; the test
restarts the publisher (a new process on the same replay address) *inside* a replay exchange, after
the old process answered, so each interleaving is exact.

Before, a recovery buffered every live message of a fresh start (and every one at or above the
position it replays from) and, once the answer was applied, skipped those below it as "replayed
already": the restarted engine's first message was discarded and the old incarnation's blocks stayed
indexed, for good when the engine then went quiet. And an old incarnation's late message (delivered
after the new stream's first) read as a gap no replay covered: healed as a loss that forgot the new
stream's blocks and stored the old one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest
from prometheus_client import REGISTRY

from kvmesh.types import Endpoint
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex
from tests.unit.kv_indexer import _support as support
from tests.unit.kv_indexer._support import A, bind_publisher, held, open_rig


def sequence_resets() -> float:
    return REGISTRY.get_sample_value("kvmesh_kv_indexer_incarnations_total", {"signal": "sequence_reset"}) or 0.0


class Engine(support.Engine):
    """Endpoint ``A``'s publisher; :meth:`restart` replaces it with a new process on the same replay
    address (seq from 0 again). ``old`` keeps the previous process's payloads (its late messages)."""

    def __init__(self, pool: EventPool, replay: str | None = None, instance_id: str = "", **publisher_args: int) -> None:
        super().__init__(pool, replay, instance_id, **publisher_args)
        self.old: dict[int, bytes] = {}

    def restart(self) -> None:
        self.publisher.shutdown()
        self.publisher = bind_publisher(self.replay)
        self.old, self.sent = self.sent, {}

    def deliver_old(self, seq: int) -> None:
        """The previous process's message ``seq`` reaches the pool late (after the new stream began)."""
        self.pool.submit(RawMessage(A, "m", seq, self.old[seq]))

    async def arrive(self, *seqs: int) -> None:
        """:meth:`deliver`, and return once the pool's worker took them."""
        stats = self.pool.stats.per_endpoint
        before = stats[A].messages if A in stats else 0
        self.deliver(*seqs)
        for _ in range(1000):
            if stats[A].messages >= before + len(seqs):
                return
            await asyncio.sleep(0)
        raise AssertionError(f"the pool did not take seqs {seqs}")


Step = Callable[[], Awaitable[None]]


class DuringReplay(ZmqReplayer):
    """The real replay client; after the publisher answered and before the answer is used, ``during``
    (one step per request, in order) runs: a restart, live messages arriving meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[int] = []
        self.during: Iterator[Step] = iter(())
        self.before: Iterator[Step] = iter(())
        """Steps run before the request is sent (one per request)."""
        self.fail = False
        """The answer is lost (after ``during`` ran): the request fails."""

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        self.requests.append(from_seq)
        first = next(self.before, None)
        if first is not None:
            await first()
        answer = await super().replay(endpoint, from_seq, timeout_seconds)
        step = next(self.during, None)
        if step is not None:
            await step()
        if self.fail:
            raise TimeoutError("the answer was lost")
        return answer


Setup = support.Rig[Engine, DuringReplay]


@pytest.fixture
async def setup(rigs: list[Setup]) -> Setup:
    return open_rig(rigs, InMemoryIndex(), DuringReplay(), Engine)


def assert_live(pool: EventPool, next_seq: int) -> None:
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (next_seq, True)


async def test_a_restart_whose_first_message_arrives_during_a_fresh_recovery_is_followed(setup: Setup) -> None:
    """The reviewer's case: the stream's start is unknown (the indexer restarted), its first message
    asks the buffer from 0; the old process answers, then restarts and publishes its new seq 0."""
    index, pool, engine, replayer = setup
    engine.publish(1, 2, 3)  # seqs 0-2
    engine.deliver(2)  # the first this incarnation sees: a fresh recovery from 0

    async def restart() -> None:
        engine.restart()
        engine.publish(11)  # the new process's seq 0
        await engine.arrive(0)

    replayer.during = iter([restart])
    resets = sequence_resets()
    await pool.drained()
    assert held(index) == {11}  # before: {1, 2, 3}, the new stream's seq 0 discarded as "replayed already"
    assert sequence_resets() == resets + 1
    assert_live(pool, 1)


async def test_a_restart_above_the_replayed_position_during_a_gap_recovery_is_followed(setup: Setup) -> None:
    """A sibling: a gap recovery from seq 2 (the old process answers 2-3); the restarted process's
    seq 2 arrives after the old seq 3 it is below, though at or above the position replayed from."""
    index, pool, engine, replayer = setup
    engine.publish(1, 2, 3, 4)  # seqs 0-3
    engine.deliver(0, 1, 3)  # seq 2 lost: a gap, replayed from 2

    async def restart() -> None:
        engine.restart()
        engine.publish(11, 12, 13)  # new seqs 0-2, only 2 arrives
        await engine.arrive(2)

    replayer.during = iter([restart])
    await pool.drained()
    assert replayer.requests == [2, 0]  # the restart's stream is asked from 0 (its seq 2 followed lost ones)
    assert held(index) == {11, 12, 13}  # before: {1, 2, 3, 4}
    assert_live(pool, 3)


async def test_a_restart_seen_only_once_the_answer_is_applied_is_followed(setup: Setup) -> None:
    """A sibling no arrival order reveals: the restarted process's message arrives after the answer,
    above every live message buffered but below what the old answer covered (a different batch at a
    seq applied): the publisher restarted after answering."""
    index, pool, engine, replayer = setup
    engine.publish(1, 2, 3, 4, 5, 6)  # seqs 0-5
    engine.deliver(1)  # fresh: asked from 0, answered 0-5

    async def restart() -> None:
        engine.restart()
        engine.publish(11, 12, 13, 14)  # new seqs 0-3, only 3 arrives
        await engine.arrive(3)

    replayer.during = iter([restart])
    await pool.drained()
    assert replayer.requests == [0, 0]
    assert held(index) == {11, 12, 13, 14}  # before: {1, ..., 6}
    assert_live(pool, 4)


async def test_an_old_incarnations_late_message_after_the_new_stream_began_is_not_applied(setup: Setup) -> None:
    """Item 2: the old process's last message is delivered after the new process's seq 0 (another ZMQ
    connection, fair-queued). It reads as a gap; the new process's answer shows it never published
    that seq: dropped, and the new stream's blocks stay."""
    index, pool, engine, _ = setup
    engine.deliver(*engine.publish(1, 2, 3))
    engine.publish(4)  # old seq 3, late
    await pool.drained()
    engine.restart()
    engine.deliver(*engine.publish(11))  # new seq 0: a restart, purged, followed
    await pool.drained()
    assert held(index) == {11}
    engine.deliver_old(3)
    await pool.drained()
    assert held(index) == {11}  # before: {4} (the new stream forgotten as a loss, the old block stored)
    assert pool.stats.dropped["unpublished"] == 1 and pool.stats.per_endpoint[A].losses == 0
    assert_live(pool, 1)
    engine.deliver(*engine.publish(12))  # the new stream goes on in order
    await pool.drained()
    assert held(index) == {11, 12}
    assert_live(pool, 2)


async def test_an_old_incarnations_late_message_below_the_new_streams_position_is_not_applied(
    setup: Setup,
) -> None:
    """A sibling: the new stream is already past the late message's seq, so it reads as a restart;
    the fresh start's answer (the new process's) holds another batch at that seq: the late message
    is the old incarnation's, dropped; the new stream is rebuilt from its buffer."""
    index, pool, engine, _ = setup
    engine.deliver(*engine.publish(1, 2, 3))
    await pool.drained()
    engine.restart()
    engine.deliver(*engine.publish(11, 12, 13, 14))  # new seqs 0-3
    await pool.drained()
    engine.deliver_old(1)
    await pool.drained()
    assert held(index) == {11, 12, 13, 14}
    assert pool.stats.dropped["old_incarnation"] == 1
    assert_live(pool, 4)


async def test_a_restart_during_a_recovery_whose_answer_is_lost_is_followed(setup: Setup) -> None:
    """A sibling with no answer to compare: the restarted process's seq 0 went back below the live
    message buffered; with nothing showing it a copy, it is read as a restart (before: sorted first,
    taken as the start, then the old seq 2 after it a loss that forgot it and stored the old block)."""
    index, pool, engine, replayer = setup
    engine.publish(1, 2, 3)
    engine.deliver(2)  # fresh: asked from 0

    async def restart() -> None:
        engine.restart()
        engine.publish(11)
        await engine.arrive(0)

    replayer.during = iter([restart])
    replayer.fail = True
    await pool.drained()
    assert held(index) == {11}  # before: {3}
    assert pool.stats.per_endpoint[A].losses == 0
    assert_live(pool, 1)


async def test_a_restart_during_a_recovery_of_an_instance_id_endpoint_waits_for_its_registration(
    rigs: list[Setup],
) -> None:
    """A sibling: the endpoint registered with an ``instance_id``; the restart read during the recovery
    purges at once and holds the new stream until the new registration, which starts it."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), DuringReplay(),
                                             lambda pool: Engine(pool, instance_id="i1"))
    engine.publish(1, 2, 3)
    engine.deliver(2)

    async def restart() -> None:
        engine.restart()
        engine.publish(11)
        await engine.arrive(0)

    replayer.during = iter([restart])
    await pool.drained()
    assert held(index) == set()  # the old incarnation's blocks purged; the new stream held
    engine.instance_id = "i2"
    index.register_endpoint(engine.endpoint)
    pool.endpoint_joined(engine.endpoint, new_incarnation=True)
    await pool.drained()
    assert held(index) == {11}
    assert_live(pool, 1)


async def test_without_a_replay_endpoint_an_old_incarnations_late_message_stands_until_the_next_new_one(
    rigs: list[Setup],
) -> None:
    """The race's residue, documented in ``events/pool.py``: with no replay buffer nothing shows whose
    the late message is; it is a gap no replay covers (a loss: the new stream's blocks forgotten, the
    old block stored) until the new stream's next message, which goes back below it: a restart,
    purged, followed."""
    index, pool, engine, _ = open_rig(rigs, InMemoryIndex(), DuringReplay(), lambda pool: Engine(pool, replay=""))
    engine.deliver(*engine.publish(1, 2, 3))
    engine.publish(4)  # old seq 3, late
    engine.restart()
    engine.deliver(*engine.publish(11))
    await pool.drained()
    engine.deliver_old(3)
    await pool.drained()
    assert held(index) == {4}  # the bounded window: a stale block until the new stream speaks again
    engine.deliver(*engine.publish(12))
    await pool.drained()
    assert held(index) == {12}  # its seq 1 went back: purged, followed (seq 0's block a lost hit)
    assert_live(pool, 2)


async def test_a_live_message_the_buffer_rolled_past_before_answering_is_no_restart(rigs: list[Setup]) -> None:
    """The boundary of the rule: the gap's first live message was published by the answering process,
    but its buffer (``buffer_steps`` 3) rolled past it before it answered. The answer does not hold it
    and holds no other batch at its seq: it lies in a hole healed as a loss, not a restart."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), DuringReplay(),
                                             lambda pool: Engine(pool, buffer_steps=3))
    engine.publish(1, 2, 3)
    engine.deliver(0, 2)  # seq 1 lost: a gap from 1, seq 2 buffered

    async def burst() -> None:
        engine.publish(4, 5, 6, 7, 8)  # seqs 3-7, not delivered; the buffer keeps 5-7

    replayer.before = iter([burst])
    resets = sequence_resets()
    await pool.drained()
    assert replayer.requests == [1]  # no restart read, no second replay
    assert sequence_resets() == resets and pool.stats.per_endpoint[A].losses == 1
    assert held(index) == {6, 7, 8}  # what followed the hole
    assert_live(pool, 8)
