"""A malformed KV-event message moves no sequence, changes no state and purges nothing.

The fresh-user trial's case: a 3-frame message on a real engine's topic, ``seq = 10**12``, payload
``b"\\xc1\\xc1\\xc1"`` (not msgpack). Before the fix the seq was recorded before the payload was decoded:
the endpoint jumped to ``last_seq = 10**12``, went ``unreliable`` (a gap nobody could replay), and the
engine's next real batch read as a publisher restart (purge, replay from 0). Siblings: payloads that
decode as msgpack but are not vLLM 0.32's / SGLang 0.5.23's ``EventBatch`` (``kvmesh/kv_events.py``),
a message for an endpoint not registered yet (held, then sequenced at its join), a seq going back,
a replayed message that cannot be decoded, and the end-of-replay seq on the live channel. A *valid*
batch is trusted whoever sent it (vLLM's ZMQ protocol has no authentication): pinned here too.
Drop lines are rate-limited per reason (``kvmesh.logging.RateLimitedLog``).
"""

from __future__ import annotations

import itertools
import logging

import msgspec
import pytest

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.kv_events import (
    END_SEQ,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    encode_seq,
    encode_sglang_batch,
    make_topic,
)
from kvmesh.logging import RateLimitedLog
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EndpointState, EventPool, RawMessage
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.events.subscriber import parse_frames
from services.kv_indexer.index import InMemoryIndex

A = EndpointId("127.0.0.1:9001")
TOPIC = make_topic(A, "m").encode()
TOKENS = list(range(8))
FAR = 10**12
_TS = itertools.count(1_700_000_000)


def good(h: int, parent: int | None) -> bytes:
    tokens = TOKENS[:4] if parent is None else TOKENS[4:8]
    events: list[KVEvent] = [BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=tokens, block_size=4)]
    return encode_batch(EventBatch(ts=float(next(_TS)), events=events, data_parallel_rank=0))


_pack = msgspec.msgpack.encode
MALFORMED = {
    "not-msgpack": b"\xc1\xc1\xc1",  # the trial's payload
    "truncated": good(1, None)[:-3],
    "map-not-array": _pack({"ts": 1.0, "events": []}),
    "scalar": _pack(7),
    "events-not-a-list": _pack([1.0, "nope", 0]),
    "ts-not-a-number": _pack(["now", [], 0]),
    "unknown-event-type": _pack([1.0, [{"type": "Nope"}], 0]),
    "stored-without-tokens": _pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                          "block_size": 4}], 0]),
    "hash-of-wrong-type": _pack([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0]),
    "ts-nan": _pack([float("nan"), [], 0]),
    "ts-inf": _pack([float("inf"), [], 0]),
    # SGLang 0.5.23's shape (kvmesh decodes it with the same structs) with a field of the wrong type
    "sglang-wrong-field": _pack([1.0, [{"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None,
                                        "token_ids": "abcd", "block_size": 4, "lora_id": None}], 0]),
}


def endpoint(replay: str = "") -> Endpoint:
    return Endpoint(id=A, url=f"http://{A}", model="m", block_size_tokens=4, replay_endpoint=replay)


def joined(index: InMemoryIndex, pool: EventPool, ep: Endpoint | None = None) -> None:
    ep = ep or endpoint()
    index.register_endpoint(ep)
    pool.endpoint_joined(ep)


def matched(index: InMemoryIndex) -> dict[str, int]:
    return {s.endpoint_id: s.matched_blocks for s in index.score("m", TOKENS).scores}


@pytest.mark.parametrize("seq", [FAR, 2, 1, 0], ids=["far-ahead", "gap-of-one", "expected", "behind"])
@pytest.mark.parametrize("body", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_payload_moves_no_seq_and_purges_nothing(body: bytes, seq: int) -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)  # no replayer: a gap would be a loss at once (entries forgotten)
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, good(1, None)))
    await pool.drained()
    pool.submit(RawMessage(A, "m", seq, body))
    await pool.drained()
    per = pool.stats.per_endpoint[A]
    assert (per.last_seq, per.sequence_gaps, pool.export()[A]) == (0, 0, (1, True))
    assert pool.state(A) is EndpointState.LIVE and pool.stats.dropped == {"bad_payload": 1}
    pool.submit(RawMessage(A, "m", 1, good(2, 1)))  # the engine's next real batch: in order, no purge
    await pool.drained()
    assert matched(index) == {A: 2} and pool.state(A) is EndpointState.LIVE
    assert (per.last_seq, per.sequence_gaps, pool.stats.dropped) == (1, 0, {"bad_payload": 1})
    await pool.shutdown()


async def test_malformed_first_message_is_not_the_streams_start() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", FAR, MALFORMED["not-msgpack"]))
    await pool.drained()
    assert pool.export()[A] == (None, True) and A not in pool.stats.per_endpoint
    pool.submit(RawMessage(A, "m", 0, good(1, None)))
    pool.submit(RawMessage(A, "m", 1, good(2, 1)))
    await pool.drained()
    assert pool.export()[A] == (2, True) and pool.state(A) is EndpointState.LIVE and matched(index) == {A: 2}
    assert pool.stats.per_endpoint[A].sequence_gaps == 0
    await pool.shutdown()


