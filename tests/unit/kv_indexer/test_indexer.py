"""BlockIndexer, the pure core: membership applied to index, pool and feed in fence order; queries."""

from __future__ import annotations

import dataclasses

from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer import snapshot
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer, IndexState
from services.kv_indexer.parity import ParityMonitor

A = EndpointId("127.0.0.1:9001")
ENDPOINT = Endpoint(id=A, url="http://127.0.0.1:9001", model="m", block_size_tokens=4)
TOKENS = list(range(8))


class RecordingFeed:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def follow(self, endpoint: Endpoint) -> None:
        self.calls.append(("follow", endpoint.id))

    def unfollow(self, endpoint_id: EndpointId) -> None:
        self.calls.append(("unfollow", endpoint_id))


def stored_batch() -> bytes:
    event = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=4)
    return encode_batch(EventBatch(ts=1.0, events=[event], data_parallel_rank=0))


async def test_join_applies_held_messages_then_follows_leave_retains_then_purges() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    feed = RecordingFeed()
    now = [0.0]
    indexer = BlockIndexer(index, pool, feed, departed_retention_seconds=10, clock=lambda: now[0])
    pool.start()
    pool.submit(RawMessage(A, "m", 0, stored_batch()))  # before the join: held
    await pool.drained()
    assert indexer.score("m", TOKENS).result.scores == []

    indexer.on_membership({A: ENDPOINT}, {})
    assert matched(indexer) == {A: 2}
    assert [set(loc.holders) for loc in indexer.lookup("m", TOKENS)] == [{A}, {A}]
    assert feed.calls == [("follow", A)]

    indexer.on_membership({}, {A: ENDPOINT})  # lease gone: not scored, entries kept
    assert matched(indexer) == {}
    assert indexer.stats().states == {A: "departed"}
    indexer.on_membership({A: ENDPOINT}, {})  # the same incarnation rejoins (etcd pause): kept
    assert matched(indexer) == {A: 2}

    indexer.on_membership({}, {A: ENDPOINT})
    now[0] = 11.0
    assert indexer.expire_departed() == [A]
    assert indexer.stats().index.endpoints == 0
    assert feed.calls[-1] == ("unfollow", A)
    await pool.shutdown()


async def test_a_new_incarnation_on_the_same_address_starts_empty() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, RecordingFeed())
    pool.start()
    first = dataclasses.replace(ENDPOINT, instance_id="boot-1")
    indexer.on_membership({A: first}, {})
    pool.submit(RawMessage(A, "m", 0, stored_batch()))
    await pool.drained()
    assert matched(indexer) == {A: 2}
    # killed and restarted on the same host:port: identical but for its instance id
    indexer.on_membership({A: dataclasses.replace(ENDPOINT, instance_id="boot-2")}, {A: first})
    assert matched(indexer) == {} and index.held_blocks(A) == {}
    pool.submit(RawMessage(A, "m", 0, stored_batch()))  # its seq starts at 0 again: in order
    await pool.drained()
    assert matched(indexer) == {A: 2}
    await pool.shutdown()


async def test_unready_indexer_answers_warming_and_a_healed_loss_is_scored_again() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, RecordingFeed())
    pool.start()
    indexer.on_membership({A: ENDPOINT}, {})
    pool.submit(RawMessage(A, "m", 0, stored_batch()))
    await pool.drained()
    indexer.ready = False
    assert indexer.score("m", TOKENS).state is IndexState.WARMING
    indexer.ready = True
    pool.submit(RawMessage(A, "m", 5, stored_batch()))  # a gap nobody can replay: a loss, healed
    await pool.drained()
    answer = indexer.score("m", TOKENS)  # live, scored for what it stored after the loss (seq 5)
    assert (answer.state, [(s.endpoint_id, s.matched_blocks) for s in answer.result.scores], answer.unknown) == (
        IndexState.READY, [(A, 2)], [])
    assert pool.stats.per_endpoint[A].losses == 1 and indexer.stats().states == {A: "live"}
    await pool.shutdown()


async def test_parity_mismatch_makes_the_model_load_only() -> None:
    index = InMemoryIndex()
    parity = ParityMonitor(sample_every=1)  # check every prompt start
    pool = EventPool(index, workers=1, parity=parity)
    indexer = BlockIndexer(index, pool, RecordingFeed(), parity)
    pool.start()
    indexer.on_membership({A: dataclasses.replace(ENDPOINT, hash_algo="sha256_cbor")}, {})
    digests = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(TOKENS, 4)]
    good = BlockStored(block_hashes=digests, parent_block_hash=None, token_ids=TOKENS, block_size=4)
    pool.submit(RawMessage(A, "m", 0, encode_batch(EventBatch(ts=1.0, events=[good]))))
    await pool.drained()
    assert indexer.score("m", TOKENS).state is IndexState.READY and matched(indexer) == {A: 2}
    pool.submit(RawMessage(A, "m", 1, stored_batch()))  # hashes 1, 2: not sha256_cbor of the tokens
    await pool.drained()
    assert indexer.score("m", TOKENS).state is IndexState.LOAD_ONLY
    assert indexer.stats().parity_mismatches == {A: "hash_algo"}
    assert indexer.score("other", TOKENS).state is IndexState.READY  # only that model
    indexer.on_membership({A: dataclasses.replace(ENDPOINT, hash_algo="sha256_cbor", instance_id="b")}, {})
    assert indexer.score("m", TOKENS).state is IndexState.READY  # re-registered: checked afresh
    await pool.shutdown()


async def test_snapshot_round_trip_restores_entries_and_stream_positions(tmp_path) -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, RecordingFeed())
    pool.start()
    ep = dataclasses.replace(ENDPOINT, instance_id="boot-1")
    indexer.on_membership({A: ep}, {})
    pool.submit(RawMessage(A, "m", 0, stored_batch()))
    orphan = BlockStored(block_hashes=[7], parent_block_hash=99, token_ids=[1, 2, 3, 4], block_size=4)
    pool.submit(RawMessage(A, "m", 1, encode_batch(EventBatch(ts=1.0, events=[orphan]))))
    await pool.drained()
    snapshot.save(indexer, tmp_path / "kv.snap")
    await pool.shutdown()

    index2 = InMemoryIndex()
    pool2 = EventPool(index2, workers=1)
    indexer2 = BlockIndexer(index2, pool2, RecordingFeed())
    assert snapshot.load(indexer2, tmp_path / "kv.snap") == {A}
    assert index2.held_blocks(A) == index.held_blocks(A) and set(index2.held_blocks(A)) == {1, 2, 7}
    assert pool2.export() == {A: (2, True)}
    assert index2.registered()[A].instance_id == "boot-1"
    assert snapshot.load(indexer2, tmp_path / "missing.snap") == set()
    (tmp_path / "bad.snap").write_bytes(b"not msgpack")
    assert snapshot.load(BlockIndexer(InMemoryIndex(), EventPool(InMemoryIndex()), RecordingFeed()), tmp_path / "bad.snap") == set()


def matched(indexer: BlockIndexer) -> dict[str, int]:
    return {s.endpoint_id: s.matched_blocks for s in indexer.score("m", TOKENS).result.scores}
