"""``python -m services.kv_indexer [flags]``: :func:`kvmesh.server.main` over this service's config and ``app.build_service``."""

from kvmesh.server import main
from services.kv_indexer.app import build_service
from services.kv_indexer.config import KvIndexerConfig

if __name__ == "__main__":
    main(KvIndexerConfig, build_service, prog="python -m services.kv_indexer", name="kv_indexer")
