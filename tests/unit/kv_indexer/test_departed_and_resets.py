"""Whose messages are these? Messages that reach the pool before the registration that says which
incarnation published them.

- A **departed** endpoint (lease gone, retained for a rejoin) keeps applying what continues its stream
  (an etcd pause of any length loses nothing); a message that reads as a publisher restart, and all
  after it, wait for the rejoin.
- A **graceful stop** deregisters first, then publishes its last batches; a restart within
  ``pending_ttl`` publishes its rescan (seq 0, 1) before its new registration: the old incarnation's
  last batches must not become the new stream's start (they made the new publisher's replay read as
  an unservable hole: a loss that forgot the rescan).
- A **crash-restart within the lease TTL** overwrites the registration (an etcd PUT): the rescan that
  arrives first must not be applied on the old stream and then purged by the new ``instance_id``.
- A **restart while a gap is replayed**, or one that follows a tail probe, is seen as a restart.

The publishers are the simulator's ``ZmqEventPublisher`` (vLLM 0.32's PUB wire and replay ROUTER,
``vllm/distributed/kv_events.py``), the replay client the real ``ZmqReplayer``, the membership path
:class:`BlockIndexer` (what the etcd watch calls); the test decides which live messages reach the pool
(the engine: ``_support.py``; the ``rigs`` fixture: ``conftest.py``).
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EndpointState, EventPool
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer
from tests.support import wait_until_async
from tests.unit.kv_indexer._support import A, Engine, held
from tests.unit.kv_indexer.test_recovery_holes import LossyDuringReplay


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def losses() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "kvmesh_kv_indexer_stream_losses"
               for s in m.samples if s.name.endswith("_total"))


def resets() -> float:
    return metric("kvmesh_kv_indexer_incarnations_total", signal="sequence_reset")


def probes(result: str) -> float:
    return metric("kvmesh_kv_indexer_tail_probes_total", result=result)


class Publisher(Engine):
    """One process of endpoint A (``_support.Engine``): a PUB socket and (unless ``replay=""``) a replay
    ROUTER at ``replay``, registered with ``instance_id``; seq ``s`` stores the block the test names."""

    def restart(self, instance_id: str) -> Publisher:
        """The process stops; a new one starts on the same addresses (seq from 0 again)."""
        self.publisher.shutdown()
        return Publisher(self.pool, self.replay, instance_id)


class NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


class Rig:
    def __init__(self, replay: bool = True, **pool_args: float) -> None:
        self.now = [1000.0]
        self.index = InMemoryIndex()
        self.replayer = LossyDuringReplay()
        self.pool = EventPool(self.index, workers=1, replayer=self.replayer, clock=lambda: self.now[0],
                              **pool_args)  # type: ignore[arg-type]
        self.indexer = BlockIndexer(self.index, self.pool, NoFeed(), departed_retention_seconds=120.0,
                                    clock=lambda: self.now[0])
        self.publishers: list[Publisher] = []
        self.pool.start()
        self.replay = replay

    def start(self, instance_id: str = "boot-1", join: bool = True) -> Publisher:
        publisher = Publisher(self.pool, None if self.replay else "", instance_id)
        self.publishers.append(publisher)
        if join:
            self.join(publisher)
        return publisher

    def restart(self, old: Publisher, instance_id: str) -> Publisher:
        new = old.restart(instance_id)
        self.publishers.append(new)
        return new

    def join(self, publisher: Publisher) -> None:
        self.indexer.on_membership({A: publisher.endpoint}, {})

    def depart(self) -> None:
        self.indexer.on_membership({}, {A: self.index.registered()[A]})

    def held(self) -> set[int]:
        return held(self.index)

    def dropped(self, reason: str) -> int:
        return self.pool.stats.dropped[reason]

    async def close(self) -> None:
        for publisher in self.publishers:
            publisher.shutdown()
        await self.pool.shutdown()
        self.replayer.close()


def make(rigs: list[Rig], replay: bool = True, **pool_args: float) -> Rig:
    rig = Rig(replay, **pool_args)
    rigs.append(rig)
    return rig


# -- a graceful stop: the old incarnation's last batches, then the new one's rescan, before its join ----


@pytest.mark.parametrize("replay", [True, False], ids=["replay-endpoint", "no-replay-endpoint"])
async def test_a_graceful_stops_last_batch_does_not_become_the_restarted_publishers_start(
        rigs: list[Rig], replay: bool) -> None:
    """The reviewer's case (/tmp/v10/departed_old_tail.py): before, old seq 5 was the new track's start,
    the new publisher's replay served 0..1, 5 read as an unservable hole: the rescan forgotten, the old
    incarnation's block 105 kept."""
    rig = make(rigs, replay)
    old = rig.start("boot-1")
    old.deliver(*old.publish(100, 101, 102, 103, 104))
    await rig.pool.drained()
    rig.depart()  # lease revoked at the graceful stop
    old.deliver(*old.publish(105))  # its last batch, after deregistering
    await rig.pool.drained()
    new = rig.restart(old, "boot-2")
    new.deliver(*new.publish(900, 901))  # the rescan, before the new registration
    await rig.pool.drained()
    before = losses()
    rig.join(new)  # a new instance_id: old entries purged, held messages start the fresh stream
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and losses() == before
    assert rig.pool.state(A) is EndpointState.LIVE and rig.pool.export()[A] == (2, True)
    new.deliver(*new.publish(902))  # and the new stream carries on
    await rig.pool.drained()
    assert rig.held() == {900, 901, 902} and losses() == before


