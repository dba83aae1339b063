"""The serving side of vLLM's KV-event replay protocol, shared by every kvmesh event publisher.

vLLM 0.32 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): a ROUTER socket
receives ``[identity, b"", start_seq (8-byte big-endian)]`` and answers, for every buffered message
with ``seq >= start_seq``, ``[identity, b"", seq, payload]``, then ``[identity, b"", END_SEQ, b""]``.
The engine simulator (:mod:`engine_simulator.publisher`) and kv_store (:mod:`services.kv_store.events`)
both serve it from their own buffers through :func:`serve_replay`; kv_indexer is the client.
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
) -> None:
    """Answer replay requests on ``router`` until ``running()`` is false (polls every 100 ms); closes it.

    Args:
        router: a bound ZMQ ROUTER socket, used by this thread only.
        running: False once the publisher shuts down.
        since: the buffered ``(seq, payload)`` pairs with ``seq >=`` its argument, oldest first (the
            caller's lock held inside it).
        name: names the publisher in log lines.

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
                router.send_multipart((identity, b"", encode_seq(seq), payload))
            router.send_multipart((identity, b"", END_SEQ, b""))
            logger.info("%s: kv events replayed from=%d messages=%d", name, start, len(wanted))
    except zmq.ZMQError as exc:
        if running():
            logger.warning("%s: replay socket failed: %s", name, exc)
    finally:
        router.close(linger=0)
