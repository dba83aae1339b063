"""Degraded modes (docs/degraded-modes.md), each with real processes: kill -9 (or SIGSTOP) one
dependency of a running mesh, then requests get the documented answer and never a 500; after the
dependency returns, the mesh serves through it again.

One mesh (etcd, the five services, two simulated engines, epp ``precise-prefix`` so kv_indexer
and the engines' ``/tokenize`` are on the path) serves the whole module; each test restores what
it broke (:meth:`Mesh.restart` brings a member back on its ports).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_cli.launcher import ManagedProcess, python_module, wait_ports_file
from kvmesh_cli.mesh import Mesh, MeshSpec
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-degraded"
BATCH = 40


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("degraded"), engines=2, policy="precise-prefix",
                    time_scale=50.0, model=MODEL, lease_ttl_seconds=3, num_gpu_blocks=256)
    with Mesh(spec) as m:
        yield m


def _metric(mesh: Mesh, name: str, **labels: str) -> float:
    text = httpx.get(mesh.member("router").metrics or "", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        labelled = line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
        if labelled or (not labels and line.startswith(name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _burst(mesh: Mesh, n: int, *, stream: bool = False) -> collections.Counter[int]:
    """``n`` concurrent completions; status code -> count (599 for a transport failure)."""
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"request {i} " + "shared prefix " * 20, "max_tokens": 4, "stream": stream}
            try:
                reply = await client.post(f"{mesh.router_url}/v1/completions", json=body)
            except httpx.HTTPError:
                return 599
            if stream and reply.status_code == 200:
                assert reply.text.rstrip().endswith("data: [DONE]")
            return reply.status_code

        return collections.Counter(await asyncio.gather(*(one(i) for i in range(n))))


def _grpc_complete(mesh: Mesh) -> grpc.StatusCode:
    with grpc.insecure_channel(mesh.member("router").grpc or "") as channel:
        try:
            router_pb2_grpc.InferenceStub(channel).Complete(
                router_pb2.CompletionRequest(model=MODEL, prompt="hello over grpc", max_tokens=2), timeout=20)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _health(mesh: Mesh) -> tuple[int, dict[str, object]]:
    reply = httpx.get(f"{mesh.router_url}/health", timeout=5)
    return reply.status_code, reply.json()


def _log(mesh: Mesh, name: str) -> str:
    return Path(mesh.member(name).log_path).read_text(errors="replace")


def _fc_in_flight(mesh: Mesh) -> int:
    with grpc.insecure_channel(mesh.member("flow_control").grpc or "") as channel:
        stats = flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest(), timeout=5)
    return int(stats.in_flight)


async def test_flow_control_killed_admits_locally_then_recovers(mesh: Mesh) -> None:
    """Fail-open with a local cap: kill -9 flow_control under load -> every request 200 (none 500),
    the gRPC front door OK, /health 200 "degraded"; restarted -> admission goes through it again."""
    assert (await _burst(mesh, 4)) == {200: 4}
    before = _metric(mesh, "kvmesh_router_degraded_total", dependency="flow_control", action="admitted_locally")

    async def kill_soon() -> None:
        await asyncio.sleep(0.05)
        mesh.kill("flow_control")

    statuses, _ = await asyncio.gather(_burst(mesh, BATCH), kill_soon())
    after_kill = await _burst(mesh, BATCH)
    assert set(statuses) <= {200}, statuses  # requests in flight at the kill included
    assert after_kill == {200: BATCH}, after_kill
    assert _grpc_complete(mesh) == grpc.StatusCode.OK
    code, body = wait_until(lambda: _health(mesh), 5, "/health degraded", until=lambda h: h[1]["status"] == "degraded")
    assert code == 200 and body["degraded"] == ["flow_control"], body  # served: not a readiness failure
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="flow_control",
                   action="admitted_locally") >= before + BATCH
    assert "degraded mode dependency=flow_control action=admitted_locally" in _log(mesh, "router")

    started = time.monotonic()
    mesh.restart("flow_control")
    wait_until(lambda: _health(mesh)[1]["status"] == "ok", 20, "router /health ok again")
    recovered = time.monotonic() - started
    local = _metric(mesh, "kvmesh_router_degraded_total", dependency="flow_control", action="admitted_locally")
    assert (await _burst(mesh, 10)) == {200: 10}
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="flow_control", action="admitted_locally") == local
    wait_until(lambda: _fc_in_flight(mesh) == 0, 10, "flow_control slots released")
    assert recovered < 20
    assert "Traceback" not in _log(mesh, "router")


async def test_epp_killed_routes_by_router_load_then_recovers(mesh: Mesh) -> None:
    """Envoy-ext_proc-style fail-open: kill -9 epp -> requests served by the least-loaded live endpoint
    from the router's etcd view (both engines used), metric and log line; restarted -> epp picks again."""
    before = _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally")
    mesh.kill("epp")
    statuses = await _burst(mesh, BATCH)
    assert statuses == {200: BATCH}, statuses
    assert (await _burst(mesh, 8, stream=True)) == {200: 8}
    assert _grpc_complete(mesh) == grpc.StatusCode.OK
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally") >= before + BATCH
    assert "degraded mode dependency=epp action=picked_locally" in _log(mesh, "router")
    served: collections.Counter[str] = collections.Counter()
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(6):
            reply = await client.post(f"{mesh.router_url}/v1/completions",
                                      json={"model": MODEL, "prompt": f"spread {i}", "max_tokens": 1})
            served[reply.headers["x-kvmesh-endpoint"]] += 1
    assert len(served) == 2, served  # idle endpoints tie; the tie rotates
    code, body = wait_until(lambda: _health(mesh), 5, "/health degraded", until=lambda h: h[1]["status"] == "degraded")
    assert code == 200 and body["degraded"] == ["epp"], body

    mesh.restart("epp")

    def epp_lists_engines() -> bool:
        with grpc.insecure_channel(mesh.epp_address) as channel:
            try:
                reply = epp_pb2_grpc.EndpointPickerStub(channel).ListEndpoints(epp_pb2.ListEndpointsRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return len(reply.endpoints) == 2

    wait_until(epp_lists_engines, 20, "restarted epp to list both engines")
    wait_until(lambda: _health(mesh)[1]["status"] == "ok", 20, "router /health ok again")
    local = _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally")
    assert (await _burst(mesh, 10)) == {200: 10}
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally") == local


async def test_kv_indexer_killed_scores_prefixes_as_unknown(mesh: Mesh) -> None:
    """kv_indexer down: epp still picks (prefix scores unknown), requests 200; restarted: it serves again."""
    mesh.kill("kv_indexer")
    assert (await _burst(mesh, 20)) == {200: 20}
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="refused") == 0
    mesh.restart("kv_indexer")
    assert (await _burst(mesh, 10)) == {200: 10}


