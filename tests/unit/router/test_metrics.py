"""The router's metric names, types and labels (Prometheus text from the default registry)."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from services.router import metrics


def test_metric_names_and_labels() -> None:
    metrics.record_ttft("tiny", 0.02)
    metrics.record_e2e("tiny", 0.5)
    metrics.record_outcome(metrics.RequestOutcome.REJECTED)
    metrics.record_retry()
    text = generate_latest(REGISTRY).decode()
    for line in (
        "# TYPE kvmesh_router_request_ttft_seconds histogram",
        'kvmesh_router_request_ttft_seconds_bucket{le="0.02",model_name="tiny"}',
        "# TYPE kvmesh_router_request_e2e_duration_seconds histogram",
        "# TYPE kvmesh_router_requests_total counter",
        'kvmesh_router_requests_total{outcome="rejected"}',
        "# TYPE kvmesh_router_requests_in_flight gauge",
        "# TYPE kvmesh_router_upstream_retries_total counter",
    ):
        assert line in text, line


def test_outcome_for_status() -> None:
    assert metrics.outcome_for_status(200) is metrics.RequestOutcome.SUCCESS
    assert metrics.outcome_for_status(429) is metrics.RequestOutcome.REJECTED
    assert metrics.outcome_for_status(504) is metrics.RequestOutcome.TIMEOUT
    assert metrics.outcome_for_status(502) is metrics.RequestOutcome.ERROR
