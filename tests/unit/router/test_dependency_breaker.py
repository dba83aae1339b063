"""The router's circuit breaker for its per-request dependencies (epp's Pick, flow_control's admission).

A hung dependency (the connection open, no answer) made every request wait its full timeout
(``pick_timeout_seconds``, ``admission_timeout_seconds``) while a killed one cost nothing: after a
call times out, :class:`~services.router.degraded.DependencyBreaker` opens for
``dependency_breaker_cool_down_seconds``; requests then take the unreachable-dependency path at once
(the local pick; local admission, fail-open with its cap) except one probe call at a time, whose
answer closes it and whose timeout renews the cool-down. Fakes here hang like a SIGSTOPped peer
behind the real clients: they sleep their timeout, then raise the client's timeout error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from services.router.clients import AdmitQuery, PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.degraded import AdmissionTimedOut, DependencyBreaker, PickerTimedOut
from services.router.readiness import Readiness, served_around
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, JSON_BODY, A, B, FakeTicket

TIMEOUT = 1.0
"""The fakes' call timeout (s): a request that waits on a hung dependency takes at least this."""
FAST = 0.5
"""A request that does not wait on it finishes well under ``TIMEOUT`` (loose: a loaded 2-core box)."""


def _open(dependency: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_dependency_breaker_open", {"dependency": dependency}) or 0.0


def _transitions(dependency: str, to: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_dependency_breaker_transitions_total",
                                     {"dependency": dependency, "to": to}) or 0.0


def _degraded(dependency: str, action: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_degraded_total", {"dependency": dependency, "action": action}) or 0.0


# -- the breaker alone ---------------------------------------------------------------------------

def test_breaker_opens_on_a_timeout_probes_one_at_a_time_after_the_cool_down_and_closes_on_an_answer() -> None:
    now = [0.0]
    changes: list[bool] = []
    breaker = DependencyBreaker("epp", 5.0, lambda: now[0], changes.append)
    assert breaker.admit() == "call" and not breaker.is_open()
    breaker.timed_out(probe=False)
    assert breaker.is_open() and changes == [True]
    assert [breaker.admit() for _ in range(3)] == ["skip"] * 3  # the cool-down: nobody calls
    now[0] = 5.0
    assert breaker.admit() == "probe"  # half-open: the one probe
    assert [breaker.admit() for _ in range(3)] == ["skip"] * 3  # the others still do not call
    now[0] = 100.0  # however long the probe hangs
    assert breaker.admit() == "skip"
    breaker.timed_out(probe=True)  # the probe timed out: the cool-down is renewed
    assert breaker.is_open() and changes == [True] and breaker.admit() == "skip"
    now[0] = 105.0
    assert breaker.admit() == "probe"
    breaker.failed(probe=True)  # refused (dead, fast): the probe ends, still open
    assert breaker.admit() == "probe"
    breaker.answered(probe=True)  # answered: closed at once
    assert not breaker.is_open() and breaker.admit() == "call" and changes == [True, False]


def test_a_disabled_breaker_never_opens() -> None:
    off = DependencyBreaker("epp", 0.0, time.monotonic)
    off.timed_out(probe=False)
    assert not off.is_open() and off.admit() == "call"


def test_a_late_answer_to_a_call_made_before_the_opening_closes_it() -> None:
    breaker = DependencyBreaker("epp", 5.0, time.monotonic)
    breaker.timed_out(probe=False)
    breaker.answered(probe=False)  # the dependency woke up and answered an older call
    assert not breaker.is_open()


# -- through the request flow ---------------------------------------------------------------------

@dataclass
class _HungPicker:
    """epp behind the router's PickerClient: while ``hung``, each Pick gets no answer and fails with
    ``PickerTimedOut`` after ``TIMEOUT``."""

    hung: bool = True
    calls: int = 0
    waiting: int = 0
    most_waiting: int = 0

    async def pick(self, query: PickQuery) -> PickReply:
        self.calls += 1
        if self.hung:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
            try:
                await asyncio.sleep(TIMEOUT)
            finally:
                self.waiting -= 1
            raise PickerTimedOut("endpoint picker: Deadline Exceeded")
        return PickReply((A, B), 0, "epp")


@dataclass
class _HungAdmission:
    """flow_control behind the router's AdmissionClient: while ``hung``, no decision, then
    ``AdmissionTimedOut`` after ``TIMEOUT``; awake, every request is dispatched on a ticket."""

    hung: bool = True
    calls: int = 0
    waiting: int = 0
    most_waiting: int = 0
    tickets: list[FakeTicket] = field(default_factory=list)

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        self.calls += 1
        if self.hung:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
            try:
                await asyncio.sleep(TIMEOUT)
            finally:
                self.waiting -= 1
            raise AdmissionTimedOut(f"not dispatched within {TIMEOUT:g}s (flow_control gave no decision)")
        ticket = FakeTicket()
        self.tickets.append(ticket)
        return ticket


@dataclass
class _Picker:
    async def pick(self, query: PickQuery) -> PickReply:
        return PickReply((A, B), 0, "epp")


@dataclass
class _Admission:
    tickets: list[FakeTicket] = field(default_factory=list)

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        ticket = FakeTicket()
        self.tickets.append(ticket)
        return ticket


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"}, content=JSON_BODY)


COOL_DOWN = 0.5


def _flow(admission: object, picker: object, **config: object) -> RequestFlow:
    cfg = RouterConfig(etcd_endpoints=[], early_pick=False, dependency_breaker_cool_down_seconds=COOL_DOWN, **config)  # type: ignore[arg-type]
    return RequestFlow(cfg, lambda: CATALOG, admission, picker,  # type: ignore[arg-type]
                       httpx.AsyncClient(transport=httpx.MockTransport(_answering)), endpoints=lambda model: (A, B))


def _request() -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}, CATALOG, 1024)


