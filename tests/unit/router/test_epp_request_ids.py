"""The id epp knows a router request by, and which requests epp is told about.

* ``PickRequest.request_id`` (and the ``CompletedRequest`` that ends it) is unique per router request:
  the client's ``x-request-id`` plus a router-unique suffix. Two client requests that share an id
  are two picks to epp (a NOT_DISPATCHED for one leaves the other's load counted); a re-pick of the
  same router request (late binding after a queued admission) supersedes its earlier pick. The
  engine still gets the client's id as sent.
* epp is told how every request an engine answered ended, however it was picked (epp's pick, the local
  degraded pick, a pinned ``previous_response_id`` follow-up): for an id epp never picked, the report
  still takes the request out of the serving endpoint's running count early. ``NOT_DISPATCHED`` (no
  engine answered) goes only where epp may hold the pick: it answered one, one was abandoned in flight,
  or one passed its deadline (epp counted it, its answer missed the router's ``pick_timeout_seconds``);
  not after a pick that failed otherwise (epp unreachable, unknown model, epp's own error answer):
  that report would only count as unmatched.

The real epp servicer and scheduler behind the router's real ``PickerClient`` on a loopback gRPC
server (the harness of ``test_not_dispatched``) where epp's accounting is asserted; a recording
picker where only what the router sends is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from kvmesh.types import CompletionOutcome, RequestCompletion, pick_request_id
from services.epp.servicer import EndpointPickerServicer
from services.router.clients import AdmitQuery, PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.degraded import PickerTimedOut, PickerUnreachable
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import ModelUnavailable, RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, JSON_BODY, SSE, A, B, FakeAdmission, FakePicker, FakeTicket
from tests.unit.router.test_not_dispatched import CONFIG, PROMPT, _completions, _Epp, _refusing
from tests.unit.router.test_pick_many import _client, _serve, _until

OTHER_PROMPT = list(range(100, 130))  # 30 tokens: tells the second request apart from the first


def _completion(prompt: list[int], stream: bool = False) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream},
                            CATALOG, 1024)


def test_each_router_request_gets_its_own_epp_id_with_the_client_id_in_front() -> None:
    first, second = RequestMeta("dup", "f", 0), RequestMeta("dup", "f", 0)
    assert first.request_id == second.request_id == "dup"  # the client's id, kept as sent
    assert first.epp_request_id != second.epp_request_id
    assert first.epp_request_id.startswith("dup~") and second.epp_request_id.startswith("dup~")
    assert replace(first, server_span=True).epp_request_id == first.epp_request_id  # the same request
    assert len({pick_request_id("x") for _ in range(1000)}) == 1000


async def test_two_client_requests_sharing_an_id_are_two_picks_to_epp() -> None:
    """One runs (its engine silent), the other with the same x-request-id fails on every engine: epp is
    told NOT_DISPATCHED for the second alone, and the first's 40 tokens stay counted until it ends."""
    go = asyncio.Event()
    seen_ids: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen_ids.append(request.headers["x-request-id"])
        if b'"prompt":[100,' in request.content:  # the second request: refused everywhere
            raise httpx.ConnectError("connection refused", request=request)

        async def body() -> AsyncIterator[bytes]:
            await go.wait()
            yield SSE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async with _Epp(engine, FakeAdmission()) as epp:
        matched = _completions("matched")

        async def first() -> None:
            async with epp.flow.session(_completion(PROMPT, stream=True), RequestMeta("dup", "f", 0)) as session:
                await session.read_all()

        task = asyncio.ensure_future(first())
        await _until(lambda: sum(epp.active().values()) == len(PROMPT))
        with pytest.raises(errors.NoEndpointsAvailable):
            async with epp.flow.session(_completion(OTHER_PROMPT), RequestMeta("dup", "f", 0)):
                pass
        await _until(lambda: _completions("matched") == matched + 1)  # the second's NOT_DISPATCHED matched its own pick
        assert sum(epp.active().values()) == len(PROMPT)  # the first's tokens: still counted
        assert len(epp.datastore._in_flight) == 1 and epp.pending() == 1
        go.set()
        await task
        await _until(epp.freed)
        assert _completions("matched") == matched + 2
        assert set(seen_ids) == {"dup"}  # the engine gets the client's id as sent


