"""kv_indexer's RPCs on ids and names it does not know, and on empty ones, over a real ``BlockIndexer``
(``InMemoryIndex`` + ``EventPool``) behind the servicer on a real gRPC server (loopback, the shared
interceptor chain).

``EndpointBlocks`` asks about one endpoint by id: one the index does not know (never registered, not
seen in etcd yet, purged after its departed retention) is ``NOT_FOUND`` naming it (before: ``{}``,
indistinguishable from a known endpoint holding nothing), while a known endpoint with no blocks still
answers no hashes and its state. ``Score``/``Lookup``/``Watch`` are about prompts and models: a model or
endpoint the index has not seen is a legitimate empty answer there (epp learns membership from etcd on
its own), so only malformed fields (a blank model, an empty endpoint id or model entry) are refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh.interceptors import server_interceptors
from kvmesh.kv_events import BlockStored, EventBatch, encode_batch
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.servicer import add_servicer

A = EndpointId("127.0.0.1:9001")
B = EndpointId("127.0.0.1:9002")
UNKNOWN = "127.0.0.1:1"
TOKENS = list(range(8))  # two full blocks of 4 tokens
RETENTION = 10.0


def _endpoint(endpoint_id: EndpointId) -> Endpoint:
    return Endpoint(id=endpoint_id, url=f"http://{endpoint_id}", model="m", block_size_tokens=4, instance_id="boot-1")


class NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


@dataclass
class Served:
    indexer: BlockIndexer
    pool: EventPool
    stub: kv_indexer_pb2_grpc.KVIndexerStub
    now: list[float]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """``A`` registered holding blocks 1 and 2 (TOKENS), ``B`` registered holding nothing."""
    now = [0.0]
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, NoFeed(), departed_retention_seconds=RETENTION, clock=lambda: now[0])
    pool.start()
    indexer.on_membership({A: _endpoint(A), B: _endpoint(B)}, {})
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=4)
    pool.submit(RawMessage(A, "m", 0, encode_batch(EventBatch(ts=1.0, events=[stored], data_parallel_rank=0))))
    await pool.drained()
    server = grpc.aio.server(interceptors=server_interceptors())
    add_servicer(server, indexer, watch_status_poll_seconds=0.05)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(indexer, pool, kv_indexer_pb2_grpc.KVIndexerStub(channel), now)
    finally:
        await channel.close()
        await server.stop(None)
        await pool.shutdown()


async def _status(call: object) -> tuple[grpc.StatusCode, str, str]:
    """The status a call failed with: code, details, the ``kvmesh-error-class`` trailer."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    error = caught.value
    return error.code(), error.details() or "", dict(error.trailing_metadata() or ()).get("kvmesh-error-class", "")


async def test_endpoint_blocks_of_an_unknown_endpoint_is_not_found_naming_it(served: Served) -> None:
    stub = served.stub
    known = await stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=A), timeout=5)
    assert (list(known.block_hashes), known.state) == ([1, 2], "live")
    empty = await stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=B), timeout=5)
    assert (list(empty.block_hashes), empty.state) == ([], "live")  # known, holding nothing: not an error

    code, details, error_class = await _status(stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=UNKNOWN), timeout=5))
    assert (code, error_class) == (grpc.StatusCode.NOT_FOUND, "UnknownEndpoint")
    assert f"endpoint '{UNKNOWN}' is not in the index" in details and "warming" not in details
    code, details, _ = await _status(stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id="h" * 100_000), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "more characters" in details and len(details) < 1_000  # echoed, capped

    for blank in ("", "  "):
        code, details, _ = await _status(stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=blank), timeout=5))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "endpoint_id is required")


async def test_endpoint_blocks_follows_an_endpoint_from_departed_to_purged(served: Served) -> None:
    stub = served.stub
    served.indexer.on_membership({}, {A: _endpoint(A)})  # its lease is gone: retained, not scored
    departed = await stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=A), timeout=5)
    assert (list(departed.block_hashes), departed.state) == ([1, 2], "departed")
    served.now[0] = RETENTION + 1
    assert served.indexer.expire_departed() == [A]
    code, details, _ = await _status(stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=A), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and f"'{A}'" in details and "purged 10s after it departed" in details


async def test_endpoint_blocks_while_warming_says_so(served: Served) -> None:
    served.indexer.ready = False  # a restart still loading its snapshot: membership may not be known yet
    code, details, _ = await _status(served.stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=UNKNOWN), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "the index is still warming up" in details
    known = await served.stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=A), timeout=5)
    assert list(known.block_hashes) == [1, 2]


async def test_score_and_lookup_keep_empty_answers_for_what_they_have_not_seen(served: Served) -> None:
    stub = served.stub
    scored = await stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS), timeout=5)
    assert [(s.endpoint_id, s.matched_blocks) for s in scored.scores] == [(A, 2)]
    # a model no endpoint serves, and candidates the index does not know: READY with no scores
    other = await stub.Score(pb.ScoreRequest(model="no-such-model", token_ids=TOKENS), timeout=5)
    assert (list(other.scores), other.state) == ([], pb.INDEX_STATE_READY)
    unknown = await stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS, endpoint_ids=[UNKNOWN]), timeout=5)
    assert (list(unknown.scores), unknown.state, unknown.total_blocks) == ([], pb.INDEX_STATE_READY, 2)
    assert list((await stub.Lookup(pb.LookupRequest(model="no-such-model", token_ids=TOKENS), timeout=5)).blocks) == []
    holders = (await stub.Lookup(pb.LookupRequest(model="m", token_ids=TOKENS), timeout=5)).blocks
    assert [[h.endpoint_id for h in b.holders] for b in holders] == [[A], [A]]


async def test_score_lookup_and_watch_refuse_blank_fields(served: Served) -> None:
    stub = served.stub
    for model in ("", " "):
        assert (await _status(stub.Score(pb.ScoreRequest(model=model, token_ids=TOKENS), timeout=5)))[:2] == (
            grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        assert (await _status(stub.Lookup(pb.LookupRequest(model=model, token_ids=TOKENS), timeout=5)))[:2] == (
            grpc.StatusCode.INVALID_ARGUMENT, "model is required")
    code, details, _ = await _status(stub.Score(pb.ScoreRequest(model="m", token_ids=TOKENS, endpoint_ids=[A, ""]), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'endpoint_ids[1]' is empty" in details

    watch = stub.Watch(pb.WatchRequest(models=["m", ""]), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await watch.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'models[1]' is empty" in (caught.value.details() or "")

    # a model the index does not know yet is watched (its endpoints appear when they register)
    later = stub.Watch(pb.WatchRequest(models=["not-yet"]), timeout=5)
    first = await later.read()
    assert first.reset and first.synced and list(first.endpoints) == [] and list(first.deltas) == []
    later.cancel()
