"""Event ingestion with real ZMQ sockets and a real index: frame parsing, order, gaps, fence, hold."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from kvmesh.kv_events import BlockStored, EventBatch, KVEvent, encode_batch, encode_seq, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.events.subscriber import ZmqSubscriber, connect_target, parse_frames
from services.kv_indexer.index import InMemoryIndex
from tests.support import wait_until_async

A = EndpointId("127.0.0.1:9001")
TOPIC = make_topic(A, "m").encode()
TOKENS = list(range(8))


def payload(*hashes_and_parents: tuple[int, int | None]) -> bytes:
    events: list[KVEvent] = [
        BlockStored(block_hashes=[h], parent_block_hash=p, token_ids=TOKENS[4 * i : 4 * i + 4] if p is None and i == 0 else TOKENS[4:8], block_size=4)
        for i, (h, p) in enumerate(hashes_and_parents)
    ]
    return encode_batch(EventBatch(ts=1.0, events=events, data_parallel_rank=0))


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


async def test_pool_orders_counts_gaps_and_drops_bad_payloads() -> None:
    index = InMemoryIndex()
    index.register_endpoint(endpoint())
    pool = EventPool(index, workers=3)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, payload((1, None))))
    pool.submit(RawMessage(A, "m", 1, payload((2, 1))))  # needs message 0 applied first
    pool.submit(RawMessage(A, "m", 5, b"\xc1garbage"))
    await pool.drained()
    assert {s.endpoint_id: s.matched_blocks for s in index.score("m", TOKENS).scores} == {A: 2}
    per = pool.stats.per_endpoint[A]
    assert (per.messages, per.last_seq, per.sequence_gaps) == (3, 5, 3)
    assert pool.stats.dropped == {"bad_payload": 1}
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
    index.register_endpoint(endpoint())
    pool.endpoint_joined(A)
    assert index.score("m", TOKENS).scores[0].matched_blocks == 2
    index.remove_endpoint(A)
    pool.endpoint_left(A)
    pool.submit(RawMessage(A, "m", 2, payload((1, None))))
    await pool.drained()
    assert pool.stats.dropped == {"endpoint_left": 1}
    index.register_endpoint(endpoint())
    pool.endpoint_joined(A)
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
    index.register_endpoint(endpoint())
    pool.endpoint_joined(A)
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
        e1 = endpoint(9001, events=bind)
        index.register_endpoint(e1)
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
        e2 = endpoint(9002, events=f"tcp://127.0.0.1:{port}")
        index.register_endpoint(e2)
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
