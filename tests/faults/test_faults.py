"""Faults injected under load into a running mesh (issue 14 item 5); marker ``faults``, ``make test-faults``.

Each test kills (SIGKILL) and restarts a service or an engine, pauses etcd (SIGSTOP/SIGCONT),
flaps an engine, or adds an engine whose /metrics is slow, while :class:`kvmesh_cli.fault_load.Load`
keeps 4 clients sending completions (half streamed). Each asserts (:func:`assert_recovered`):
requests that had not started streaming are answered or cleanly refused (never ``lost``, timed out
or 500), epp lists every engine with fresh metrics again within the lease TTL (+ watch/scrape
delays), every request after the repair succeeds, flow_control's in-flight gauge returns to 0 and
no surviving service's open fds grow.

flow_control and epp killed exercise the router's degraded modes (docs/degraded-modes.md): admitted
locally under a cap, and picked by load from the router's own membership view.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvmesh_cli.fault_load import metric_value
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module
from kvmesh_cli.mesh import Mesh
from tests.faults.conftest import LEASE_TTL_SECONDS
from tests.faults.faultlib import assert_recovered, engine_ids, epp_view, run_fault, wait_membership

pytestmark = [pytest.mark.faults, pytest.mark.integration]

MEMBERSHIP_WITHIN = LEASE_TTL_SECONDS + 4.0
"""Lease TTL plus the watch, the first scrape and epp's freshness window."""
ETCD_PAUSE_SECONDS = float(os.environ.get("KVMESH_FAULT_ETCD_PAUSE_SECONDS", "30"))


def _kill_restart(mesh: Mesh, name: str, down_seconds: float = 1.0):  # type: ignore[no-untyped-def]
    async def fault() -> None:
        mesh.kill(name)
        await asyncio.sleep(down_seconds)
        await asyncio.to_thread(mesh.restart, name)
    return fault


@pytest.mark.parametrize("name", ["engine-1", "kv_indexer", "kv_store"])
async def test_kill_and_restart(mesh: Mesh, name: str) -> None:
    """kill -9 then restart: an engine (its streams may break; nothing else), kv_indexer (prefix
    scores unknown meanwhile), kv_store (not on the request path)."""
    allowed = frozenset()
    report = await run_fault(mesh, f"kill -9 {name}", _kill_restart(mesh, name), touched={name}, allowed=allowed)
    assert_recovered(report, MEMBERSHIP_WITHIN)


async def test_kill_and_restart_epp(mesh: Mesh) -> None:
    report = await run_fault(mesh, "kill -9 epp", _kill_restart(mesh, "epp"), touched={"epp"})
    assert_recovered(report, MEMBERSHIP_WITHIN)
    assert not {k for k in report.classes if k.startswith("refused")}, report.line()  # served by load meanwhile


async def test_kill_and_restart_flow_control(mesh: Mesh) -> None:
    report = await run_fault(mesh, "kill -9 flow_control", _kill_restart(mesh, "flow_control"),
                             touched={"flow_control"})
    assert_recovered(report, MEMBERSHIP_WITHIN)


async def test_kill_and_restart_router(mesh: Mesh) -> None:
    """Requests inside the killed router die with it (``lost``, the client's to retry); new ones are
    refused at connect (``router_unreachable``) until it is back; nothing after is lost."""
    report = await run_fault(mesh, "kill -9 router", _kill_restart(mesh, "router"), touched={"router"},
                             allowed=frozenset({"lost"}))
    assert report.classes.get("lost", 0) <= 4, report.line()  # at most the in-flight ones (concurrency 4)
    assert_recovered(report, MEMBERSHIP_WITHIN)


async def test_etcd_paused(mesh: Mesh) -> None:
    """etcd frozen (SIGSTOP) for ``KVMESH_FAULT_ETCD_PAUSE_SECONDS`` (30): the mesh keeps serving from
    its last known membership; after SIGCONT leases are re-established and epp converges."""
    etcd = mesh.member("etcd").process

    async def fault() -> None:
        os.killpg(etcd.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(ETCD_PAUSE_SECONDS)
        finally:
            os.killpg(etcd.pid, signal.SIGCONT)

    report = await run_fault(mesh, f"pause etcd {ETCD_PAUSE_SECONDS:.0f}s", fault,
                             membership_timeout_seconds=MEMBERSHIP_WITHIN + 5)
    assert_recovered(report, MEMBERSHIP_WITHIN + 5)


async def test_engine_health_flaps(mesh: Mesh) -> None:
    """engine-1 frozen 1 s / running 1 s, five times: its requests wait or go elsewhere, none is lost,
    and its registration survives (each freeze is shorter than the lease TTL)."""
    engine = mesh.member("engine-1").process
    left: list[str] = []

    async def fault() -> None:
        for _ in range(5):
            os.killpg(engine.pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)
            os.killpg(engine.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)
            left.extend(engine_ids(mesh) - await epp_view(mesh))

    report = await run_fault(mesh, "flapping engine-1", fault)
    assert_recovered(report, MEMBERSHIP_WITHIN)


async def test_slow_metrics_engine_is_not_picked(mesh: Mesh) -> None:
    """A third engine whose /metrics answers 1 s late (past epp's 0.5 s scrape timeout): epp never has
    fresh metrics for it, so it is never picked; the others serve everything; epp's scraper does not
    pile up connections (its fds stay flat); when it leaves, membership is the two engines again."""
    port = free_port()
    slow = ManagedProcess(
        f"slow-metrics-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", mesh.spec.model,
                      "--etcd-endpoints", mesh.etcd_address, "--lease-ttl-seconds", str(LEASE_TTL_SECONDS),
                      "--events-endpoint", mesh.events_bind_endpoint, "--time-scale", "20",
                      "--num-gpu-blocks", "512",
                      "--fault-metrics-delay-seconds", "1.0"),
        mesh.spec.run_dir / f"slow-metrics-{port}.log",
    ).start()
    served_by_slow = 0

    async def fault() -> None:
        nonlocal served_by_slow
        await asyncio.sleep(6.0)  # registered and scraped (late) for a while under load
        url = f"http://127.0.0.1:{port}/metrics"
        served = await asyncio.to_thread(metric_value, url, "vllm:request_success_total", 5.0)
        assert served is not None, slow.log_tail()
        served_by_slow = int(served)
        slow.stop()

    try:
        report = await run_fault(mesh, "slow /metrics engine", fault)
    finally:
        slow.stop()
    assert served_by_slow == 0
    assert_recovered(report, MEMBERSHIP_WITHIN)
    assert await wait_membership(mesh, engine_ids(mesh), 1.0) is not None
