"""The event pool: applies each endpoint's KV-event messages exactly once and in sequence order.

Follows llm-d's ``pkg/kvcache/kvevents/pool.go``: a message is routed to worker
``crc32(endpoint id) % N``, so one endpoint's messages are handled by one worker, in arrival
order, while endpoints spread over workers. ``start()`` does not block; ``shutdown()`` lets the
workers drain, then stops them. Workers are asyncio tasks on the service's loop (the index is
synchronous and does no I/O), so membership changes never race with an event being applied.

**Sequence.** Per endpoint the pool knows the next sequence number it expects (vLLM numbers its
messages 0, 1, 2, ... per publisher). A message with

* the expected seq is decoded and applied;
* a higher seq is a *gap*: the endpoint enters ``recovering``, its live messages are buffered, and
  the missing range is asked of the publisher's replay buffer (:class:`Replayer`, vLLM's ROUTER
  protocol); replayed and buffered messages are then applied in order, each seq once. Live messages
  lost *while* the replay was answered (published after the publisher answered), or dropped from a
  live buffer that overflowed (``recovery_buffer_messages``), leave a hole in the buffered ones that
  is still in the publisher's buffer: it is asked for again. A range the publisher can no longer
  serve (no replay endpoint, timeout past ``replay_timeout_seconds``, buffer already rolled over) is
  a *loss*, healed as below;
* a lower seq is either a *duplicate* or a *publisher restart*. A duplicate is a copy of a message
  applied: vLLM 0.32 replays the very bytes it published (``(seq, payload)`` from its buffer), so its
  ``ts`` (the engine's ``time.time()`` when the batch was made) is the one applied at that seq. The
  pool keeps the ``ts`` applied at each seq served by a replay (until the next in-order live message
  shows the live stream has passed them, at most :data:`_REPLAYED_KEPT`) and at the last
  :data:`_LIVE_KEPT` seqs applied live. A lower seq whose ``ts`` equals the one kept for it is a
  duplicate, dropped (``batches_dropped{reason="duplicate"}``, one INFO line per endpoint per 10 s).
  Duplicates are normal after a recovery: the replay answers up to the publisher's newest message,
  while the same messages are still on their way over the live SUB socket (queued in ZMQ while the
  indexer was starting, or in the worker's queue). Any other lower seq (a seq never applied, such as
  one inside a healed hole or below a forged far-ahead seq, or one applied with another ``ts``) is
  the publisher's: it restarted (a new incarnation the registration did not reveal; vLLM numbers
  from 0 again per process): the endpoint's entries are purged and its stream starts afresh, as
  below. Neither rule compares clocks, so an engine whose clock stepped back across a restart, or a
  batch stamped far in the future, cannot make the engine's later batches read as duplicates.

**A restart during a recovery.** A restart is read whatever state the stream is in; while a recovery
runs (a gap, or a fresh start asking the buffer from 0) the live messages are buffered (``_Recovery``:
each with its arrival number, and the number reached when the publisher was last asked), and:

* a message below the position the recovery replays from, never applied, is a restart at once;
* whether a buffered message went back is decided once the answer is applied, walking the buffer
  in arrival order: one not above a message buffered before it (skipping those the answer disowned,
  below), neither a second copy of one buffered (the same seq and ``ts``) nor a copy of one applied,
  went back: a restart unless the answer shows it a copy (a reordered live message), or a restart
  when there is no answer. It is checked before "below the answer: replayed already": a new
  process's seq 0 is below an old process's answer whose buffer rolled past seq 0. One seq -> ``ts``
  map per answer: buffering a live message during a recovery is O(1);
* once the answer is applied, a buffered message below it with another batch at its seq was
  published by another process than the one that answered: when it arrived after the request, the
  publisher restarted since (a restart, from that message on: purge, then the new stream, held for a
  registration like any restart); before it, see the next point.

Before (until wave 11) a fresh start buffered every live message, then skipped those below the
answer as "replayed already": the restarted engine's first batch was discarded and the old
incarnation's blocks stayed indexed (``tests/unit/kv_indexer/test_restart_during_recovery.py``).

**An old incarnation's late message.** The old process's last batches come on its own ZMQ connection,
fair-queued by the SUB socket with the new process's, so one can arrive after the new stream began.
It reads as a gap (its seq above the new stream's) or a restart (below it), and either way the replay
buffer is asked. vLLM 0.32's publisher thread appends each message to its buffer as it sends it and
serves replay requests between two messages, so an answer holds every message its process published
before answering. A message received before the request was sent that the answer does not hold (above
its newest seq) or holds with another batch is not the answering process's: dropped
(``batches_dropped{reason="unpublished"}`` / ``{reason="old_incarnation"}``). "Not held" is confirmed by
asking once more from the message's seq (:meth:`EventPool._disowned`: vLLM's replay ROUTER can drop a
long answer's tail at its send high-water mark); unconfirmed, it is kept as a live message. If the recovery was not a
fresh start, the entries from before it are that older process's too: purged and the stream started
afresh. Before, such a message was a gap no replay covered: a loss that forgot the new stream's
blocks and stored one the new engine does not hold. The race left: without a replay endpoint nothing
tells whose the message is: it is healed as a loss and applied, and stands until the new stream's next
message goes back below it (a restart: purged); a late message at exactly the new stream's next seq,
whose own message there was lost, cannot be told from it.

**Fresh start.** An endpoint whose start is unknown (no message applied yet for its incarnation:
the indexer restarted without its snapshot of it, or the publisher restarted) holds no entry that
a lost message could have made stale, so the first sequence it gets is its start, not a gap. If
its publisher has a replay endpoint, its buffer is asked once (from seq 0, ``trigger=first_batch``,
or at once by :meth:`recover` at startup) and the first replayed seq is the start; otherwise, or
when the replay fails, the first live message is (a replay that found the buffer empty does not
count: the next message with seq > 0 asks again). A hole *after* the start is a gap as usual.

**Healing a loss.** Messages lost for good may have removed blocks the index still holds (a false
positive: a request routed where its prefix no longer is) and stored blocks it lacks (a false
negative: only a lost hit). At the hole, before the first message after it is applied, the
endpoint's entries (every medium, orphans included) are forgotten (``KVBlockIndex.forget_blocks``:
its ``engine hash -> key`` pairs stay as recent removals so later chains still key), then the
messages after the hole are applied and the endpoint is ``live`` (scored) at once: what it holds
from then on was stored after the loss and not removed since, a subset of the engine's cache.
Counted in ``stream_losses_total{cause}`` and ``forgotten_blocks_total``, logged as a warning.
Before this, a loss made the endpoint ``unreliable`` (never scored) until an ``AllBlocksCleared`` or
a restart, which in production may never come. Upstream: vLLM 0.32's replay buffer leaves a gap
older than ``buffer_steps`` to the consumer; Dynamo's own workers answer such a request with a dump
of their whole radix tree (``TreeDump``), which vLLM cannot give, and its ZMQ listener and llm-d's
subscriber log the gap and keep applying, keeping entries the lost messages may have removed. kvmesh
forgets instead, erring toward lost hits, never toward stale ones. The cost: blocks the engine
still holds from before the loss are not scored until it stores them again (vLLM announces a block
once, when it is cached, not on every hit; its only whole-cache event, ``AllBlocksCleared``, comes from
an admin cache reset). A design choice, not a defect: ``docs/kv-index.md``, "Why forget".

**Tail probe.** vLLM sends no heartbeat, so a lost *final* message (the last batch before an engine
goes idle) is revealed by no later seq. An endpoint with a replay endpoint that has been quiet
``tail_probe_quiet_seconds`` after its last applied message is asked once for what came after it
(one probe in flight per endpoint, ``tail_probe_concurrency`` in all, ``tail_probe_max_per_second``;
a failed probe changes nothing and is retried after another quiet period, ``tail_probe_attempts``
times per position; a confirmed tail is asked again while the endpoint stays idle, at doubling
intervals up to ``tail_probe_idle_max_seconds``, for a batch lost after it). What a probe finds is
applied in order, a hole in it healed as a loss; the endpoint stays ``live`` (scored) while the probe
is in flight. ``tail_probes_total{result}``. Endpoints are taken round-robin, first probes of a new
position before retries and idle re-probes, and a probe that ends starts the next one due, so the
configured rate is reached at any fleet size: with the defaults (20/s, idle re-probe up to 30 s) up to
600 idle endpoints are re-probed every 30 s; beyond that every one still is, every ``N / 20`` s.

**Internal errors.** A batch the index fails on (an exception, a bug) may be half applied: the
endpoint's entries are forgotten as for a loss (``stream_losses_total{cause="internal_error"}``,
``batches_dropped{reason="internal_error"}``) and its stream goes on after it. A recovery that raises
anywhere else is healed the same way and always ends (the endpoint never stays ``recovering``).

**Malformed messages.** A message is decoded *before* it is sequenced: one whose payload is not a
vLLM 0.32 / SGLang 0.5.23 ``EventBatch`` (undecodable msgpack, another shape, an unknown event
type, a field of the wrong type, a non-finite ``ts``) is dropped and counted
(``batches_dropped{reason="bad_payload"}``) without touching its endpoint's sequence, state or
entries: its seq is not evidence of anything. A replayed message that cannot be decoded is a
message lost (a hole, asked for again, then healed as a loss). Drop lines are rate-limited per reason
(:class:`kvmesh.logging.RateLimitedLog`: one per 10 s with the count suppressed). A *valid* message
is trusted, whoever sent it: vLLM's ZMQ protocol has no authentication, so a well-formed batch with
a far-ahead seq is a gap. The engine's replay answer shows it never published it: dropped
(``unpublished``). Without a replay endpoint it is healed as a loss, and the engine's real seq after
it, never applied, is a publisher restart: its entries are purged once and its stream is followed
again from there, whatever ``ts`` the forged batch carried. Keep the events bind address on
a network only engines reach.

**Registration race.** An engine may publish before the indexer's etcd watch sees it join. A
message for an endpoint that was never registered is held (at most ``pending_batches`` per
endpoint, for ``pending_ttl_seconds``) and sequenced when it joins. Messages for an endpoint
purged after leaving are dropped (the fence, ``endpoint_left``) for ``departed_retention_seconds``
after the purge, then held as an unregistered endpoint's.

**Which incarnation?** A registration says who publishes, and can come after the messages:

* *departed* (lease gone, retained): messages that continue its stream are sequenced as before
  (the next seq applied, a gap replayed, a copy dropped: the same incarnation publishing through
  an etcd pause loses nothing); the first that reads as a restart (a lower seq never applied, or any message while its
  start is unknown) and all after it are held (at most ``pending_batches``, the oldest dropped, for
  ``departed_retention_seconds``: ``batches_dropped{reason="departed"}``) until the rejoin: the same
  incarnation follows them as a restart, a new one starts its fresh stream with them;
* *registered with an* ``instance_id``: a restarted process registers a new one, but a
  crash-restart within its lease TTL overwrites its key (an etcd PUT) that the watch may see after
  the restarted publisher's first batches. A sequence reset purges the old entries at once and
  holds the new stream until the new registration (started there on a fresh track) or
  ``pending_ttl_seconds`` (then followed as a restart on the same track);
* at a new incarnation's join, held messages are sequenced from the first one that goes back (below
  the old stream's next seq, a seq 0, or below its predecessor): those before it are the old
  incarnation's last batches (published after it deregistered), dropped
  (``batches_dropped{reason="old_incarnation"}``); taken as the new stream's start they made its
  real start read as an unservable hole, healed as a loss that forgot the new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
import zlib
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvmesh.kv_events import AllBlocksCleared, BlockStored, EventBatch, decode_batch
from kvmesh.logging import RateLimitedLog
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer import metrics
from services.kv_indexer.events.fields import EventFieldFilter
from services.kv_indexer.index.base import KVBlockIndex

logger = logging.getLogger(__name__)

_MAX_PENDING_ENDPOINTS = 1024
"""At most this many never-registered endpoints have messages held at once."""
_APPLY_CHUNK = 2000
"""Replayed messages applied between yields to the loop."""
_NO_REPLAY = "no replay endpoint"
_LIVE_KEPT = 64
"""Per endpoint, the ``ts`` of the last this many seqs applied live is kept (a re-sent live message)."""
_REPLAYED_KEPT = 200_000
"""Per endpoint, at most this many seqs served by a replay keep their ``ts`` (the oldest go first)."""
_HOLD_DEPARTED = "departed"
"""Hold kind: the endpoint departed; a message that reads as a restart waits for the rejoin."""
_HOLD_RESET = "reset"
"""Hold kind: an endpoint registered with an ``instance_id`` restarted its sequence; its new stream
waits for the new registration (a crash-restart within the lease TTL is an etcd PUT, seen later)."""


class EndpointState(enum.StrEnum):
    """Recovery state of an endpoint's event stream (a metric label)."""

    LIVE = "live"
    """Every message so far applied once, in order."""
    RECOVERING = "recovering"
    """A gap is being replayed; live messages are buffered."""
    UNRELIABLE = "unreliable"
    """No longer entered: a loss now heals (older entries forgotten, live again). Kept as the metric
    label and the wire value older replicas and snapshots know."""


