"""gRPC KVIndexer servicer: protobuf in, :class:`~services.kv_indexer.indexer.BlockIndexer` call, protobuf out."""

from __future__ import annotations

import grpc

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh.errors import InvalidRequest
from kvmesh.types import EndpointId
from kvmesh.wire import medium_to_proto
from services.kv_indexer.indexer import BlockIndexer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVIndexer"].full_name


class KVIndexerServicer(kv_indexer_pb2_grpc.KVIndexerServicer):
    def __init__(self, indexer: BlockIndexer) -> None:
        self._indexer = indexer

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        if not request.model:
            raise InvalidRequest("model is required")
        endpoint_ids = [EndpointId(e) for e in request.endpoint_ids] or None
        result = self._indexer.score(request.model, request.token_ids, endpoint_ids)
        return pb.ScoreResponse(
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
        locations = self._indexer.lookup(request.model, request.token_ids)
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
                )
                for e in stats.index.per_endpoint
            ],
        )


def add_servicer(server: grpc.aio.Server, indexer: BlockIndexer) -> None:
    kv_indexer_pb2_grpc.add_KVIndexerServicer_to_server(KVIndexerServicer(indexer), server)
