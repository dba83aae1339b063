"""Event ingestion with real ZMQ sockets and a real index: frame parsing, order, gaps, fence, hold."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import zmq

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encode_seq,
    make_topic,
)
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.events.subscriber import ZmqSubscriber, connect_target, parse_frames
from services.kv_indexer.index import InMemoryIndex
from tests.support import wait_until_async

A = EndpointId("127.0.0.1:9001")
TOPIC = make_topic(A, "m").encode()
TOKENS = list(range(8))
_TS = itertools.count(1_700_000_000)
"""Batch timestamps: each payload is newer than the last, as vLLM's ``time.time()`` stamps are."""


def payload(*hashes_and_parents: tuple[int, int | None]) -> bytes:
    events: list[KVEvent] = [
        BlockStored(block_hashes=[h], parent_block_hash=p, token_ids=TOKENS[4 * i : 4 * i + 4] if p is None and i == 0 else TOKENS[4:8], block_size=4)
        for i, (h, p) in enumerate(hashes_and_parents)
    ]
    return encode_batch(EventBatch(ts=float(next(_TS)), events=events, data_parallel_rank=0))


def endpoint(url_port: int = 9001, events: str = "") -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{url_port}"), url=f"http://127.0.0.1:{url_port}", model="m", block_size_tokens=4, events_endpoint=events)


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ([TOPIC, encode_seq(7), b"x"], RawMessage(A, "m", 7, b"x")),
        ([TOPIC, encode_seq(7)], "frame_count"),
        ([TOPIC, encode_seq(7), b"x", b"y"], "frame_count"),
        ([b"kv@tiny", encode_seq(7), b"x"], "bad_topic"),
        ([b"\xff\xfe", encode_seq(7), b"x"], "bad_topic"),
        ([TOPIC, b"\x01", b"x"], "bad_seq"),
    ],
    ids=["ok", "two-frames", "four-frames", "vllm-bare-topic", "not-utf8", "short-seq"],
)
def test_parse_frames(frames: list[bytes], expected: object) -> None:
    assert parse_frames(frames) == expected


@pytest.mark.parametrize(
    ("events", "target"),
    [("tcp://*:5558", "tcp://127.0.0.1:5558"), ("tcp://0.0.0.0:5558", "tcp://127.0.0.1:5558"), ("tcp://127.0.0.1:7", "tcp://127.0.0.1:7")],
    ids=["star", "any", "explicit"],
)
def test_connect_target(events: str, target: str) -> None:
    assert connect_target(endpoint(events=events)) == target


def joined(index: InMemoryIndex, pool: EventPool, ep: Endpoint | None = None) -> Endpoint:
    ep = ep or endpoint()
    index.register_endpoint(ep)
    pool.endpoint_joined(ep)
    return ep


def scores(index: InMemoryIndex) -> dict[str, int]:
    return {s.endpoint_id: s.matched_blocks for s in index.score("m", TOKENS).scores}


async def test_pool_applies_in_order_and_drops_bad_payloads() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=3)
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    pool.submit(RawMessage(A, "m", 1, payload((2, 1))))  # needs message 0 applied first
    pool.submit(RawMessage(A, "m", 2, b"\xc1garbage"))
    await pool.drained()
    assert scores(index) == {A: 2}
    per = pool.stats.per_endpoint[A]
    assert (per.messages, per.last_seq, per.sequence_gaps) == (2, 1, 0)  # a malformed message moves no seq
    assert pool.stats.dropped == {"bad_payload": 1}
    assert pool.state(A) is EndpointState.LIVE
    await pool.shutdown()


async def test_gap_without_replay_endpoint_is_a_loss_healed_at_once() -> None:
    """Nobody can replay the gap: the entries that predate it are forgotten (a lost removal may have
    made them stale), the message after it is applied, and the endpoint is live (scored) at once."""
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, replayer=ZmqReplayer())
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    pool.submit(RawMessage(A, "m", 3, payload((2, 1))))  # seq 1-2 lost, nobody can replay them
    await pool.drained()
    assert pool.state(A) is EndpointState.LIVE
    assert pool.stats.per_endpoint[A].sequence_gaps == 2 and pool.stats.per_endpoint[A].losses == 1
    assert set(index.held_blocks(A)) == {2}  # block 1 forgotten; block 2 still keys on it (its hash's key kept)
    assert scores(index) == {}  # a prefix starting at the forgotten block matches nothing: no stale hit
    pool.submit(RawMessage(A, "m", 4, encode_batch(EventBatch(ts=float(next(_TS)), events=[AllBlocksCleared()]))))
    pool.submit(RawMessage(A, "m", 5, payload((1, None), (2, 1))))  # stored again after the loss: scored
    await pool.drained()
    assert pool.state(A) is EndpointState.LIVE and scores(index) == {A: 2}
    await pool.shutdown()