class Replayer(Protocol):
    """Fetches buffered messages from a publisher (vLLM's replay ROUTER in production)."""

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        """Every buffered ``(seq, payload)`` with ``seq >= from_seq``, in order; raises on failure."""
        ...


class ParityCheck(Protocol):
    def check(self, endpoint_id: EndpointId, event: BlockStored) -> None: ...


@dataclass(slots=True)
class RawMessage:
    """One ZMQ message whose frames parsed: endpoint and model from the topic, seq, raw payload;
    ``batch`` is the decoded payload, set by the pool before the message is sequenced."""

    endpoint_id: EndpointId
    model: str
    seq: int
    payload: bytes
    batch: EventBatch | None = field(default=None, compare=False, repr=False)


DROP_LOG_INTERVAL_SECONDS = 10.0
"""At most one drop line per reason (bad frames, bad topic, bad seq, bad payload) per this many seconds."""


def decode_payload(payload: bytes) -> EventBatch:
    """The payload as an :class:`EventBatch` (vLLM 0.32 / SGLang 0.5.23, ``kvmesh.kv_events``).

    Raises:
        msgspec.DecodeError: not msgpack, or not an ``EventBatch`` (``msgspec.ValidationError``).
        ValueError: a non-finite ``ts`` (vLLM and SGLang stamp ``time.time()``).
    """
    batch = decode_batch(payload)
    if not math.isfinite(batch.ts):
        raise ValueError(f"batch ts {batch.ts!r} is not a finite time")
    return batch


@dataclass
class EndpointIngestStats:
    """Per endpoint: messages handled, the last sequence number, messages missed and losses healed."""

    messages: int = 0
    last_seq: int | None = None
    sequence_gaps: int = 0
    losses: int = 0
    """Losses healed (messages no replay could serve; older entries forgotten)."""


@dataclass
class IngestStats:
    """Whole-pool counters (``dropped`` by reason)."""

    dropped: Counter[str] = field(default_factory=Counter)
    per_endpoint: dict[EndpointId, EndpointIngestStats] = field(default_factory=dict)

    @property
    def batches_dropped(self) -> int:
        return sum(self.dropped.values())


@dataclass
class _Recovery:
    from_seq: int
    trigger: str
    started: float
    fresh: bool = False
    """The stream's start is unknown: the first message obtained (replayed or live) is its start."""
    buffer: deque[tuple[int, RawMessage]] = field(default_factory=deque)
    """``(arrival number, message)`` of the live messages that arrived meanwhile, in arrival order (a
    deque: past the limit its oldest goes in O(1), a flood's normal path)."""
    overflowed: bool = False
    arrived: int = 0
    """Messages buffered so far (the last one's arrival number)."""
    asked_at: int = 0
    """``arrived`` when the publisher was last asked: messages numbered up to it were published
    before the answer was made, so the answer holds them, or the answering process did not publish them."""


@dataclass
class _Track:
    """Sequencing state of one registered endpoint."""

    endpoint: Endpoint
    next_seq: int | None = None
    """The next seq expected; None while the start is unknown (nothing applied for this incarnation)."""
    recovery: _Recovery | None = None
    live_seqs: list[int] = field(default_factory=lambda: [-1] * _LIVE_KEPT)
    """Ring of the last seqs applied live (slot ``seq % _LIVE_KEPT``); with ``live_ts``, their batches' ``ts``."""
    live_ts: list[float] = field(default_factory=lambda: [0.0] * _LIVE_KEPT)
    replayed: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """``seq -> ts`` of the messages applied from a replay answer since the last in-order live message."""
    history_asked: bool = False
    """The replay buffer was already asked for this fresh start (one replay per start)."""
    applied_at: float | None = None
    """Clock time the last message was applied (None: none since this incarnation was tracked)."""
    probed_seq: int | None = None
    """``next_seq`` when the last tail probe ended (a new position is probed after the quiet time)."""
    probe_failures: int = 0
    """Failed tail probes at ``probed_seq``."""
    probe_after: float = 0.0
    """At ``probed_seq``, no tail probe before this clock time (a failure's retry, the idle re-probe)."""
    probe_interval: float = 0.0
    """The idle re-probe interval at ``probed_seq`` (doubles after each probe that found nothing)."""
    probing: bool = False
    restarts: int = 0
    """Publisher restarts read from its sequence (``_older``); a tail probe started before one is stale."""
    departed: bool = False
    """Its lease is gone (retained for a rejoin): messages that continue its stream are applied as
    before; one that reads as a publisher restart, and every one after it, is held until the rejoin
    says whose they are (:meth:`EventPool.endpoint_joined`)."""
    held: deque[tuple[float, RawMessage]] | None = None
    """``(received, message)`` held until a registration says which incarnation they belong to
    (``held_why``); None: not holding."""
    held_why: str = ""
    """:data:`_HOLD_DEPARTED` (released at the rejoin, bounded by the departed retention) or
    :data:`_HOLD_RESET` (released at the new registration, or ``pending_ttl_seconds`` after the reset)."""
    held_since: float = 0.0
    """Clock time the hold began."""
    held_went_back: bool = False
    """The hold began with a message that went back (a restart): every message held is after it, the
    new incarnation's, even once the oldest were dropped (else it began while the start was unknown)."""

    @property
    def state(self) -> EndpointState:
        return EndpointState.LIVE if self.recovery is None else EndpointState.RECOVERING


