"""The dependency breaker opens on a *hung* dependency, not on a *busy* one.

A timeout alone is no proof of a hang: flow_control queues a request as long as its band's TTL allows
(which may exceed the router's ``admission_timeout_seconds``) and a saturated pool queues everything;
epp's picks slow down under load. :class:`~services.router.degraded.DependencyBreaker` opens only when
the dependency showed no sign of life during the timed-out call's wait: for epp, no other Pick was
answered meanwhile; for flow_control, no admission call was answered within
``LIVENESS_FRESH_SECONDS`` and its grpc.health.v1 ``Check`` gets no answer either. What the client
gets is the same either way (504 for the admission, the local pick for the Pick). The fakes stand
for the real clients as in ``test_dependency_breaker.py``; ``tests/integration/test_breaker_busy_flow_control.py``
runs the flow_control case against a real flow_control process.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import httpx
from prometheus_client import REGISTRY

from kvmesh import errors
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2_grpc
from kvmesh.clock import ManualClock
from kvmesh.interceptors import server_interceptors
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import PluginHandle, PrefixMatch
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from services.epp.servicer import EndpointPickerServicer
from services.router.clients import AdmitQuery, PickerClient, PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.degraded import AdmissionTimedOut, DependencyBreaker, PickerTimedOut
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, JSON_BODY, A, B, FakeTicket

TIMEOUT = 0.4
"""The fakes' call timeout (s)."""


# -- the breaker alone ---------------------------------------------------------------------------

def test_a_timeout_of_a_busy_dependency_never_opens_and_a_busy_probe_closes_it() -> None:
    now = [0.0]
    changes: list[bool] = []
    breaker = DependencyBreaker("flow_control", 5.0, lambda: now[0], changes.append)
    assert not breaker.heard_since(0.0)
    now[0] = 1.0
    breaker.answered(probe=False)  # another call answered at t=1
    assert breaker.heard_since(0.5) and breaker.heard_since(1.0) and not breaker.heard_since(1.5)
    breaker.busy(probe=False)
    assert not breaker.is_open() and breaker.admit() == "call" and changes == []
    breaker.timed_out(probe=False)  # no sign of life: hung
    assert breaker.is_open() and changes == [True]
    now[0] = 10.0
    assert breaker.admit() == "probe"
    breaker.heard()  # e.g. a liveness check answered while the probe waited in a long queue
    breaker.busy(probe=True)  # the probe timed out on a responsive dependency: it is not hung
    assert not breaker.is_open() and changes == [True, False] and breaker.admit() == "call"


# -- through the request flow ---------------------------------------------------------------------

def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"}, content=JSON_BODY)


def _flow(admission: object, picker: object, **config: object) -> RequestFlow:
    settings: dict[str, object] = {"dependency_breaker_cool_down_seconds": 5.0, "health_check_timeout_seconds": 0.2}
    cfg = RouterConfig(etcd_endpoints=[], early_pick=False, **(settings | config))  # type: ignore[arg-type]
    return RequestFlow(cfg, lambda: CATALOG, admission, picker,  # type: ignore[arg-type]
                       httpx.AsyncClient(transport=httpx.MockTransport(_answering)), endpoints=lambda model: (A, B))


def _request(prompt: list[int] | None = None) -> RouterRequest:
    body = {"model": "tiny", "prompt": prompt or [1, 2, 3], "max_tokens": 2}
    return validate_request(RequestKind.COMPLETION, body, CATALOG, 1024)


async def _serve(flow: RequestFlow, rid: str, prompt: list[int] | None = None) -> tuple[float, str]:
    """One request: (seconds it took, the endpoint that served it or the error's class)."""
    started = time.monotonic()
    try:
        async with flow.session(_request(prompt), RequestMeta(rid, "f", 0)) as session:
            await session.read_all()
            how = session.endpoint.id
    except errors.KvmeshError as exc:
        how = type(exc).__name__
    return time.monotonic() - started, how


