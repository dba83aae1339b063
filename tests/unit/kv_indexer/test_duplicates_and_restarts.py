"""A lower seq is a duplicate only when it is a copy of a message applied; anything else is a restart.

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) numbers its messages from 0 per
publisher process (``itertools.count()``) and replays the very ``(seq, payload)`` it published, so a
duplicate carries the ``ts`` already applied at its seq. Before, a lower seq was a duplicate whenever
its ``ts`` was no newer than the last batch applied: one well-formed batch stamped far in the future
(forged, corrupt, or an engine whose clock jumped) or a restart whose wall clock stepped back made
every later batch of the engine a "duplicate", dropped at DEBUG level, for good.

The publisher is the simulator's ``ZmqEventPublisher`` (vLLM 0.32's wire and replay ROUTER
protocol), the client the real ``ZmqReplayer``; the test decides which live messages reach the pool
(the shared set-up: ``_support.py``, ``conftest.py``).
"""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from kvmesh.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex
from tests.unit.kv_indexer import _support as support
from tests.unit.kv_indexer._support import A, bind_publisher, held, open_rig

NOW = 1_764_540_000.0  # the engine's wall clock at its first batch (2025-11-30)
FAR_FUTURE = 1e15  # a well-formed, finite ts some 31 million years ahead
DUPLICATE_LOG = "dropping duplicate kv event message"
RESTART_LOG = "publisher restarted"


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def sequence_resets() -> float:
    return metric("kvmesh_kv_indexer_incarnations_total", signal="sequence_reset")


def stored(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(range(4 * h, 4 * h + 4)), block_size=4)


class Engine(support.Engine):
    """A vLLM-style publisher (PUB, and a replay ROUTER unless ``replay=False``) whose batches carry
    the ``ts`` the test gives; its live messages reach the pool when the test delivers them."""

    def __init__(self, pool: EventPool, replay: bool = True) -> None:
        super().__init__(pool, None if replay else "")

    def publish(self, ts: float, *events: KVEvent) -> int:  # type: ignore[override]
        return self.send(encode_batch(EventBatch(ts=ts, events=list(events), data_parallel_rank=0)))

    def restart(self) -> None:
        """A new publisher process on the same addresses: seq counts from 0 again."""
        self.publisher.shutdown()
        self.publisher = bind_publisher(self.replay)
        self.sent = {}


def forge(pool: EventPool, seq: int, ts: float, *events: KVEvent) -> None:
    """A well-formed batch on the engine's topic that the engine never published."""
    pool.submit(RawMessage(A, "m", seq, encode_batch(EventBatch(ts=ts, events=list(events), data_parallel_rank=0))))


Rig = support.Rig[Engine, ZmqReplayer]


def rig(made: list[Rig], replay: bool = True) -> Rig:
    return open_rig(made, InMemoryIndex(), ZmqReplayer(), lambda pool: Engine(pool, replay))


