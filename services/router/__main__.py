"""``python -m services.router [flags]``: :func:`kvmesh.server.main` over this service's config and ``app.build_service``."""

from kvmesh.server import main
from services.router.app import build_service
from services.router.config import RouterConfig

if __name__ == "__main__":
    main(RouterConfig, build_service, prog="python -m services.router", name="router")
