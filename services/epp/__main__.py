"""``python -m services.epp [flags]``: :func:`kvmesh.server.main` over this service's config and ``app.build_service``."""

from kvmesh.server import main
from services.epp.app import build_service
from services.epp.config import EppConfig

if __name__ == "__main__":
    main(EppConfig, build_service, prog="python -m services.epp", name="epp")
