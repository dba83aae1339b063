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
from collections import deque
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


# -- wave 11 review (R2): "went back" decided at the answer, in arrival order --------------------------


def unpublished_drops(pool: EventPool) -> int:
    return pool.stats.dropped["unpublished"]


async def test_new_message_after_an_old_late_one_disowned_by_the_answer_is_no_restart(setup: Setup) -> None:
    """The old incarnation's late seq 3 arrives after the new stream's seq 0 (a gap from 1, asked of the
    new process, which has published only seq 0: an empty answer). The new process's seq 1 arrives while
    the answer is on its way: it is below the late message, but the answer disowns that one (dropped as
    ``unpublished``), so seq 1 went back below nothing: applied, no purge. Before, it was marked "went
    back" on arrival and read as a restart: the healthy new stream was purged and replayed from 0."""
    index, pool, engine, replayer = setup
    engine.deliver(*engine.publish(1, 2, 3))
    engine.publish(4)  # old seq 3, late
    await pool.drained()
    engine.restart()
    engine.deliver(*engine.publish(11))  # new seq 0: a restart, followed
    await pool.drained()
    assert held(index) == {11}
    resets, losses = sequence_resets(), pool.stats.per_endpoint[A].losses

    async def new_one() -> None:
        engine.publish(12)  # new seq 1, published after the (empty) answer
        await engine.arrive(1)

    replayer.during = iter([new_one])
    replayer.requests.clear()
    engine.deliver_old(3)
    await pool.drained()
    assert held(index) == {11, 12}
    assert sequence_resets() == resets and pool.stats.per_endpoint[A].losses == losses
    assert unpublished_drops(pool) == 1
    assert replayer.requests == [1, 3]  # the gap, then the late seq asked once more (disowned: nothing there)
    assert_live(pool, 2)


async def test_restart_during_a_fresh_recovery_after_the_old_buffer_rolled_past_seq_0(rigs: list[Setup]) -> None:
    """A fresh start asked from 0 of an old process whose buffer rolled past seq 0 (any engine past
    ``buffer_steps`` messages): it answers 3-5. The restarted process's seq 0 arrived meanwhile, below the
    live seq 4 buffered before it: a restart, though it is below the answer (checked before "below the
    answer: replayed already, or inside a hole"). Before, it was skipped and the old blocks stayed."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), DuringReplay(), lambda pool: Engine(pool, buffer_steps=3))
    engine.publish(1, 2, 3, 4, 5, 6)  # seqs 0-5, the buffer keeps 3-5
    engine.deliver(4)  # fresh: asked from 0, answered 3-5

    async def restart() -> None:
        engine.restart()
        engine.publish(11)  # the new process's seq 0
        await engine.arrive(0)

    replayer.during = iter([restart])
    resets = sequence_resets()
    await pool.drained()
    assert held(index) == {11}
    assert sequence_resets() == resets + 1
    assert_live(pool, 1)


@pytest.mark.parametrize("instance_id", ["", "i1"])
async def test_forged_far_ahead_message_is_dropped_and_a_healthy_endpoint_keeps_its_blocks(
    rigs: list[Setup], instance_id: str
) -> None:
    """One well-formed message at seq 1000 that the engine never published opens a gap recovery; the
    engine's real next message (seq 3) arrives after its answer was made, below the forged one. The
    answer, and a second ask from 1000, disown the forged message: dropped (``unpublished``), nothing
    forgotten, no restart. Before, seq 3 was "back" below the forged top: read as a restart, the
    endpoint purged (and, with an ``instance_id``, its stream held for a registration that never comes)."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), DuringReplay(),
                                             lambda pool: Engine(pool, instance_id=instance_id))
    engine.deliver(*engine.publish(1, 2, 3))
    await pool.drained()

    async def next_real() -> None:
        engine.publish(4)  # seq 3, published after the answer
        await engine.arrive(3)

    replayer.during = iter([next_real])
    resets = sequence_resets()
    pool.submit(RawMessage(A, "m", 1000, support.one_block(99)))
    await pool.drained()
    assert held(index) == {1, 2, 3, 4}
    assert unpublished_drops(pool) == 1
    assert pool.stats.per_endpoint[A].losses == 0 and sequence_resets() == resets
    assert replayer.requests == [3, 1000]
    assert_live(pool, 4)


