"""``python -m services.kv_store [flags]``: :func:`kvmesh.server.main` over this service's config and ``app.build_service``."""

from kvmesh.server import main
from services.kv_store.app import build_service
from services.kv_store.config import KvStoreConfig

if __name__ == "__main__":
    main(KvStoreConfig, build_service, prog="python -m services.kv_store", name="kv_store")
