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
  lost *while* the replay was answered (published after the publisher answered) leave a hole in the
  buffered ones that is still in the publisher's buffer: it is asked for again. A range the
  publisher can no longer serve (no replay endpoint, timeout past ``replay_timeout_seconds``, buffer
  already rolled over, too many live messages buffered meanwhile) marks the endpoint ``unreliable``;
* a lower seq is either a *duplicate* or a *publisher restart*, told apart by the batch's ``ts``
  (vLLM stamps each ``KVEventBatch`` with the engine's ``time.time()``): a message no newer than the
  last one applied is a duplicate, dropped (``batches_dropped{reason="duplicate"}``). Duplicates are
  normal after a recovery: the replay answers up to the publisher's newest message, while the same
  messages are still on their way over the live SUB socket (queued in ZMQ while the indexer was
  starting, or in the worker's queue). A newer one means the publisher restarted (a new incarnation
  the registration did not reveal; vLLM numbers from 0 again): the endpoint's entries are purged
  and its stream starts afresh, as below.

**Fresh start.** An endpoint whose start is unknown (no message applied yet for its incarnation:
the indexer restarted without its snapshot of it, or the publisher restarted) holds no entry that
a lost message could have made stale, so the first sequence it gets is its start, not a gap. If
its publisher has a replay endpoint, its buffer is asked once (from seq 0, ``trigger=first_batch``,
or at once by :meth:`recover` at startup) and the first replayed seq is the start; otherwise, or
when the replay fails, the first live message is (a replay that found the buffer empty does not
count: the next message with seq > 0 asks again). A hole *after* the start is a gap as usual.
``unreliable`` lasts until a fresh state is known: an ``AllBlocksCleared`` or a new incarnation.

**Malformed messages.** A message is decoded *before* it is sequenced: one whose payload is not a
vLLM 0.32 / SGLang 0.5.23 ``EventBatch`` (undecodable msgpack, another shape, an unknown event
type, a field of the wrong type, a non-finite ``ts``) is dropped and counted
(``batches_dropped{reason="bad_payload"}``) without touching its endpoint's sequence, state or
entries: its seq is not evidence of anything. A replayed message that cannot be decoded is a
message lost (a hole, asked for again, then ``unreliable``). Drop lines are rate-limited per reason
(:class:`kvmesh.logging.RateLimitedLog`: one per 10 s with the count suppressed). A *valid* message
is trusted, whoever sent it: vLLM's ZMQ protocol has no authentication, so a well-formed batch with
a far-ahead seq is a gap (then, when the engine's real seq follows, a publisher restart), exactly as
if the engine had sent it. Keep the events bind address on a network only engines reach.

**Registration race.** An engine may publish before the indexer's etcd watch sees it join. A
message for an endpoint that was never registered is held (at most ``pending_batches`` per
endpoint, for ``pending_ttl_seconds``) and sequenced when it joins. Messages for an endpoint
purged after leaving are dropped (the fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
import zlib
from collections import Counter, deque
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


class EndpointState(enum.StrEnum):
    """Recovery state of an endpoint's event stream (a metric label)."""

    LIVE = "live"
    """Every message so far applied once, in order."""
    RECOVERING = "recovering"
    """A gap is being replayed; live messages are buffered."""
    UNRELIABLE = "unreliable"
    """Messages were lost for good: its entries are scored as unknown until a fresh state."""


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
    """Per endpoint: messages handled, the last sequence number and messages missed."""

    messages: int = 0
    last_seq: int | None = None
    sequence_gaps: int = 0


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
    buffer: list[RawMessage] = field(default_factory=list)
    overflowed: bool = False


@dataclass
class _Track:
    """Sequencing state of one registered endpoint."""

    endpoint: Endpoint
    next_seq: int | None = None
    """The next seq expected; None while the start is unknown (nothing applied for this incarnation)."""
    reliable: bool = True
    recovery: _Recovery | None = None
    last_ts: float | None = None
    """``ts`` of the last batch applied in this process (None: none yet, or restored from a snapshot)."""
    history_asked: bool = False
    """The replay buffer was already asked for this fresh start (one replay per start)."""

    @property
    def state(self) -> EndpointState:
        if self.recovery is not None:
            return EndpointState.RECOVERING
        return EndpointState.LIVE if self.reliable else EndpointState.UNRELIABLE


class EventPool:
    """N ordered workers between the subscriber and the index.

    Args:
        index: where events are applied.
        workers: number of shards (>= 1).
        queue_size: messages each worker may queue; beyond it a message is dropped (``queue_full``).
        pending_batches: per never-registered endpoint, messages held until it joins.
        pending_ttl_seconds: how long such messages are held.
        replayer: where missed messages are fetched from (None: every gap marks the endpoint unreliable).
        replay_timeout_seconds: deadline of one replay request.
        recovery_buffer_messages: live messages buffered per recovering endpoint before giving up.
        parity: checks each ``BlockStored`` against the registration (optional).
        clock: monotonic seconds (injectable for tests).
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
        self._departed: set[EndpointId] = set()
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

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (returns at once)."""
        for i, queue in enumerate(self._queues):
            self._tasks.append(asyncio.create_task(self._work(queue), name=f"kv-events-worker-{i}"))

    async def shutdown(self, timeout_seconds: float = 5.0) -> None:
        """Let the workers drain what is queued, then stop them (recoveries in flight are cancelled)."""
        for task in list(self._recoveries):
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
        """Wait until every queued message has been handled and no recovery is running."""
        while True:
            for queue in self._queues:
                await queue.join()
            if not self._recoveries:
                return
            await asyncio.wait(set(self._recoveries))

    # -- membership -------------------------------------------------------------------------

    def endpoint_joined(self, endpoint: Endpoint, new_incarnation: bool = True) -> None:
        """The endpoint was registered in the index: sequence its held messages, in order.

        ``new_incarnation``: its stream starts afresh (sequence unknown, reliable); False when the
        same incarnation rejoins (its sequencing carries on).
        """
        endpoint_id = endpoint.id
        self._departed.discard(endpoint_id)
        track = self._tracks.get(endpoint_id)
        if track is None or new_incarnation:
            if track is not None:
                track.recovery = None
            track = self._tracks[endpoint_id] = _Track(endpoint)
        else:
            track.endpoint = endpoint
        held = self._pending.pop(endpoint_id, None)
        if not held:
            return
        now = self._clock()
        fresh = [message for received, message in held if now - received <= self._pending_ttl]
        for message in fresh:
            self._sequence(track, message)
        logger.info("sequenced held event messages endpoint=%s messages=%d expired=%d", endpoint_id, len(fresh), len(held) - len(fresh))

    def endpoint_left(self, endpoint_id: EndpointId) -> None:
        """The endpoint was purged: its late messages are dropped from now on."""
        self._departed.add(endpoint_id)
        self._pending.pop(endpoint_id, None)
        self.stats.per_endpoint.pop(endpoint_id, None)
        track = self._tracks.pop(endpoint_id, None)
        if track is not None:
            track.recovery = None
        self._update_settled()

    def restore(self, endpoint: Endpoint, next_seq: int | None, reliable: bool) -> None:
        """Sequencing state of an endpoint restored from a snapshot (before it is confirmed by etcd)."""
        self._tracks[endpoint.id] = _Track(endpoint, next_seq, reliable)

    def export(self) -> dict[EndpointId, tuple[int | None, bool]]:
        """Per tracked endpoint ``(next expected seq, reliable)``, for a snapshot. A recovering
        endpoint exports the seq its recovery starts from (what was applied before the gap: the
        restarted indexer's startup replay covers the gap again); one recovering from a fresh start
        exports what it applied so far (None: nothing yet)."""
        out: dict[EndpointId, tuple[int | None, bool]] = {}
        for eid, t in self._tracks.items():
            recovery = t.recovery
            out[eid] = (t.next_seq if recovery is None or recovery.fresh else recovery.from_seq, t.reliable)
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
        self._sequence(track, message)

    def _sequence(self, track: _Track, message: RawMessage) -> None:
        stats = self._endpoint_stats(message.endpoint_id)
        stats.messages += 1
        if track.recovery is not None:
            self._buffer(track, message)
            return
        seq = message.seq
        expected = track.next_seq
        if expected is None:
            self._start_fresh(track, message, stats)
            return
        if seq < expected:
            self._older(track, message, expected, stats)
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

    def _older(self, track: _Track, message: RawMessage, expected: int, stats: EndpointIngestStats) -> None:
        """A seq below the expected one: a duplicate (``ts`` no newer than the last batch applied)
        is dropped; anything else is a publisher restart: purge, then start afresh with it."""
        if message.batch is None and not self._decode(message):
            return
        assert message.batch is not None
        ts = message.batch.ts
        if track.last_ts is not None and ts <= track.last_ts:
            logger.debug(
                "dropping duplicate kv event message endpoint=%s seq=%d (next expected %d)",
                message.endpoint_id, message.seq, expected,
            )
            self.record_drop("duplicate")
            return
        logger.warning(
            "kv event sequence went back endpoint=%s expected=%d got=%d with a newer batch: publisher restarted, "
            "purging its entries",
            message.endpoint_id, expected, message.seq,
        )
        metrics.record_incarnation("sequence_reset")
        self._index.apply(message.endpoint_id, AllBlocksCleared())
        track.reliable = True
        track.next_seq = None
        track.last_ts = None
        track.history_asked = False
        self._start_fresh(track, message, stats)

    def _endpoint_stats(self, endpoint_id: EndpointId) -> EndpointIngestStats:
        stats = self.stats.per_endpoint.get(endpoint_id)
        if stats is None:
            stats = self.stats.per_endpoint[endpoint_id] = EndpointIngestStats()
        return stats

    def _apply_message(self, track: _Track, message: RawMessage, stats: EndpointIngestStats | None = None) -> None:
        """Apply one in-order message, already decoded (``message.batch``), and move the seq past it."""
        batch = message.batch
        assert batch is not None, "messages are decoded before they are sequenced"
        track.next_seq = message.seq + 1
        (stats or self._endpoint_stats(message.endpoint_id)).last_seq = message.seq
        track.last_ts = batch.ts
        self._apply(track, batch)

    def _apply(self, track: _Track, batch: EventBatch) -> None:
        """One batch, in order: parity checks, reliability, the field filter, then the index (a
        whole batch per call where the index has ``apply_batch``)."""
        endpoint_id = track.endpoint.id
        events = batch.events
        parity = self._parity
        if parity is not None or not track.reliable:
            for event in events:
                kind = type(event)
                if kind is BlockStored:
                    if parity is not None:
                        parity.check(endpoint_id, event)  # type: ignore[arg-type]
                elif kind is AllBlocksCleared and not track.reliable:
                    track.reliable = True
                    logger.info("endpoint=%s cleared its cache: reliable again", endpoint_id)
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
            recovery.buffer.pop(0)
        recovery.buffer.append(message)

    def _start_recovery(
        self, track: _Track, from_seq: int, trigger: str, first: RawMessage | None, fresh: bool = False
    ) -> None:
        recovery = _Recovery(from_seq, trigger, self._clock(), fresh)
        if first is not None:
            recovery.buffer.append(first)
        track.recovery = recovery
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

    async def _ask(self, endpoint: Endpoint, from_seq: int) -> tuple[list[tuple[int, bytes]], str]:
        """The publisher's buffered messages from ``from_seq`` on, and ``""``; or ``[]`` and why not."""
        if self._replayer is None or not endpoint.replay_endpoint:
            return [], "no replay endpoint"
        try:
            return await self._replayer.replay(endpoint, from_seq, self._replay_timeout), ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return [], f"{type(exc).__name__}: {exc}"

    async def _recover(self, track: _Track, recovery: _Recovery) -> None:
        """Replay from ``recovery.from_seq``, then apply the buffered live messages, in seq order.

        The publisher answers with what it had *when asked*; live messages published after that can
        be lost on their way too (the loss that caused the gap may still be going on), so the
        buffer may hold a hole the replay could not cover. Such a hole is still in the publisher's
        buffer: it is asked for again (one more round per hole, each round from the first missing
        seq), and only a hole the publisher can no longer serve (a failed or empty answer, an
        answer starting past the hole, an overflowed live buffer) makes the endpoint ``unreliable``.
        """
        endpoint = track.endpoint
        expected = recovery.from_seq
        # a fresh start loses nothing by a failed replay or an overflowed buffer: only a hole after
        # the first message applied (``started``) can leave stale entries
        started = not recovery.fresh
        complete = True
        failure = ""
        replayed = 0
        rounds = 0
        hole = False  # the previous round left a hole in the buffered messages: this round must fill it
        while True:
            rounds += 1
            asked = expected
            replies, failure = await self._ask(endpoint, asked)
            if track.recovery is not recovery:
                return  # the endpoint left or restarted meanwhile
            if (failure or recovery.overflowed) and started:
                complete = False
            for i, (seq, payload) in enumerate(replies):
                if seq < expected:
                    continue  # answered twice
                replay = RawMessage(endpoint.id, endpoint.model, seq, payload)
                if not self._decode(replay):
                    continue  # unreadable: lost, so the next seq applied is past a hole
                if seq > expected and started:
                    complete = False
                started = True
                self._apply_message(track, replay)
                expected = seq + 1
                replayed += 1
                if i % _APPLY_CHUNK == _APPLY_CHUNK - 1:
                    await asyncio.sleep(0)
                    if track.recovery is not recovery:
                        return
            if hole and expected == asked:
                complete = False  # it published the missing seq (later ones arrived) and cannot serve it: lost
            hole = False
            buffered, recovery.buffer = sorted(recovery.buffer, key=lambda m: m.seq), []
            for k, message in enumerate(buffered):  # live messages that arrived meanwhile
                if message.seq < expected:
                    continue  # replayed already, or buffered twice
                if message.seq > expected and started:
                    if complete and not failure and not recovery.overflowed:
                        hole = True  # lost after the publisher answered: still in its buffer, ask again
                        recovery.buffer = buffered[k:]
                        break
                    complete = False
                started = True
                self._apply_message(track, message)
                expected = message.seq + 1
            if not hole:
                break
            logger.info(
                "kv event recovery endpoint=%s: live messages from seq=%d on were lost while replaying; asking again",
                endpoint.id, expected,
            )
        track.recovery = None
        track.next_seq = expected if started else None
        if not started:  # the buffer was empty then: what the first live message follows may be there now
            track.history_asked = False
        if not complete:
            track.reliable = False
        result = "recovered" if complete else "unreliable"
        duration = self._clock() - recovery.started
        metrics.record_recovery(recovery.trigger, result, duration, replayed)
        log = logger.info if complete and track.reliable else logger.warning
        log(
            "kv event recovery endpoint=%s trigger=%s from=%d to=%d replayed=%d rounds=%d result=%s%s state=%s "
            "duration=%.3fs",
            endpoint.id, recovery.trigger, recovery.from_seq, expected, replayed, rounds, result,
            f" ({failure})" if failure else "", track.state, duration,
        )

    # -- held messages ----------------------------------------------------------------------

    def _hold(self, message: RawMessage) -> None:
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

    def tracked(self) -> Iterable[EndpointId]:
        return self._tracks.keys()