class TruncatingReplay(DuringReplay):
    """vLLM 0.32's replay ROUTER keeps ZMQ's send high-water mark (1000) without ``ROUTER_MANDATORY``: a
    long answer can lose its tail and still end with the end marker. ``keep`` (one per request, in order;
    None: all) is how many messages of each answer arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: Iterator[int | None] = iter(())

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        answer = await super().replay(endpoint, from_seq, timeout_seconds)
        keep = next(self.keep, None)
        return answer if keep is None else answer[:keep]


async def test_a_live_message_above_an_answer_that_lost_its_tail_is_not_dropped(rigs: list[Setup]) -> None:
    """Seqs 3-8 were lost live, seq 9 arrived: a gap from 3, whose answer (3-9) loses its tail past 5.
    Seq 9, received before the ask and above the answer's newest, is not disowned on that answer's word:
    a second ask from 9 shows the same batch there, so it is kept; the hole 6-8 is asked for again and
    everything is applied once, in order, with no drop and no loss. Before, seq 9 was dropped as
    ``unpublished`` and the endpoint stood at seq 6 until its next message."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), TruncatingReplay(), Engine)
    engine.deliver(*engine.publish(1, 2, 3))
    await pool.drained()
    engine.publish(4, 5, 6, 7, 8, 9, 10)  # seqs 3-9
    replayer.keep = iter([3])  # the first answer keeps 3-5
    engine.deliver(9)
    await pool.drained()
    assert held(index) == set(range(1, 11))
    assert unpublished_drops(pool) == 0 and pool.stats.per_endpoint[A].losses == 0
    assert replayer.requests == [3, 9, 6]
    assert_live(pool, 10)


async def test_a_late_message_is_kept_when_the_second_ask_fails(rigs: list[Setup]) -> None:
    """The sibling where nothing is proven: the first answer does not hold the live seq 9, and the second
    ask (from 9) fails. The message is not dropped on the first answer's word: kept as a live message; its
    hole (6-8) is asked for again and served, so it is applied in order."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), TruncatingReplay(), Engine)
    engine.deliver(*engine.publish(1, 2, 3))
    await pool.drained()
    engine.publish(4, 5, 6, 7, 8, 9, 10)

    async def nothing() -> None:
        pass

    async def lose_next_answer() -> None:
        replayer.fail = True

    async def answer_again() -> None:
        replayer.fail = False

    replayer.keep = iter([3])
    replayer.before = iter([nothing, lose_next_answer, answer_again])
    engine.deliver(9)
    await pool.drained()
    assert unpublished_drops(pool) == 0
    assert held(index) == set(range(1, 11))
    assert replayer.requests == [3, 9, 6]
    assert_live(pool, 10)


class _CountingDeque(deque[tuple[int, RawMessage]]):
    """A recovery's live buffer that counts the scans over it."""

    scans = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingDeque.scans += 1
        return super().__iter__()

    def __reversed__(self):  # type: ignore[no-untyped-def]
        _CountingDeque.scans += 1
        return super().__reversed__()


async def queued(pool: EventPool) -> None:
    """Every message submitted so far was handled (a recovery may still be waiting for its answer)."""
    for queue in pool._queues:
        await queue.join()


async def test_live_messages_buffered_during_a_recovery_never_scan_the_buffer(rigs: list[Setup]) -> None:
    """A recovery whose buffered top is far ahead (a forged or late seq) while the answer is slow: every
    later live message is below it. Buffering one is O(1): "went back" and "a second copy of one buffered"
    are decided once, when the answer arrives (a seq -> ``ts`` map of the buffer). Before, each such
    message scanned the whole buffer for a copy: O(n^2) per recovery, on the event loop."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), DuringReplay(), Engine)
    engine.deliver(*engine.publish(1))
    await pool.drained()
    gate = asyncio.Event()

    async def slow_answer() -> None:
        await gate.wait()

    replayer.before = iter([slow_answer])
    pool.submit(RawMessage(A, "m", 1 << 40, support.one_block(99)))  # forged far ahead: a gap recovery
    await queued(pool)
    recovery = pool._tracks[A].recovery
    assert recovery is not None
    recovery.buffer = _CountingDeque(recovery.buffer)
    _CountingDeque.scans = 0
    engine.publish(*range(2, 302))  # seqs 1-300, each below the forged top
    engine.deliver(*range(1, 301))
    await queued(pool)
    assert _CountingDeque.scans == 0
    assert len(recovery.buffer) == 301
    gate.set()
    await pool.drained()
    assert held(index) == set(range(1, 302)) and unpublished_drops(pool) == 1
    assert_live(pool, 301)


async def test_a_disowned_message_is_asked_about_once_and_dropped_once_across_rounds(setup: Setup) -> None:
    """A forged seq 1000 opens a gap from 3 (answered 3-5); the engine's seq 6 is lost live after the
    answer and its seq 7 arrives: a hole, asked for again from 6. The forged message, disowned by the
    second ask of the first round, is not asked about again in the next round and is counted once."""
    index, pool, engine, replayer = setup
    engine.deliver(*engine.publish(1, 2, 3))
    await pool.drained()
    engine.publish(4, 5, 6)  # seqs 3-5, lost live

    async def after_answer() -> None:
        engine.publish(7, 8)  # seqs 6-7: 6 lost live, 7 arrives
        await engine.arrive(7)

    replayer.during = iter([after_answer])
    pool.submit(RawMessage(A, "m", 1000, support.one_block(99)))
    await pool.drained()
    assert replayer.requests == [3, 1000, 6]
    assert unpublished_drops(pool) == 1 and pool.stats.per_endpoint[A].losses == 0
    assert held(index) == set(range(1, 9))
    assert_live(pool, 8)