async def test_engine_killed_falls_back_before_the_first_byte(mesh: Mesh) -> None:
    """kill -9 one engine (its etcd lease still live): requests that picked it move to the other
    before the first byte, so none is lost; after the lease expires it is not picked at all."""
    retries = _metric(mesh, "kvmesh_router_upstream_retries_total")
    mesh.kill("engine-0")
    try:
        assert (await _burst(mesh, 20)) == {200: 20}
        assert _metric(mesh, "kvmesh_router_upstream_retries_total") > retries
    finally:
        mesh.restart("engine-0")
    wait_until(lambda: _health(mesh)[1]["endpoints"] == 2, 20, "engine-0 registered again")
    assert (await _burst(mesh, 10)) == {200: 10}


async def test_etcd_paused_keeps_last_membership_and_leases_come_back(mesh: Mesh) -> None:
    """etcd SIGSTOPped past the lease TTL (3 s): requests keep being served from the last known
    membership; after SIGCONT every registration is back (leases re-established) and requests work."""
    etcd = mesh.member("etcd").process
    os.killpg(etcd.pid, signal.SIGSTOP)
    try:
        assert (await _burst(mesh, 10)) == {200: 10}
        await asyncio.sleep(4.5)  # past the lease TTL
        assert (await _burst(mesh, 10)) == {200: 10}
    finally:
        os.killpg(etcd.pid, signal.SIGCONT)

    def all_back() -> bool:
        code, body = _health(mesh)
        return code == 200 and body["endpoints"] == 2

    wait_until(all_back, 30, "both engines registered again after etcd came back")
    assert (await _burst(mesh, 10)) == {200: 10}