async def _serve(flow: RequestFlow, rid: str) -> tuple[float, str]:
    """One request through ``flow``: (seconds it took, the profile of its pick or the error's class)."""
    started = time.monotonic()
    try:
        async with flow.session(_request(), RequestMeta(rid, "f", 0)) as session:
            await session.read_all()
            how = session.endpoint.id
    except errors.KvmeshError as exc:
        how = type(exc).__name__
    return time.monotonic() - started, how


async def test_a_hung_epp_costs_one_timeout_then_picks_are_local_at_once_with_one_probe() -> None:
    picker = _HungPicker()
    flow = _flow(_Admission(), picker)
    opened, closed, local = _transitions("epp", "open"), _transitions("epp", "closed"), _degraded("epp", "picked_locally")
    try:
        took, _ = await _serve(flow, "first")
        assert took >= TIMEOUT  # the first one waits the pick timeout, then picks locally (served)
        assert flow.open_breakers() == ["epp"] and _open("epp") == 1 and _transitions("epp", "open") == opened + 1
        results = await asyncio.gather(*(_serve(flow, f"c{i}") for i in range(8)))  # within the cool-down
        assert all(t < FAST and how in (A.id, B.id) for t, how in results), results  # local pick, no wait
        assert picker.calls == 1  # epp not asked
        await asyncio.sleep(COOL_DOWN)
        results = await asyncio.gather(*(_serve(flow, f"r{i}") for i in range(8)))  # half-open
        waited = sorted(t for t, _ in results)
        # one of them is the probe (it waits the timeout); the 7 others do not wait on epp at all
        assert waited[-1] >= TIMEOUT and all(t < FAST for t in waited[:-1]), waited
        assert all(how in (A.id, B.id) for _, how in results)  # all served by the local pick
        assert picker.calls == 2 and picker.most_waiting == 1  # the first call, then one probe at a time
        assert _degraded("epp", "picked_locally") >= local + 17
        assert flow.open_breakers() == ["epp"]  # the probe timed out: renewed, still open
        picker.hung = False  # epp wakes up: the next request after the cool-down probes, its answer closes it
        await asyncio.sleep(COOL_DOWN)
        took, how = await _serve(flow, "probe")
        assert took < FAST and how in (A.id, B.id) and flow.open_breakers() == [] and _open("epp") == 0
        assert _transitions("epp", "closed") == closed + 1
        calls = picker.calls
        await asyncio.gather(*(_serve(flow, f"after{i}") for i in range(3)))
        assert picker.calls == calls + 3  # closed: every request asks epp again
    finally:
        await flow.aclose()


