"""``RequestFlow.session``: one construct owns a request's life, and every way it ends closes it exactly once.

The admission stream and epp are fakes; the engine is an ``httpx.MockTransport`` whose answers the
test scripts (whole bodies, SSE streams, a stream that breaks, a refused connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import pytest

from kvmesh import errors
from services.router.clients import CompletionReport
from services.router.request_flow import ClientGone, EngineFailed, FlowSession, RequestFlow, RequestMeta
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import (
    CATALOG,
    CONFIG,
    JSON_BODY,
    MODEL,
    SSE,
    B,
    FakeAdmission,
    FakePicker,
    FakeTicket,
    in_flight,
    outcome_count,
)


def engine(answer: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def sse_answer(chunks: list[bytes], fail: bool = False, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            await asyncio.sleep(0)
            yield chunk
        if fail:
            raise httpx.ReadError("connection reset by engine")

    return lambda request: httpx.Response(status, headers={"content-type": "text/event-stream"}, content=body())


def request(stream: bool) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": stream}, CATALOG, 1024)


META = RequestMeta(request_id="r1", flow_id="f", priority=0)


@dataclass
class Harness:
    flow: RequestFlow
    admission: FakeAdmission
    picker: FakePicker
    before: dict[str, float]
    in_flight_before: float

    def delta(self, outcome: str) -> float:
        return outcome_count(outcome) - self.before[outcome]

    def ticket(self) -> FakeTicket:
        (ticket,) = self.admission.tickets
        return ticket

    def closed_once(self) -> CompletionReport | None:
        """The one report the ticket got (fails unless closed exactly once); the in-flight gauge is back."""
        ticket = self.ticket()
        assert len(ticket.reports) == 1, ticket.reports
        assert in_flight() == self.in_flight_before
        return ticket.reports[0]


OUTCOMES = ("success", "cancelled", "upstream_error", "error", "unavailable", "invalid")


def harness(answer: Callable[[httpx.Request], httpx.Response], admission: FakeAdmission | None = None,
            picker: FakePicker | None = None) -> Harness:
    admission = admission or FakeAdmission()
    picker = picker or FakePicker()
    flow = RequestFlow(CONFIG, lambda: CATALOG, admission, picker, engine(answer))
    return Harness(flow, admission, picker, {o: outcome_count(o) for o in OUTCOMES}, in_flight())


async def test_non_streamed_success_closes_once_with_the_usage() -> None:
    h = harness(lambda r: httpx.Response(200, content=JSON_BODY, headers={"content-type": "application/json"}))
    async with h.flow.session(request(False), META) as session:
        assert await session.read_all() == JSON_BODY
        assert h.ticket().reports == []  # still open inside the block
    report = h.closed_once()
    assert report is not None and report.success and (report.prompt_tokens, report.completion_tokens) == (3, 2)
    assert h.delta("success") == 1 and session._response.is_closed


async def test_streamed_events_carry_raw_bytes_and_parsed_pieces() -> None:
    split = [SSE[:10], SSE[10:70], SSE[70:]]  # cuts inside events
    h = harness(sse_answer(split))
    async with h.flow.session(request(True), META) as session:
        chunks = [c async for c in session.iter_events()]
    assert b"".join(c.raw for c in chunks) == SSE
    assert all(c.raw.endswith(b"\n\n") for c in chunks)  # whole events only
    assert "".join(p.text for c in chunks for p in c.pieces) == "hello"
    assert session.usage is not None and session.usage.completion_tokens == 2
    report = h.closed_once()
    assert report is not None and report.success and report.completion_tokens == 2
    assert h.delta("success") == 1


@pytest.mark.parametrize("gone", [asyncio.CancelledError, ClientGone], ids=["cancelled", "client-gone"])
async def test_client_gone_mid_stream_cancels_and_closes_once(gone: type[BaseException]) -> None:
    h = harness(sse_answer([SSE]))
    with pytest.raises(gone):
        async with h.flow.session(request(True), META) as session:
            async for _ in session.iter_events():
                raise gone()
    report = h.closed_once()
    assert report is not None and not report.success
    assert h.delta("cancelled") == 1 and h.delta("success") == 0
    assert session._response.is_closed  # the engine request is cancelled


async def test_task_cancelled_mid_answer_closes_once() -> None:
    release = asyncio.Event()

    first_event = SSE.index(b"\n\n") + 2

    async def slow() -> AsyncIterator[bytes]:
        yield SSE[:first_event]
        await release.wait()  # never: the engine hangs mid-answer
        yield SSE[first_event:]

    h = harness(lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=slow()))
    started = asyncio.Event()

    async def consume() -> None:
        async with h.flow.session(request(True), META) as session:
            async for _ in session.iter_events():
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    h.closed_once()
    assert h.delta("cancelled") == 1


async def test_async_generator_closed_by_its_consumer_counts_as_cancelled() -> None:
    """A gRPC stream its client closed: GeneratorExit at the generator's ``yield`` ends the session."""
    h = harness(sse_answer([SSE]))

    async def chunks() -> AsyncIterator[bytes]:
        async with h.flow.session(request(True), META) as session:
            async for chunk in session.iter_events():
                yield chunk.raw

    gen = chunks()
    await anext(gen)
    await gen.aclose()
    h.closed_once()
    assert h.delta("cancelled") == 1