@dataclass
class _SlowPicks:
    """epp under load: picks of prompt ``[9]`` get no answer in time (``PickerTimedOut`` after
    ``TIMEOUT``), the others are answered after ``delay``; ``hung``: none is answered."""

    delay: float = 0.05
    hung: bool = False
    answered: int = 0

    async def pick(self, query: PickQuery) -> PickReply:
        if self.hung or list(query.prompt_token_ids or ()) == [9]:
            await asyncio.sleep(TIMEOUT)
            raise PickerTimedOut("endpoint picker: Deadline Exceeded")
        await asyncio.sleep(self.delay)
        self.answered += 1
        return PickReply((A, B), 0, "epp")


@dataclass
class _Admission:
    tickets: list[FakeTicket] = field(default_factory=list)

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        ticket = FakeTicket()
        self.tickets.append(ticket)
        return ticket


async def test_a_slow_pick_while_other_picks_are_answered_does_not_open_the_epp_breaker() -> None:
    picker = _SlowPicks()
    flow = _flow(_Admission(), picker)
    try:
        async def others() -> list[tuple[float, str]]:
            results = []
            for i in range(5):  # answered during the slow pick's wait, all before it times out
                results.append(await _serve(flow, f"o{i}"))
            return results

        slow, answered = await asyncio.gather(_serve(flow, "slow", [9]), others())
        assert slow[0] >= TIMEOUT and slow[1] in (A.id, B.id)  # the client: the local pick, as before
        assert all(how in (A.id, B.id) for _, how in answered) and picker.answered == 5
        assert flow.open_breakers() == []  # busy, not hung
        calls = picker.answered
        assert (await _serve(flow, "next"))[1] in (A.id, B.id) and picker.answered == calls + 1  # epp still asked
        picker.hung = True  # now nothing comes back at all: a hang opens it
        took, how = await _serve(flow, "hung")
        assert took >= TIMEOUT and how in (A.id, B.id) and flow.open_breakers() == ["epp"]
        took, how = await _serve(flow, "skipped")
        assert took < TIMEOUT and how in (A.id, B.id)  # the breaker open: no wait on epp
    finally:
        await flow.aclose()


@dataclass
class _QueueingAdmission:
    """flow_control behind the router's AdmissionClient, its queue longer than the router's wait: no
    decision in time (``AdmissionTimedOut`` after ``TIMEOUT``). ``health`` is the client's
    grpc.health.v1 check: ``status`` after ``health_delay`` (a hung process: ``DEADLINE_EXCEEDED``
    at the check's deadline)."""

    status: str = "SERVING"
    health_delay: float = 0.01
    calls: int = 0
    checks: int = 0

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        self.calls += 1
        await asyncio.sleep(TIMEOUT)
        raise AdmissionTimedOut(f"not dispatched within {TIMEOUT:g}s (flow_control gave no decision)")

    async def health(self, timeout_seconds: float) -> str:
        self.checks += 1
        if self.status == "DEADLINE_EXCEEDED":
            await asyncio.sleep(timeout_seconds)
        else:
            await asyncio.sleep(self.health_delay)
        return self.status


async def test_requests_queued_past_the_admission_timeout_keep_the_flow_control_breaker_closed() -> None:
    admission = _QueueingAdmission()
    flow = _flow(admission, _SlowPicks())
    off = _flow(_QueueingAdmission(), _SlowPicks(), dependency_breaker_cool_down_seconds=0)
    try:
        results = await asyncio.gather(*(_serve(flow, f"q{i}") for i in range(6)))
        assert all(t >= TIMEOUT and how == "AdmissionTimedOut" for t, how in results), results  # 504, as before
        assert flow.open_breakers() == []  # flow_control answers its health check: queued, not hung
        assert admission.checks == 1  # one check for the six timeouts (shared, then reused)
        without = await asyncio.gather(*(_serve(off, f"q{i}") for i in range(6)))
        assert [how for _, how in without] == [how for _, how in results]  # the same answers as without a breaker
        took, how = await _serve(flow, "again")
        assert took >= TIMEOUT and how == "AdmissionTimedOut" and admission.calls == 7  # still asked, not bypassed
        assert flow.local_admission.in_flight == 0
    finally:
        await flow.aclose()
        await off.aclose()


