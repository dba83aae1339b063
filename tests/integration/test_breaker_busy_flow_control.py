"""The router's flow_control breaker against a real flow_control process: a long queue is not a hang.

flow_control runs with one slot (``max_in_flight: 1``) and a band whose queue TTL (120 s) is far
above the router's ``admission_timeout_seconds`` (1 s); another client (another router, say) holds
the slot, so every request the router sends is legitimately queued and gets no decision in time.
The router side is the router's own request flow and ``AdmissionClient`` (the multiplexed
``AdmitMany`` stream, credits asked) over loopback gRPC; the engine answer is mocked. Queued past
the timeout, each request gets the 504 it gets without a breaker, and the breaker stays closed
(flow_control answers its health check): the next request still asks flow_control instead of
being admitted locally. SIGSTOPped, flow_control answers nothing: the first timeout opens it.
The last test runs the same with two router *processes* (breaker on, and off) over HTTP, in front of
in-test engines and epp (``tests/integration/test_router.py``'s fakes).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as pb
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import free_port
from services.router.clients import AdmissionClient, PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, validate_request
from tests.integration.test_flow_control import enqueue, stats_become
from tests.integration.test_router import MODEL as ROUTER_MODEL
from tests.integration.test_router import FakeEngine, FakeEpp, _healthy, _models, _start, _until, serve_fake_epp
from tests.unit.router.fakes import CATALOG, JSON_BODY, A, B

pytestmark = pytest.mark.integration

ADMISSION_TIMEOUT = 1.0


class _Picker:
    async def pick(self, query: PickQuery) -> PickReply:
        return PickReply((A, B), 0, "epp")


def _admitted_locally() -> float:
    return REGISTRY.get_sample_value("kvmesh_router_degraded_total",
                                     {"dependency": "flow_control", "action": "admitted_locally"}) or 0.0


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"}, content=JSON_BODY)


async def _flow(address: str, cool_down: float, **settings: float) -> tuple[RequestFlow, AdmissionClient]:
    config = RouterConfig(etcd_endpoints=[], early_pick=False, **({"admission_timeout_seconds": ADMISSION_TIMEOUT}
                          | settings), dependency_breaker_cool_down_seconds=cool_down)
    client = AdmissionClient(address, config.admission_timeout_seconds, config.admission_close_timeout_seconds,
                             credits=config.admission_credits)
    await client.connect()
    flow = RequestFlow(config, lambda: CATALOG, client, _Picker(),
                       httpx.AsyncClient(transport=httpx.MockTransport(_answering)), endpoints=lambda model: (A, B))
    return flow, client


async def _serve(flow: RequestFlow, rid: str) -> tuple[float, str]:
    """One completion: (seconds it took, the endpoint that served it or the error's class)."""
    request = validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                               CATALOG, 1024)
    started = time.monotonic()
    try:
        async with flow.session(request, RequestMeta(rid, "tenant", 0)) as session:
            await session.read_all()
            how = str(session.endpoint.id)
    except errors.KvmeshError as exc:
        how = type(exc).__name__
    return time.monotonic() - started, how


@pytest.fixture
def flow_control(start_service, tmp_path: Path):
    config = tmp_path / "flow_control.yaml"
    config.write_text("max_in_flight: 1\nbands:\n  - {priority: 0, name: interactive, ttl_seconds: 120}\n")
    return start_service("flow_control", "--config", str(config))


