"""The ZMQ SUB side of vLLM's KV-event publisher (``vllm/distributed/kv_events.py``, ZmqEventPublisher).

One SUB socket, subscribed to every topic, that

* **binds** ``bind_endpoint`` (e.g. ``tcp://127.0.0.1:5557``): vLLM *connects* its PUB socket
  when its endpoint is a plain ``tcp://host:port``, so many engines can share one bound SUB;
* **connects** to each registered engine whose ``events_endpoint`` differs from the bind endpoint
  (an engine that *binds*, e.g. ``tcp://*:5558``; the ``*`` is replaced by the host of the
  engine's URL, since that is where it listens).

A message is three frames ``[topic, seq (8-byte big-endian), msgpack payload]``; the topic
``kv@<host:port>@<model>`` (llm-d's convention, :func:`kvmesh.kv_events.parse_topic`) names the
endpoint. Well-formed frames go to the :class:`~services.kv_indexer.events.pool.EventPool`
(which decodes the payload in the endpoint's worker, before the seq is looked at); anything else is
dropped and counted (``frame_count``, ``bad_topic``, ``bad_seq``; one rate-limited line per reason),
moving no endpoint's sequence, and the receive loop keeps running.
"""

from __future__ import annotations

import contextlib
import logging
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvmesh.kv_events import END_SEQ, decode_seq, parse_topic, peek_data_parallel_rank
from kvmesh.types import Endpoint, EndpointId, dp_endpoint_id
from services.kv_indexer.events.pool import EventPool, RawMessage

logger = logging.getLogger(__name__)


def parse_frames(frames: list[bytes]) -> RawMessage | str:
    """A :class:`RawMessage`, or the drop reason (``frame_count``, ``bad_topic``, ``bad_seq``: not 8
    bytes, or vLLM's end-of-replay marker ``-1``, which a live publisher never sends)."""
    if len(frames) != 3:
        return "frame_count"
    topic, seq_frame, payload = frames
    try:
        endpoint_id, model = parse_topic(topic)
    except (ValueError, UnicodeDecodeError):
        return "bad_topic"
    if seq_frame == END_SEQ:
        return "bad_seq"
    try:
        seq = decode_seq(seq_frame)
    except ValueError:
        return "bad_seq"
    # one server may front several data-parallel ranks, each with its own cache: the rank is part
    # of the endpoint identity (rank 0 / none keeps the bare host:port)
    return RawMessage(dp_endpoint_id(endpoint_id, peek_data_parallel_rank(payload)), model, seq, payload)


def connect_target(endpoint: Endpoint, address: str | None = None) -> str:
    """Where to connect for an engine that binds ``address`` (default: its events endpoint):
    ``*``/``0.0.0.0`` become its URL's host."""
    target = endpoint.events_endpoint if address is None else address
    host = urlsplit(endpoint.url).hostname or "127.0.0.1"
    for wildcard in ("://*:", "://0.0.0.0:"):
        target = target.replace(wildcard, f"://{host}:")
    return target


class ZmqSubscriber:
    """Receives KV-event messages and hands them to ``pool``.

    Args:
        pool: where parsed messages go (and drops are counted).
        bind_endpoint: ZMQ endpoint to bind (``""``: bind nothing, only connect).
        rcvhwm_messages: ZMQ receive high-water mark (messages buffered before ZMQ drops).
    """

    def __init__(self, pool: EventPool, bind_endpoint: str, rcvhwm_messages: int = 100000) -> None:
        self._pool = pool
        self.bind_endpoint = bind_endpoint
        self._rcvhwm = rcvhwm_messages
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._connected: dict[EndpointId, str] = {}

    def start(self) -> None:
        """Create the socket and bind (returns at once; :meth:`run` receives).

        Raises:
            zmq.ZMQError: when ``bind_endpoint`` cannot be bound (address in use, bad address).
        """
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind_endpoint:
            try:
                sock.bind(self.bind_endpoint)
            except zmq.ZMQError:  # closed here: an open socket would block the context's term() at stop forever
                sock.close(linger=0)
                raise
            logger.info("kv events SUB bound endpoint=%s", self.bind_endpoint)
        self._socket = sock

    def follow(self, endpoint: Endpoint) -> None:
        """Connect to ``endpoint``'s publisher if it binds its own (idempotent)."""
        if self._socket is None or not endpoint.events_endpoint or endpoint.events_endpoint == self.bind_endpoint:
            return
        target = connect_target(endpoint)
        if self._connected.get(endpoint.id) == target:
            return
        self.unfollow(endpoint.id)
        try:
            self._socket.connect(target)
        except zmq.ZMQError as exc:
            logger.warning("cannot connect to kv events endpoint=%s target=%s error=%s", endpoint.id, target, exc)
            return
        self._connected[endpoint.id] = target
        logger.info("kv events SUB connected endpoint=%s target=%s", endpoint.id, target)

    def unfollow(self, endpoint_id: EndpointId) -> None:
        """Disconnect from an endpoint's publisher, if connected."""
        target = self._connected.pop(endpoint_id, None)
        if target is not None and self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disconnect(target)

    async def run(self) -> None:
        """Receive until cancelled; bad messages are dropped and counted, never raised."""
        if self._socket is None:
            self.start()
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            parsed = parse_frames(frames)
            if isinstance(parsed, str):
                self._pool.drop_malformed(parsed, "frames=%d topic=%r", len(frames), frames[0][:120] if frames else b"")
            else:
                self._pool.submit(parsed)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