class EventPool:
    """N ordered workers between the subscriber and the index.

    Args:
        index: where events are applied.
        workers: number of shards (>= 1).
        queue_size: messages each worker may queue; beyond it a message is dropped (``queue_full``).
        pending_batches: per never-registered endpoint, messages held until it joins; also the most
            held per registered endpoint while a registration is awaited (a departed endpoint's
            restarted publisher, a reset sequence).
        pending_ttl_seconds: how long a never-registered endpoint's messages are held; how long a
            reset sequence of an endpoint registered with an ``instance_id`` waits for its new
            registration before it is followed as a restart.
        departed_retention_seconds: how long a departed endpoint's held messages are kept (its
            retention in :class:`~services.kv_indexer.indexer.BlockIndexer`), and how long a purged
            endpoint's late messages are dropped (the fence) rather than held as unregistered.
        replayer: where missed messages are fetched from (None: every gap is a loss, healed).
        replay_timeout_seconds: deadline of one replay request.
        recovery_buffer_messages: live messages buffered per recovering endpoint; beyond it the oldest
            are dropped (asked of the replay buffer again; a loss only when it cannot serve them).
        parity: checks each ``BlockStored`` against the registration (optional).
        clock: monotonic seconds (injectable for tests).
        tail_probe_quiet_seconds: quiet time after an endpoint's last message before its replay
            buffer is asked for what followed (0: no tail probe).
        tail_probe_timeout_seconds: deadline of one tail probe.
        tail_probe_attempts: failed probes per stream position before waiting for the next message.
        tail_probe_max_per_second: probes started per second, over all endpoints (a sustained rate:
            the next probe starts as one ends, endpoints taken round-robin, first probes of a new
            position before retries and idle re-probes).
        tail_probe_concurrency: probes in flight at once.
        tail_probe_idle_max_seconds: a confirmed tail is probed again while the endpoint stays idle,
            at doubling intervals from twice the quiet time up to this (0: never again until its
            next message).
    """

    def __init__(
        self,
        index: KVBlockIndex,
        workers: int = 4,
        queue_size: int = 10000,
        pending_batches: int = 256,
        pending_ttl_seconds: float = 10.0,
        replayer: Replayer | None = None,
        replay_timeout_seconds: float = 5.0,
        recovery_buffer_messages: int = 100_000,
        parity: ParityCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
        tail_probe_quiet_seconds: float = 0.0,
        tail_probe_timeout_seconds: float = 2.0,
        tail_probe_attempts: int = 3,
        tail_probe_max_per_second: float = 20.0,
        tail_probe_concurrency: int = 4,
        tail_probe_idle_max_seconds: float = 30.0,
        departed_retention_seconds: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._index = index
        self._apply_batch = getattr(index, "apply_batch", None)
        """The index's whole-batch apply (None: ``apply`` per event)."""
        self._queues: list[asyncio.Queue[RawMessage | None]] = [asyncio.Queue(queue_size) for _ in range(workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._recoveries: set[asyncio.Task[None]] = set()
        self._pending: dict[EndpointId, deque[tuple[float, RawMessage]]] = {}
        self._pending_batches = pending_batches
        self._pending_ttl = pending_ttl_seconds
        self._departed_retention = departed_retention_seconds
        self._departed: dict[EndpointId, float] = {}
        """Purged endpoints (the fence) -> clock time purged; forgotten after the retention."""
        self._holding: set[EndpointId] = set()
        """Tracked endpoints whose ``held`` is not None."""
        self._tracks: dict[EndpointId, _Track] = {}
        self._replayer = replayer
        self._replay_timeout = replay_timeout_seconds
        self._recovery_buffer = recovery_buffer_messages
        self._parity = parity
        self._fields = EventFieldFilter()
        self._clock = clock
        self._drop_log = RateLimitedLog(logger, DROP_LOG_INTERVAL_SECONDS, clock)
        self._settled = asyncio.Event()
        self._settled.set()
        self.stats = IngestStats()
        self._forget = getattr(index, "forget_blocks", None)
        """The index's ``forget_blocks`` (None: an ``AllBlocksCleared`` heals a loss)."""
        self._probe_quiet = tail_probe_quiet_seconds
        self._probe_timeout = tail_probe_timeout_seconds
        self._probe_attempts = max(tail_probe_attempts, 1)
        self._probe_rate = tail_probe_max_per_second
        self._probe_concurrency = max(tail_probe_concurrency, 1)
        self._probe_idle_max = tail_probe_idle_max_seconds
        self._probe_tokens = 0.0
        self._probe_refilled: float | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._probe_backlog = False
        """The last scan left a due probe unstarted (a finished probe starts the next one)."""
        self._housekeeping: asyncio.Task[None] | None = None
        self._closing = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (returns at once)."""
        self._closing = False
        for i, queue in enumerate(self._queues):
            self._tasks.append(asyncio.create_task(self._work(queue), name=f"kv-events-worker-{i}"))
        if self._housekeeping is None:
            self._housekeeping = asyncio.create_task(self._housekeep_forever(), name="kv-events-housekeeping")

    async def shutdown(self, timeout_seconds: float = 5.0) -> None:
        """Let the workers drain what is queued, then stop them (recoveries and probes in flight are cancelled)."""
        self._closing = True
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            self._housekeeping = None
        for task in [*self._recoveries, *self._probes]:
            task.cancel()
        for queue in self._queues:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        if self._tasks:
            _, running = await asyncio.wait(self._tasks, timeout=timeout_seconds)
            for task in running:
                task.cancel()
            for task in running:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks.clear()

    # -- input ------------------------------------------------------------------------------

    def submit(self, message: RawMessage) -> None:
        """Queue a message on its endpoint's worker (never blocks; drops when the queue is full)."""
        queue = self._queues[zlib.crc32(message.endpoint_id.encode()) % len(self._queues)]
        try:
            queue.put_nowait(message)
        except asyncio.QueueFull:
            self.record_drop("queue_full")

    def record_drop(self, reason: str) -> None:
        """Count a message dropped before reaching the pool (bad frames, bad topic) or in it."""
        self.stats.dropped[reason] += 1
        metrics.record_batch_dropped(reason)

    def drop_malformed(self, reason: str, message: str, *args: object) -> None:
        """Count a malformed message (``frame_count``, ``bad_topic``, ``bad_seq``, ``bad_payload``) and
        log ``message % args``, rate-limited per reason (one line per 10 s, with the count suppressed)."""
        self.record_drop(reason)
        self._drop_log.warning(reason, "dropping malformed kv event message reason=%s " + message, reason, *args)

    def _decode(self, message: RawMessage) -> bool:
        """Set ``message.batch``; False (counted, logged, nothing else touched) when it cannot be decoded."""
        try:
            message.batch = decode_payload(message.payload)
        except (msgspec.DecodeError, ValueError) as exc:
            self.drop_malformed(
                "bad_payload", "endpoint=%s seq=%d bytes=%d error=%s",
                message.endpoint_id, message.seq, len(message.payload), exc,
            )
            return False
        return True

    async def drained(self) -> None:
        """Wait until every queued message has been handled and no recovery or tail probe is running."""
        while True:
            for queue in self._queues:
                await queue.join()
            if not self._recoveries and not self._probes:
                return
            await asyncio.wait({*self._recoveries, *self._probes})

    # -- membership -------------------------------------------------------------------------

    def endpoint_joined(self, endpoint: Endpoint, new_incarnation: bool = True) -> None:
        """The endpoint was registered in the index: sequence its held messages, in order.

        ``new_incarnation``: its stream starts afresh (sequence unknown, reliable); False when the
        same incarnation rejoins (its sequencing carries on, and a held message that reads as a
        restart is one: the registration says no other incarnation is coming).

        Held messages of a new incarnation are sequenced from the first one that goes back (a seq
        below the old stream's next one, a seq 0, or a seq below the one held before it): those
        before it continue the old incarnation's stream (its last batches, published after it
        deregistered) and are dropped (``batches_dropped{reason="old_incarnation"}``); taken as the new
        stream's start they would make its real start read as a hole.
        """
        endpoint_id = endpoint.id
        self._departed.pop(endpoint_id, None)
        track = self._tracks.get(endpoint_id)
        held: list[tuple[float, RawMessage]] = []
        if track is not None and track.held is not None:
            held.extend(track.held)
        now = self._clock()
        pending = self._pending.pop(endpoint_id, None)
        expired = 0
        if pending:
            for received, message in pending:
                if now - received <= self._pending_ttl:
                    held.append((received, message))
                else:
                    expired += 1
                    self.record_drop("unregistered")
        held.sort(key=lambda item: item[0])  # arrival order (stable: a track's and the pending ones interleave)
        if track is None or new_incarnation:
            if track is not None:
                track.recovery = None
                self._holding.discard(endpoint_id)
                messages = [m for _, m in held]
                if track.held is None or not track.held_went_back:
                    messages = self._new_incarnation_messages(messages, track.next_seq)
            else:
                messages = [m for _, m in held]
            track = self._tracks[endpoint_id] = _Track(endpoint)
            self._fields.forget(endpoint_id)  # its KV groups are the new process's to say
        else:
            track.endpoint = endpoint
            track.departed = False
            track.held = None
            self._holding.discard(endpoint_id)
            messages = [m for _, m in held]
        for message in messages:
            self._sequence_held(track, message)
        if held or expired:
            logger.info(
                "sequenced held event messages endpoint=%s messages=%d dropped=%d expired=%d (%s incarnation)",
                endpoint_id, len(messages), len(held) - len(messages), expired,
                "new" if new_incarnation else "same",
            )

    def _new_incarnation_messages(
        self, held: list[RawMessage], old_next: int | None
    ) -> list[RawMessage]:
        """Of messages held across a change of incarnation, those from the first one that goes back
        on: a seq below ``old_next`` (the old stream's next seq), a seq 0, or one below its
        predecessor. Those before it continue the old stream: dropped (``old_incarnation``). With
        no such message: none when ``old_next`` is known (all continue the old stream), else all
        (nothing tells them apart)."""
        start = None
        for i, message in enumerate(held):
            seq = message.seq
            if (old_next is not None and seq < old_next) or seq == 0 or (i and seq < held[i - 1].seq):
                start = i
                break
        if start is None:
            start = len(held) if old_next is not None else 0
        for _ in range(start):
            self.record_drop("old_incarnation")
        return held[start:]

    def endpoint_departed(self, endpoint_id: EndpointId) -> None:
        """Its lease is gone (not purged: a rejoin may follow). Messages that continue its stream are
        still applied (the same incarnation publishing through an etcd pause loses nothing); one that
        reads as a publisher restart (a seq below the next one that is no copy of one applied, or any
        message while its start is unknown), and every one after it, is held until
        :meth:`endpoint_joined` says which incarnation they belong to: a restarted publisher's first
        batches (a kv_store's rescan) can arrive before its new registration, and read on the old
        incarnation's stream they would be purged with it. Held at most ``pending_batches`` (the
        oldest dropped beyond) for ``departed_retention_seconds``
        (``batches_dropped{reason="departed"}``)."""
        track = self._tracks.get(endpoint_id)
        if track is not None:
            track.departed = True
            if track.held is not None:
                track.held_why = _HOLD_DEPARTED  # now released only by a rejoin

    def endpoint_left(self, endpoint_id: EndpointId) -> None:
        """The endpoint was purged: its late messages are dropped from now on (for the departed
        retention; after that they are held as an unregistered endpoint's)."""
        self._departed[endpoint_id] = self._clock()
        self._pending.pop(endpoint_id, None)
        self.stats.per_endpoint.pop(endpoint_id, None)
        self._holding.discard(endpoint_id)
        self._fields.forget(endpoint_id)
        track = self._tracks.pop(endpoint_id, None)
        if track is not None:
            track.recovery = None
            for _ in track.held or ():
                self.record_drop("departed")
            track.held = None
        self._update_settled()

    def restore(self, endpoint: Endpoint, next_seq: int | None, reliable: bool = True) -> None:
        """Sequencing state of an endpoint restored from a snapshot (before it is confirmed by etcd).
        ``reliable=False`` (a snapshot from before losses healed) is the caller's to heal: it does not
        restore that endpoint's entries (:func:`services.kv_indexer.snapshot.load`)."""
        self._tracks[endpoint.id] = _Track(endpoint, next_seq)

    def export(self) -> dict[EndpointId, tuple[int | None, bool]]:
        """Per tracked endpoint ``(next expected seq, reliable)``, for a snapshot (``reliable`` is always
        True since a loss heals; the field stays for the snapshot format). A recovering
        endpoint exports the seq its recovery starts from (what was applied before the gap: the
        restarted indexer's startup replay covers the gap again); one recovering from a fresh start
        exports what it applied so far (None: nothing yet)."""
        out: dict[EndpointId, tuple[int | None, bool]] = {}
        for eid, t in self._tracks.items():
            recovery = t.recovery
            out[eid] = (t.next_seq if recovery is None or recovery.fresh else recovery.from_seq, True)
        return out

    def state(self, endpoint_id: EndpointId) -> EndpointState | None:
        track = self._tracks.get(endpoint_id)
        return None if track is None else track.state

    def states(self) -> dict[EndpointId, EndpointState]:
        return {eid: t.state for eid, t in self._tracks.items()}

    def recover(self, endpoint: Endpoint, trigger: str = "startup") -> None:
        """Ask ``endpoint``'s replay buffer for everything after the last applied message now
        (from seq 0 when its start is unknown); no-op when it has no replay endpoint or is recovering."""
        track = self._tracks.get(endpoint.id)
        if track is None or track.recovery is not None or not endpoint.replay_endpoint or self._replayer is None:
            return
        fresh = track.next_seq is None
        if fresh:
            track.history_asked = True
        self._start_recovery(track, track.next_seq or 0, trigger, None, fresh=fresh)

    async def settled(self) -> None:
        """Return once no recovery is running."""
        await self._settled.wait()

    # -- workers ----------------------------------------------------------------------------

    async def _work(self, queue: asyncio.Queue[RawMessage | None]) -> None:
        """Handle the queue's messages in order; what is already queued is taken with ``get_nowait``
        (``await queue.get()`` does not yield while the queue is non-empty either, so the loop's
        fairness is unchanged; only the coroutine per message is saved)."""
        handle = self._handle
        while True:
            message = await queue.get()
            while True:
                try:
                    if message is None:
                        return
                    handle(message)
                except Exception:
                    logger.exception("event message failed endpoint=%s", message.endpoint_id if message else "")
                    self.record_drop("internal_error")
                finally:
                    queue.task_done()
                if queue.empty():
                    break
                message = queue.get_nowait()

    def _handle(self, message: RawMessage) -> None:
        if message.batch is None and not self._decode(message):
            return  # before sequencing: a malformed message moves no seq and purges nothing
        endpoint_id = message.endpoint_id
        track = self._tracks.get(endpoint_id)
        if track is None or not self._index.is_registered(endpoint_id):
            if endpoint_id in self._departed:
                self.record_drop("endpoint_left")
            else:
                self._hold(message)
            return
        if track.held is not None:
            self._hold_more(track, message)
            return
        self._sequence(track, message)

    def _sequence_held(self, track: _Track, message: RawMessage) -> None:
        """Sequence a message released from a hold: a restart it reveals is followed at once (the
        registration has spoken, or will not)."""
        if track.held is not None:  # cannot happen with may_hold=False; kept for safety
            self._hold_more(track, message)
            return
        self._sequence(track, message, may_hold=False)

    def _sequence(self, track: _Track, message: RawMessage, may_hold: bool = True, count: bool = True) -> None:
        """Sequence one decoded message of a registered endpoint; ``may_hold``: a message that reads as
        a publisher restart may be held for a registration (departed, or registered with an
        ``instance_id``) rather than followed as a restart at once; ``count``: False for a message
        counted already (sequenced again after a failed recovery)."""
        stats = self._endpoint_stats(message.endpoint_id)
        if count:
            stats.messages += 1
        seq = message.seq
        recovery = track.recovery
        if recovery is not None:
            if recovery.fresh or seq >= recovery.from_seq or self._is_copy(track, message):
                # buffered; whether it went back (a restart) is decided when the answer is applied,
                # walking the buffer in arrival order (:meth:`_went_back_meanwhile`)
                self._buffer(track, message)
                return
            # below the position the recovery started from and never applied: the publisher
            # restarted while its gap was being replayed (the recovery reads the old stream)
            self._went_back(track, message, recovery.from_seq, stats, may_hold)
            return
        expected = track.next_seq
        if expected is None:
            if track.departed and may_hold:
                self._hold_more(track, message, _HOLD_DEPARTED)  # whose start is it? the rejoin says
                return
            self._start_fresh(track, message, stats)
            return
        if seq < expected:
            self._older(track, message, expected, stats, may_hold)
            return
        if seq > expected:
            missed = seq - expected
            stats.sequence_gaps += missed
            metrics.record_sequence_gap(missed)
            logger.warning(
                "kv event sequence gap endpoint=%s expected=%d got=%d missed=%d: replaying",
                message.endpoint_id, expected, seq, missed,
            )
            self._start_recovery(track, expected, "gap", message)
            return
        if track.replayed:  # the live stream has passed every replayed seq: no copy of one can follow
            track.replayed.clear()
        self._apply_message(track, message, stats)

    def _start_fresh(self, track: _Track, message: RawMessage, stats: EndpointIngestStats) -> None:
        """The first message of a stream whose start is unknown: ask the replay buffer once for
        what came before it (when there is one and seq > 0), else take it as the start."""
        if message.seq > 0 and not track.history_asked and self._replayer is not None and track.endpoint.replay_endpoint:
            track.history_asked = True
            logger.info(
                "kv event stream of endpoint=%s starts at seq=%d: replaying its publisher's buffer from 0",
                message.endpoint_id, message.seq,
            )
            self._start_recovery(track, 0, "first_batch", message, fresh=True)
            return
        self._apply_message(track, message, stats)

    @staticmethod
    def _is_copy(track: _Track, message: RawMessage) -> bool:
        """A copy of a message applied: its seq's ``ts`` as kept from a replay or the last live ones."""
        assert message.batch is not None, "messages are decoded before they are sequenced"
        seq = message.seq
        ts = message.batch.ts
        slot = seq % _LIVE_KEPT
        return track.replayed.get(seq) == ts or (track.live_seqs[slot] == seq and track.live_ts[slot] == ts)

    @staticmethod
    def _applied_at(track: _Track, seq: int) -> bool:
        """A batch was applied at ``seq`` and its ``ts`` kept (from a replay, or among the last live ones)."""
        return seq in track.replayed or track.live_seqs[seq % _LIVE_KEPT] == seq

    def _older(
        self, track: _Track, message: RawMessage, expected: int, stats: EndpointIngestStats, may_hold: bool = True
    ) -> None:
        """A seq below the expected one: a copy of a message applied (the same seq with the same
        ``ts``, kept from a replay or the last live ones) is a duplicate, dropped; anything else is
        a publisher restart (:meth:`_went_back`)."""
        if self._is_copy(track, message):
            self.record_drop("duplicate")
            self._drop_log.log(
                logging.INFO, f"duplicate {message.endpoint_id}",
                "dropping duplicate kv event message endpoint=%s seq=%d (a copy of one applied; next expected %d)",
                message.endpoint_id, message.seq, expected,
            )
            return
        self._went_back(track, message, expected, stats, may_hold)

    def _went_back(
        self, track: _Track, message: RawMessage, expected: int, stats: EndpointIngestStats, may_hold: bool
    ) -> None:
        """The sequence went back to a seq never applied: the publisher restarted. Purge, then start
        afresh with it; except, with ``may_hold``:

        * a departed endpoint: the message and all after it are held until the rejoin says whose
          they are (nothing purged yet: a rejoin of the same incarnation purges, a new one starts empty);
        * an endpoint registered with an ``instance_id``: a restarted process registers a new one,
          and a crash-restart within its lease TTL overwrites its key (an etcd PUT) that the watch may
          see after the restarted publisher's first batches (a kv_store's rescan). The old entries are
          purged at once (that publisher is gone), and the new stream is held until the new
          registration (started on a fresh track there) or ``pending_ttl_seconds`` (followed here as a
          restart). Without the hold the new stream was applied on the old track, then purged by the
          join of the new instance_id: lost for good.
        """
        if may_hold and track.departed:
            self._hold_more(track, message, _HOLD_DEPARTED, went_back=True)
            return
        hold = may_hold and bool(track.endpoint.instance_id) and self._pending_batches > 0
        logger.warning(
            "kv event sequence went back endpoint=%s expected=%d got=%d, a message never applied: publisher "
            "restarted, purging its entries%s",
            message.endpoint_id, expected, message.seq,
            f"; its new stream held up to {self._pending_ttl:.0f}s for its new registration" if hold else "",
        )
        metrics.record_incarnation("sequence_reset")
        self._reset(track)
        if hold:
            self._hold_more(track, message, _HOLD_RESET, went_back=True)
            return
        self._start_fresh(track, message, stats)

    def _reset(self, track: _Track) -> None:
        """The publisher restarted: purge its entries and forget its stream (position, copies kept,
        a recovery in flight, the tail probe's state: a new incarnation is probed from its own start)."""
        self._index.apply(track.endpoint.id, AllBlocksCleared())
        track.restarts += 1
        track.recovery = None  # a recovery in flight reads the old stream: it returns at its next step
        track.next_seq = None
        track.replayed.clear()
        track.live_seqs[:] = [-1] * _LIVE_KEPT
        track.history_asked = False
        track.probed_seq = None
        track.probe_failures = 0
        track.probe_after = 0.0
        track.probe_interval = 0.0

    def _endpoint_stats(self, endpoint_id: EndpointId) -> EndpointIngestStats:
        stats = self.stats.per_endpoint.get(endpoint_id)
        if stats is None:
            stats = self.stats.per_endpoint[endpoint_id] = EndpointIngestStats()
        return stats

    def _apply_message(
        self, track: _Track, message: RawMessage, stats: EndpointIngestStats | None = None, replayed: bool = False
    ) -> None:
        """Apply one in-order message, already decoded (``message.batch``), and move the seq past it;
        ``replayed``: it came from a replay answer (a live copy of it may follow)."""
        batch = message.batch
        assert batch is not None, "messages are decoded before they are sequenced"
        seq = message.seq
        track.next_seq = seq + 1
        (stats or self._endpoint_stats(message.endpoint_id)).last_seq = seq
        if replayed:
            kept = track.replayed
            kept[seq] = batch.ts
            if len(kept) > _REPLAYED_KEPT:
                kept.popitem(last=False)
        else:
            slot = seq % _LIVE_KEPT
            track.live_seqs[slot] = seq
            track.live_ts[slot] = batch.ts
        track.applied_at = self._clock()
        try:
            self._apply(track, batch)
        except Exception:
            # the batch may be half applied (a removal lost): heal as a loss of this one message, so
            # what the index holds stays a subset of the engine's cache; the stream goes on after it
            logger.exception("kv event message failed in the index endpoint=%s seq=%d", message.endpoint_id, seq)
            self.record_drop("internal_error")
            self._lose(track, "internal_error", seq, seq + 1)

    def _apply(self, track: _Track, batch: EventBatch) -> None:
        """One batch, in order: parity checks, the field filter, then the index (a whole batch per
        call where the index has ``apply_batch``)."""
        endpoint_id = track.endpoint.id
        events = batch.events
        parity = self._parity
        if parity is not None:
            for event in events:
                if type(event) is BlockStored:
                    parity.check(endpoint_id, event)
        admitted = self._fields.admit_all(endpoint_id, events)  # KV groups, ignored fields (events/fields.py)
        apply_batch = self._apply_batch
        if apply_batch is not None:
            apply_batch(endpoint_id, admitted)
            return
        for event in admitted:
            self._index.apply(endpoint_id, event)

    # -- recovery ---------------------------------------------------------------------------

    def _buffer(self, track: _Track, message: RawMessage) -> None:
        recovery = track.recovery
        assert recovery is not None
        if len(recovery.buffer) >= self._recovery_buffer:
            recovery.overflowed = True
            recovery.buffer.popleft()
        recovery.arrived += 1
        recovery.buffer.append((recovery.arrived, message))

    def _start_recovery(
        self, track: _Track, from_seq: int, trigger: str, first: RawMessage | None, fresh: bool = False
    ) -> None:
        recovery = _Recovery(from_seq, trigger, self._clock(), fresh)
        track.recovery = recovery
        if first is not None:
            self._buffer(track, first)
        task = asyncio.create_task(self._recover(track, recovery), name=f"kv-replay-{track.endpoint.id}")
        self._recoveries.add(task)
        self._settled.clear()
        task.add_done_callback(self._recovery_done)

    def _recovery_done(self, task: asyncio.Task[None]) -> None:
        self._recoveries.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("recovery failed", exc_info=task.exception())
        self._update_settled()

    def _update_settled(self) -> None:
        if not self._recoveries:
            self._settled.set()

    async def _ask(
        self, endpoint: Endpoint, from_seq: int, timeout_seconds: float | None = None
    ) -> tuple[list[tuple[int, bytes]], str]:
        """The publisher's buffered messages from ``from_seq`` on, and ``""``; or ``[]`` and why not
        (:data:`_NO_REPLAY` without a replay endpoint)."""
        if self._replayer is None or not endpoint.replay_endpoint:
            return [], _NO_REPLAY
        try:
            timeout = self._replay_timeout if timeout_seconds is None else timeout_seconds
            return await self._replayer.replay(endpoint, from_seq, timeout), ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return [], f"{type(exc).__name__}: {exc}"

    async def _recover(self, track: _Track, recovery: _Recovery) -> None:
        """:meth:`_replay_gap`, guarded: an unexpected exception in it (a bug, a replayer answering
        something that is not ``(seq, payload)`` pairs) would leave the endpoint ``recovering`` (never
        scored, every live message buffered) for good. It is healed as a loss instead
        (``stream_losses_total{cause="internal_error"}``: its entries forgotten), the stream starts
        afresh from the live messages buffered meanwhile (its buffer is not asked again for this
        start), and the recovery always ends (``track.recovery`` cleared)."""
        try:
            await self._replay_gap(track, recovery)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("kv event recovery failed endpoint=%s trigger=%s", track.endpoint.id, recovery.trigger)
            if track.recovery is recovery and self._tracks.get(track.endpoint.id) is track:
                self._internal_error_heal(track, recovery)
        finally:
            if track.recovery is recovery:
                track.recovery = None

    def _drop_unpublished(self, message: RawMessage, reason: str, newest: int) -> None:
        """Drop a live message a recovery buffered that the publisher's answer shows it did not publish."""
        self.record_drop(reason)
        self._drop_log.warning(
            f"{reason}:{message.endpoint_id}",
            "dropping kv event message endpoint=%s seq=%d reason=%s: received before its publisher answered a "
            "replay (newest seq=%d) that %s it, so an older incarnation (or a forger) sent it",
            message.endpoint_id, message.seq, reason, newest,
            "holds another batch at its seq instead of" if reason == "old_incarnation" else "does not hold",
        )

    async def _disowned(self, track: _Track, suspects: list[tuple[int, RawMessage]]) -> set[int]:
        """Of ``suspects`` (``(arrival number, message)`` received before the publisher was asked, above the
        newest seq its answer holds), the arrival numbers of those its publisher did not publish.

        The answer alone is not proof: vLLM 0.32's replay ROUTER keeps ZMQ's default send high-water mark
        (1000 messages) without ``ROUTER_MANDATORY``, so a long answer can lose its tail silently and
        still end with the end marker. The publisher is asked once more, from the lowest suspect's seq (a
        short answer); a suspect is disowned when that answer holds another batch at its seq (another
        ``ts``) or nothing at or above it. A failed ask, or an answer that holds its seq with its ``ts``
        or skips it, disowns nothing: the message is kept as a live one (a hole before it is asked for
        again, then healed as a loss)."""
        replies, failure = await self._ask(track.endpoint, min(message.seq for _, message in suspects))
        if failure:
            return set()
        newest = max((seq for seq, _ in replies), default=-1)
        wanted = {message.seq for _, message in suspects}
        held: dict[int, float | None] = {}
        for seq, payload in replies:
            if seq in wanted:
                try:
                    held[seq] = decode_payload(payload).ts
                except (msgspec.DecodeError, ValueError):
                    held[seq] = None  # unreadable: proves nothing
        disowned: set[int] = set()
        for number, message in suspects:
            assert message.batch is not None
            ts = held.get(message.seq, message.batch.ts) if message.seq <= newest else None
            if message.seq > newest or (ts is not None and ts != message.batch.ts):
                disowned.add(number)
        return disowned

    def _went_back_meanwhile(
        self, track: _Track, entries: Iterable[tuple[int, RawMessage]], dropped: set[int]
    ) -> set[int]:
        """Arrival numbers of the buffered live messages that went back: walking ``entries`` in arrival
        order (skipping ``dropped``, the messages the answer disowned), a seq not above one that arrived
        before it, not a second copy of a message buffered (the same seq and ``ts``) nor of one applied.
        Built once per answer: a seq -> ``ts`` map of what was buffered, O(n) in the buffer."""
        back: set[int] = set()
        top = -1
        seen: dict[int, float] = {}
        for number, message in entries:
            if number in dropped:
                continue
            assert message.batch is not None, "messages are decoded before they are sequenced"
            seq = message.seq
            ts = message.batch.ts
            if seq <= top and seen.get(seq) != ts and not self._is_copy(track, message):
                back.add(number)
            seen[seq] = ts
            if seq > top:
                top = seq
        return back

    def _restarted_meanwhile(self, track: _Track, recovery: _Recovery, rest: list[RawMessage], expected: int) -> None:
        """The publisher restarted while ``recovery`` ran (the answer and a live message differ at a
        seq): what the endpoint holds reads the old stream. Purged; the new stream starts afresh from
        ``rest`` (live messages published after the answer, the first one's restart followed as any:
        held for a registration, or its buffer asked from 0), or with none, by asking the new process's
        buffer from 0 (``trigger="restart"``)."""
        metrics.record_recovery(recovery.trigger, "restarted", self._clock() - recovery.started, 0)
        if rest:
            self._went_back(track, rest[0], expected, self._endpoint_stats(track.endpoint.id), may_hold=True)
            self._resequence(track, rest[1:])
            return
        logger.warning(
            "kv event recovery endpoint=%s: its publisher's answer holds other batches than the live ones "
            "(it restarted), purging its entries and asking the new process's buffer from 0", track.endpoint.id,
        )
        metrics.record_incarnation("sequence_reset")
        self._reset(track)
        if not track.departed:
            self.recover(track.endpoint, "restart")

    def _resequence(self, track: _Track, messages: Iterable[RawMessage]) -> None:
        """Sequence messages a recovery buffered (counted already) once it ended: a restart among them
        that started a hold makes the hold take the rest."""
        for message in messages:
            try:
                if track.held is not None:
                    self._hold_more(track, message)
                else:
                    self._sequence(track, message, count=False)
            except Exception:
                logger.exception("event message failed endpoint=%s", message.endpoint_id)
                self.record_drop("internal_error")

    def _internal_error_heal(self, track: _Track, recovery: _Recovery) -> None:
        """Heal a recovery that raised: forget, start afresh, sequence the live messages it buffered."""
        track.recovery = None
        try:
            self._lose(track, "internal_error", recovery.from_seq, None)
        except Exception:
            logger.exception("kv event loss heal failed endpoint=%s", track.endpoint.id)
        track.next_seq = None
        track.history_asked = True  # the buffer's answer is what failed: the first live message is the start
        track.replayed.clear()
        metrics.record_recovery(recovery.trigger, "healed", self._clock() - recovery.started, 0)
        self._resequence(track, [m for _, m in recovery.buffer])  # arrival order: a restart among them is read as one

    async def _replay_gap(self, track: _Track, recovery: _Recovery) -> None:
        """Replay from ``recovery.from_seq``, then apply the buffered live messages, in seq order.

        The publisher answers with what it had *when asked*; live messages published after that can
        be lost on their way too (the loss that caused the gap may still be going on), so the
        buffer may hold a hole the replay could not cover. So may a live buffer that overflowed
        (``recovery_buffer_messages``: its oldest messages dropped). Such a hole is usually still in
        the publisher's buffer: it is asked for again (one more round per hole, each round from the
        first missing seq). A hole the publisher can no longer serve (no replay endpoint, a failed
        answer, an answer starting past it or holding an unreadable message, a position asked again
        that the answer did not cover) is a loss: healed (:meth:`_lose`) just
        before the first message after it is applied. A replay that failed with nothing to compare
        against (a startup replay after a snapshot, no live message since) cannot tell whether the
        publisher went on meanwhile: healed as a loss too, and the stream starts afresh (nothing is
        left that a lost message could make stale, so its next message is a start, not a gap).

        The answer is also evidence of *whose* the buffered messages are (module docstring, "A restart
        during a recovery", "An old incarnation's late message"): one received before the request that
        the answer does not hold, or holds with another batch, is dropped (an older process's; the
        endpoint purged if the recovery continued its stream); one received after it below what the
        answer applied, with another batch there, or one that went back with no copy in the answer, is
        a restart (:meth:`_restarted_meanwhile`).
        """
        endpoint = track.endpoint
        expected = recovery.from_seq
        # a fresh start loses nothing by a failed replay or an overflowed buffer: only a hole after
        # the first message applied (``started``) can leave stale entries
        started = not recovery.fresh
        failure = ""
        replayed = 0
        applied = 0
        rounds = 0
        losses = 0
        hole = False  # the previous round left a hole in the buffered messages: this round must fill it
        # arrival numbers of live messages an answer did not hold: disowned by a second ask (dropped when
        # reached), or not (kept); each asked about once per recovery
        disowned: set[int] = set()
        unproven: set[int] = set()
        while True:
            rounds += 1
            asked = expected
            recovery.asked_at = recovery.arrived
            replies, failure = await self._ask(endpoint, asked)
            if track.recovery is not recovery:
                return  # the endpoint left or restarted meanwhile
            for i, (seq, payload) in enumerate(replies):
                if seq < expected:
                    continue  # answered twice
                replay = RawMessage(endpoint.id, endpoint.model, seq, payload)
                if not self._decode(replay):
                    continue  # unreadable: lost, so the next seq applied is past a hole
                if seq > expected and started:
                    cause = "live_buffer_overflow" if hole and recovery.overflowed else "replay_incomplete"
                    losses += self._lose(track, cause, expected, seq)
                started = True
                self._apply_message(track, replay, replayed=True)
                expected = seq + 1
                replayed += 1
                applied += 1
                if i % _APPLY_CHUNK == _APPLY_CHUNK - 1:
                    await asyncio.sleep(0)
                    if track.recovery is not recovery:
                        return
            # the same position asked twice and still not served: the publisher cannot serve it
            unserved = hole and expected == asked
            hole = False
            # vLLM's publisher thread buffers each message as it sends it and answers between two: an
            # answer holds every message its process published before answering, up to ``newest``
            newest = max((seq for seq, _ in replies), default=-1)
            asked_at = recovery.asked_at
            if not failure:
                suspects = [
                    (number, message) for number, message in recovery.buffer
                    if number <= asked_at and message.seq > newest and message.seq >= expected
                    and number not in disowned and number not in unproven
                ]
                if suspects:
                    found = await self._disowned(track, suspects)
                    if track.recovery is not recovery:
                        return  # the endpoint left or restarted meanwhile
                    disowned |= found
                    unproven.update(number for number, _ in suspects if number not in found)
            entries = recovery.buffer
            recovery.buffer = deque()
            back = self._went_back_meanwhile(track, entries, disowned)
            buffered = sorted(entries, key=lambda entry: entry[1].seq)  # seq order (stable: arrival order within a seq)
            for k, (number, message) in enumerate(buffered):  # live messages that arrived meanwhile
                before_ask = number <= asked_at  # published before the answer was made
                if number in back and not self._is_copy(track, message):
                    # it went back below a live message buffered before it and the answer holds no copy
                    # of it: the publisher restarted (checked first: a new process's seq 0 is below
                    # an answer from an old process whose buffer rolled past seq 0)
                    self._restarted_meanwhile(track, recovery, [m for n, m in entries if n >= number], expected)
                    return
                if message.seq < expected:
                    if self._is_copy(track, message) or not self._applied_at(track, message.seq):
                        continue  # replayed already, buffered twice, or inside a hole healed as a loss
                    # another batch than the one applied at its seq: the publisher restarted in between
                    if before_ask and not failure:
                        # published before the answer, whose process then published another batch at
                        # its seq: an older incarnation's late message
                        self._drop_unpublished(message, "old_incarnation", newest)
                        if recovery.fresh:
                            continue
                        # the entries from before the recovery are that older incarnation's too
                        self._restarted_meanwhile(track, recovery, [m for n, m in entries if n > asked_at], expected)
                        return
                    # published after the answer (or no answer to tell): the restarted process's
                    self._restarted_meanwhile(track, recovery, [m for n, m in entries if n >= number], expected)
                    return
                if number in disowned:
                    # published before the answer, which does not hold it, and a second ask from its
                    # seq disowns it too: the answering process never published it (an older
                    # incarnation's late message, or a forged one)
                    self._drop_unpublished(message, "unpublished", newest)
                    continue
                if message.seq > expected and started:
                    if not (failure or unserved):
                        # lost after the publisher answered, or dropped by an overflowed live buffer:
                        # still in its buffer, ask again
                        hole = True
                        recovery.buffer = deque(sorted(buffered[k:]))  # arrival order
                        break
                    cause = (
                        ("no_replay_endpoint" if failure == _NO_REPLAY else "replay_failed") if failure
                        else "live_buffer_overflow" if recovery.overflowed else "replay_incomplete"
                    )
                    losses += self._lose(track, cause, expected, message.seq)
                started = True
                self._apply_message(track, message)
                expected = message.seq + 1
                applied += 1
            if not hole:
                break
            logger.info(
                "kv event recovery endpoint=%s: live messages from seq=%d on were lost while replaying%s; asking again",
                endpoint.id, expected, " (live buffer overflowed)" if recovery.overflowed else "",
            )
        if failure and started and not applied and not recovery.fresh:
            # nothing received to tell whether the publisher went on since ``from_seq``: a loss; with
            # nothing left to go stale the stream starts afresh (its next message asks the buffer again)
            losses += self._lose(track, "no_replay_endpoint" if failure == _NO_REPLAY else "replay_failed", expected, None)
            started = False
        track.recovery = None
        track.next_seq = expected if started else None
        if not started:  # the buffer was empty then: what the first live message follows may be there now
            track.history_asked = False
        elif track.applied_at is None:  # the replay confirmed the tail (an idle engine at startup): the
            track.applied_at = self._clock()  # tail probe's quiet time counts from here
        result = "healed" if losses else "recovered"
        duration = self._clock() - recovery.started
        metrics.record_recovery(recovery.trigger, result, duration, replayed)
        log = logger.warning if losses else logger.info
        log(
            "kv event recovery endpoint=%s trigger=%s from=%d to=%d replayed=%d rounds=%d result=%s%s state=%s "
            "duration=%.3fs",
            endpoint.id, recovery.trigger, recovery.from_seq, expected, replayed, rounds, result,
            f" ({failure})" if failure else "", track.state, duration,
        )

    def _lose(self, track: _Track, cause: str, expected: int, got: int | None) -> int:
        """Messages from ``expected`` (to ``got``, exclusive; None: unknown) are lost for good: forget
        the endpoint's entries, which predate the loss and may be stale (removals lost), so that
        what is applied from ``got`` on leaves it holding only blocks it really holds. Returns 1."""
        endpoint_id = track.endpoint.id
        if self._forget is not None:
            forgotten = int(self._forget(endpoint_id))
        else:
            forgotten = len(self._index.held_blocks(endpoint_id))
            self._index.apply(endpoint_id, AllBlocksCleared())
        metrics.record_loss(cause, forgotten)
        self._endpoint_stats(endpoint_id).losses += 1
        logger.warning(
            "kv event messages lost for good endpoint=%s cause=%s seqs=%d..%s: forgot its %d older entries "
            "(they may be stale), following it from seq=%s on, scored again",
            endpoint_id, cause, expected, "?" if got is None else got - 1, forgotten, "?" if got is None else got,
        )
        return 1

    # -- tail probe -------------------------------------------------------------------------

    async def _housekeep_forever(self) -> None:
        """Every tick (a quarter of the tail probe's quiet time, within 0.05-1 s; 1 s without tail
        probes): held messages (:meth:`expire_held`), then tail probes (:meth:`probe_tails`)."""
        probing = self._probe_quiet > 0 and self._replayer is not None
        tick = min(max(self._probe_quiet / 4, 0.05), 1.0) if probing else 1.0
        while True:
            await asyncio.sleep(tick)
            try:
                self.expire_held()
            except Exception:  # never let the loop die
                logger.exception("held messages scan failed")
            if not probing:
                continue
            try:
                self.probe_tails()
            except Exception:  # never let the loop die: a probe is an optimisation of safety, not the stream
                logger.exception("tail probe scan failed")

    def probe_tails(self) -> int:
        """Start a tail probe for each endpoint quiet ``tail_probe_quiet_seconds`` since its last
        applied message (live, with a replay endpoint): at once at a new position, else when its
        retry or idle re-probe is due; within the rate and concurrency bounds. Returns how many
        were started.

        Fair at any fleet size: endpoints are taken round-robin (a track probed moves to the end of
        the scan order), first probes of a new position before retries of a failed one, and those
        before idle re-probes; a probe that ends starts the next one due (within the bounds), so
        ``tail_probe_max_per_second`` is reachable whatever the tick. Before, at most
        ``tail_probe_concurrency`` probes started per tick (8/s at the default tick) and the scan
        always began at the first endpoint: the first ~240 endpoints' idle re-probes took every slot
        and later ones were never probed."""
        if self._replayer is None or self._probe_quiet <= 0 or self._closing:
            return 0
        now = self._clock()
        last = self._probe_refilled
        self._probe_refilled = now
        cap = max(self._probe_rate, 1.0)
        self._probe_tokens = min(cap, self._probe_tokens + (cap if last is None else (now - last) * self._probe_rate))
        slots = min(self._probe_concurrency - len(self._probes), int(self._probe_tokens))
        if slots <= 0:
            self._probe_backlog = True  # nothing may start now; a probe that ends looks again
            return 0
        first: list[_Track] = []
        retries: list[_Track] = []
        idle: list[_Track] = []
        quiet = self._probe_quiet
        backlog = False
        for track in list(self._tracks.values()):  # least recently probed first
            if (
                track.probing or track.departed or track.held is not None or track.recovery is not None
                or track.next_seq is None or track.applied_at is None
                or not track.endpoint.replay_endpoint or now - track.applied_at < quiet
            ):
                continue
            if track.probed_seq != track.next_seq:
                first.append(track)
                if len(first) >= slots:
                    backlog = True  # more may be due further on: looked at when a slot frees
                    break
            elif now >= track.probe_after:
                (retries if track.probe_failures else idle).append(track)
        due = first + retries + idle
        self._probe_backlog = backlog or len(due) > slots
        for track in due[:slots]:
            self._start_probe(track)
        return min(len(due), slots)

    def _start_probe(self, track: _Track) -> None:
        assert track.next_seq is not None
        self._probe_tokens -= 1
        track.probing = True
        endpoint_id = track.endpoint.id
        self._tracks[endpoint_id] = self._tracks.pop(endpoint_id)  # to the end of the round-robin order
        task = asyncio.create_task(self._probe(track, track.next_seq), name=f"kv-tail-probe-{endpoint_id}")
        self._probes.add(task)
        task.add_done_callback(self._probe_done)

    @staticmethod
    def _probe_ended(track: _Track, from_seq: int) -> None:
        """A probe from ``from_seq`` ended: a new position (the stream moved since) starts its own
        retries and idle intervals."""
        if track.probed_seq != from_seq or track.next_seq != from_seq:
            track.probe_failures = 0
            track.probe_interval = 0.0
        track.probed_seq = track.next_seq

    def _probe_done(self, task: asyncio.Task[None]) -> None:
        self._probes.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            logger.error("tail probe failed", exc_info=task.exception())
        if self._probe_backlog:  # a slot freed while probes were due: start the next at once
            try:
                self.probe_tails()
            except Exception:
                logger.exception("tail probe scan failed")

    async def _probe(self, track: _Track, from_seq: int) -> None:
        """Ask for what followed ``from_seq - 1``; apply it in order (a hole in it healed as a loss)."""
        endpoint = track.endpoint
        started = self._clock()
        restarts = track.restarts
        try:
            replies, failure = await self._ask(endpoint, from_seq, self._probe_timeout)
        finally:
            track.probing = False
        if (self._tracks.get(endpoint.id) is not track or track.recovery is not None or track.next_seq is None
                or track.restarts != restarts  # an answer from the incarnation that restarted meanwhile
                or track.departed or track.held is not None):  # whose stream it reads is the rejoin's to say
            metrics.record_tail_probe("superseded")  # left, departed, restarted or recovering meanwhile
            return
        if failure:
            self._probe_ended(track, from_seq)
            track.probe_failures += 1
            # retry after another quiet period; after the last attempt, only at the idle re-probe
            last = track.probe_failures >= self._probe_attempts
            if last and not self._probe_idle_max:
                track.probe_after = math.inf
            else:
                track.probe_after = self._clock() + (self._probe_idle_max if last else self._probe_quiet)
            if last:
                track.probe_failures = 0
            metrics.record_tail_probe("failed")
            self._drop_log.log(logging.INFO, f"tail-probe:{endpoint.id}",  # one line per endpoint per 10 s
                               "kv event tail probe endpoint=%s from=%d failed (%s)", endpoint.id, from_seq, failure)
            return
        expected = track.next_seq  # live messages may have moved it while the probe travelled
        found = 0
        losses = 0
        for seq, payload in replies:
            if seq < expected:
                continue
            message = RawMessage(endpoint.id, endpoint.model, seq, payload)
            if not self._decode(message):
                continue  # unreadable: the next one is past a hole
            if seq > expected:
                losses += self._lose(track, "replay_incomplete", expected, seq)
            self._apply_message(track, message, replayed=True)
            expected = seq + 1
            found += 1
        self._probe_ended(track, from_seq)
        track.probe_failures = 0
        if not found:
            # the tail is confirmed; re-probed while idle at doubling intervals (a final message lost later)
            track.probe_interval = min(max(track.probe_interval * 2, 2 * self._probe_quiet), self._probe_idle_max)
            track.probe_after = self._clock() + track.probe_interval if self._probe_idle_max else math.inf
            metrics.record_tail_probe("nothing_lost")
            return
        track.probe_after = 0.0
        metrics.record_tail_probe("found")
        metrics.record_recovery("tail_probe", "healed" if losses else "recovered", self._clock() - started, found)
        logger.warning(
            "kv event tail probe endpoint=%s: %d message(s) from seq=%d on never arrived live (a lost final "
            "message), applied from its replay buffer%s",
            endpoint.id, found, from_seq, "; a loss healed" if losses else "",
        )

    # -- held messages ----------------------------------------------------------------------

    def _hold(self, message: RawMessage) -> None:
        """Hold a message of an endpoint not registered (yet): at most ``pending_batches`` per endpoint
        for ``pending_ttl_seconds``, :data:`_MAX_PENDING_ENDPOINTS` endpoints."""
        endpoint_id = message.endpoint_id
        held = self._pending.get(endpoint_id)
        if held is None:
            if len(self._pending) >= _MAX_PENDING_ENDPOINTS:
                self.record_drop("unregistered")
                return
            held = self._pending[endpoint_id] = deque(maxlen=max(self._pending_batches, 1))
            logger.info("holding event messages of unregistered endpoint=%s until it joins", endpoint_id)
        if self._pending_batches == 0:
            self.record_drop("unregistered")
            return
        if len(held) == held.maxlen:
            self.record_drop("unregistered")
        now = self._clock()
        while held and now - held[0][0] > self._pending_ttl:
            held.popleft()
            self.record_drop("unregistered")
        held.append((now, message))

    def _hold_more(self, track: _Track, message: RawMessage, why: str = "", went_back: bool = False) -> None:
        """Hold a registered endpoint's message until a registration says whose it is (``why`` starts a
        hold: :data:`_HOLD_DEPARTED` or :data:`_HOLD_RESET`; ``went_back``: it begins with a restart's message).

        A departed hold keeps at most ``pending_batches`` (the oldest dropped: what is left is still a
        fresh stream's run, whose start the replay buffer can fill) for the departed retention
        (``batches_dropped{reason="departed"}``). A reset hold is released (followed as a restart)
        once ``pending_ttl_seconds`` passed without the new registration, or when it is full."""
        now = self._clock()
        endpoint_id = track.endpoint.id
        held = track.held
        if held is None:
            if self._pending_batches <= 0:
                if why == _HOLD_DEPARTED:
                    self.record_drop("departed")
                else:
                    self._sequence(track, message, may_hold=False)
                return
            held = track.held = deque()
            track.held_why = why or _HOLD_DEPARTED
            track.held_since = now
            track.held_went_back = went_back
            self._holding.add(endpoint_id)
            logger.info(
                "holding event messages of endpoint=%s from seq=%d until its %s says whose they are",
                endpoint_id, message.seq, "rejoin" if track.held_why == _HOLD_DEPARTED else "new registration",
            )
        if track.held_why == _HOLD_RESET:
            if now - track.held_since > self._pending_ttl or len(held) >= self._pending_batches:
                self._release(track)
                self._sequence(track, message, may_hold=False)
                return
        else:
            while held and now - held[0][0] > self._departed_retention:
                held.popleft()
                self.record_drop("departed")
            if len(held) >= self._pending_batches:
                held.popleft()
                self.record_drop("departed")
        held.append((now, message))

    def _release(self, track: _Track) -> None:
        """End a reset hold with no new registration: its messages are followed on the track (whose
        stream was reset: the first is the new stream's start)."""
        held = track.held or deque()
        track.held = None
        self._holding.discard(track.endpoint.id)
        logger.info(
            "no new registration of endpoint=%s within %.0fs of its sequence reset: following its %d held "
            "message(s) as the restarted stream", track.endpoint.id, self._pending_ttl, len(held),
        )
        for _, message in held:
            self._sequence_held(track, message)

    def expire_held(self) -> None:
        """Housekeeping (every tick of the pool's loop): release reset holds past ``pending_ttl_seconds``,
        drop departed holds' messages past the retention, never-registered endpoints' past the
        ``pending_ttl_seconds`` (and the endpoint with its last one), and fence entries past the retention."""
        now = self._clock()
        for endpoint_id in list(self._holding):
            track = self._tracks.get(endpoint_id)
            if track is None or track.held is None:
                self._holding.discard(endpoint_id)
                continue
            if track.held_why == _HOLD_RESET:
                if now - track.held_since > self._pending_ttl:
                    self._release(track)
                continue
            held = track.held
            while held and now - held[0][0] > self._departed_retention:
                held.popleft()
                self.record_drop("departed")
        for endpoint_id in [e for e, held in self._pending.items() if not held or now - held[-1][0] > self._pending_ttl]:
            for _ in self._pending.pop(endpoint_id):
                self.record_drop("unregistered")
        if self._departed:
            for endpoint_id in [e for e, since in self._departed.items() if now - since > self._departed_retention]:
                del self._departed[endpoint_id]

    def tracked(self) -> Iterable[EndpointId]:
        return self._tracks.keys()
