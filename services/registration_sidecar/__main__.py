"""``python -m services.registration_sidecar [flags]``: :func:`kvmesh.server.main` over ``SidecarConfig`` and ``app.build_service``."""

from kvmesh.server import main
from services.registration_sidecar.app import build_service
from services.registration_sidecar.config import SidecarConfig

if __name__ == "__main__":
    main(SidecarConfig, build_service, prog="registration_sidecar", name="registration_sidecar")