async def test_an_old_tail_held_while_the_start_was_unknown_is_dropped_at_the_new_join(rigs: list[Rig]) -> None:
    """Sibling: the endpoint departed before any message was applied (its start unknown), so its old
    last batch is held too; at the new incarnation's join the held messages start at the first that
    goes back (seq 0): the old one before it is dropped (``old_incarnation``), not taken as the start."""
    rig = make(rigs, replay=True)
    old = rig.start("boot-1")
    old.publish(100, 101, 102, 103, 104)  # none reached the indexer
    rig.depart()
    old.deliver(*old.publish(105))  # held: its start is unknown
    await rig.pool.drained()
    new = rig.restart(old, "boot-2")
    new.deliver(*new.publish(900, 901))
    await rig.pool.drained()
    assert rig.held() == set()
    rig.join(new)
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and rig.dropped("old_incarnation") == 1
    assert rig.pool.export()[A] == (2, True)


async def test_a_same_incarnation_rejoin_follows_a_held_restart_as_one(rigs: list[Rig]) -> None:
    """Sibling: the messages that read as a restart were held; the rejoin says the same incarnation
    (the registration did not reveal the restart), so they are followed as a restart: purge, fresh start."""
    rig = make(rigs, replay=True)
    old = rig.start("")
    old.deliver(*old.publish(100, 101, 102))
    await rig.pool.drained()
    rig.depart()
    new = rig.restart(old, "")
    new.deliver(*new.publish(900, 901))
    await rig.pool.drained()
    assert rig.held() == {100, 101, 102}  # held: nothing purged before the rejoin says
    count = resets()
    rig.join(new)
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and resets() == count + 1 and rig.pool.export()[A] == (2, True)


# -- the same incarnation through a long etcd pause ----------------------------------------------------


async def test_the_same_incarnation_departed_past_the_pending_ttl_and_256_batches_loses_nothing(
        rigs: list[Rig]) -> None:
    """/tmp/v10/departed_hold.py and its sibling: a lease lost for 15 s (> pending_ttl 10 s) while the
    engine published 300 batches (> 256). Before, every message was held (256 at most, 10 s) and the
    rejoin found a hole: a loss (no replay endpoint) that forgot every entry, the drops counted
    ``unregistered`` for a registered endpoint."""
    rig = make(rigs, replay=False)
    engine = rig.start("boot-1")
    engine.deliver(*engine.publish(1, 2, 3, 4))
    await rig.pool.drained()
    before = losses()
    rig.depart()
    engine.deliver(*engine.publish(*range(100, 250)))
    await rig.pool.drained()
    rig.now[0] += 15.0
    rig.pool.expire_held()
    engine.deliver(*engine.publish(*range(250, 400)))
    await rig.pool.drained()
    assert A in rig.indexer.departed() and rig.indexer.score("m", list(range(400, 404))).result.scores == []
    rig.join(engine)  # the same instance_id: scored again, nothing to catch up
    await rig.pool.drained()
    assert rig.held() == {1, 2, 3, 4, *range(100, 400)} and losses() == before
    assert rig.pool.stats.batches_dropped == 0 and rig.pool.stats.per_endpoint[A].losses == 0
    assert rig.pool.export()[A] == (304, True) and A not in rig.indexer.departed()