@dataclass
class _QueuedTicket(FakeTicket):
    queue_seconds: float = 2.0  # waited in flow_control: the early pick is dropped, picked again at dispatch


@dataclass
class _QueuingAdmission(FakeAdmission):
    async def admit(self, request: AdmitQuery) -> _QueuedTicket:
        await asyncio.sleep(self.delay)
        return _QueuedTicket()


async def test_a_re_pick_of_the_same_router_request_supersedes_its_early_pick() -> None:
    """The early pick lands (40 tokens counted), admission says the request was queued, the router picks
    again at dispatch under the same epp id: epp counts one pick, not two."""
    go = asyncio.Event()
    posted: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        posted.append(request.headers["x-request-id"])

        async def body() -> AsyncIterator[bytes]:
            await go.wait()
            yield SSE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async with _Epp(engine, _QueuingAdmission(delay=0.3)) as epp:
        async def client() -> None:
            async with epp.flow.session(_completion(PROMPT, stream=True), RequestMeta("r-repick", "f", 0)) as session:
                await session.read_all()

        task = asyncio.ensure_future(client())
        await _until(lambda: sum(epp.active().values()) == len(PROMPT))  # the early pick
        await _until(lambda: bool(posted))  # the dispatch's pick came back (the engine has the request)
        # one pick counted, not two: the dispatch's superseded the early one
        assert sum(epp.active().values()) == len(PROMPT) and epp.pending() == 1 and len(epp.datastore._in_flight) == 1
        assert sum(epp.datastore.picks_total(e.id) for e in (A, B)) == 1
        assert posted == ["r-repick"]
        go.set()
        await task
        await _until(epp.freed)


@dataclass
class _RecordingPicker(FakePicker):
    """epp as the router sees it: answers (or raises ``fail``, or never answers while ``hang``), and
    records every completion the router reports."""

    fail: BaseException | None = None
    hang: bool = False
    completed: list[RequestCompletion] = field(default_factory=list)

    async def pick(self, query: PickQuery) -> PickReply:
        if self.hang or self.fail is not None:
            self.queries.append(query)
            if self.hang:
                await asyncio.Event().wait()
            raise self.fail  # type: ignore[misc]
        return await super().pick(query)

    def report_completed(self, completion: RequestCompletion) -> None:
        self.completed.append(completion)


def _flow(picker: _RecordingPicker, engine: Callable[[httpx.Request], httpx.Response],
          failure_mode: str = "open") -> RequestFlow:
    config = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30, epp_failure_mode=failure_mode)  # type: ignore[arg-type]
    return RequestFlow(config, lambda: CATALOG, FakeAdmission(), picker,
                       httpx.AsyncClient(transport=httpx.MockTransport(engine)), endpoints=lambda model: (A, B))


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "application/json"}, content=JSON_BODY)


async def _complete(flow: RequestFlow, meta: RequestMeta, raised: type[BaseException] | None = None) -> None:
    """One completion of ``PROMPT`` through ``flow``, closed after it: read whole, or (``raised``) refused
    with that error as its session opens."""
    try:
        if raised is None:
            async with flow.session(_completion(PROMPT), meta) as session:
                await session.read_all()
        else:
            with pytest.raises(raised):
                async with flow.session(_completion(PROMPT), meta):
                    pass
    finally:
        await flow.aclose()


