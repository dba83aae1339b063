"""The tail probe's scheduling at fleet scale: every idle endpoint is probed, at the configured rate.

Before, ``probe_tails`` (one call per 0.5 s tick) started at most ``tail_probe_concurrency`` (4)
probes per tick, 8/s whatever ``tail_probe_max_per_second`` (20) said, and scanned the endpoints from
the first every time: the first ~240 endpoints' idle re-probes took every slot and later endpoints
were never probed (/tmp/v10/probe_starvation.py: 760 of 1,000 never probed in 300 s).

What is under test is the pool's scheduling, not the replay protocol (the real ``ZmqReplayer``
against vLLM's replay ROUTER is exercised in test_loss_healing.py): the :class:`Replayer` port is
answered in process, counting asks, so a thousand endpoints need no thousand sockets, and the clock
is the test's.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex

_TS = itertools.count(1_700_000_000)


class CountingReplayer:
    """A publisher whose buffer holds nothing after what was applied (every tail confirmed); records
    each ask, and the most asks in flight at once."""

    def __init__(self) -> None:
        self.asked: Counter[EndpointId] = Counter()
        self.order: list[EndpointId] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        self.asked[endpoint.id] += 1
        self.order.append(endpoint.id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # an answer takes a turn of the loop
        self.in_flight -= 1
        return []


def endpoint(i: int) -> Endpoint:
    return Endpoint(id=EndpointId(f"10.0.{i // 250}.{i % 250}:8000"), url="http://x", model="m", block_size_tokens=4,
                    replay_endpoint="tcp://127.0.0.1:1")


def message(ep: Endpoint, seq: int, h: int) -> RawMessage:
    stored = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)
    return RawMessage(ep.id, "m", seq, encode_batch(EventBatch(ts=float(next(_TS)), events=[stored], data_parallel_rank=0)))


def fleet(n: int, now: list[float], **pool_args: float) -> tuple[EventPool, CountingReplayer, list[Endpoint]]:
    """``n`` endpoints with one message applied each; the pool's workers are not started (messages are
    handed to its sequencing directly, and no housekeeping tick runs: the test calls ``probe_tails``)."""
    index = InMemoryIndex()
    replayer = CountingReplayer()
    pool = EventPool(index, workers=1, replayer=replayer, clock=lambda: now[0],
                     tail_probe_quiet_seconds=2.0, **pool_args)  # type: ignore[arg-type]
    endpoints = [endpoint(i) for i in range(n)]
    for i, ep in enumerate(endpoints):
        index.register_endpoint(ep)
        pool.endpoint_joined(ep)
        pool._handle(message(ep, 0, i))
    return pool, replayer, endpoints


async def run_ticks(pool: EventPool, now: list[float], seconds: float, tick: float = 0.5) -> None:
    for _ in range(int(seconds / tick)):
        now[0] += tick
        pool.probe_tails()
        await pool.drained()  # the probes, and those their ends started, run to the end


async def test_every_idle_endpoint_is_probed_at_the_configured_rate_whatever_the_fleet_size() -> None:
    now = [0.0]
    pool, replayer, _ = fleet(1000, now)  # defaults: 20/s, 4 at once, idle re-probe up to 30 s
    await run_ticks(pool, now, 120.0)
    total = sum(replayer.asked.values())
    assert len(replayer.asked) == 1000  # before: 240 probed, 760 never
    assert 0.95 * 20 * 118 <= total <= 20 * 120 + 20  # the configured rate, reached (before: 8/s at most)
    assert max(replayer.asked.values()) - min(replayer.asked.values()) <= 1  # round-robin: fair
    assert replayer.most_in_flight <= 4
    await pool.shutdown()


async def test_first_probes_of_a_new_position_go_before_idle_re_probes() -> None:
    now = [0.0]
    pool, replayer, endpoints = fleet(50, now, tail_probe_max_per_second=1.0, tail_probe_idle_max_seconds=4.0)
    await run_ticks(pool, now, 60.0)  # every tail confirmed; idle re-probes due all the time (50 > 1/s * 4 s)
    assert len(replayer.asked) == 50
    busy = endpoints[7]
    pool._handle(message(busy, 1, 999))  # new activity: a new position to probe once quiet
    now[0] += 2.0
    replayer.order.clear()
    await run_ticks(pool, now, 1.0)
    assert replayer.order[0] == busy.id  # not behind the 49 idle re-probes due
    await pool.shutdown()


async def test_a_probe_that_ends_starts_the_next_one_due_without_waiting_for_a_tick() -> None:
    now = [0.0]
    pool, replayer, _ = fleet(20, now, tail_probe_concurrency=1, tail_probe_max_per_second=20.0)
    now[0] += 3.0
    assert pool.probe_tails() == 1  # one slot: one started by the scan...
    await pool.drained()  # ...and each end starts the next, within the rate's tokens
    assert len(replayer.asked) == 20 and replayer.most_in_flight == 1
    assert pool.probe_tails() == 0  # every tail confirmed: nothing due until the idle re-probe
    await pool.shutdown()


async def test_the_rate_still_bounds_the_chain() -> None:
    now = [0.0]
    pool, replayer, _ = fleet(50, now, tail_probe_concurrency=4, tail_probe_max_per_second=5.0)
    now[0] += 3.0
    pool.probe_tails()
    await pool.drained()
    assert sum(replayer.asked.values()) == 5  # one second's tokens; the clock has not moved since
    await run_ticks(pool, now, 2.0)
    assert sum(replayer.asked.values()) == 15  # 5 per second of clock
    await pool.shutdown()