# -- /health follows one rule (docs/degraded-modes.md, "The router's /health") ----------------------------


def _pause(mesh: Mesh, name: str) -> int:
    pid = mesh.member(name).process.pid
    os.killpg(pid, signal.SIGSTOP)
    return pid


def _start_router(mesh: Mesh, tmp_path: Path, *args: str) -> tuple[ManagedProcess, str]:
    """A second router on this mesh's flow_control, epp and etcd, with ``args``; -> (process, http url)."""
    ports_file = tmp_path / "router-extra.ports.json"
    proc = ManagedProcess("router-extra", python_module(
        "services.router", "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0", "--ports-file", str(ports_file),
        "--etcd-endpoints", mesh.etcd_address, "--lease-ttl-seconds", "3", "--flow-control-address",
        mesh.member("flow_control").grpc or "", "--epp-address", mesh.epp_address, "--health-cache-seconds", "0.2",
        "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5", *args),
        tmp_path / "router-extra.log").start()
    url = f"http://127.0.0.1:{wait_ports_file(ports_file, proc, 30.0)['http']}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok", 30, "extra router ready")
    return proc, url


def _health_at(url: str) -> tuple[int, dict[str, object]]:
    reply = httpx.get(f"{url}/health", timeout=5)
    return reply.status_code, reply.json()


def _wait_health(url: str, code: int, status: str | None = None) -> tuple[int, dict[str, object]]:
    return wait_until(lambda: _health_at(url), 20, f"{url}/health {code} {status or ''}",
                      until=lambda h: h[0] == code and (status is None or h[1]["status"] == status))


async def test_epp_paused_router_serves_and_is_degraded_not_unready(mesh: Mesh) -> None:
    """SIGSTOPped epp (hung, connection open): the requests are served by the local pick (those of the
    first burst after the pick timeout, which opens the router's epp breaker; then at once), so /health
    is 200 "degraded" naming epp (dependencies.epp DEADLINE_EXCEEDED), not 503; the breaker gauge is 1.
    SIGCONT -> "ok", and once the cool-down (5 s) has passed the next request's probe is answered: the
    breaker closes and epp picks again."""
    wait_until(lambda: _health(mesh)[1]["status"] == "ok", 30, "router /health ok")
    before = _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally")
    pid = _pause(mesh, "epp")
    try:
        assert (await _burst(mesh, 6)) == {200: 6}
        code, body = wait_until(lambda: _health(mesh), 10, "/health degraded", until=lambda h: h[1]["status"] == "degraded")
        assert code == 200 and body["degraded"] == ["epp"] and "error" not in body, body
        assert body["dependencies"]["epp"] == "DEADLINE_EXCEEDED", body  # type: ignore[index]
        assert _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally") >= before + 6
        assert _metric(mesh, "kvmesh_router_dependency_breaker_open", dependency="epp") == 1
        started = time.monotonic()
        assert (await _burst(mesh, 6)) == {200: 6}  # the breaker open: no request waits on the hung epp
        assert time.monotonic() - started < 4, "requests waited on the hung epp"
    finally:
        os.killpg(pid, signal.SIGCONT)
    _wait_health(mesh.router_url, 200, "ok")

    def probed() -> float:  # one request at a time: after the cool-down, one of them is the probe
        httpx.post(f"{mesh.router_url}/v1/completions", json={"model": MODEL, "prompt": "probe", "max_tokens": 2},
                   timeout=30)
        return _metric(mesh, "kvmesh_router_dependency_breaker_open", dependency="epp")

    wait_until(probed, 20, "epp breaker closed", until=lambda value: value == 0)
    local = _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally")
    assert (await _burst(mesh, 6)) == {200: 6}
    assert _metric(mesh, "kvmesh_router_degraded_total", dependency="epp", action="picked_locally") == local


