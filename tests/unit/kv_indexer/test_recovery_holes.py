"""Live messages lost *while* a gap is being replayed (the flake of ``tests/faults/test_event_loss.py``).

A replay answers with what the publisher buffered when it was asked (vLLM 0.32's replay ROUTER,
``vllm/distributed/kv_events.py``); the live messages published after that keep arriving and are
buffered by the recovery. When the loss that caused the gap is still going on, some of those are
lost too, so the buffer holds a hole the answer could not cover. Those messages are still in the
publisher's buffer: the recovery must ask for them again, not declare a loss (which then kept the
endpoint ``unreliable``, unscored for good, so epp scored 0 for the engine that served a prompt).
Only a hole the publisher can no longer serve is a loss (healed: ``test_loss_healing.py``).

The publisher is the simulator's ``ZmqEventPublisher`` (vLLM 0.32's wire and replay protocol) and
the client the real ``ZmqReplayer``; the test decides, inside the replay exchange, which live
messages reach the pool, so each interleaving is exact, not timing-dependent.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator

import pytest

from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.types import Endpoint
from services.kv_indexer.events.pool import EndpointState, EventPool
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex
from tests.unit.kv_indexer import _support as support
from tests.unit.kv_indexer._support import A, held, open_rig

_TS = itertools.count(1_700_000_000)


def block(h: int) -> bytes:
    """Seq ``h - 1``'s batch: block ``h`` chained on block ``h - 1`` (a prompt growing one block per step)."""
    stored = BlockStored(block_hashes=[h], parent_block_hash=h - 1 if h > 1 else None,
                         token_ids=list(range(4 * h, 4 * h + 4)), block_size=4)
    return encode_batch(EventBatch(ts=float(next(_TS)), events=[stored], data_parallel_rank=0))


class Engine(support.Engine):
    """A publisher whose seq ``s`` stores block ``s + 1``; the pool is fed by hand (:meth:`deliver`)."""

    def __init__(self, pool: EventPool, buffer_steps: int = 10_000) -> None:
        super().__init__(pool, buffer_steps=buffer_steps)

    def publish(self, n: int) -> list[int]:  # type: ignore[override]
        """Publish ``n`` more messages (buffered for replay); returns their seqs."""
        return [self.send(block(self.publisher.next_seq + 1)) for _ in range(n)]

    async def arrive(self, *seqs: int) -> None:
        """:meth:`deliver`, and return once the pool's worker took them (a recovering stream buffers them)."""
        stats = self.pool.stats.per_endpoint
        before = stats[A].messages if A in stats else 0
        self.deliver(*seqs)
        for _ in range(1000):
            if stats[A].messages >= before + len(seqs):
                return
            await asyncio.sleep(0)
        raise AssertionError(f"the pool did not take seqs {seqs}")


Step = Callable[[], Awaitable[None]]


class LossyDuringReplay(ZmqReplayer):
    """The real replay client; after the publisher answered and before the answer is used, ``during``
    (one step per request, in order) publishes and delivers live messages: what arrives meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[int] = []
        self.during: Iterator[Step] = iter(())

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        self.requests.append(from_seq)
        answer = await super().replay(endpoint, from_seq, timeout_seconds)
        step = next(self.during, None)
        if step is not None:
            await step()
        return answer


Setup = support.Rig[Engine, LossyDuringReplay]


@pytest.fixture
async def setup(rigs: list[Setup]) -> Setup:
    return open_rig(rigs, InMemoryIndex(), LossyDuringReplay(), Engine)


async def test_a_live_message_lost_while_the_gap_was_replayed_is_asked_for_again(setup: Setup) -> None:
    index, pool, engine, replayer = setup
    engine.publish(3)
    engine.deliver(0, 2)  # seq 1 lost: a gap, replayed from 1 (the answer: 1-2)

    async def meanwhile() -> None:  # the loss goes on: 3 and 5 lost, 4 and 6 arrive while the answer travels
        engine.publish(4)
        await engine.arrive(4, 6)

    replayer.during = iter([meanwhile])
    await pool.drained()
    assert replayer.requests == [1, 3]  # the hole at 3 opened after the publisher answered: asked again
    assert pool.state(A) is EndpointState.LIVE
    assert held(index) == set(range(1, 8))  # every block the engine stored, nothing else
    assert pool.export()[A] == (7, True)
    assert index.stats().per_endpoint[0].events_applied == 7  # seq 0..6, each once


async def test_a_loss_that_lasts_several_answers_is_asked_for_until_covered(setup: Setup) -> None:
    index, pool, engine, replayer = setup
    engine.publish(2)
    engine.deliver(1)  # seq 0 lost

    async def lose_one() -> None:
        first, _ = engine.publish(2)
        await engine.arrive(first + 1)  # every answer, the next message is lost again

    replayer.during = iter([lose_one, lose_one, lose_one])
    await pool.drained()
    assert replayer.requests == [0, 2, 4, 6]
    assert pool.state(A) is EndpointState.LIVE and pool.export()[A] == (8, True)
    assert held(index) == set(range(1, 9))


async def test_a_first_batch_recovery_with_a_hole_after_its_start_asks_again(setup: Setup) -> None:
    """A fresh stream (indexer restarted): its start is asked once from 0; a live loss after the start
    is still replayable, so the stream ends live."""
    index, pool, engine, replayer = setup
    engine.publish(5)
    engine.deliver(4)  # the first message this incarnation sees: the buffer is asked from 0

    async def meanwhile() -> None:
        engine.publish(3)
        await engine.arrive(7)  # 5 and 6 lost

    replayer.during = iter([meanwhile])
    await pool.drained()
    assert replayer.requests == [0, 5]
    assert pool.state(A) is EndpointState.LIVE and held(index) == set(range(1, 9))


async def test_a_hole_the_publisher_can_no_longer_serve_is_a_loss(rigs: list[Setup]) -> None:
    """The boundary of the kind: when the missing messages left the publisher's buffer (vLLM's
    ``buffer_steps`` rolled past them), asking again cannot help: a loss. Healed: the entries that
    predate the hole are forgotten (they may be stale), what follows it is applied, the stream is live."""
    index, pool, engine, replayer = open_rig(rigs, InMemoryIndex(), LossyDuringReplay(),
                                             lambda pool: Engine(pool, buffer_steps=3))
    engine.publish(3)
    engine.deliver(0, 2)

    async def meanwhile() -> None:
        engine.publish(5)  # seq 3-7; the buffer keeps 5-7 only
        await engine.arrive(7)  # 3-6 lost, 3 and 4 for good

    replayer.during = iter([meanwhile])
    await pool.drained()
    assert replayer.requests == [1, 3]  # asked again once, answered from 5 on: 3-4 are gone
    assert pool.state(A) is EndpointState.LIVE and pool.stats.per_endpoint[A].losses == 1
    assert held(index) == {6, 7, 8}  # 1-3 forgotten at the hole; 6-8 (seq 5-7) applied after it
    assert index.score("m", list(range(4, 36))).scores == []  # nothing stale: 6 chains on the lost 5