async def test_a_departed_hold_is_bounded_by_count_and_retention_and_counted_departed(rigs: list[Rig]) -> None:
    rig = make(rigs, replay=False, pending_batches=4)
    old = rig.start("boot-1")
    old.deliver(*old.publish(100, 101, 102))
    await rig.pool.drained()
    rig.depart()
    new = rig.restart(old, "boot-2")
    new.deliver(*new.publish(*range(900, 910)))  # 10 messages that read as a restart: 4 kept
    await rig.pool.drained()
    assert rig.dropped("departed") == 6 and rig.dropped("unregistered") == 0
    rig.join(new)
    await rig.pool.drained()
    assert rig.held() == {906, 907, 908, 909} and rig.pool.export()[A] == (10, True)  # a fresh start at seq 6

    rig.depart()  # again: held messages older than the retention are dropped
    newer = rig.restart(new, "boot-3")
    newer.deliver(*newer.publish(700, 701))
    await rig.pool.drained()
    rig.now[0] += 121.0
    rig.pool.expire_held()
    assert rig.dropped("departed") == 8
    newer.deliver(*newer.publish(702))
    await rig.pool.drained()
    assert rig.indexer.expire_departed() == [A]  # purged with one message held: counted too
    assert rig.dropped("departed") == 9 and rig.pool.state(A) is None


# -- a crash-restart within the lease TTL (an etcd PUT, no DELETE) ---------------------------------------


@pytest.mark.parametrize("replay", [True, False], ids=["replay-endpoint", "no-replay-endpoint"])
async def test_a_crash_restarts_rescan_before_its_new_registration_is_kept(rigs: list[Rig], replay: bool) -> None:
    """/tmp/v10/crash_restart_rescan.py: before, the rescan was applied on the old stream as a sequence
    reset, then the join of the new instance_id purged it: ``after join: []``."""
    rig = make(rigs, replay)
    old = rig.start("boot-1")
    old.deliver(*old.publish(100, 101, 102, 103, 104))
    await rig.pool.drained()
    count, instance_ids = resets(), metric("kvmesh_kv_indexer_incarnations_total", signal="instance_id")
    new = rig.restart(old, "boot-2")
    new.deliver(*new.publish(900, 901))  # the rescan reaches the pool before the watch sees the PUT
    await rig.pool.drained()
    assert rig.held() == set() and resets() == count + 1  # the old entries purged at once, the rescan held
    assert rig.pool.state(A) is EndpointState.LIVE
    rig.join(new)
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and rig.pool.export()[A] == (2, True)
    assert metric("kvmesh_kv_indexer_incarnations_total", signal="instance_id") == instance_ids + 1


async def test_a_reset_with_no_new_registration_is_followed_as_a_restart_after_the_pending_ttl(
        rigs: list[Rig]) -> None:
    """The hold is bounded: no new registration within pending_ttl (a registrant that kept its
    instance_id, a forged low seq) and the held stream is followed as a restart, on the old registration."""
    rig = make(rigs, replay=True, pending_ttl_seconds=10.0)
    old = rig.start("boot-1")
    old.deliver(*old.publish(100, 101, 102))
    await rig.pool.drained()
    new = rig.restart(old, "boot-1")  # same instance_id: no new registration will come
    new.deliver(*new.publish(900, 901))
    await rig.pool.drained()
    assert rig.held() == set()
    rig.now[0] += 11.0
    rig.pool.expire_held()  # the pool's housekeeping tick
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and rig.pool.export()[A] == (2, True)

    # a message arriving past the ttl releases the hold too (the housekeeping tick not come yet)
    newer = rig.restart(new, "boot-1")
    newer.deliver(*newer.publish(700))
    await rig.pool.drained()
    rig.now[0] += 11.0
    newer.deliver(*newer.publish(701))
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {700, 701} and rig.pool.export()[A] == (2, True)


async def test_a_reset_of_an_endpoint_without_instance_id_is_followed_at_once(rigs: list[Rig]) -> None:
    """Without an instance_id no registration will say it restarted: the reset is the restart."""
    rig = make(rigs, replay=True)
    old = rig.start("")
    old.deliver(*old.publish(100, 101, 102))
    await rig.pool.drained()
    new = rig.restart(old, "")
    new.deliver(*new.publish(900, 901))
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901} and rig.pool.export()[A] == (2, True)


