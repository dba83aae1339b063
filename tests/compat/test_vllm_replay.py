"""kv_indexer's replay client against vLLM 0.32's own ``ZmqEventPublisher`` (``.venv-vllm``, no engine).

Matches vLLM 0.32.0 (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``): each
replayed message is ``[identity, b"", topic, seq, payload]`` and the answer ends with
``[identity, b"", b"", END_SEQ, b""]``, so a DEALER receives 4 frames. The publisher is vLLM's class
itself, run by ``tests/compat/vllm_replay_publisher.py`` in ``.venv-vllm`` (it needs no GPU and no
engine: only its PUB and replay ROUTER sockets and its publisher thread). Skipped without
``.venv-vllm`` (``make vllm-env``); an error instead under ``KVMESH_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvmesh.kv_events import BlockStored, decode_batch, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from kvmesh_cli.vllm_engine import vllm_python
from services.kv_indexer.events.pool import EndpointState, EventPool
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import InMemoryIndex

A = EndpointId("127.0.0.1:9001")
TOPIC = make_topic(A, "m")
COUNT = 5
SCRIPT = Path(__file__).with_name("vllm_replay_publisher.py")
Publisher = tuple[Endpoint, "zmq.Socket[bytes]", "zmq.Context[zmq.Socket[bytes]]"]


def _vllm_missing() -> str | None:
    py = vllm_python()
    return None if py.exists() else f"no vLLM environment at {py} (run `make vllm-env`)"


if _vllm_missing() is not None and os.environ.get("KVMESH_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"make test-vllm: {_vllm_missing()}")
pytestmark = pytest.mark.skipif(_vllm_missing() is not None, reason=f"real vLLM not available: {_vllm_missing()}")


@pytest.fixture(scope="module")
def vllm_publisher() -> Iterator[Publisher]:
    """vLLM 0.32's ZmqEventPublisher with ``COUNT`` batches published and buffered (buffer_steps=3: seqs
    2-4 kept), its PUB connected to a SUB bound here, its replay ROUTER bound on 127.0.0.1."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [str(vllm_python()), str(SCRIPT), f"tcp://127.0.0.1:{pub_port}", replay, TOPIC, str(COUNT), "3"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # vLLM's import takes ~10 s; a failure closes stdout
        assert line == "ready", f"vLLM publisher did not start (rc={proc.poll()})"
        endpoint = Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, replay_endpoint=replay)
        yield endpoint, sub, ctx
    finally:
        proc.kill()
        proc.wait(timeout=10)
        sub.close(linger=0)
        ctx.term()


async def test_replay_client_reads_vllm_032_answers_with_the_topic_frame(vllm_publisher: Publisher) -> None:
    """Asked from 0, vLLM answers what its buffer holds (seqs 2-4, 4 frames each, topic included) and its
    end marker; asked from 3, seqs 3-4; asked past its newest, nothing. Each payload decodes as vLLM's
    batch and carries the ``ts`` it was published with."""
    endpoint, _, _ = vllm_publisher
    replayer = ZmqReplayer()
    try:
        everything = await replayer.replay(endpoint, 0, 5.0)
        assert [seq for seq, _ in everything] == [2, 3, 4]
        for seq, payload in everything:
            batch = decode_batch(payload)
            assert batch.ts == 1000.0 + seq
            assert isinstance(batch.events[0], BlockStored) and batch.events[0].block_hashes == [seq]
        assert await replayer.replay(endpoint, 3, 5.0) == everything[1:]
        assert await replayer.replay(endpoint, COUNT, 5.0) == []
    finally:
        replayer.close()


async def test_replayed_messages_are_the_bytes_vllm_published_live(vllm_publisher: Publisher) -> None:
    """A raw DEALER sees vLLM 0.32's exact frames; the payload of each replayed seq is the one its PUB sent
    (a duplicate after a recovery is told by this equality of ``ts``)."""
    endpoint, sub, ctx = vllm_publisher
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint.replay_endpoint)
    try:
        dealer.send_multipart([b"", (4).to_bytes(8, "big")])
        assert dealer.poll(5000)
        first = dealer.recv_multipart()
        assert first[:3] == [b"", TOPIC.encode(), (4).to_bytes(8, "big")]
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        dealer.close(linger=0)
    live: dict[int, bytes] = {}
    while sub.poll(200):  # the PUB connected late may have dropped the first ones (slow joiner)
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        live[int.from_bytes(seq, "big")] = payload
    replayer = ZmqReplayer()
    try:
        replayed = dict(await replayer.replay(endpoint, 0, 5.0))
    finally:
        replayer.close()
    for seq in set(live) & set(replayed):
        assert live[seq] == replayed[seq]


async def test_event_pool_recovers_from_vllms_replay_buffer(vllm_publisher: Publisher) -> None:
    """The indexer's startup recovery (a fresh start, asked from 0) takes vLLM's buffer (seqs 2-4) as the
    stream's start: the endpoint is live with those blocks and expects seq 5."""
    endpoint, _, _ = vllm_publisher
    index = InMemoryIndex()
    replayer = ZmqReplayer()
    pool = EventPool(index, workers=1, replayer=replayer, replay_timeout_seconds=5)
    index.register_endpoint(endpoint)
    pool.endpoint_joined(endpoint)
    pool.start()
    try:
        pool.recover(endpoint)
        await pool.settled()
        await pool.drained()
        assert pool.state(A) is EndpointState.LIVE
        assert set(index.held_blocks(A)) == {2, 3, 4}
        assert pool.export()[A] == (COUNT, True)
    finally:
        await pool.shutdown()
        replayer.close()