async def test_malformed_message_for_an_unregistered_endpoint_is_not_held() -> None:
    """Held messages are sequenced at the join: a malformed one would have become the stream's start."""
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    pool.start()
    pool.submit(RawMessage(A, "m", FAR, MALFORMED["map-not-array"]))
    await pool.drained()
    assert pool.stats.dropped == {"bad_payload": 1}  # dropped at once, not held
    joined(index, pool)
    assert pool.export()[A] == (None, True) and A not in pool.stats.per_endpoint
    pool.submit(RawMessage(A, "m", 0, good(1, None)))
    await pool.drained()
    assert pool.export()[A] == (1, True) and pool.state(A) is EndpointState.LIVE and matched(index) == {A: 1}
    assert pool.stats.dropped == {"bad_payload": 1}
    await pool.shutdown()


async def test_undecodable_replayed_message_is_a_loss_not_a_step() -> None:
    """A replayed message that cannot be decoded was published but cannot be applied: a loss, never a
    step silently taken past an event it did not apply. Healed: the entries that predate it are
    forgotten, what follows is applied, the stream is live (vLLM 0.32's replay ROUTER, served by the
    simulator's publisher)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", TOPIC.decode(), replay_endpoint=replay)
    payloads = [good(1, None), MALFORMED["not-msgpack"], good(2, 1)]
    for p in payloads:
        publisher.publish_payload(p)
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, replayer=ZmqReplayer(), replay_timeout_seconds=5)
    joined(index, pool, endpoint(replay))
    pool.start()
    try:
        pool.submit(RawMessage(A, "m", 0, payloads[0]))
        pool.submit(RawMessage(A, "m", 2, payloads[2]))  # seq 1 lost on PUB; its replay is garbage
        await pool.drained()
        assert pool.state(A) is EndpointState.LIVE and pool.stats.per_endpoint[A].losses == 1
        assert pool.export()[A] == (3, True) and pool.stats.dropped["bad_payload"] >= 1
        assert set(index.held_blocks(A)) == {2} and matched(index) == {}  # block 1 forgotten: no stale prefix
    finally:
        publisher.shutdown()
        await pool.shutdown()


async def test_a_valid_batch_is_trusted_whoever_sent_it() -> None:
    """vLLM 0.32's KV-event ZMQ protocol has no authentication: a well-formed batch on an engine's
    topic with a far-ahead seq is a gap, exactly as if the engine had sent it (docs/kv-index.md,
    "Malformed and forged messages"). Only malformed messages are refused."""
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    joined(index, pool)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, good(1, None)))
    pool.submit(RawMessage(A, "m", FAR, encode_sglang_batch(float(next(_TS)), [])))  # SGLang's format: also valid
    await pool.drained()
    assert pool.stats.per_endpoint[A].last_seq == FAR and pool.stats.per_endpoint[A].losses == 1
    assert pool.state(A) is EndpointState.LIVE and matched(index) == {}  # a loss: the older entries forgotten
    await pool.shutdown()


@pytest.mark.parametrize(
    ("frames", "reason"),
    [([TOPIC, END_SEQ, good(1, None)], "bad_seq"), ([TOPIC, b"\x00" * 9, b"x"], "bad_seq"),
     ([TOPIC, encode_seq(1)], "frame_count"), ([b"kv@@m", encode_seq(1), b"x"], "bad_topic")],
    ids=["end-of-replay-seq", "nine-byte-seq", "two-frames", "empty-endpoint"],
)
def test_malformed_frames_never_reach_sequencing(frames: list[bytes], reason: str) -> None:
    assert parse_frames(frames) == reason


async def test_drop_lines_are_rate_limited_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    index = InMemoryIndex()
    pool = EventPool(index, workers=1, clock=lambda: now[0])
    joined(index, pool)
    pool.start()
    caplog.set_level(logging.WARNING, logger="services.kv_indexer.events.pool")
    for seq in range(50):
        pool.submit(RawMessage(A, "m", FAR + seq, MALFORMED["not-msgpack"]))
        pool.drop_malformed("bad_topic", "frames=%d", 3)
    await pool.drained()
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(line.split("reason=")[1].split()[0] for line in lines) == ["bad_payload", "bad_topic"]
    now[0] = 10.0
    pool.submit(RawMessage(A, "m", 7, MALFORMED["scalar"]))
    await pool.drained()
    assert len(caplog.records) == 3
    assert "(+49 more bad_payload lines suppressed in the last 10s)" in caplog.records[-1].getMessage()
    assert pool.stats.dropped == {"bad_payload": 51, "bad_topic": 50}  # every drop counted
    await pool.shutdown()


def test_rate_limited_log_first_at_once_then_one_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("t.ratelog"), 10.0, lambda: now[0])
    caplog.set_level(logging.INFO, logger="t.ratelog")
    assert log.warning("a", "x=%d", 1) is True
    assert [log.warning("a", "x=%d", i) for i in range(3)] == [False] * 3
    assert log.warning("b", "other kind") is True and log.suppressed("a") == 3
    now[0] = 109.9
    assert log.warning("a", "x") is False
    now[0] = 110.0
    assert log.log(logging.INFO, "a", "x=%d", 9) is True and log.suppressed("a") == 0
    assert [r.getMessage() for r in caplog.records] == [
        "x=1", "other kind", "x=9 (+4 more a lines suppressed in the last 10s)",
    ]