async def test_a_restart_while_a_gap_is_replayed_is_seen_as_a_restart(rigs: list[Rig]) -> None:
    """Sibling: the restarted publisher's seq 0 arrives while the old stream's gap is being replayed.
    Before, it was buffered and discarded as "replayed already" (below the recovery's start): the new
    stream's first batch lost, and its seq 1 then read as a second restart."""
    rig = make(rigs, replay=True)
    old = rig.start("")
    old.deliver(*old.publish(100, 101, 102))
    old.publish(103)  # lost
    old.deliver(*old.publish(104))  # a gap at 3: replayed
    holder: list[Publisher] = []

    async def the_restart_arrives() -> None:  # while the old publisher's answer travels
        new = rig.restart(old, "")
        holder.append(new)
        new.deliver(*new.publish(900))
        before = rig.pool.stats.per_endpoint[A].messages
        await wait_until_async(lambda: rig.pool.stats.per_endpoint[A].messages, 5, "seq 0 taken",
                               until=lambda n: n > before, interval=0.001)

    rig.replayer.during = iter([the_restart_arrives])
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900} and rig.pool.export()[A] == (1, True)
    new = holder[0]
    count = resets()
    new.deliver(*new.publish(901))
    await rig.pool.drained()
    assert rig.held() == {900, 901} and resets() == count and rig.pool.state(A) is EndpointState.LIVE


# -- tail probes across restarts and departures -----------------------------------------------------------


async def test_a_restart_resets_the_tail_probe_so_the_new_incarnation_is_probed_at_the_same_seq(
        rigs: list[Rig]) -> None:
    """With ``tail_probe_idle_max_seconds=0`` a confirmed tail is not probed again at that seq. The
    restarted publisher reached the same seq (3) with its final message lost: before, the probe state
    of the old incarnation said "confirmed at 3" and the new tail was never probed."""
    rig = make(rigs, replay=True, tail_probe_quiet_seconds=1.0, tail_probe_idle_max_seconds=0)
    old = rig.start("")
    old.deliver(*old.publish(100, 101, 102))
    await rig.pool.drained()
    confirmed = probes("nothing_lost")
    rig.now[0] += 2.0
    await wait_until_async(lambda: probes("nothing_lost"), 5, "the old tail confirmed", until=lambda n: n > confirmed)
    await rig.pool.drained()
    assert rig.replayer.requests == [3]
    new = rig.restart(old, "")
    new.deliver(*new.publish(900, 901, 902))
    new.publish(903)  # its final message, lost
    await rig.pool.drained()
    await rig.pool.settled()
    assert rig.held() == {900, 901, 902} and rig.pool.export()[A] == (3, True)
    rig.now[0] += 2.0
    await wait_until_async(lambda: rig.held(), 5, "the new tail probed", until=lambda h: 903 in h)
    assert rig.replayer.requests[-1] == 3 and rig.pool.export()[A] == (4, True)


async def test_a_tail_probe_answer_is_dropped_when_the_endpoint_departed_meanwhile(rigs: list[Rig]) -> None:
    rig = make(rigs, replay=True, tail_probe_quiet_seconds=1.0, tail_probe_idle_max_seconds=0)
    engine = rig.start("boot-1")
    engine.deliver(*engine.publish(100, 101))
    engine.publish(102)  # lost: the probe's answer carries it
    await rig.pool.drained()
    superseded = probes("superseded")

    async def the_lease_goes() -> None:
        rig.depart()

    rig.replayer.during = iter([the_lease_goes])
    rig.now[0] += 2.0
    await wait_until_async(lambda: probes("superseded"), 5, "the answer dropped", until=lambda n: n == superseded + 1)
    await rig.pool.drained()
    assert rig.held() == {100, 101} and rig.pool.export()[A] == (2, True)
    rig.join(engine)  # the same incarnation back: its tail is probed again and found
    rig.now[0] += 2.0
    await wait_until_async(lambda: rig.held(), 5, "the tail found after the rejoin", until=lambda h: 102 in h)


async def test_no_probe_starts_for_a_holding_endpoint(rigs: list[Rig]) -> None:
    """A stream held for a registration is no stream to probe (its position is the old incarnation's)."""
    rig = make(rigs, replay=True, tail_probe_quiet_seconds=1.0)
    old = rig.start("boot-1")
    old.deliver(*old.publish(100))
    await rig.pool.drained()
    new = rig.restart(old, "boot-2")
    new.deliver(*new.publish(900))  # a reset held for the new registration
    await rig.pool.drained()
    asked = len(rig.replayer.requests)
    rig.now[0] += 5.0
    assert rig.pool.probe_tails() == 0
    await asyncio.sleep(0.3)  # a few housekeeping ticks
    assert len(rig.replayer.requests) == asked