def test_fail_closed_router_is_unready_where_the_default_one_is_degraded(mesh: Mesh, tmp_path: Path) -> None:
    """The rule is config-aware. Side by side on one mesh: epp SIGSTOPped -> the default router (fail-open)
    200 "degraded" and serving, a router with ``--epp-failure-mode closed`` 503 naming epp and refusing
    (503). flow_control SIGSTOPped -> the fail-closed router: past the credits it lent, a request gets 504
    at the admission timeout (2 s), which opens its dependency breaker; then requests get its
    unreachable-flow_control answer, 503, at once (a probe after each 5 s cool-down still waits: 504);
    /health 503 naming flow_control. The default (fail-open) router serves around a hung flow_control
    (after one admission timeout it admits locally): 200 "degraded" naming flow_control. SIGCONT -> both "ok"."""
    wait_until(lambda: _health(mesh)[1]["status"] == "ok", 30, "router /health ok")
    proc, closed = _start_router(mesh, tmp_path, "--epp-failure-mode", "closed", "--flow-control-failure-mode", "closed",
                                 "--pick-timeout-seconds", "1", "--admission-timeout-seconds", "2")
    body_json = {"model": MODEL, "prompt": "closed router", "max_tokens": 2}
    try:
        assert httpx.post(f"{closed}/v1/completions", json=body_json, timeout=30).status_code == 200
        pid = _pause(mesh, "epp")
        try:
            code, body = wait_until(lambda: _health_at(closed), 10, "closed router unready", until=lambda h: h[0] == 503)
            assert body["status"] == "unavailable" and body["dependencies"]["epp"] == "DEADLINE_EXCEEDED", body  # type: ignore[index]
            assert "epp is DEADLINE_EXCEEDED" in body["error"]["message"]  # type: ignore[index]
            assert httpx.post(f"{closed}/v1/completions", json=body_json, timeout=30).status_code == 503
            code, body = wait_until(lambda: _health(mesh), 10, "default router degraded",
                                    until=lambda h: h[1]["status"] == "degraded")
            assert code == 200 and body["degraded"] == ["epp"], body
        finally:
            os.killpg(pid, signal.SIGCONT)
        wait_until(lambda: _health_at(closed)[1]["status"] == "ok", 20, "closed router ok after SIGCONT")
        # its epp breaker (opened by the timed-out pick) closes on the first probe after the 5 s cool-down
        wait_until(lambda: httpx.post(f"{closed}/v1/completions", json=body_json, timeout=30).status_code, 20,
                   "closed router picks through epp again", until=lambda code: code == 200)

        pid = _pause(mesh, "flow_control")
        try:
            statuses, took = [], []
            for _ in range(6):
                started = time.monotonic()
                statuses.append(httpx.post(f"{closed}/v1/completions", json=body_json, timeout=30).status_code)
                took.append(time.monotonic() - started)
            # lent credits (200), the first 504 at the 2 s admission timeout, then the breaker: 503 at once
            first = statuses.index(504)
            assert set(statuses[:first]) <= {200} and statuses[first + 1:] == [503] * (5 - first), statuses
            assert all(t < 1.5 for t in took[first + 1:]), took  # not the 2 s wait
            code, body = _wait_health(closed, 503)
            assert body["dependencies"]["flow_control"] == "DEADLINE_EXCEEDED", body  # type: ignore[index]
            assert "flow_control is DEADLINE_EXCEEDED" in body["error"]["message"]  # type: ignore[index]
            code, body = _wait_health(mesh.router_url, 200, "degraded")  # fail-open with the breaker: served around
            assert body["degraded"] == ["flow_control"], body
            assert body["dependencies"]["flow_control"] == "DEADLINE_EXCEEDED", body  # type: ignore[index]
        finally:
            os.killpg(pid, signal.SIGCONT)
        for url in (closed, mesh.router_url):
            _wait_health(url, 200, "ok")
        assert httpx.post(f"{closed}/v1/completions", json=body_json, timeout=30).status_code == 200
    finally:
        proc.stop()
