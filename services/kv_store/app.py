"""Wires kv_store together: config -> tiers, store, metrics, servicer -> a GrpcService."""

from __future__ import annotations

import grpc

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc
from kvmesh.server import GrpcService, ServiceSpec
from services.kv_store.config import KvStoreConfig
from services.kv_store.metrics import register_metrics
from services.kv_store.servicer import SERVICE_NAME, KVStoreServicer
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier


def build_service(config: KvStoreConfig) -> GrpcService:
    """The kv_store as a GrpcService: one CPU tier of ``cpu_capacity_bytes`` behind the servicer."""
    store = BlockStore([CpuTier(config.cpu_capacity_bytes)])
    register_metrics(store)
    servicer = KVStoreServicer(store, config.get_chunk_bytes)

    def add_servicers(server: grpc.aio.Server) -> None:
        kv_store_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)

    return GrpcService(config, ServiceSpec(name="kv_store", service_names=[SERVICE_NAME], add_servicers=add_servicers))
