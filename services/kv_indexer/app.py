"""Wires kv_indexer together: config -> index, event pipeline, servicer -> a GrpcService.

Nothing opens a socket here: the ZMQ SUB socket binds and the etcd watch starts in ``on_start``
(:meth:`IndexerPipeline.start`), before the gRPC port opens.
"""

from __future__ import annotations

import grpc

from kvmesh.server import GrpcService, ServiceSpec
from services.kv_indexer.config import KvIndexerConfig
from services.kv_indexer.index import InMemoryIndex, InstrumentedIndex
from services.kv_indexer.pipeline import IndexerPipeline
from services.kv_indexer.servicer import SERVICE_NAME, add_servicer


def build_service(config: KvIndexerConfig) -> GrpcService:
    """The kv_indexer as a GrpcService: the instrumented in-memory index fed by the event pipeline."""
    pipeline = IndexerPipeline(config, InstrumentedIndex(InMemoryIndex(
        config.recent_removed_blocks, config.orphan_blocks, config.prompt_key_cache_mib << 20
    )))

    def add_servicers(server: grpc.aio.Server) -> None:
        add_servicer(server, pipeline.indexer, config.watch_status_poll_seconds, config.watch_heartbeat_seconds)

    spec = ServiceSpec(
        name="kv_indexer",
        service_names=[SERVICE_NAME],
        add_servicers=add_servicers,
        on_start=[pipeline.start],
        background=[pipeline.receive, pipeline.maintain],
        on_stop=[pipeline.stop],
        ready=pipeline.ready,
    )
    return GrpcService(config, spec)
