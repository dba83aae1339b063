"""The client side of the KV-event replay protocol (vLLM 0.32 ``ZmqEventPublisher``, SGLang's too).

The publisher keeps its last ``buffer_steps`` messages (``(seq, payload)``) and serves them on a ROUTER
socket bound at ``KVEventsConfig.replay_endpoint``. A client (here a DEALER) sends
``[b"", start_seq as 8-byte big-endian]``; the publisher answers one message per buffered message with
``seq >= start_seq``, in order, then an end marker whose seq frame is ``-1`` as 8-byte big-endian signed
(``0xff * 8``, :data:`kvmesh.kv_events.END_SEQ`). Two forms of the answer exist upstream, both accepted
(the DEALER sees what follows the ROUTER's identity frame):

* vLLM 0.32 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): 4 frames,
  ``[b"", topic, seq, payload]``, ending with ``[b"", b"", END_SEQ, b""]``;
* SGLang 0.5.23 (``sglang/srt/disaggregation/kv_events.py``) and vLLM before the topic frame: 3 frames,
  ``[b"", seq, payload]``, ending with ``[b"", END_SEQ, b""]``.

Nothing else is said: a start older than the buffer simply yields the buffer from its first message
on, so the caller checks continuity.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from kvmesh.kv_events import END_SEQ, decode_seq
from kvmesh.types import Endpoint
from services.kv_indexer.events.subscriber import connect_target


class ReplayUnavailable(Exception):
    """The endpoint registered no replay endpoint."""


class ZmqReplayer:
    """Asks publishers for missed messages over vLLM's replay protocol (one DEALER per request).

    The exchange runs in a worker thread with a plain (blocking) socket: a replay of a million
    messages is a tight receive loop, which an asyncio future per message would slow tenfold.
    """

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    async def replay(self, endpoint: Endpoint, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        """Every buffered ``(seq, payload)`` with ``seq >= from_seq``, in the publisher's order.

        Raises:
            ReplayUnavailable: ``endpoint.replay_endpoint`` is empty.
            TimeoutError: the end marker did not arrive within ``timeout_seconds``.
            zmq.ZMQError, ValueError: a bad address or a malformed reply.
        """
        if not endpoint.replay_endpoint:
            raise ReplayUnavailable(f"endpoint {endpoint.id} registered no replay endpoint")
        target = connect_target(endpoint, endpoint.replay_endpoint)
        return await asyncio.to_thread(self._exchange, target, from_seq, timeout_seconds)

    def _exchange(self, target: str, from_seq: int, timeout_seconds: float) -> list[tuple[int, bytes]]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        deadline = time.monotonic() + timeout_seconds
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(target)
            sock.send_multipart([b"", from_seq.to_bytes(8, "big")])
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms):
                    raise TimeoutError(f"replay from {target} timed out after {timeout_seconds}s ({len(out)} messages)")
                while True:  # drain what has arrived without waiting
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    n = len(frames)  # 3: [b"", seq, payload] (SGLang); 4: [b"", topic, seq, payload] (vLLM 0.32)
                    if n not in (3, 4) or frames[0] != b"":
                        raise ValueError(f"malformed replay reply: {n} frames")
                    seq_frame = frames[n - 2]
                    if seq_frame == END_SEQ:
                        return out
                    out.append((decode_seq(seq_frame), frames[n - 1]))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._ctx.term()
