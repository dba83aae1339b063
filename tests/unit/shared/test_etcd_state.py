"""kvmesh.membership.EtcdState: up/down per process, failures by operation, rate-limited lines."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.membership import EtcdState, etcd_health, register_etcd_metrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_up_is_unknown_until_a_client_reports_then_follows_every_client() -> None:
    state = EtcdState(Clock())
    lease, watch = object(), object()
    assert state.up() is None
    state.succeeded(lease)
    state.succeeded(watch)
    assert state.up() is True
    state.failed(watch, "watch", "x")
    assert state.up() is False
    state.succeeded(lease)  # another client reaching etcd does not clear this one's failure
    assert state.up() is False
    state.succeeded(watch)
    assert state.up() is True
    state.failed(lease, "keepalive", "x")
    state.forget(lease)  # a stopped client no longer counts
    assert state.up() is True


def test_warnings_are_rate_limited_per_operation_with_the_count_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    state = EtcdState(clock, log_interval_seconds=10.0)
    clients = [object(), object(), object()]
    caplog.set_level(logging.INFO, logger="kvmesh.membership")
    for second in range(25):  # 25 s down, every client failing once a second (what the retries do)
        clock.now = 100.0 + second
        for client in clients:
            state.failed(client, "keepalive", "key=%s", "k")
        state.failed(clients[0], "watch", "prefix=%s", "p")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    keepalive = [w for w in warnings if "operation=keepalive" in w]
    watch = [w for w in warnings if "operation=watch" in w]
    assert len(keepalive) == 3 and len(watch) == 3  # at 0 s, 10 s, 20 s
    assert keepalive[0] == "degraded mode dependency=etcd operation=keepalive key=k"  # the caller's words only
    assert "(+29 more keepalive failures in the last 10s)" in keepalive[1]
    assert "(+9 more watch failures in the last 10s)" in watch[1]
    assert all(w.startswith("degraded mode dependency=etcd ") for w in warnings)
    assert state.failures("keepalive") == 75 and state.failures("watch") == 25

    clock.now = 130.0
    for client in clients:
        state.succeeded(client)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["etcd reachable again after 30.0s (100 failed etcd calls meanwhile)"]
    caplog.clear()
    state.failed(clients[0], "keepalive", "again")  # a new outage logs at once
    assert len(caplog.records) == 1


async def test_metrics_and_health_follow_the_state() -> None:
    state = EtcdState(Clock())
    registry = CollectorRegistry()
    register_etcd_metrics(registry, state)
    text = generate_latest(registry).decode()
    assert "# TYPE kvmesh_etcd_up gauge" in text
    assert not any(line.startswith("kvmesh_etcd_up") for line in text.splitlines())  # no client: no sample
    client = object()
    state.failed(client, "register", "x")
    text = generate_latest(registry).decode()
    assert await etcd_health(0.5, state) == "UNAVAILABLE"
    assert "kvmesh_etcd_up 0.0" in text
    assert 'kvmesh_etcd_failures_total{operation="register"} 1.0' in text
    state.succeeded(client)
    assert "kvmesh_etcd_up 1.0" in generate_latest(registry).decode()
    assert await etcd_health(0.5, state) == "SERVING"
