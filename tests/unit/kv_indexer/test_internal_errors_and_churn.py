"""An exception inside the pool never wedges an endpoint, and endpoint churn leaves no state behind.

- The index raising on a batch (a bug; the batch may be half applied) is healed as a loss of that
  batch, on every path that applies one: live, a gap's replay, a tail probe. Before, inside a
  recovery it left the endpoint ``recovering`` (never scored, every later message buffered) for
  good (/tmp/v10/recovery_wedge.py).
- A recovery that raises anywhere else (a replayer answering something that is not ``(seq, payload)``
  pairs) ends, healed as a loss, and the live messages it buffered start the stream afresh.
- Per-endpoint state of endpoints that come and go is forgotten: the drop log's kinds
  (``duplicate <id>``, ``tail-probe:<id>``), the fence of purged ids after the retention, messages
  held for endpoints that never registered.

The publisher is the simulator's ``ZmqEventPublisher`` (vLLM 0.32's wire and replay ROUTER), the
client the real ``ZmqReplayer`` (the engine and the ``rigs`` set-up: ``_support.py``, ``conftest.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import pytest
from prometheus_client import REGISTRY

from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.logging import RateLimitedLog
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.index.base import ApplyOutcome, IndexEvent
from tests.support import wait_until_async
from tests.unit.kv_indexer import _support as support
from tests.unit.kv_indexer._support import A, Engine, held, open_rig

BAD = 666
_TS = itertools.count(1_700_000_000)


def internal_losses() -> float:
    return REGISTRY.get_sample_value("kvmesh_kv_indexer_stream_losses_total", {"cause": "internal_error"}) or 0.0


class FlakyIndex(InMemoryIndex):
    """The in-memory index with a bug: it raises on any batch storing block ``BAD``."""

    def apply_batch(self, endpoint_id: EndpointId, events: Iterable[IndexEvent]) -> list[ApplyOutcome]:
        events = list(events)
        if any(isinstance(e, BlockStored) and e.block_hashes and e.block_hashes[0] == BAD for e in events):
            raise RuntimeError("index bug on one batch")
        return super().apply_batch(endpoint_id, events)


class WrongShapeReplayer(ZmqReplayer):
    """The real client, wrapped by a buggy adapter: its answer's seqs are strings."""

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        answer = await super().replay(endpoint, from_seq, timeout_seconds)
        return [(str(seq), payload) for seq, payload in answer]  # type: ignore[misc]


Rig = support.Rig[Engine, ZmqReplayer]


def rig(made: list[Rig], replayer: ZmqReplayer | None = None, **pool_args: float) -> Rig:
    return open_rig(made, FlakyIndex(), replayer or ZmqReplayer(), Engine, **pool_args)


async def test_an_index_error_on_a_replayed_batch_heals_and_the_endpoint_stays_live(rigs: list[Rig]) -> None:
    """The reviewer's case: the gap's replay hits the batch the index fails on."""
    index, pool, engine, _ = rig(rigs)
    before = internal_losses()
    engine.deliver(*engine.publish(100))
    engine.publish(BAD)  # lost live; the replay serves it
    engine.deliver(*engine.publish(102))
    await pool.drained()
    await pool.settled()
    engine.deliver(*engine.publish(103, 104, 105))
    await pool.drained()
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (6, True)  # before: recovering for good
    assert held(index) == {102, 103, 104, 105}  # 100 predates the half-applied batch: forgotten
    assert internal_losses() == before + 1 and pool.stats.dropped["internal_error"] == 1


async def test_an_index_error_on_a_live_batch_heals_as_a_loss_of_that_batch(rigs: list[Rig]) -> None:
    index, pool, engine, _ = rig(rigs)
    before = internal_losses()
    engine.deliver(*engine.publish(100, BAD, 102))
    await pool.drained()
    assert pool.state(A) is EndpointState.LIVE and held(index) == {102} and pool.export()[A] == (3, True)
    assert internal_losses() == before + 1


async def test_an_index_error_in_a_tail_probes_find_heals(rigs: list[Rig]) -> None:
    index, pool, engine, _ = rig(rigs, tail_probe_quiet_seconds=0.1, tail_probe_idle_max_seconds=0)
    before = internal_losses()
    engine.deliver(*engine.publish(100))
    engine.publish(BAD, 102)  # lost live: the probe finds them
    await wait_until_async(lambda: held(index), 5, "the probe's find applied", until=lambda h: 102 in h)
    await pool.drained()
    assert held(index) == {102} and pool.state(A) is EndpointState.LIVE and pool.export()[A] == (3, True)
    assert internal_losses() == before + 1


