"""kv_store's KV-event publisher and its etcd registration as an event source (the I/O side).

Wire: vLLM 0.32's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``), as the engines'
(``engine_simulator/publisher.py``): a PUB socket (an XPUB, the same wire to a SUB, so the
publisher can see when kv_indexer's subscription arrived: :meth:`StoreEventPublisher.wait_subscribed`;
a PUB drops what it sends before then, and a restarted instance's first batch is what it rescanned) sends ``[topic, seq (8-byte big-endian),
msgpack EventBatch [ts, events, 0]]`` with topic ``kv@<kv_store host:port>@<model>``; it connects
to a plain ``tcp://host:port`` (kv_indexer binds) and binds for ``*``/``::``/``ipc://``. Replay:
the last ``buffer_steps`` batches are served on a ROUTER socket (request ``[id, b"", start seq]``,
answer ``[id, b"", seq, payload]*`` then ``[id, b"", -1, b""]``), by a daemon thread, so
kv_indexer's gap recovery works for kv_store exactly as for an engine.

Membership: the instance registers, under a lease, an ``Endpoint`` JSON at
``/kvmesh/v1/kv_sources/<model>/<host:port>`` (:func:`kvmesh.membership.kv_source_key`): ``id`` is
its gRPC address (the id engines name in their ``kv_stores`` label), ``events_endpoint``,
``replay_endpoint`` and a fresh ``instance_id`` per start (a restart is a new incarnation: the
index drops what the old one published), ``labels`` ``kv_source=kv_store`` and ``shared_domains``.
Routing never watches that prefix, so a kv_store is never picked as an engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import zmq

from kvmesh.kv_event_replay import serve_replay
from kvmesh.kv_events import EventBatch, KVEvent, encode_batch, encode_seq, make_topic

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_STEPS = 10_000
"""vLLM's ``KVEventsConfig.buffer_steps`` default."""


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcards and local transports, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class StoreEventPublisher:
    """PUB (+ replay ROUTER) for kv_store's residency events; ``publish`` never blocks.

    Args:
        endpoint: ``tcp://host:port`` (connect) or a bind endpoint.
        source_id: this instance's id (its gRPC ``host:port``), the topic's endpoint part.
        model: the model whose blocks it publishes.
        replay_endpoint: ROUTER endpoint to bind (``tcp://127.0.0.1:*`` picks a port), ``""``: none.

    Raises:
        zmq.ZMQError: when binding fails.
    """

    def __init__(
        self, endpoint: str, source_id: str, model: str, replay_endpoint: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS, hwm: int = 100_000,
    ) -> None:
        self.topic = make_topic(source_id, model).encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 500)
        (self._sock.bind if endpoint_binds(endpoint) else self._sock.connect)(endpoint)
        self.seq = 0
        self.dropped = 0
        self.published_events = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer_steps, 1))
        self._lock = threading.Lock()
        self._running = True
        self.replay_endpoint = ""
        self._thread: threading.Thread | None = None
        if replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            bound = router.getsockopt(zmq.LAST_ENDPOINT)
            self.replay_endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,), name="kv-store-replay", daemon=True)
            self._thread.start()
        logger.info("kv_store events endpoint=%s topic=%s replay=%s", endpoint, self.topic.decode(), self.replay_endpoint or "-")

    async def wait_subscribed(self, timeout_seconds: float) -> bool:
        """Wait until a subscriber's subscription reached this socket (at most ``timeout_seconds``);
        whether one did. Events published earlier would be dropped by the socket (ZMQ's slow
        joiner): kv_store attaches its publisher only after this, so its first batches (a restart's
        republished blocks) reach kv_indexer live rather than through a later gap replay."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                self._sock.recv(flags=zmq.NOBLOCK)  # a subscription message: b"\x01" + topic prefix
                return True
            except zmq.Again:
                pass
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch under the next seq and keep it for replay."""
        if not events:
            return
        payload = encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self.seq
        self.seq += 1
        self.published_events += len(events)
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._sock.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # kept for replay: the indexer recovers it from the gap

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        serve_replay(router, lambda: self._running, self._buffered_since, "kv_store", self.topic)

    def _buffered_since(self, start: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start]

    def shutdown(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._sock.close()
