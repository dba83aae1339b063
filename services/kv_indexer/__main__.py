"""``python -m services.kv_indexer [flags]``: parse config, build the indexer, run the gRPC service."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from kvmesh.server import GrpcService, ServiceSpec
from services.kv_indexer.config import KvIndexerConfig
from services.kv_indexer.index import InMemoryIndex, InstrumentedIndex
from services.kv_indexer.indexer import KvIndexer
from services.kv_indexer.servicer import SERVICE_NAME, add_servicer

logger = logging.getLogger("services.kv_indexer")


def main(argv: list[str] | None = None) -> None:
    config = load_config(KvIndexerConfig, argv, prog="python -m services.kv_indexer")
    setup_logging("kv_indexer", config.log_level)
    logger.info("config:\n%s", config.dump_yaml())
    indexer = KvIndexer(config, InstrumentedIndex(InMemoryIndex(config.recent_removed_blocks)))
    spec = ServiceSpec(
        name="kv_indexer",
        service_names=[SERVICE_NAME],
        add_servicers=lambda server: add_servicer(server, indexer),
        on_start=[indexer.start],
        background=[indexer.receive],
        on_stop=[indexer.stop],
    )
    asyncio.run(GrpcService(config, spec).run())


if __name__ == "__main__":
    main(sys.argv[1:])
