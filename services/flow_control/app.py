"""Wires flow_control together: config -> controller (bands, policies, saturation detector) with its
metrics, the epp pool poller and the TTL sweep as background tasks, the servicer -> a GrpcService."""

from __future__ import annotations

import grpc
from prometheus_client import REGISTRY

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc
from kvmesh.server import Background, GrpcService, ServiceSpec
from services.flow_control.config import FlowControlConfig
from services.flow_control.controller import FlowController
from services.flow_control.metrics import ControllerCollector, PrometheusObserver
from services.flow_control.pool import EppPoolSource
from services.flow_control.servicer import SERVICE_NAME, FlowControlServicer


def build_service(config: FlowControlConfig) -> GrpcService:
    """The flow_control service: controller, TTL sweep and (with ``epp_address``) the pool poller, the servicer."""
    observer = PrometheusObserver(max_flow_labels=config.max_flow_labels)
    controller = FlowController(config.limits(), observer=observer, detector=config.detector())
    observer.band_label = controller.band_label
    observer.before_scrape = controller.collect_idle_bands
    REGISTRY.register(ControllerCollector(controller, observer.flow_label))
    servicer = FlowControlServicer(controller)
    background: list[Background] = [controller.run_expiry]
    if config.epp_address:
        source = EppPoolSource(config.epp_address, controller, config.pool_poll_interval_seconds, observer,
                               idle_interval_seconds=min(config.pool_idle_poll_interval_seconds,
                                                         config.metrics_staleness_seconds / 2))
        background.append(source.run)

    def add_servicers(server: grpc.aio.Server) -> None:
        flow_control_pb2_grpc.add_FlowControlServicer_to_server(servicer, server)

    spec = ServiceSpec(
        name="flow_control",
        service_names=[SERVICE_NAME],
        add_servicers=add_servicers,
        background=background,
    )
    return GrpcService(config, spec)