@pytest.mark.parametrize(("fail", "engine", "raised"), [
    (PickerUnreachable("epp down"), _refusing, errors.NoEndpointsAvailable),  # local pick, engines refuse
    (errors.UnknownModel("epp has no 'tiny' yet"), _refusing, errors.NoEndpointsAvailable),  # local pick
    (errors.NoEndpointsAvailable("epp: no endpoint"), _answering, errors.NoEndpointsAvailable),  # epp's own error
], ids=["unreachable-refused", "unknown-model-refused", "epp-error"])
async def test_no_not_dispatched_for_a_request_epp_did_not_pick(
    fail: BaseException, engine: Callable[[httpx.Request], httpx.Response], raised: type[BaseException] | None,
) -> None:
    picker = _RecordingPicker(fail=fail)
    await _complete(_flow(picker, engine), RequestMeta("r-local", "f", 0), raised)
    assert picker.queries  # epp was asked
    assert picker.completed == []  # but holds nothing of it: no NOT_DISPATCHED (it would count as unmatched)


@pytest.mark.parametrize("fail", [PickerUnreachable("epp down"), errors.UnknownModel("epp has no 'tiny' yet"),
                                  PickerTimedOut("endpoint picker: Deadline Exceeded")],
                         ids=["unreachable", "unknown-model", "timed-out"])
async def test_a_locally_picked_request_an_engine_answered_is_always_reported(fail: BaseException) -> None:
    """The local degraded pick served it: epp is told its outcome on the endpoint that served it (epp takes
    it out of that endpoint's running count, ``Datastore.note_completed``), as before the gate on NOT_DISPATCHED."""
    picker = _RecordingPicker(fail=fail)
    meta = RequestMeta("r-local-ok", "f", 0)
    await _complete(_flow(picker, _answering), meta)
    assert [(c.request_id, c.endpoint_id, c.outcome) for c in picker.completed] == [
        (meta.epp_request_id, c.endpoint_id, CompletionOutcome.SUCCESS) for c in picker.completed]
    assert len(picker.completed) == 1 and picker.completed[0].endpoint_id in (A.id, B.id)
    assert picker.completed[0].completion_tokens == 2  # the engine's usage (fakes.JSON_BODY), for epp's output mean


async def test_a_pinned_follow_up_an_engine_answered_is_reported_on_its_endpoint() -> None:
    """A ``previous_response_id`` follow-up goes to the endpoint holding the response without asking epp;
    its completion still reaches epp, on that endpoint."""
    picker = _RecordingPicker()
    body = {"model": "tiny", "input": "and then?", "previous_response_id": "resp_1", "max_output_tokens": 2}
    request = replace(validate_request(RequestKind.RESPONSES, body, CATALOG, 1024), pinned_endpoint_id=B.id)
    flow = _flow(picker, _answering)
    meta = RequestMeta("r-pinned", "f", 0)
    try:
        async with flow.session(request, meta) as session:
            await session.read_all()
    finally:
        await flow.aclose()
    assert session.endpoint.id == B.id
    assert picker.queries == []  # epp was not asked
    assert [(c.request_id, c.endpoint_id, c.outcome) for c in picker.completed] == [
        (meta.epp_request_id, B.id, CompletionOutcome.SUCCESS)]


async def test_a_pick_past_its_deadline_with_epp_failing_closed_is_reported_not_dispatched() -> None:
    """The pick timed out (epp may have counted it) and the router refuses the request (failing closed):
    epp is told NOT_DISPATCHED."""
    picker = _RecordingPicker(fail=PickerTimedOut("endpoint picker: Deadline Exceeded"))
    meta = RequestMeta("r-late-closed", "f", 0)
    await _complete(_flow(picker, _answering, failure_mode="closed"), meta, errors.NoEndpointsAvailable)
    assert [(c.request_id, c.outcome) for c in picker.completed] == [(meta.epp_request_id, CompletionOutcome.NOT_DISPATCHED)]


def _picked_locally() -> float:
    return REGISTRY.get_sample_value("kvmesh_router_degraded_total", {"dependency": "epp", "action": "picked_locally"}) or 0.0


