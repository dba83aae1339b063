"""gRPC KVIndexer servicer: protobuf in, :class:`~services.kv_indexer.indexer.BlockIndexer` call, protobuf out."""

from __future__ import annotations

import grpc
from opentelemetry import trace

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh.errors import InvalidRequest
from kvmesh.hashing import KeyScope
from kvmesh.types import EndpointId
from kvmesh.wire import medium_to_proto
from services.kv_indexer.indexer import BlockIndexer, IndexState

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVIndexer"].full_name


class KVIndexerServicer(kv_indexer_pb2_grpc.KVIndexerServicer):
    def __init__(self, indexer: BlockIndexer) -> None:
        self._indexer = indexer

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        if not request.model:
            raise InvalidRequest("model is required")
        endpoint_ids = [EndpointId(e) for e in request.endpoint_ids] or None
        scope = KeyScope(request.lora_name or None, request.cache_salt or None)
        answer = self._indexer.score(request.model, request.token_ids, endpoint_ids, scope)
        result = answer.result
        _annotate_score(request.model, result)
        return pb.ScoreResponse(
            state=_STATES[answer.state],
            unknown_endpoint_ids=answer.unknown,
            scores=[
                pb.EndpointScore(
                    endpoint_id=s.endpoint_id,
                    matched_blocks=s.matched_blocks,
                    matched_tokens=s.matched_tokens,
                    matched_blocks_by_medium={str(m): n for m, n in s.matched_blocks_by_medium.items()},
                )
                for s in result.scores
            ],
            total_blocks=result.total_blocks,
            block_size_tokens=result.block_size_tokens,
        )

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        if not request.model:
            raise InvalidRequest("model is required")
        locations = self._indexer.lookup(
            request.model, request.token_ids, KeyScope(request.lora_name or None, request.cache_salt or None)
        )
        return pb.LookupResponse(
            blocks=[
                pb.BlockLocation(
                    block_key=loc.block_key,
                    holders=[
                        pb.BlockHolder(endpoint_id=eid, medium=medium_to_proto(medium))
                        for eid, media in sorted(loc.holders.items())
                        for medium in sorted(media)
                    ],
                )
                for loc in locations
            ]
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = self._indexer.stats()
        ingest = stats.ingest.per_endpoint
        registered = self._indexer.index.registered()
        return pb.StatsResponse(
            blocks=stats.index.blocks,
            endpoints=stats.index.endpoints,
            events_applied=stats.index.events_applied,
            batches_dropped=stats.ingest.batches_dropped,
            per_endpoint=[
                pb.EndpointIndexStats(
                    endpoint_id=e.endpoint_id,
                    blocks=e.blocks,
                    events_applied=e.events_applied,
                    last_seq=(ingest[e.endpoint_id].last_seq or 0) if e.endpoint_id in ingest else 0,
                    state=stats.states.get(e.endpoint_id, ""),
                    instance_id=registered[e.endpoint_id].instance_id if e.endpoint_id in registered else "",
                )
                for e in stats.index.per_endpoint
            ],
            ready=stats.ready,
            parity_mismatches={str(k): v for k, v in stats.parity_mismatches.items()},
        )

    async def EndpointBlocks(
        self, request: pb.EndpointBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndpointBlocksResponse:
        if not request.endpoint_id:
            raise InvalidRequest("endpoint_id is required")
        endpoint_id = EndpointId(request.endpoint_id)
        held = self._indexer.index.held_blocks(endpoint_id)
        return pb.EndpointBlocksResponse(
            block_hashes=sorted(held), state=self._indexer.stats().states.get(endpoint_id, "")
        )


_STATES = {
    IndexState.READY: pb.INDEX_STATE_READY,
    IndexState.WARMING: pb.INDEX_STATE_WARMING,
    IndexState.LOAD_ONLY: pb.INDEX_STATE_LOAD_ONLY,
}


def add_servicer(server: grpc.aio.Server, indexer: BlockIndexer) -> None:
    kv_indexer_pb2_grpc.add_KVIndexerServicer_to_server(KVIndexerServicer(indexer), server)


def _annotate_score(model: str, result: object) -> None:
    """Trace attributes an operator reads on the Score span (issue 11): the prompt's blocks, the best
    prefix match and its split per medium (``kvmesh.prefix.matched_blocks.GPU`` ...)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    scores = list(getattr(result, "scores", ()))
    best = max(scores, key=lambda s: s.matched_blocks, default=None)
    span.set_attribute("kvmesh.model", model)
    span.set_attribute("kvmesh.prefix.total_blocks", int(getattr(result, "total_blocks", 0)))
    span.set_attribute("kvmesh.prefix.endpoints_scored", len(scores))
    if best is not None:
        span.set_attribute("kvmesh.prefix.best_endpoint", str(best.endpoint_id))
        span.set_attribute("kvmesh.prefix.matched_blocks", int(best.matched_blocks))
        span.set_attribute("kvmesh.prefix.matched_tokens", int(best.matched_tokens))
        for medium, n in best.matched_blocks_by_medium.items():
            span.set_attribute(f"kvmesh.prefix.matched_blocks.{getattr(medium, 'name', medium)}", int(n))
