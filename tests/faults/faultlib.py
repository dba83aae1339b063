"""One fault run: load before, the fault and its repair, load after; then the suite's assertions.

:func:`run_fault` returns a :class:`FaultReport` (outcome classes, recovery time, membership
convergence time, fd growth) that the tests assert on and print (``-s`` shows the table).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh_cli.fault_load import OK, Load, Outcome, metric_value, open_fds
from kvmesh_cli.mesh import Mesh

SERVICES = ("router", "epp", "kv_indexer", "flow_control", "kv_store")


@dataclass
class FaultReport:
    name: str
    classes: Counter[str]
    bad: list[Outcome]
    after_repair: Counter[str]
    recovery_seconds: float
    membership_seconds: float | None
    in_flight_after: float | None
    fd_growth: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        return (f"{self.name:<24} total={sum(self.classes.values()):>4} {dict(self.classes)} "
                f"recovery={self.recovery_seconds:.1f}s membership={self.membership_seconds}s "
                f"in_flight_after={self.in_flight_after} fd_growth={self.fd_growth}")


def engine_ids(mesh: Mesh) -> set[str]:
    return {url.removeprefix("http://") for url in mesh.engine_urls}


async def epp_view(mesh: Mesh) -> set[str]:
    """Endpoints epp lists with metrics younger than 2 s (empty when epp does not answer)."""
    try:
        async with grpc.aio.insecure_channel(mesh.epp_address) as channel:
            reply = await epp_pb2_grpc.EndpointPickerStub(channel).ListEndpoints(
                epp_pb2.ListEndpointsRequest(), timeout=2.0)
    except grpc.aio.AioRpcError:
        return set()
    return {s.endpoint.id for s in reply.endpoints if 0 <= s.metrics_age_seconds < 2.0}


async def wait_membership(mesh: Mesh, expected: set[str], timeout: float) -> float | None:
    """Seconds until epp lists exactly ``expected`` with fresh metrics; None if not within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await epp_view(mesh) == expected:
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.1)
    return None


def service_fds(mesh: Mesh, skip: set[str]) -> dict[str, int]:
    return {m.name: open_fds(m.process.pid) for m in mesh.members
            if m.name in SERVICES and m.name not in skip and m.process.alive()}


async def run_fault(
    mesh: Mesh,
    name: str,
    fault: Callable[[], Awaitable[None]],
    *,
    touched: set[str] = frozenset(),  # type: ignore[assignment]
    allowed: frozenset[str] = frozenset(),
    before_seconds: float = 2.0,
    after_seconds: float = 4.0,
    membership_timeout_seconds: float = 10.0,
    concurrency: int = 4,
) -> FaultReport:
    """Run ``fault`` (which injects and repairs) under load; measure what the suite asserts.

    ``touched``: members the fault restarts (their fds are not compared); ``allowed``: classes of
    :data:`kvmesh_cli.fault_load.NEVER` this fault may cause (e.g. ``lost`` for requests inside a killed router).
    """
    assert await wait_membership(mesh, engine_ids(mesh), 15.0) is not None, "mesh not whole before the fault"
    fds_before = service_fds(mesh, touched)
    async with Load(mesh.router_url, mesh.spec.model, concurrency=concurrency) as load:
        await asyncio.sleep(before_seconds)
        t_fault = time.monotonic()
        await fault()
        t_repaired = time.monotonic()
        membership = await wait_membership(mesh, engine_ids(mesh), membership_timeout_seconds)
        await asyncio.sleep(after_seconds)
    failed_after = [o.ended for o in load.outcomes if o.started >= t_fault and o.klass != OK]
    recovery = (max(failed_after) - t_fault) if failed_after else 0.0
    in_flight = None
    for _ in range(50):  # the admission slots come back once the load has stopped
        in_flight = metric_value(mesh.member("flow_control").metrics or "", "kvmesh_flow_control_in_flight")
        if in_flight == 0:
            break
        await asyncio.sleep(0.2)
    fds_after = service_fds(mesh, touched)
    report = FaultReport(
        name=name,
        classes=load.classes(),
        bad=load.bad(allowed=allowed),
        after_repair=load.classes(since=t_repaired + (membership or 0.0) + 1.0),
        recovery_seconds=round(recovery, 2),
        membership_seconds=membership,
        in_flight_after=in_flight,
        fd_growth={k: fds_after[k] - v for k, v in fds_before.items() if k in fds_after},
    )
    print(report.line())
    return report


def assert_recovered(report: FaultReport, membership_within: float) -> None:
    """The suite's common assertions (issue 14 item 5)."""
    assert not report.bad, f"{report.name}: requests lost or 500: {report.bad[:5]}"
    assert report.classes.get("http_500", 0) == 0, report.line()
    assert report.membership_seconds is not None and report.membership_seconds <= membership_within, report.line()
    assert report.after_repair and set(report.after_repair) == {OK}, report.line()
    assert report.in_flight_after == 0, report.line()
    assert all(growth <= 12 for growth in report.fd_growth.values()), report.line()