async def test_exception_in_the_body_is_an_error_and_propagates() -> None:
    h = harness(sse_answer([SSE]))
    with pytest.raises(RuntimeError, match="bug"):
        async with h.flow.session(request(True), META):
            raise RuntimeError("bug")
    report = h.closed_once()
    assert report is not None and not report.success
    assert h.delta("upstream_error") == 1


async def test_engine_failing_mid_stream_raises_engine_failed() -> None:
    h = harness(sse_answer([SSE[:60]], fail=True))
    with pytest.raises(EngineFailed, match="closed the connection mid-stream") as info:
        async with h.flow.session(request(True), META) as session:
            async for _ in session.iter_events():
                pass
    assert isinstance(info.value, errors.NoEndpointsAvailable) and isinstance(info.value.__cause__, httpx.ReadError)
    h.closed_once()
    assert h.delta("upstream_error") == 1


async def test_engine_error_status_counts_by_status() -> None:
    h = harness(lambda r: httpx.Response(400, content=b'{"error": {"message": "bad"}}', headers={"content-type": "application/json"}))
    async with h.flow.session(request(False), META) as session:
        assert session.status_code == 400
        await session.read_all()
    report = h.closed_once()
    assert report is not None and not report.success
    assert h.delta("invalid") == 1


async def test_rejected_admission_propagates_and_counts_nothing_here() -> None:
    h = harness(sse_answer([SSE]), admission=FakeAdmission(reject=errors.QueueFull("full")))
    with pytest.raises(errors.QueueFull):
        async with h.flow.session(request(True), META):
            pytest.fail("entered a rejected session")
    assert h.admission.tickets == [] and in_flight() == h.in_flight_before
    assert all(h.delta(o) == 0 for o in OUTCOMES)  # the front door that answers it counts it


async def test_nothing_to_pick_after_admission_releases_the_slot_once() -> None:
    h = harness(sse_answer([SSE]), picker=FakePicker(order=()))
    with pytest.raises(errors.NoEndpointsAvailable):
        async with h.flow.session(request(True), META):
            pytest.fail("entered without an endpoint")
    report = h.closed_once()
    assert report is not None and not report.success and report.completion_tokens == 0


async def test_cancelled_while_queued_counts_cancelled() -> None:
    h = harness(sse_answer([SSE]), admission=FakeAdmission(delay=10))

    async def enter() -> None:
        async with h.flow.session(request(True), META):
            pytest.fail("admitted")

    task = asyncio.create_task(enter())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.delta("cancelled") == 1 and in_flight() == h.in_flight_before


async def test_refused_engine_falls_back_before_the_first_byte() -> None:
    def answer(req: httpx.Request) -> httpx.Response:
        if req.url.host == "a":
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, content=JSON_BODY, headers={"content-type": "application/json"})

    h = harness(answer)
    async with h.flow.session(request(False), META) as session:
        await session.read_all()
    assert (session.endpoint.id, session.attempts) == (B.id, 2)
    h.closed_once()


def test_session_is_the_only_way_in() -> None:
    assert not hasattr(RequestFlow, "start") and not hasattr(FlowSession, "close")
