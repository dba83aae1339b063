"""``kvmesh_registration_sidecar_*`` metrics (default registry, served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

REGISTERED = Gauge(
    "kvmesh_registration_sidecar_registered",
    "1 while the engine's endpoint key is registered in etcd, else 0.",
)
HEALTH_CHECKS = Counter(
    "kvmesh_registration_sidecar_health_checks_total",
    "Health polls of the engine, by result (ok, failed, timeout).",
    ["result"],
)
TRANSITIONS = Counter(
    "kvmesh_registration_sidecar_transitions_total",
    "Registration changes, by action (register, deregister).",
    ["action"],
)
