"""``python -m services.kv_store [flags]``: parse config, build the store, serve."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc
from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from kvmesh.server import GrpcService, ServiceSpec
from services.kv_store.config import KvStoreConfig
from services.kv_store.metrics import register_metrics
from services.kv_store.servicer import SERVICE_NAME, KVStoreServicer
from services.kv_store.store import KVStore
from services.kv_store.tiers.cpu import CpuTier

logger = logging.getLogger("services.kv_store")


def main(argv: list[str] | None = None) -> None:
    config = load_config(KvStoreConfig, argv, prog="python -m services.kv_store")
    setup_logging("kv_store", config.log_level)
    logger.info("config:\n%s", config.dump_yaml())
    store = KVStore([CpuTier(config.cpu_capacity_bytes)])
    register_metrics(store)
    servicer = KVStoreServicer(store, config.get_chunk_bytes)
    spec = ServiceSpec(
        name="kv_store",
        service_names=[SERVICE_NAME],
        add_servicers=lambda server: kv_store_pb2_grpc.add_KVStoreServicer_to_server(servicer, server),
    )
    asyncio.run(GrpcService(config, spec).run())


if __name__ == "__main__":
    main(sys.argv[1:])
