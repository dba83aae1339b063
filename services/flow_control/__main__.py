"""``python -m services.flow_control [flags]``: parse config, build the controller, serve."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc
from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from kvmesh.server import GrpcService, ServiceSpec
from services.flow_control.config import FlowControlConfig
from services.flow_control.controller import FlowController
from services.flow_control.metrics import PrometheusObserver
from services.flow_control.servicer import SERVICE_NAME, FlowControlServicer

logger = logging.getLogger("services.flow_control")


def main(argv: list[str] | None = None) -> None:
    config = load_config(FlowControlConfig, argv, prog="python -m services.flow_control")
    setup_logging("flow_control", config.log_level)
    logger.info("config:\n%s", config.dump_yaml())

    async def serve() -> None:
        controller = FlowController(config.limits(), observer=PrometheusObserver())
        servicer = FlowControlServicer(controller)
        spec = ServiceSpec(
            name="flow_control",
            service_names=[SERVICE_NAME],
            add_servicers=lambda server: flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, server),
            background=[controller.run_expiry],
        )
        await GrpcService(config, spec).run()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1:])