async def test_gap_is_replayed_from_a_real_vllm_style_replay_socket_exactly_once_in_order() -> None:
    """vLLM 0.32's protocol (ZmqEventPublisher's ROUTER): served by the simulator's publisher."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", TOPIC.decode(), replay_endpoint=replay)
    payloads = [payload((1, None)), payload((2, 1)), payload((3, 2)), payload((2, 1))]
    for p in payloads:
        publisher.publish_payload(p)  # buffered for replay (no subscriber on the PUB side)
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, replayer=ZmqReplayer(), replay_timeout_seconds=5)
    joined(index, pool, Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, replay_endpoint=replay))
    pool.start()
    try:
        pool.submit(RawMessage(A, "m", 0, payloads[0]))
        pool.submit(RawMessage(A, "m", 3, payloads[3]))  # 1 and 2 were lost on PUB
        pool.submit(RawMessage(A, "m", 3, payloads[3]))  # a duplicate: applied once
        await pool.drained()
        assert pool.state(A) is EndpointState.LIVE
        assert set(index.held_blocks(A)) == {1, 2, 3}
        assert index.stats().per_endpoint[0].events_applied == 4  # seq 0..3, each once
        assert pool.export()[A] == (4, True)
    finally:
        publisher.shutdown()
        await pool.shutdown()


async def test_first_batch_after_an_indexer_restart_takes_the_replays_first_seq_as_its_start() -> None:
    """A fresh stream holds nothing a lost message could make stale: a replay buffer that rolled past
    seq 0 gives the start, and the stream is live (vLLM 0.32's replay ROUTER, buffer_steps=2)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", TOPIC.decode(), replay_endpoint=replay, buffer_steps=2)
    for p in (payload((1, None)), payload((2, 1)), payload((3, 2))):
        publisher.publish_payload(p)  # the buffer keeps seq 1-2 only: seq 0 is gone
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, replayer=ZmqReplayer())
    joined(index, pool, Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, replay_endpoint=replay))
    pool.start()
    try:
        pool.submit(RawMessage(A, "m", 2, payload((3, 2))))
        await pool.drained()
        assert pool.state(A) is EndpointState.LIVE  # the replay's first seq (1) is the start
        assert set(index.held_blocks(A)) == {2, 3}  # chains without their parent are still held
        assert pool.export()[A] == (3, True) and pool.stats.per_endpoint[A].sequence_gaps == 0
        later = [payload((4, 3)), payload((5, 4)), payload((6, 5))]
        for p in later:
            publisher.publish_payload(p)  # seq 3-5; the buffer keeps 4-5 only
        pool.submit(RawMessage(A, "m", 5, later[2]))  # a hole after the start is a gap
        await pool.drained()
        # seq 3 left the buffer: not replayable, a loss, healed: older entries forgotten, 4-5 applied, live
        assert pool.state(A) is EndpointState.LIVE and pool.stats.per_endpoint[A].losses == 1
        assert set(index.held_blocks(A)) == {5, 6}
    finally:
        publisher.shutdown()
        await pool.shutdown()


async def test_fresh_stream_without_replay_endpoint_starts_at_its_first_message() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, replayer=ZmqReplayer())
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 41, payload((1, None))))
    pool.submit(RawMessage(A, "m", 42, payload((2, 1))))
    await pool.drained()
    assert pool.state(A) is EndpointState.LIVE and scores(index) == {A: 2}
    assert pool.stats.per_endpoint[A].sequence_gaps == 0 and pool.export()[A] == (43, True)
    await pool.shutdown()


async def test_sequence_going_back_is_a_new_incarnation_and_purges() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    pool.submit(RawMessage(A, "m", 1, payload((2, 1))))
    pool.submit(RawMessage(A, "m", 0, payload((9, None))))  # the engine restarted: its seq is 0 again
    await pool.drained()
    assert set(index.held_blocks(A)) == {9}
    assert pool.state(A) is EndpointState.LIVE
    await pool.shutdown()


async def test_pool_holds_messages_until_first_join_and_fences_after_leave() -> None:
    index = InMemoryIndex()
    now = [0.0]
    pool = EventPool(index, workers=1, pending_ttl_seconds=5, clock=lambda: now[0])
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    pool.submit(RawMessage(A, "m", 1, payload((2, 1))))
    await pool.drained()
    assert index.score("m", TOKENS).scores == []
    joined(index, pool)
    assert index.score("m", TOKENS).scores[0].matched_blocks == 2
    index.remove_endpoint(A)
    pool.endpoint_left(A)
    pool.submit(RawMessage(A, "m", 2, payload((1, None))))
    await pool.drained()
    assert pool.stats.dropped == {"endpoint_left": 1}
    joined(index, pool)
    assert index.score("m", TOKENS).scores == []
    await pool.shutdown()


async def test_held_messages_expire() -> None:
    index = InMemoryIndex()
    now = [0.0]
    pool = EventPool(index, workers=1, pending_ttl_seconds=5, clock=lambda: now[0])
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    await pool.drained()
    now[0] = 6.0
    joined(index, pool)
    assert index.score("m", TOKENS).scores == []
    await pool.shutdown()


