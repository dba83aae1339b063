"""Prometheus metrics of flow_control, written only through :class:`PrometheusObserver`.

| name | type | labels |
|---|---|---|
| ``kvmesh_flow_control_queue_size`` | gauge | |
| ``kvmesh_flow_control_in_flight`` | gauge | |
| ``kvmesh_flow_control_outcome_total`` | counter | ``outcome`` (:class:`QueueOutcome` values) |
| ``kvmesh_flow_control_queue_duration_seconds`` | histogram | ``outcome`` |
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.flow_control.types import AdmissionRequest, QueueOutcome

QUEUE_DURATION_BUCKETS_SECONDS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PrometheusObserver:
    """A :class:`~services.flow_control.controller.ControllerObserver` that records metrics."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.queue_size = Gauge(
            "kvmesh_flow_control_queue_size", "Requests waiting in the admission queue.", registry=registry
        )
        self.in_flight = Gauge(
            "kvmesh_flow_control_in_flight", "Requests dispatched and not yet released.", registry=registry
        )
        self.outcomes = Counter(
            "kvmesh_flow_control_outcome", "Requests by admission outcome.", ["outcome"], registry=registry
        )
        self.queue_duration = Histogram(
            "kvmesh_flow_control_queue_duration_seconds",
            "Seconds a request waited before its outcome.",
            ["outcome"],
            buckets=QUEUE_DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        for outcome in QueueOutcome:  # export every series from the start
            self.outcomes.labels(outcome.value)

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        self.outcomes.labels(outcome.value).inc()
        self.queue_duration.labels(outcome.value).observe(max(queue_seconds, 0.0))

    def on_state(self, queued: int, in_flight: int) -> None:
        self.queue_size.set(queued)
        self.in_flight.set(in_flight)