class _LateScheduler:
    """epp's real scheduler whose answer comes ``delay`` s after it picked, and counted, the request (a
    stalled epp event loop, a slow write): the router's deadline passes first."""

    def __init__(self, scheduler: object, delay: float) -> None:
        self._scheduler, self.delay = scheduler, delay
        self.picked = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._scheduler, name)

    async def pick(self, request: object) -> object:
        decision = await self._scheduler.pick(request)  # type: ignore[attr-defined]
        self.picked += 1
        await asyncio.sleep(self.delay)
        return decision


@pytest.mark.parametrize("multiplexed", [True, False], ids=["pick-many", "unary"])
@pytest.mark.parametrize("failure_mode", ["open", "closed"])
async def test_a_pick_epp_counted_but_answered_too_late_is_freed(multiplexed: bool, failure_mode: str) -> None:
    """The real epp counts the pick (40 active prompt tokens, one pending), then answers after the router's
    ``pick_timeout`` (0.5 s): the router's ``PickerClient`` reads ``PickerTimedOut`` (its own timer on
    PickMany, ``DEADLINE_EXCEEDED`` on a unary call, or the entry's own deadline), picks locally and the
    engine answers (``open``: the SUCCESS completion frees the pick on epp), or refuses the request
    (``closed``: NOT_DISPATCHED drops it). Before, nothing was sent: the counts stayed until epp's TTL."""
    epp = _Epp(_answering, FakeAdmission())
    late = _LateScheduler(epp.scheduler, 3.0)
    server, port = await _serve(EndpointPickerServicer(late))  # type: ignore[arg-type]
    client = await _client(port, multiplexed=multiplexed, timeout=0.5)
    assert await client.needs_prompt(5.0)  # asked once, up front: the pick's whole 0.5 s is the pick's
    config = CONFIG.model_copy(update={"epp_failure_mode": failure_mode})
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), client,
                       httpx.AsyncClient(transport=httpx.MockTransport(_answering)), endpoints=lambda model: (A, B))
    matched, local = _completions("matched"), _picked_locally()
    try:
        meta = RequestMeta("r-late", "f", 0)
        if failure_mode == "open":
            async with flow.session(_completion(PROMPT), meta) as session:
                await session.read_all()
            assert _picked_locally() > local  # the degraded mode's pick served it
        else:
            with pytest.raises(errors.NoEndpointsAvailable):
                async with flow.session(_completion(PROMPT), meta):
                    pass
        assert late.picked >= 1  # epp counted the pick
        await _until(epp.freed)  # ... and was told how it ended
        assert _completions("matched") >= matched + 1
    finally:
        await flow.aclose()
        await client.close()
        await server.stop(0)


async def test_unknown_model_with_epp_failing_closed_reports_nothing() -> None:
    picker = _RecordingPicker(fail=errors.UnknownModel("no such model"))
    await _complete(_flow(picker, _answering, failure_mode="closed"), RequestMeta("r-unknown", "f", 0), ModelUnavailable)
    assert picker.completed == []


async def test_a_pick_epp_answered_is_reported_not_dispatched_under_its_epp_id() -> None:
    picker = _RecordingPicker()
    meta = RequestMeta("r-epp", "f", 0)
    await _complete(_flow(picker, _refusing), meta, errors.NoEndpointsAvailable)
    assert {q.request_id for q in picker.queries} == {meta.epp_request_id}
    assert [(c.request_id, c.outcome) for c in picker.completed] == [(meta.epp_request_id, CompletionOutcome.NOT_DISPATCHED)]


async def test_a_pick_abandoned_in_flight_is_reported_not_dispatched() -> None:
    """The client leaves while epp is picking: epp may have counted the pick, so it is told."""
    picker = _RecordingPicker(hang=True)
    flow = _flow(picker, _answering)
    try:
        async def client() -> None:
            async with flow.session(_completion(PROMPT), RequestMeta("r-gone", "f", 0)):
                pass

        task = asyncio.ensure_future(client())
        await _until(lambda: len(picker.queries) >= 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await flow.aclose()
    assert [c.outcome for c in picker.completed] == [CompletionOutcome.NOT_DISPATCHED]
