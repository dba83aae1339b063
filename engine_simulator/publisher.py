"""KV-event publishers: ZMQ exactly as vLLM 0.32's ``ZmqEventPublisher``, or nothing.

Wire (``vllm/distributed/kv_events.py``): a PUB socket sends one multipart message per engine
step with events: ``[topic, seq (8-byte big-endian), msgpack EventBatch [ts, events, 0]]``.
The socket *connects* to a plain ``tcp://host:port`` (the subscriber binds) and *binds* when the
endpoint contains ``*`` or ``::`` or is ``ipc://``/``inproc://``, as vLLM decides. The topic is
``kv@<host:port>@<model>`` (llm-d's convention, so a subscriber bound for many engines knows the
sender). ``seq`` starts at 0 and grows by one per message.

Sending never blocks the event loop: the socket is non-blocking with vLLM's high-water mark
(100,000 messages); a message that would block is dropped and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import zmq

from kvmesh.kv_events import EventBatch, KVEvent, encode_batch, encode_seq, make_topic

logger = logging.getLogger(__name__)

DEFAULT_HWM = 100_000


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

    Raises:
        zmq.ZMQError: when binding fails.
    """

    def __init__(
        self, endpoint: str, topic: str, data_parallel_rank: int = 0, hwm: int = DEFAULT_HWM
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
        try:
            self._sock.send_multipart((self.topic, encode_seq(self._seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            logger.warning("kv events dropped (subscriber slow) seq=%d dropped=%d", self._seq, self.dropped)
        self._seq += 1

    def shutdown(self) -> None:
        self._sock.close()


def make_publisher(endpoint: str, endpoint_id: str, model: str) -> EventPublisher:
    """A ZMQ publisher for a non-empty endpoint, else the null one."""
    if not endpoint:
        return NullEventPublisher()
    return ZmqEventPublisher(endpoint, make_topic(endpoint_id, model))