async def test_subscriber_binds_for_connecting_engines_and_connects_to_binding_ones() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=2)
    pool.start()
    bind = f"tcp://127.0.0.1:{free_port()}"
    sub = ZmqSubscriber(pool, bind)
    sub.start()
    task = asyncio.create_task(sub.run())
    ctx = zmq.Context()
    try:
        # engine 1 connects to our bound SUB (vLLM with a plain tcp://host:port)
        e1 = joined(index, pool, endpoint(9001, events=bind))
        sub.follow(e1)  # same as the bind endpoint: no connect
        pub1 = ctx.socket(zmq.PUB)
        pub1.connect(bind)
        seq = iter(range(10**6))
        await wait_until_async(
            lambda: index.score("m", TOKENS).scores,
            5,
            "engine 1's block in the index",
            interval=0.02,
            before_each=lambda: pub1.send_multipart([TOPIC, encode_seq(next(seq)), payload((1, None))]),
        )
        # engine 2 binds its PUB (vLLM with tcp://*:port); we connect to it
        port = free_port()
        pub2 = ctx.socket(zmq.PUB)
        pub2.bind(f"tcp://127.0.0.1:{port}")
        e2 = joined(index, pool, endpoint(9002, events=f"tcp://127.0.0.1:{port}"))
        sub.follow(e2)
        topic2 = make_topic(e2.id, "m").encode()
        await wait_until_async(
            lambda: index.score("m", TOKENS).scores,
            5,
            "both engines in the index",
            until=lambda scores: len(scores) == 2,
            interval=0.02,
            before_each=lambda: pub2.send_multipart([topic2, encode_seq(next(seq)), payload((5, None))]),
        )
        # garbage does not stop the loop
        pub1.send_multipart([b"only-one-frame"])
        await wait_until_async(
            lambda: pool.stats.dropped["frame_count"], 5, "a frame_count drop", until=lambda n: n >= 1, interval=0.02
        )
        sub.unfollow(e2.id)
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sub.close()
        ctx.destroy(linger=0)
        await pool.shutdown()


@pytest.mark.parametrize(
    ("form", "frames", "end"),
    [
        # vLLM 0.32 (ZmqEventPublisher._service_replay): [b"", topic, seq, payload], end [b"", b"", END_SEQ, b""]
        ("vllm-0.32", lambda seq, p: [b"", TOPIC, encode_seq(seq), p], [b"", b"", END_SEQ, b""]),
        # SGLang 0.5.23 (and vLLM before the topic frame): [b"", seq, payload], end [b"", END_SEQ, b""]
        ("sglang-0.5.23", lambda seq, p: [b"", encode_seq(seq), p], [b"", END_SEQ, b""]),
    ],
)
async def test_replay_client_reads_both_upstream_answer_forms(form: str, frames, end: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    """Both upstream forms of a replay answer are read exactly (the end marker in either ends it); any
    other frame count is a malformed reply (ValueError), not a silent short answer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    payloads = {3: payload((1, None)), 4: payload((2, 1))}

    def serve(extra: list[bytes] | None) -> None:
        identity, _, start = router.recv_multipart()
        for seq, p in payloads.items():
            if seq >= int.from_bytes(start, "big"):
                router.send_multipart([identity, *frames(seq, p)])
        if extra is not None:
            router.send_multipart([identity, *extra])
        router.send_multipart([identity, *end])

    ep = Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, replay_endpoint=f"tcp://127.0.0.1:{port}")
    replayer = ZmqReplayer()
    try:
        task = asyncio.create_task(replayer.replay(ep, 0, 5.0))
        await asyncio.to_thread(serve, None)
        assert await task == [(3, payloads[3]), (4, payloads[4])]
        task = asyncio.create_task(replayer.replay(ep, 4, 5.0))
        await asyncio.to_thread(serve, None)
        assert await task == [(4, payloads[4])]
        task = asyncio.create_task(replayer.replay(ep, 0, 5.0))
        await asyncio.to_thread(serve, [b"", TOPIC, encode_seq(5), payloads[4], b"x"])  # 5 frames
        with pytest.raises(ValueError, match="malformed replay reply: 5 frames"):
            await task
    finally:
        replayer.close()
        router.close(linger=0)
        ctx.term()


def test_simulator_replay_server_answers_in_vllm_032s_exact_frames() -> None:
    """``kvmesh.kv_event_replay`` (the simulator's replay ROUTER) answers as vLLM 0.32's
    ``ZmqEventPublisher._service_replay``: ``[b"", topic, seq, payload]`` per message, then
    ``[b"", b"", END_SEQ, b""]`` (``tests/compat/test_vllm_replay.py`` checks the same frames from vLLM itself)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", TOPIC.decode(), replay_endpoint=replay)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        payloads = [payload((1, None)), payload((2, 1))]
        for p in payloads:
            publisher.publish_payload(p)
        dealer.connect(replay)
        dealer.send_multipart([b"", encode_seq(1)])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", TOPIC, encode_seq(1), payloads[1]]
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        ctx.term()
        publisher.shutdown()
