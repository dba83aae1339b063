"""BlockIndexer, the pure core: membership applied to index, pool and feed in fence order; queries."""

from __future__ import annotations

from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer

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


async def test_join_applies_held_messages_then_follows_and_leave_purges() -> None:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    feed = RecordingFeed()
    indexer = BlockIndexer(index, pool, feed)
    pool.start()
    pool.submit(RawMessage(A, "m", 0, stored_batch()))  # before the join: held
    await pool.drained()
    assert indexer.score("m", TOKENS).scores == []

    indexer.on_membership({A: ENDPOINT}, {})
    assert [(s.endpoint_id, s.matched_blocks) for s in indexer.score("m", TOKENS).scores] == [(A, 2)]
    assert [set(loc.holders) for loc in indexer.lookup("m", TOKENS)] == [{A}, {A}]
    assert feed.calls == [("follow", A)]

    indexer.on_membership({}, {A: ENDPOINT})
    assert indexer.score("m", TOKENS).scores == []
    assert indexer.stats().index.endpoints == 0
    assert feed.calls == [("follow", A), ("unfollow", A)]
    await pool.shutdown()
