"""A router started where nothing listens at its flow_control and epp addresses says so, and recovers.

Real processes: etcd, one engine simulator registered in it, a router whose ``--flow-control-address`` and
``--epp-address`` are ports where nothing listens. The router comes up at once (start-up is not delayed), logs one
WARNING per dependency naming its address, config field, flag and env var, shows them as
``kvmesh_router_dependency_up{dependency} 0`` and in ``/health`` (200 ``degraded``), and serves requests with the
documented degraded behaviour (admitted and picked locally: docs/degraded-modes.md). A flow_control started later on
that port is picked up: one INFO line, the gauge 1, ``/health`` no longer lists it, requests go through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok, wait_ports_file
from tests.conftest import ServiceStarter
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "tiny"


@pytest.fixture
def engine(etcd: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = ManagedProcess("engine", python_module(
        "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--etcd-endpoints", etcd,
        "--lease-ttl-seconds", "3", "--time-scale", "50"), tmp_path / "engine.log").start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def _metric(metrics_url: str, name: str, absent: float | None = None, **labels: str) -> float:
    """The sample's value; ``absent`` when there is none (None: the test fails)."""
    text = httpx.get(metrics_url, timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    assert absent is not None, f"no sample {name}{labels}"
    return absent


def _health(url: str) -> tuple[int, dict[str, Any]]:
    reply = httpx.get(f"{url}/health", timeout=5)
    return reply.status_code, reply.json()


def _locally_admitted(metrics_url: str) -> float:
    return _metric(metrics_url, "kvmesh_router_degraded_total", 0.0, dependency="flow_control",
                   action="admitted_locally")


def _lines(log: Path, needle: str) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if needle in line]


def test_unreachable_dependencies_are_named_at_start_and_recovery_is_seen(
    etcd: str, engine: str, tmp_path: Path, start_service: ServiceStarter
) -> None:
    fc_address, epp_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nothing listens there
    ports_file = tmp_path / "router.ports.json"
    log = tmp_path / "router.log"
    started = time.monotonic()
    router = ManagedProcess("router", python_module(
        "services.router", "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0", "--ports-file",
        str(ports_file), "--etcd-endpoints", etcd, "--flow-control-address", fc_address, "--epp-address", epp_address,
        "--health-cache-seconds", "0.2", "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5"),
        log).start()
    try:
        ports = wait_ports_file(ports_file, router, 30.0)
        url, metrics = f"http://127.0.0.1:{ports['http']}", f"http://127.0.0.1:{ports['metrics']}/metrics"
        # up, and ready to serve around both (the warning waits for no one): 200 degraded once the engine is seen
        code, body = wait_until(lambda: _health(url), 30, "router /health degraded with the engine",
                                until=lambda h: h[0] == 200 and h[1]["endpoints"] == 1)
        assert time.monotonic() - started < 25
        assert body["status"] == "degraded" and body["degraded"] == ["flow_control", "epp"], body
        assert body["dependencies"] == {"flow_control": "UNAVAILABLE", "epp": "UNAVAILABLE", "etcd": "SERVING"}, body
        # one WARNING each, naming the address and how to set it, and what requests get meanwhile
        warnings = wait_until(lambda: (_lines(log, "did not answer within"), _lines(log, "WARNING")), 15,
                              "the start-up warnings", until=lambda w: len(w[0]) == 2)[0]
        fc_line = next(line for line in warnings if f"flow_control at {fc_address}" in line)
        assert "WARNING" in fc_line and "set flow_control_address (--flow-control-address, env " \
            "KVMESH_ROUTER_FLOW_CONTROL_ADDRESS)" in fc_line and "admitted locally" in fc_line, fc_line
        epp_line = next(line for line in warnings if f"epp at {epp_address}" in line)
        assert "set epp_address (--epp-address, env KVMESH_ROUTER_EPP_ADDRESS)" in epp_line, epp_line
        assert "picked locally" in epp_line, epp_line
        assert _metric(metrics, "kvmesh_router_dependency_up", dependency="flow_control") == 0
        assert _metric(metrics, "kvmesh_router_dependency_up", dependency="epp") == 0
        # the documented degraded behaviour: served, admitted and picked locally
        body_json = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        local_before = _locally_admitted(metrics)
        reply = httpx.post(f"{url}/v1/completions", json=body_json, timeout=30)
        assert reply.status_code == 200, reply.text
        assert _locally_admitted(metrics) == local_before + 1
        assert _metric(metrics, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally") >= 1
        # flow_control appears on the configured port: seen without a restart
        start_service("flow_control", "--grpc-port", fc_address.rsplit(":", 1)[1])
        wait_until(lambda: _lines(log, f"flow_control at {fc_address} answers now"), 15, "the recovery line")
        assert _metric(metrics, "kvmesh_router_dependency_up", dependency="flow_control") == 1
        code, body = wait_until(lambda: _health(url), 15, "flow_control no longer degraded",
                                until=lambda h: h[1].get("degraded") == ["epp"])
        assert code == 200 and body["dependencies"]["flow_control"] == "SERVING", body

        def through_flow_control() -> bool:  # served, and not by local admission (the admission stream reconnects)
            before = _locally_admitted(metrics)
            served = httpx.post(f"{url}/v1/completions", json=body_json, timeout=30).status_code == 200
            return served and _locally_admitted(metrics) == before

        wait_until(through_flow_control, 15, "a request admitted by flow_control")
        assert len(_lines(log, "did not answer within")) == 2  # said once, not repeated
        assert _metric(metrics, "kvmesh_router_dependency_up", dependency="epp") == 0
    finally:
        router.stop()
