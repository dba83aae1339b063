"""The serving side of vLLM 0.32's KV-event replay protocol, shared by every kvmesh event publisher.

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): a ROUTER socket
receives ``[identity, b"", start_seq (8-byte big-endian)]`` and answers, for every buffered message
with ``seq >= start_seq``, ``[identity, b"", topic, seq, payload]``, then
``[identity, b"", b"", END_SEQ, b""]`` (the end marker carries an empty topic). SGLang 0.5.23 and older
vLLM send the same without the topic frame; :class:`services.kv_indexer.events.replay.ZmqReplayer`
reads both. The engine simulator (:mod:`engine_simulator.publisher`) and kv_store
(:mod:`services.kv_store.events`) both serve it from their own buffers through :func:`serve_replay`;
kv_indexer is the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvmesh.kv_events import END_SEQ, encode_seq

logger = logging.getLogger(__name__)


def serve_replay(
    router: zmq.Socket[bytes],
    running: Callable[[], bool],
    since: Callable[[int], list[tuple[int, bytes]]],
    name: str,
    topic: bytes = b"",
) -> None:
    """Answer replay requests on ``router`` until ``running()`` is false (polls every 100 ms); closes it.

    Args:
        router: a bound ZMQ ROUTER socket, used by this thread only.
        running: False once the publisher shuts down.
        since: the buffered ``(seq, payload)`` pairs with ``seq >=`` its argument, oldest first (the
            caller's lock held inside it).
        name: names the publisher in log lines.
        topic: the publisher's topic, sent as the second frame of each replayed message as vLLM 0.32
            does (its ``KVEventsConfig.topic``, empty by default).

    A request of the wrong shape is logged and ignored; a socket error ends the loop with a warning
    (unless shutting down).
    """
    try:
        while running():
            if not router.poll(100):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                logger.warning("%s: invalid replay request: %d frames", name, len(frames))
                continue
            identity, _, start_frame = frames
            start = int.from_bytes(start_frame, "big")
            wanted = since(start)
            for seq, payload in wanted:
                router.send_multipart((identity, b"", topic, encode_seq(seq), payload))
            router.send_multipart((identity, b"", b"", END_SEQ, b""))
            logger.info("%s: kv events replayed from=%d messages=%d", name, start, len(wanted))
    except zmq.ZMQError as exc:
        if running():
            logger.warning("%s: replay socket failed: %s", name, exc)
    finally:
        router.close(linger=0)
