"""PrometheusObserver writes the documented series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvmesh.clock import ManualClock
from services.flow_control.controller import ControllerLimits, FlowController
from services.flow_control.metrics import PrometheusObserver
from services.flow_control.types import AdmissionRequest


def test_metrics_follow_the_controller() -> None:
    registry = CollectorRegistry()
    clock = ManualClock()
    controller = FlowController(ControllerLimits(1, 1.0, 1), clock, observer=PrometheusObserver(registry))
    first = controller.enqueue(AdmissionRequest("a"))
    controller.enqueue(AdmissionRequest("b"))
    controller.enqueue(AdmissionRequest("c"))  # queue full
    assert registry.get_sample_value("kvmesh_flow_control_queue_size") == 1
    assert registry.get_sample_value("kvmesh_flow_control_in_flight") == 1
    clock.advance(2.0)
    controller.expire_due()
    controller.release(first)
    value = registry.get_sample_value
    assert value("kvmesh_flow_control_queue_size") == 0
    assert value("kvmesh_flow_control_in_flight") == 0
    assert value("kvmesh_flow_control_outcome_total", {"outcome": "dispatched"}) == 1
    assert value("kvmesh_flow_control_outcome_total", {"outcome": "rejected_capacity"}) == 1
    assert value("kvmesh_flow_control_outcome_total", {"outcome": "evicted_ttl"}) == 1
    assert value("kvmesh_flow_control_outcome_total", {"outcome": "shed"}) == 0
    assert value("kvmesh_flow_control_queue_duration_seconds_count", {"outcome": "evicted_ttl"}) == 1
    assert value("kvmesh_flow_control_queue_duration_seconds_sum", {"outcome": "evicted_ttl"}) == 2.0
