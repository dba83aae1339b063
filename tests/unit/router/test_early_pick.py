"""The early pick: epp's Pick runs beside admission while flow_control dispatches at once, and is
dropped (picked again at dispatch: late binding) when the request was queued; a rejection stops
early picks until a request is dispatched at once again. Order of events, not timings, is asserted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from kvmesh import errors
from services.router.clients import AdmitQuery, CompletionReport, PickQuery, PickReply
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, CONFIG, JSON_BODY, MODEL, FakePicker

META = RequestMeta(request_id="r1", flow_id="f", priority=0)


def request() -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": MODEL, "prompt": "hello", "max_tokens": 2}, CATALOG, 1024)


@dataclass
class Ticket:
    queue_seconds: float
    reports: list[CompletionReport | None] = field(default_factory=list)

    async def close(self, report: CompletionReport | None = None) -> None:
        self.reports.append(report)


@dataclass
class Admission:
    """Admits after yielding a few times; ``queued`` / ``reject`` decide the next answers."""

    events: list[str]
    queue_seconds: list[float] = field(default_factory=list)
    reject: BaseException | None = None

    async def admit(self, request: AdmitQuery) -> Ticket:
        self.events.append("admit-start")
        for _ in range(5):
            await asyncio.sleep(0)
        self.events.append("admit-end")
        if self.reject is not None:
            raise self.reject
        return Ticket(self.queue_seconds.pop(0) if self.queue_seconds else 0.0)


@dataclass
class Picker(FakePicker):
    events: list[str] = field(default_factory=list)

    async def pick(self, query: PickQuery) -> PickReply:
        self.events.append("pick")
        await asyncio.sleep(0)
        return await super().pick(query)


def flow(events: list[str], admission: Admission, early: bool = True) -> tuple[RequestFlow, Picker]:
    picker = Picker(events=events)
    http = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, content=JSON_BODY, headers={"content-type": "application/json"})))
    config = CONFIG.model_copy(update={"early_pick": early})
    return RequestFlow(config, lambda: CATALOG, admission, picker, http), picker


async def _one(f: RequestFlow) -> None:
    async with f.session(request(), META) as session:
        await session.read_all()


async def test_pick_runs_beside_admission_when_dispatched_at_once() -> None:
    events: list[str] = []
    f, picker = flow(events, Admission(events))
    await _one(f)
    assert events.index("pick") < events.index("admit-end") and len(picker.queries) == 1


async def test_disabled_early_pick_picks_after_admission() -> None:
    events: list[str] = []
    f, _ = flow(events, Admission(events), early=False)
    await _one(f)
    assert events == ["admit-start", "admit-end", "pick"]


async def test_a_queued_request_is_picked_again_at_dispatch_and_stops_early_picks() -> None:
    events: list[str] = []
    admission = Admission(events, queue_seconds=[2.0, 0.0, 0.0])
    f, _ = flow(events, admission)
    await _one(f)  # early pick dropped, picked again after the 2 s queue
    assert events[-1] == "pick" and events.count("pick") == 2 and events.index("pick") < events.index("admit-end")
    events.clear()
    await _one(f)  # the last request was queued: no early pick
    assert events == ["admit-start", "admit-end", "pick"]
    events.clear()
    await _one(f)  # the last one was dispatched at once: early picks again
    assert events.index("pick") < events.index("admit-end")


async def test_a_rejection_cancels_the_early_pick_and_stops_early_picks() -> None:
    events: list[str] = []
    admission = Admission(events, reject=errors.QueueFull("rejected by admission: full"))
    f, _ = flow(events, admission)
    with pytest.raises(errors.QueueFull):
        await _one(f)
    admission.reject = None
    events.clear()
    await _one(f)
    assert events == ["admit-start", "admit-end", "pick"]


@dataclass
class CreditAdmission(Admission):
    """An admission client holding a credit for band 0 (``admits_at_once``, as :class:`AdmissionClient`)."""

    credits: int = 1
    asked: list[tuple[int, object]] = field(default_factory=list)

    def admits_at_once(self, priority: int, options: object = None) -> bool:
        self.asked.append((priority, options))
        return self.credits > 0 and priority == 0


async def test_no_early_pick_when_a_credit_admits_at_once() -> None:
    """Admitted on a credit there is nothing to overlap: the pick runs after admission, inline."""
    events: list[str] = []
    admission = CreditAdmission(events)
    f, picker = flow(events, admission)
    await _one(f)
    assert events == ["admit-start", "admit-end", "pick"] and len(picker.queries) == 1
    assert admission.asked == [(0, None)]
    admission.credits = 0  # no credit held: the pick goes beside admission again
    events.clear()
    await _one(f)
    assert events.index("pick") < events.index("admit-end")