@pytest.fixture
async def holder(flow_control) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """Another client's dispatched request holding flow_control's only slot for the whole test."""
    _, address = flow_control
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.FlowControlStub(channel).Admit()
        await call.write(enqueue("holder", flow_id="other-router"))
        assert (await call.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        yield call
        call.cancel()


async def test_requests_queued_past_the_admission_timeout_keep_the_breaker_closed(flow_control, holder) -> None:
    _, address = flow_control
    flow, client = await _flow(address, cool_down=5.0)
    off, off_client = await _flow(address, cool_down=0.0)
    local = _admitted_locally()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.FlowControlStub(channel)
            results = await asyncio.gather(*(_serve(flow, f"q{i}") for i in range(4)))
            assert all(t >= ADMISSION_TIMEOUT and how == "AdmissionTimedOut" for t, how in results), results
            assert flow.open_breakers() == []  # flow_control is answering: queued, not hung
            assert flow.local_admission.in_flight == 0
            await stats_become(stub, in_flight=1, queued=0)  # the router released its timed-out requests
            # what a client gets is the same as from a router without a breaker
            without = await asyncio.gather(*(_serve(off, f"w{i}") for i in range(4)))
            assert [how for _, how in without] == [how for _, how in results]
            # still closed: the next request asks flow_control (and is queued again), not admitted locally
            took, how = await _serve(flow, "again")
            assert took >= ADMISSION_TIMEOUT and how == "AdmissionTimedOut" and flow.open_breakers() == []
            # the slot frees while one waits: it is dispatched through flow_control
            waiting = asyncio.ensure_future(_serve(flow, "dispatched"))
            await stats_become(stub, in_flight=1, queued=1)
            holder.cancel()
            _, how = await waiting
            assert how in (A.id, B.id)  # dispatched by flow_control within the timeout
            await stats_become(stub, in_flight=0, queued=0)
            assert _admitted_locally() == local  # no request bypassed flow_control
    finally:
        await flow.aclose()
        await client.close()
        await off.aclose()
        await off_client.close()


async def test_a_sigstopped_flow_control_still_opens_the_breaker(flow_control, holder) -> None:
    proc, address = flow_control
    flow, client = await _flow(address, cool_down=5.0)
    try:
        took, how = await _serve(flow, "queued")  # the stream is up; a queued request: closed
        assert how == "AdmissionTimedOut" and flow.open_breakers() == []
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            took, how = await _serve(flow, "hung")
            assert took >= ADMISSION_TIMEOUT and how == "AdmissionTimedOut"
            assert flow.open_breakers() == ["flow_control"]  # nothing came back, not even the health check
            took, how = await _serve(flow, "local")
            assert took < ADMISSION_TIMEOUT / 2 and how in (A.id, B.id)  # admitted locally at once
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
    finally:
        await flow.aclose()
        await client.close()


async def test_a_sigstopped_flow_control_is_found_at_the_liveness_check_not_the_admission_timeout(
        flow_control, holder) -> None:
    """``admission_liveness_check_seconds`` (0.3 s here) under a 3 s admission timeout, against the real
    flow_control: a request queued on it (live: its health check answers) still waits out the timeout and
    leaves the breaker closed; SIGSTOPped, a request is admitted locally after about one check (not 3 s)."""
    proc, address = flow_control
    flow, client = await _flow(address, cool_down=5.0, admission_timeout_seconds=3.0,
                               admission_liveness_check_seconds=0.3)
    try:
        took, how = await _serve(flow, "queued")
        assert how == "AdmissionTimedOut" and took >= 3.0 and flow.open_breakers() == []
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            took, how = await _serve(flow, "hung")
            assert how in (A.id, B.id) and took < 2.5, (took, how)  # the check (0.3 s) + the health check (0.5 s)
            assert flow.open_breakers() == ["flow_control"]
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
    finally:
        await flow.aclose()
        await client.close()


def _router_metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_router_processes_answer_queued_requests_alike_with_and_without_the_breaker(
        flow_control, holder, etcd: str, run_dir: Path) -> None:
    proc, address = flow_control
    epp = FakeEpp()
    epp_server, epp_port = await serve_fake_epp(epp)
    engines = [await FakeEngine().start(etcd)]
    epp.order = [e.endpoint for e in engines]  # type: ignore[misc]
    routers: dict[str, tuple[str, str]] = {}
    procs = []
    try:
        for name, cool_down in (("breaker", "5"), ("no_breaker", "0")):
            http_port, metrics_port = free_port(), free_port()
            router, _ = _start("router", run_dir, etcd, "--http-port", str(http_port), "--flow-control-address", address,
                               "--epp-address", f"127.0.0.1:{epp_port}", "--admission-timeout-seconds", "1",
                               "--dependency-breaker-cool-down-seconds", cool_down, "--health-cache-seconds", "0.2",
                               metrics_port=metrics_port)
            procs.append(router)
            routers[name] = (f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics")
        body = {"model": ROUTER_MODEL, "prompt": "queued", "max_tokens": 1}
        async with httpx.AsyncClient(timeout=20) as client:
            for http, _ in routers.values():
                await _until(lambda http=http: _models(client, http), 15, "router to see the engine")
                await _until(lambda http=http: _healthy(client, http), 10, "router ready")

            async def burst(http: str, n: int) -> list[tuple[int, str, str | None]]:
                replies = await asyncio.gather(*(client.post(f"{http}/v1/completions", json=body) for _ in range(n)))
                return [(r.status_code, r.json()["error"]["type"], r.headers.get("retry-after")) for r in replies]

            http, metrics = routers["breaker"]
            with_breaker = await burst(http, 3)  # queued behind the held slot past the 1 s admission timeout
            without = await burst(routers["no_breaker"][0], 3)
            assert with_breaker == without == [(504, "timeout", None)] * 3, (with_breaker, without)
            text = (await client.get(metrics)).text
            assert _router_metric(text, "kvmesh_router_dependency_breaker_open", dependency="flow_control") == 0
            assert _router_metric(text, "kvmesh_router_dependency_breaker_transitions_total",
                                  dependency="flow_control", to="open") == 0
            assert (await client.get(f"{http}/health")).json()["status"] == "ok"
            started = time.monotonic()  # still asking flow_control (queued again), not admitting locally
            assert (await burst(http, 1)) == [(504, "timeout", None)] and time.monotonic() - started >= 1.0

            os.killpg(proc.pid, signal.SIGSTOP)
            try:
                assert (await burst(http, 1)) == [(504, "timeout", None)]  # the request waiting when it hung
                text = (await client.get(metrics)).text
                assert _router_metric(text, "kvmesh_router_dependency_breaker_open", dependency="flow_control") == 1
                started = time.monotonic()
                served = await client.post(f"{http}/v1/completions", json=body)
                assert served.status_code == 200 and time.monotonic() - started < 1.0  # admitted locally at once
            finally:
                os.killpg(proc.pid, signal.SIGCONT)
    finally:
        for router in procs:
            router.stop()
        for engine in engines:
            await engine.stop()
        await epp_server.stop(0)
