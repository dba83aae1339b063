"""What one fairness id costs on flow_control's ``/metrics``: distributions per band, count and sum per flow.

A histogram per ``(band, flow)`` pair cost 18 lines each (14 buckets, ``+Inf``, count, sum, created):
with ``max_flow_labels`` 1000, ~18,000 lines. The wait per flow is now a summary without quantiles
(count, sum, created: the mean per flow), and its distribution a histogram per band.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from services.flow_control.metrics import PrometheusObserver
from services.flow_control.types import AdmissionRequest, QueueOutcome


def test_a_flow_label_costs_a_count_and_a_sum_and_the_distribution_is_per_band() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry, max_flow_labels=100)
    for i in range(50):
        request = AdmissionRequest(f"r{i}", flow_id=f"tenant-{i}", priority=i % 2)
        observer.on_outcome(request, QueueOutcome.DISPATCHED, 0.02 * (i % 5))
    observer.on_outcome(AdmissionRequest("late", flow_id="tenant-0"), QueueOutcome.EVICTED_TTL, 30.0)
    value = registry.get_sample_value
    assert value("kvmesh_flow_control_flow_queue_wait_seconds_count", {"band": "0", "flow": "tenant-0"}) == 1
    assert value("kvmesh_flow_control_flow_queue_wait_seconds_sum", {"band": "1", "flow": "tenant-3"}) == 0.06
    assert value("kvmesh_flow_control_band_queue_wait_seconds_count", {"band": "0"}) == 25  # dispatched only
    assert value("kvmesh_flow_control_band_queue_wait_seconds_bucket", {"band": "1", "le": "0.05"}) == 15
    text = generate_latest(registry).decode()
    per_flow = [line for line in text.splitlines() if 'flow="tenant-7"' in line]
    assert len(per_flow) == 3, per_flow  # count, sum, created: no buckets
    assert "kvmesh_flow_control_flow_queue_wait_seconds_bucket" not in text
    assert "# TYPE kvmesh_flow_control_flow_queue_wait_seconds summary" in text
    assert text.count("kvmesh_flow_control_band_queue_wait_seconds_bucket{") == 2 * 15  # two bands