async def test_a_flow_control_that_answers_nothing_still_opens_the_breaker() -> None:
    admission = _QueueingAdmission(status="DEADLINE_EXCEEDED")
    flow = _flow(admission, _SlowPicks())
    try:
        results = await asyncio.gather(*(_serve(flow, f"h{i}") for i in range(4)))
        assert all(how == "AdmissionTimedOut" for _, how in results)
        assert flow.open_breakers() == ["flow_control"] and admission.checks == 1
        took, how = await _serve(flow, "local")
        assert took < TIMEOUT and how in (A.id, B.id) and admission.calls == 4  # admitted locally at once
    finally:
        await flow.aclose()


async def test_a_health_check_that_fails_fast_is_no_sign_of_life() -> None:
    admission = _QueueingAdmission(status="UNAVAILABLE")
    flow = _flow(admission, _SlowPicks())
    try:
        assert (await _serve(flow, "h"))[1] == "AdmissionTimedOut"
        assert flow.open_breakers() == ["flow_control"]
    finally:
        await flow.aclose()


@dataclass
class _CreditsThenHung(_QueueingAdmission):
    """A SIGSTOPped flow_control whose stream still holds ``credits`` lent before it stopped: those
    requests are admitted at once without any answer from it (no sign of life), the next ones hang."""

    credits: int = 2
    tickets: list[FakeTicket] = field(default_factory=list)

    def admits_at_once(self, priority: int, options: object = None) -> bool:
        return self.credits > 0

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        if self.credits > 0:
            self.credits -= 1
            ticket = FakeTicket()
            self.tickets.append(ticket)
            return ticket
        return await super().admit(request)


async def test_requests_admitted_on_lent_credits_are_no_sign_of_life() -> None:
    admission = _CreditsThenHung(status="DEADLINE_EXCEEDED", credits=0)
    flow = _flow(admission, _SlowPicks(delay=0.0))
    try:
        hung = asyncio.ensure_future(_serve(flow, "h"))  # waits for a decision that never comes
        await asyncio.sleep(TIMEOUT / 4)
        admission.credits = 2  # credits still held by the stream: spent during the wait, no answer from flow_control
        assert [how for _, how in await asyncio.gather(_serve(flow, "c1"), _serve(flow, "c2"))] == [A.id, A.id]
        assert (await hung)[1] == "AdmissionTimedOut"
        assert flow.open_breakers() == ["flow_control"]  # the credits spent meanwhile were not an answer
    finally:
        await flow.aclose()


