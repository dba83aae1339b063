"""Wires flow_control together: config -> controller (with its Prometheus observer), servicer -> a GrpcService."""

from __future__ import annotations

import grpc

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc
from kvmesh.server import GrpcService, ServiceSpec
from services.flow_control.config import FlowControlConfig
from services.flow_control.controller import FlowController
from services.flow_control.metrics import PrometheusObserver
from services.flow_control.servicer import SERVICE_NAME, FlowControlServicer


def build_service(config: FlowControlConfig) -> GrpcService:
    """The flow_control service: the FCFS controller, its TTL sweep as a background task, the servicer."""
    controller = FlowController(config.limits(), observer=PrometheusObserver())
    servicer = FlowControlServicer(controller)

    def add_servicers(server: grpc.aio.Server) -> None:
        flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, server)

    spec = ServiceSpec(
        name="flow_control",
        service_names=[SERVICE_NAME],
        add_servicers=add_servicers,
        background=[controller.run_expiry],
    )
    return GrpcService(config, spec)