def duplicates(pool: EventPool) -> int:
    return pool.stats.dropped["duplicate"]


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay-endpoint", "replay-endpoint"])
async def test_a_forged_far_ahead_seq_with_a_far_future_ts_does_not_blind_the_index(
    rigs: list[Rig], replay: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The reviewer's case: seq 10**12 with ts 1e15, then the engine's real batches. Without a replay
    endpoint it is a gap nothing covers (a loss healed, the forged batch applied, the engine's next seq
    a restart); with one, the engine's answer (newest seq 0) shows it never published it: dropped
    (``unpublished``), nothing forgotten, and the engine's next batches follow in order."""
    index, pool, engine, _ = rig(rigs, replay)
    engine.deliver(engine.publish(NOW, stored(1)))
    await pool.drained()
    resets = sequence_resets()
    forge(pool, 10**12, FAR_FUTURE)
    await pool.drained()
    if replay:
        assert pool.export()[A] == (1, True) and held(index) == {1} and pool.stats.dropped["unpublished"] == 1
    else:
        assert pool.export()[A] == (10**12 + 1, True) and held(index) == set()

    caplog.clear()
    for h in range(2, 7):  # the engine's next five batches, seqs 1-5
        engine.deliver(engine.publish(NOW + h, stored(h, h - 1)))
    await pool.drained()
    assert duplicates(pool) == 0  # before: all five dropped as duplicates, the engine scored 0 for good
    # without a replay buffer: purged once (a restart read); with one: never forgotten, no restart
    assert sequence_resets() == resets + (0 if replay else 1) and caplog.text.count(RESTART_LOG) == (0 if replay else 1)
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (6, True)
    assert held(index) == ({1} if replay else set()) | {2, 3, 4, 5, 6}
    engine.deliver(engine.publish(NOW + 7, BlockRemoved(block_hashes=[6])))
    await pool.drained()
    assert 6 not in held(index)  # its removals are applied too


async def test_the_engines_own_copies_after_a_forged_gap_are_duplicates_then_its_next_seq_in_order(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    """The forged gap's replay serves the engine's real seqs 1-2 (they were late live) and ends there:
    the forged seq, received before the engine answered, is not the engine's (dropped, ``unpublished``;
    before, a loss that forgot block 1's chain, then the engine's seq 3 read as a restart). The live
    copies of 1-2 are duplicates (the same ts), its seq 3 follows in order, whatever the forged ts."""
    index, pool, engine, _ = rig(rigs)
    engine.deliver(engine.publish(NOW, stored(1)))
    await pool.drained()
    engine.publish(NOW + 1, stored(2, 1))  # seq 1, on its way
    engine.publish(NOW + 2, BlockRemoved(block_hashes=[1]))  # seq 2, on its way
    forge(pool, 10**12, FAR_FUTURE)
    await pool.drained()
    assert held(index) == {2} and pool.stats.dropped["unpublished"] == 1  # replayed 1-2, the forged one dropped
    assert pool.stats.per_endpoint[A].losses == 0 and pool.export()[A] == (3, True)
    resets = sequence_resets()
    caplog.set_level(logging.INFO, "services.kv_indexer.events.pool")
    caplog.clear()
    engine.deliver(1, 2)  # the late live copies
    await pool.drained()
    assert duplicates(pool) == 2 and sequence_resets() == resets  # copies of replayed messages: no restart
    assert caplog.text.count(DUPLICATE_LOG) == 1  # one line per endpoint per 10 s
    engine.deliver(engine.publish(NOW + 3, stored(3, 2)))
    await pool.drained()
    assert sequence_resets() == resets and duplicates(pool) == 2
    assert held(index) == {2, 3}  # exactly what the engine holds
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (4, True)


async def test_a_restart_whose_wall_clock_stepped_back_purges_and_is_followed(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture
) -> None:
    """The restarted engine's batches are stamped *before* the old incarnation's last one (its clock
    was corrected backwards across the restart; the registration did not reveal a new incarnation)."""
    index, pool, engine, _ = rig(rigs)
    for h in range(1, 4):
        engine.deliver(engine.publish(NOW + 100 + h, stored(h, h - 1 if h > 1 else None)))
    await pool.drained()
    assert held(index) == {1, 2, 3}
    resets = sequence_resets()
    engine.restart()
    caplog.clear()
    for h in range(11, 14):  # seqs 0-2 again, an hour earlier than the old ones
        engine.deliver(engine.publish(NOW - 3600 + h, stored(h, h - 1 if h > 11 else None)))
    await pool.drained()
    assert duplicates(pool) == 0  # before: read as duplicates (older ts) until seq 3, the old blocks kept
    assert sequence_resets() == resets + 1 and caplog.text.count(RESTART_LOG) == 1
    assert held(index) == {11, 12, 13} and pool.export()[A] == (3, True)


async def test_after_one_far_future_batch_in_order_a_later_restart_is_still_seen(rigs: list[Rig]) -> None:
    """An engine whose clock jumped ahead (its last batch stamped 1e15), then restarted with its clock
    corrected: copies from a replay are still duplicates, and the restart purges."""
    index, pool, engine, _ = rig(rigs)
    engine.deliver(engine.publish(NOW, stored(1)))
    engine.publish(NOW + 1, stored(2, 1))  # seq 1: lost live, replayed
    engine.deliver(engine.publish(FAR_FUTURE, stored(3, 2)))  # seq 2: the gap; the clock jumped
    await pool.drained()
    engine.deliver(1)  # its late live copy
    await pool.drained()
    assert held(index) == {1, 2, 3} and duplicates(pool) == 1
    resets = sequence_resets()
    engine.restart()
    engine.deliver(engine.publish(NOW + 10, stored(21)))  # seq 0 again, ts far below the last applied
    engine.deliver(engine.publish(NOW + 11, stored(22, 21)))
    await pool.drained()
    assert sequence_resets() == resets + 1 and duplicates(pool) == 1  # before: both dropped as duplicates
    assert held(index) == {21, 22} and pool.state(A) is EndpointState.LIVE


async def test_a_re_sent_live_message_is_a_duplicate_and_one_with_another_ts_a_restart(rigs: list[Rig]) -> None:
    index, pool, engine, _ = rig(rigs, replay=False)
    for h in range(1, 4):
        engine.deliver(engine.publish(NOW + h, stored(h, h - 1 if h > 1 else None)))
    engine.deliver(1, 2)  # copies of live messages applied
    await pool.drained()
    assert duplicates(pool) == 2 and held(index) == {1, 2, 3}
    resets = sequence_resets()
    forge(pool, 1, NOW + 1.5, stored(9))  # seq 1 again but not the batch applied at seq 1: a new stream
    await pool.drained()
    assert sequence_resets() == resets + 1 and held(index) == {9} and pool.export()[A] == (2, True)