class _SlowForNine:
    """kv_indexer stand-in for epp's precise profile: a prompt starting with token 9 is scored after 2 s
    (past the router's pick timeout), the others at once."""

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        if token_ids and token_ids[0] == 9:
            await asyncio.sleep(2.0)
        return PrefixMatch(len(token_ids) // 64, {})


async def test_a_real_epp_slow_on_one_pick_while_answering_the_others_is_not_hung() -> None:
    """The router's PickerClient (the multiplexed PickMany stream) against the real epp servicer and
    scheduler over loopback gRPC: the slow pick passes its deadline and is picked locally, the breaker
    stays closed, and the next requests are still picked by epp."""
    datastore = Datastore(ManualClock())
    source, data = resolve_scheduling_config("precise-prefix")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=_SlowForNine()), source)
    datastore.set_endpoints({A.id: A, B.id: B})
    for endpoint in (A, B):
        datastore.record_scrape(endpoint.id, ScrapeSample(0, 0, 0.0))
    server = grpc.aio.server(interceptors=server_interceptors())
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(
        EndpointPickerServicer(Scheduler(datastore, profile, LiveEndpointFilter("live"))), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    picker = PickerClient(f"127.0.0.1:{port}", timeout_seconds=TIMEOUT)
    await picker.connect()
    flow = _flow(_Admission(), picker, pick_timeout_seconds=TIMEOUT)
    local = REGISTRY.get_sample_value("kvmesh_router_degraded_total", {"dependency": "epp", "action": "picked_locally"}) or 0

    def picked_locally() -> float:
        value = REGISTRY.get_sample_value("kvmesh_router_degraded_total", {"dependency": "epp", "action": "picked_locally"})
        return (value or 0) - local

    try:
        async def others() -> list[tuple[float, str]]:
            results = []
            for i in range(8):
                results.append(await _serve(flow, f"o{i}", [1, 2, i]))
                await asyncio.sleep(TIMEOUT / 8)
            return results

        slow, answered = await asyncio.gather(_serve(flow, "slow", [9, 1, 2]), others())
        assert slow[0] >= TIMEOUT and slow[1] in (A.id, B.id)  # past the pick timeout: picked locally, served
        assert all(how in (A.id, B.id) for _, how in answered)
        assert picked_locally() == 1  # only the slow one: epp answered the others
        assert flow.open_breakers() == []  # a busy epp, not a hung one
        assert (await _serve(flow, "next"))[1] in (A.id, B.id) and picked_locally() == 1  # epp still asked
    finally:
        await flow.aclose()
        await picker.close()
        await server.stop(0)


@dataclass
class _WaitsLong(_QueueingAdmission):
    """flow_control with no decision for ``wait`` s (far past the liveness check interval, short of the router's
    admission timeout); its health check answers ``status``. ``released``: calls given up (cancelled)."""

    wait: float = 30.0
    released: int = 0

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        self.calls += 1
        try:
            await asyncio.sleep(self.wait)
        except asyncio.CancelledError:
            self.released += 1
            raise
        return FakeTicket()


async def test_a_hung_flow_control_is_found_within_the_liveness_interval_not_the_admission_timeout() -> None:
    """A fresh-user trial: SIGSTOP on flow_control, clients with a 30 s timeout (under the router's 35 s
    admission timeout): no request was served for as long as the hang lasted, as the breaker opened only at
    the admission timeout. Now each waiting call checks flow_control's liveness every
    ``admission_liveness_check_seconds``: hung, the call is given up (released), the breaker opens, and the
    request and those after it are admitted locally."""
    admission = _WaitsLong(status="DEADLINE_EXCEEDED")
    flow = _flow(admission, _SlowPicks(delay=0.0), admission_liveness_check_seconds=0.2, admission_timeout_seconds=35)
    try:
        results = await asyncio.gather(*(_serve(flow, f"h{i}") for i in range(3)))
        assert all(how in (A.id, B.id) for _, how in results), results  # served, locally admitted
        assert all(took < 2.0 for took, _ in results), results  # ~ the interval + one health check (0.2 s)
        assert flow.open_breakers() == ["flow_control"] and admission.released == 3
        took, how = await _serve(flow, "next")
        assert took < 0.2 and how in (A.id, B.id) and admission.calls == 3  # breaker open: not asked
        assert flow.local_admission.in_flight == 0
    finally:
        await flow.aclose()


async def test_a_long_queue_on_a_live_flow_control_keeps_waiting_past_the_liveness_checks() -> None:
    admission = _WaitsLong(status="SERVING", wait=0.7)
    flow = _flow(admission, _SlowPicks(delay=0.0), admission_liveness_check_seconds=0.1, admission_timeout_seconds=35)
    try:
        took, how = await _serve(flow, "queued")
        assert how in (A.id, B.id) and took >= 0.7  # its decision, after checks that found it alive
        assert admission.checks >= 1 and admission.released == 0 and flow.open_breakers() == []  # (a verdict is reused 1 s)
    finally:
        await flow.aclose()
