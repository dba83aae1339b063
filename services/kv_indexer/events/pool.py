"""The event pool: applies each endpoint's KV-event messages in order, sharded over N workers.

Follows llm-d's ``pkg/kvcache/kvevents/pool.go``: a message is routed to worker
``crc32(endpoint id) % N``, so one endpoint's messages are always handled by one worker, in
arrival order, while endpoints spread over workers. ``start()`` does not block; ``shutdown()``
lets the workers drain their queues, then stops them. Workers are asyncio tasks on the service's
loop (the index is synchronous and does no I/O), so membership changes made on the same loop
never race with an event being applied.

Per message a worker: tracks the publisher's sequence number (a jump forward is a gap: logged and
counted, since vLLM's replay endpoint is not used yet; a jump backward is a publisher restart),
decodes the msgpack payload (:func:`kvmesh.kv_events.decode_batch`; a bad payload is dropped and
counted), and applies its events to the index.

Registration race: an engine may publish before the indexer's etcd watch has seen it join. A
message for an endpoint that was never registered is held (at most ``pending_batches`` per
endpoint, for ``pending_ttl_seconds``) and applied, in order, when the endpoint joins. Messages
for an endpoint that left are dropped (the fence), and a rejoin starts from an empty state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvmesh.kv_events import EventBatch, decode_batch
from kvmesh.types import EndpointId
from services.kv_indexer import metrics
from services.kv_indexer.index.base import KVBlockIndex

logger = logging.getLogger(__name__)

_MAX_PENDING_ENDPOINTS = 1024
"""At most this many never-registered endpoints have messages held at once."""


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One ZMQ message whose frames parsed: endpoint and model from the topic, seq, raw payload."""

    endpoint_id: EndpointId
    model: str
    seq: int
    payload: bytes


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


class EventPool:
    """N ordered workers between the subscriber and the index.

    Args:
        index: where events are applied.
        workers: number of shards (>= 1).
        queue_size: messages each worker may queue; beyond it a message is dropped (``queue_full``).
        pending_batches: per never-registered endpoint, messages held until it joins.
        pending_ttl_seconds: how long such messages are held.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        index: KVBlockIndex,
        workers: int = 4,
        queue_size: int = 10000,
        pending_batches: int = 256,
        pending_ttl_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._index = index
        self._queues: list[asyncio.Queue[RawMessage | None]] = [asyncio.Queue(queue_size) for _ in range(workers)]
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[EndpointId, deque[tuple[float, EventBatch]]] = {}
        self._pending_batches = pending_batches
        self._pending_ttl = pending_ttl_seconds
        self._departed: set[EndpointId] = set()
        self._clock = clock
        self.stats = IngestStats()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (returns at once)."""
        for i, queue in enumerate(self._queues):
            self._tasks.append(asyncio.create_task(self._work(queue), name=f"kv-events-worker-{i}"))

    async def shutdown(self, timeout_seconds: float = 5.0) -> None:
        """Let the workers drain what is queued, then stop them."""
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

    async def drained(self) -> None:
        """Wait until every queued message has been handled (for tests and shutdown)."""
        for queue in self._queues:
            await queue.join()

    # -- membership -------------------------------------------------------------------------

    def endpoint_joined(self, endpoint_id: EndpointId) -> None:
        """The endpoint was registered in the index: apply its held messages, in order."""
        self._departed.discard(endpoint_id)
        held = self._pending.pop(endpoint_id, None)
        if not held:
            return
        now = self._clock()
        applied = 0
        for received, batch in held:
            if now - received <= self._pending_ttl:
                self._apply(endpoint_id, batch)
                applied += 1
        logger.info("applied held event messages endpoint=%s messages=%d expired=%d", endpoint_id, applied, len(held) - applied)

    def endpoint_left(self, endpoint_id: EndpointId) -> None:
        """The endpoint was purged: its late messages are dropped from now on."""
        self._departed.add(endpoint_id)
        self._pending.pop(endpoint_id, None)
        self.stats.per_endpoint.pop(endpoint_id, None)

    # -- workers ----------------------------------------------------------------------------

    async def _work(self, queue: asyncio.Queue[RawMessage | None]) -> None:
        while True:
            message = await queue.get()
            try:
                if message is None:
                    return
                self._handle(message)
            except Exception:
                logger.exception("event message failed endpoint=%s", message.endpoint_id if message else "")
                self.record_drop("internal_error")
            finally:
                queue.task_done()

    def _handle(self, message: RawMessage) -> None:
        endpoint_id = message.endpoint_id
        if endpoint_id in self._departed and not self._index.is_registered(endpoint_id):
            self.record_drop("endpoint_left")
            return
        stats = self.stats.per_endpoint.setdefault(endpoint_id, EndpointIngestStats())
        stats.messages += 1
        if stats.last_seq is not None:
            if message.seq > stats.last_seq + 1:
                missed = message.seq - stats.last_seq - 1
                stats.sequence_gaps += missed
                metrics.record_sequence_gap(missed)
                logger.warning(
                    "kv event sequence gap endpoint=%s expected=%d got=%d missed=%d",
                    endpoint_id, stats.last_seq + 1, message.seq, missed,
                )
            elif message.seq <= stats.last_seq:
                logger.info(
                    "kv event sequence restarted endpoint=%s last=%d got=%d (publisher restart or repeat)",
                    endpoint_id, stats.last_seq, message.seq,
                )
        stats.last_seq = message.seq
        try:
            batch = decode_batch(message.payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            logger.warning("dropping undecodable event message endpoint=%s seq=%d error=%s", endpoint_id, message.seq, exc)
            self.record_drop("bad_payload")
            return
        if not self._index.is_registered(endpoint_id):
            self._hold(endpoint_id, batch)
            return
        self._apply(endpoint_id, batch)

    def _hold(self, endpoint_id: EndpointId, batch: EventBatch) -> None:
        held = self._pending.get(endpoint_id)
        if held is None:
            if len(self._pending) >= _MAX_PENDING_ENDPOINTS:
                self.record_drop("unregistered")
                return
            held = self._pending[endpoint_id] = deque(maxlen=self._pending_batches)
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
        held.append((now, batch))

    def _apply(self, endpoint_id: EndpointId, batch: EventBatch) -> None:
        for event in batch.events:
            self._index.apply(endpoint_id, event)
