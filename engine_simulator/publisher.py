"""KV-event publishers: ZMQ exactly as vLLM 0.32's ``ZmqEventPublisher``, or nothing.

Wire (``vllm/distributed/kv_events.py``): a PUB socket sends one multipart message per engine
step with events: ``[topic, seq (8-byte big-endian), msgpack EventBatch [ts, events, 0]]``.
The socket *connects* to a plain ``tcp://host:port`` (the subscriber binds) and *binds* when the
endpoint contains ``*`` or ``::`` or is ``ipc://``/``inproc://``, as vLLM decides. The topic is
``kv@<host:port>@<model>`` (llm-d's convention, so a subscriber bound for many engines knows the
sender). ``seq`` starts at 0 and grows by one per message.

Sending never blocks the event loop: the socket is non-blocking with vLLM's high-water mark
(100,000 messages); a message that would block is dropped and counted.

Replay (vLLM's ``replay_endpoint``): the last ``buffer_steps`` messages are kept and served on a
ROUTER socket bound at ``replay_endpoint``, by a daemon thread, exactly as vLLM's publisher thread
does: a request ``[identity, b"", start seq (8-byte big-endian)]`` is answered with
``[identity, b"", seq, payload]`` for every buffered message with ``seq >= start``, then
``[identity, b"", -1 (8-byte signed), b""]``. :meth:`ZmqEventPublisher.drop_next` withholds the
next messages from the PUB socket (still buffered): a crafted gap a subscriber must replay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

import zmq

from kvmesh.kv_event_replay import serve_replay
from kvmesh.kv_events import EventBatch, KVEvent, encode_batch, encode_seq, make_topic

logger = logging.getLogger(__name__)

DEFAULT_HWM = 100_000
DEFAULT_BUFFER_STEPS = 10_000
"""vLLM's ``KVEventsConfig.buffer_steps`` default."""


class EventPublisher(Protocol):
    """Publishes a step's KV events; ``shutdown`` releases the transport."""

    def publish(self, events: list[KVEvent]) -> None: ...

    def shutdown(self) -> None: ...


class NullEventPublisher:
    """The disabled publisher (``--events-endpoint ""``)."""

    def publish(self, events: list[KVEvent]) -> None:
        return None

    def shutdown(self) -> None:
        return None


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcards and local transports, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket publishing ``EventBatch`` messages.

    Args:
        endpoint: ``tcp://host:port`` (connect) or e.g. ``tcp://*:port`` (bind).
        topic: usually ``make_topic(endpoint_id, model)``.
        data_parallel_rank: the batch's third field (0 for a single engine).
        replay_endpoint: ROUTER endpoint to bind for replay requests (``""``: no replay).
        buffer_steps: messages kept for replay.

    Raises:
        zmq.ZMQError: when binding fails.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        data_parallel_rank: int = 0,
        hwm: int = DEFAULT_HWM,
        replay_endpoint: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 500)
        if endpoint_binds(endpoint):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self._seq = 0
        self.dropped = 0
        self._withhold = 0
        self.withheld = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 1))
        self._lock = threading.Lock()
        self._running = True
        self.replay_endpoint = replay_endpoint
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError:  # closed here: open sockets would block the shared context's term() forever
                router.close(linger=0)
                self._sock.close(linger=0)
                raise
            bound = router.getsockopt(zmq.LAST_ENDPOINT)
            self.replay_endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)  # "*" port resolved
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        logger.info(
            "kv events publisher endpoint=%s mode=%s topic=%s",
            endpoint,
            "bind" if endpoint_binds(endpoint) else "connect",
            topic,
        )

    @property
    def bound_endpoint(self) -> str | None:
        """The concrete endpoint when bound (e.g. ``tcp://127.0.0.1:*`` resolved to a port), else None."""
        if not endpoint_binds(self.endpoint):
            return None
        value = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (nothing for an empty list)."""
        if not events:
            return
        payload = encode_batch(
            EventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        )
        self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> None:
        """Send one already encoded batch under the next seq, and buffer it for replay."""
        seq = self._seq
        self._seq += 1
        if self.replay_endpoint:
            with self._lock:
                self._buffer.append((seq, payload))
        if self._withhold > 0:
            self._withhold -= 1
            self.withheld += 1
            return
        try:
            self._sock.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            logger.warning("kv events dropped (subscriber slow) seq=%d dropped=%d", seq, self.dropped)

    def drop_next(self, count: int) -> None:
        """Withhold the next ``count`` messages from the PUB socket (still numbered and buffered)."""
        self._withhold += count

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        serve_replay(router, lambda: self._running, self._buffered_since, "engine", self.topic)

    def _buffered_since(self, start: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]

    def shutdown(self) -> None:
        self._running = False
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2.0)
        self._sock.close()


def make_publisher(
    endpoint: str, endpoint_id: str, model: str, replay_endpoint: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS
) -> EventPublisher:
    """A ZMQ publisher for a non-empty endpoint, else the null one."""
    if not endpoint:
        return NullEventPublisher()
    return ZmqEventPublisher(
        endpoint, make_topic(endpoint_id, model), replay_endpoint=replay_endpoint, buffer_steps=buffer_steps
    )