async def test_a_hung_flow_control_fails_open_after_the_first_timeout_with_one_probe() -> None:
    admission = _HungAdmission()
    flow = _flow(admission, _Picker())
    local = _degraded("flow_control", "admitted_locally")
    try:
        took, how = await _serve(flow, "first")
        assert took >= TIMEOUT and how == "AdmissionTimedOut"  # the request that waited: 504, as before
        assert flow.open_breakers() == ["flow_control"] and _open("flow_control") == 1
        results = await asyncio.gather(*(_serve(flow, f"c{i}") for i in range(8)))  # within the cool-down
        assert all(t < FAST and how in (A.id, B.id) for t, how in results), results  # admitted locally
        assert admission.calls == 1
        await asyncio.sleep(COOL_DOWN)
        results = await asyncio.gather(*(_serve(flow, f"r{i}") for i in range(8)))  # half-open
        took_sorted = sorted(results)
        probe, rest = took_sorted[-1], took_sorted[:-1]
        assert probe[0] >= TIMEOUT and probe[1] == "AdmissionTimedOut"  # the probe waited and timed out
        assert all(t < FAST and how in (A.id, B.id) for t, how in rest), results  # admitted locally, served
        assert admission.calls == 2 and admission.most_waiting == 1
        assert _degraded("flow_control", "admitted_locally") == local + 15
        assert flow.local_admission.in_flight == 0  # every local slot given back
        admission.hung = False  # flow_control wakes up: the probe is dispatched, the breaker closes
        await asyncio.sleep(COOL_DOWN)
        took, how = await _serve(flow, "probe")
        assert how in (A.id, B.id) and flow.open_breakers() == [] and _open("flow_control") == 0
        await asyncio.gather(*(_serve(flow, f"after{i}") for i in range(3)))
        assert admission.calls == 6 and len(admission.tickets) == 4
        # every ticket flow_control gave was closed exactly once (its slot released, with a report)
        assert all(len(t.reports) == 1 for t in admission.tickets)
    finally:
        await flow.aclose()


async def test_with_the_breaker_off_every_request_waits_as_before() -> None:
    picker = _HungPicker()
    cfg = RouterConfig(etcd_endpoints=[], early_pick=False, dependency_breaker_cool_down_seconds=0)
    flow = RequestFlow(cfg, lambda: CATALOG, _Admission(), picker,  # type: ignore[arg-type]
                       httpx.AsyncClient(transport=httpx.MockTransport(_answering)), endpoints=lambda model: (A, B))
    try:
        results = await asyncio.gather(*(_serve(flow, f"r{i}") for i in range(3)))
        assert all(t >= TIMEOUT for t, _ in results) and picker.calls == 3 and flow.open_breakers() == []
    finally:
        await flow.aclose()


@pytest.mark.parametrize("status", ["DEADLINE_EXCEEDED", "SERVING"])
def test_health_names_a_dependency_whose_breaker_is_open(status: str) -> None:
    degradable, hang_tolerant = served_around(flow_control_failure_mode="open", degraded_max_in_flight=256,
                                              epp_failure_mode="open", etcd=False, breaker=True)
    assert "flow_control" in hang_tolerant  # a hung flow_control is served around (after the first timeout)
    ready = Readiness({"flow_control": status, "epp": "SERVING"}, 2, degradable, hang_tolerant,
                      breakers_open=frozenset({"flow_control"}))
    if status == "SERVING":  # answering again: the breaker closes on the next request's probe
        assert ready.ready and ready.degraded == [] and ready.body()["status"] == "ok"
    else:
        assert ready.ready and ready.degraded == ["flow_control"] and ready.body()["status"] == "degraded"
    closed_mode = Readiness({"flow_control": status}, 2, frozenset(), frozenset(), breakers_open=frozenset({"flow_control"}))
    assert closed_mode.degraded == [] and closed_mode.ready == (status == "SERVING")  # fail-closed: not served around
    _, without = served_around(flow_control_failure_mode="open", degraded_max_in_flight=256,
                               epp_failure_mode="open", etcd=False)
    assert "flow_control" not in without


async def test_the_client_message_of_failed_attempts_holds_the_error_text_not_its_repr() -> None:
    def refusing(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    cfg = RouterConfig(etcd_endpoints=[], early_pick=False)
    flow = RequestFlow(cfg, lambda: CATALOG, _Admission(), _Picker(),  # type: ignore[arg-type]
                       httpx.AsyncClient(transport=httpx.MockTransport(refusing)), endpoints=lambda model: (A, B))
    try:
        with pytest.raises(errors.NoEndpointsAvailable) as raised:
            async with flow.session(_request(), RequestMeta("r", "f", 0)):
                pass
    finally:
        await flow.aclose()
    message = str(raised.value)
    assert "attempt(s): " in message and "engine b:1 at http://b:1 refused the connection" in message, message
    assert "Error(" not in message and "Unreachable(" not in message and "Stall(" not in message, message


def test_a_serving_health_check_ends_the_cool_down_early() -> None:
    now = [0.0]
    breaker = DependencyBreaker("epp", 5.0, lambda: now[0])
    breaker.timed_out(probe=False)
    assert breaker.admit() == "skip"
    breaker.seen_serving()  # /health's check answered: the next request probes at once
    assert breaker.is_open() and breaker.admit() == "probe" and breaker.admit() == "skip"
    breaker.answered(probe=True)
    assert not breaker.is_open()
    breaker.seen_serving()  # closed: nothing changes
    assert breaker.admit() == "call"