async def test_a_recovery_that_raises_ends_healed_and_its_buffered_messages_start_the_stream(
        rigs: list[Rig], caplog: pytest.LogCaptureFixture) -> None:
    index, pool, engine, _ = rig(rigs, replayer=WrongShapeReplayer())
    before = internal_losses()
    healed = REGISTRY.get_sample_value("kvmesh_kv_indexer_recoveries_total", {"trigger": "gap", "result": "healed"}) or 0.0
    engine.deliver(*engine.publish(100))
    engine.publish(101)  # lost
    engine.deliver(*engine.publish(102, 103, 104))  # a gap: the replay's answer makes the recovery raise
    await pool.drained()
    await pool.settled()
    assert pool.state(A) is EndpointState.LIVE and "kv event recovery failed" in caplog.text
    assert held(index) == {102, 103, 104} and pool.export()[A] == (5, True)  # 100 forgotten: 101 was lost
    assert internal_losses() == before + 1
    assert REGISTRY.get_sample_value("kvmesh_kv_indexer_recoveries_total", {"trigger": "gap", "result": "healed"}) == healed + 1
    engine.deliver(*engine.publish(105))
    await pool.drained()
    assert held(index) == {102, 103, 104, 105}


# -- churn ------------------------------------------------------------------------------------------------


def payload(h: int) -> bytes:
    stored = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)
    return encode_batch(EventBatch(ts=float(next(_TS)), events=[stored], data_parallel_rank=0))


async def test_churned_endpoints_leave_no_state_behind() -> None:
    now = [0.0]
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, clock=lambda: now[0], departed_retention_seconds=120.0, pending_ttl_seconds=10.0)
    pool.start()
    try:
        for i in range(300):  # each joins, sends a batch and a copy of it (a duplicate log kind), is purged
            ep = Endpoint(id=EndpointId(f"10.1.{i // 250}.{i % 250}:8000"), url="http://x", model="m", block_size_tokens=4)
            index.register_endpoint(ep)
            pool.endpoint_joined(ep)
            body = payload(i)
            pool.submit(RawMessage(ep.id, "m", 0, body))
            pool.submit(RawMessage(ep.id, "m", 1, payload(i + 1000)))
            pool.submit(RawMessage(ep.id, "m", 0, body))
            await pool.drained()
            index.remove_endpoint(ep.id)
            pool.endpoint_left(ep.id)
            now[0] += 0.1
        for i in range(50):  # endpoints that publish and never register
            pool.submit(RawMessage(EndpointId(f"10.2.0.{i}:8000"), "m", 0, payload(i)))
        await pool.drained()
        assert pool.stats.dropped["duplicate"] == 300
        late = EndpointId("10.1.0.0:8000")
        pool.submit(RawMessage(late, "m", 2, payload(7)))  # a purged endpoint's late message: the fence
        await pool.drained()
        assert pool.stats.dropped["endpoint_left"] == 1

        now[0] += 200.0  # past the retention and the pending ttl
        pool.expire_held()
        pool._drop_log.log(logging.INFO, "sweep", "a line after the churn")
        assert pool._departed == {} and pool._pending == {} and pool._tracks == {}
        assert pool._drop_log.kinds() <= 1 and pool.stats.dropped["unregistered"] == 50
        pool.submit(RawMessage(late, "m", 3, payload(8)))  # past the retention: held as unregistered
        await pool.drained()
        assert pool.stats.dropped["endpoint_left"] == 1 and list(pool._pending) == [late]
    finally:
        await pool.shutdown()


def test_rate_limited_log_forgets_kinds_that_come_and_go(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t.rl.churn"), 10.0, lambda: now[0])
    caplog.set_level(logging.WARNING, logger="t.rl.churn")
    for i in range(1000):
        log.warning(f"kind-{i}", "line %d", i)
    log.warning("noisy", "first")
    log.warning("noisy", "suppressed")
    assert log.kinds() == 1001
    now[0] = 10.0
    log.warning("other", "x")  # one sweep: the idle kinds with nothing suppressed go
    assert log.kinds() == 2  # "noisy" kept: its count is still owed
    now[0] = 15.0
    log.warning("noisy", "second")
    assert caplog.records[-1].getMessage() == "second (+1 more noisy lines suppressed in the last 10s)"
    log.warning("noisy", "suppressed again")
    now[0] = 120.0  # past forget_after (10 intervals): forgotten, count and all
    log.warning("other", "y")
    assert log.kinds() == 1 and log.suppressed("noisy") == 0
