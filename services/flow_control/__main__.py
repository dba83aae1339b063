"""``python -m services.flow_control [flags]``: :func:`kvmesh.server.main` over this service's config and ``app.build_service``."""

from kvmesh.server import main
from services.flow_control.app import build_service
from services.flow_control.config import FlowControlConfig

if __name__ == "__main__":
    main(FlowControlConfig, build_service, prog="python -m services.flow_control", name="flow_control")
