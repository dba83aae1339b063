"""Builders shared by the epp unit tests."""

from __future__ import annotations

from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.interfaces import Candidate, EndpointMetrics


def cand(
    port: int,
    *,
    waiting: float = 0,
    running: float = 0,
    usage: float = 0.0,
    pending: int = 0,
    age: float | None = 0.0,
    failures: int = 0,
    model: str = "m",
) -> Candidate:
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model)
    metrics = EndpointMetrics(
        num_requests_waiting=waiting,
        num_requests_running=running,
        kv_cache_usage_perc=usage,
        pending_picks=pending,
        age_seconds=age,
        consecutive_failures=failures,
    )
    return Candidate(endpoint, metrics)
