"""What a hung engine is counted as, and when a silent engine is no failure at all (docs/degraded-modes.md,
"an engine hung").

Accounting: an attempt that failed before its first byte is a retry (``kvmesh_router_upstream_retries_total``) and a
stall ``action="redispatched"`` only once another attempt actually starts; when none follows (one candidate, the
attempt budget spent, the re-pick failing, the client gone) the stall is ``action="abandoned"`` and no retry is
counted: the client's 503 and the metric agree (before: ``redispatched`` and a retry for a request answered 503).

Whole answers: once the framer passed ``data: [DONE]`` (or a non-streamed body reached its ``content-length``),
an engine that goes silent before closing the body (a pause, a GC, SIGSTOP), fails its ``/health``, resets, or
the router stopping ends the request as a **success**, nothing appended (before: an error event and a second
``[DONE]`` after the whole answer, ``upstream_error``, a failure told to epp and flow_control).

Engines are ``httpx.MockTransport`` answers; the real-HTTP side is ``tests/integration/test_router_hung_engine.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from kvmesh.types import RequestCompletion
from services.router import request_flow
from services.router.config import RouterConfig
from services.router.degraded import LocalPicker
from services.router.passthrough import Passthrough
from services.router.request_flow import EngineStalled, RequestFlow, RequestMeta, seconds_text
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, JSON_BODY, SSE, A, B, FakeAdmission, FakePicker, outcome_count

META = RequestMeta(request_id="r-acct", flow_id="f", priority=0)
FAST = RouterConfig(etcd_endpoints=[], engine_first_byte_timeout_seconds=0.2, engine_stream_idle_timeout_seconds=0.3,
                    engine_departed_idle_seconds=0.1, request_timeout_seconds=30,
                    engine_health_probe_after_seconds=0.1,
                    engine_health_probe_timeout_seconds=0.2, engine_health_probe_interval_seconds=0.2)
"""Short limits; ``/health`` of a hung host never answers, so a wait is cut past 0.1 s + a 0.2 s probe."""


def _request(stream: bool) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream},
                            CATALOG, 1024)


def _stalled(reason: str, action: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_engine_stalled_total", {"reason": reason, "action": action}) or 0.0


def _retries() -> float:
    return REGISTRY.get_sample_value("kvmesh_router_upstream_retries_total") or 0.0


def _counts() -> dict[str, float]:
    """Every stall (reason, action) pair and the retries."""
    out = {f"{reason}/{action}": _stalled(reason, action) for reason in request_flow.STALL_REASONS
           for action in ("redispatched", "abandoned", "ended")}
    out["retries"] = _retries()
    return out


def _grew(before: dict[str, float]) -> dict[str, float]:
    """What grew since ``before`` (zero rows left out)."""
    now = _counts()
    return {key: now[key] - before[key] for key in now if now[key] != before[key]}


async def _forever() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()
    yield b""


def _engines(hung: set[str], tail: Callable[[], AsyncIterator[bytes]] | None = None,
             body: bytes = SSE, headers: dict[str, str] | None = None) -> Callable[[httpx.Request], httpx.Response]:
    """Hosts in ``hung`` answer 200 headers and then nothing (their ``/health`` hangs too); the others
    answer ``body`` at once, followed by ``tail()`` (None: the body closes at once)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, content=_forever()) if request.url.host in hung else httpx.Response(200)

        async def content() -> AsyncIterator[bytes]:
            if request.url.host in hung:
                await asyncio.Event().wait()
            yield body
            if tail is not None:
                async for chunk in tail():
                    yield chunk

        return httpx.Response(200, headers=headers or {"content-type": "text/event-stream"}, content=content())

    return answer


@dataclass
class RecordingPicker(FakePicker):
    """The fake epp that also records the completions the router reports (epp's ``Completed``)."""

    completions: list[RequestCompletion] = field(default_factory=list)

    def report_completed(self, completion: RequestCompletion) -> None:
        self.completions.append(completion)


def _flow(config: RouterConfig, answer: Callable[[httpx.Request], httpx.Response],
          order: tuple = (A, B)) -> tuple[RequestFlow, FakeAdmission, RecordingPicker]:
    admission, picker = FakeAdmission(), RecordingPicker(order)
    flow = RequestFlow(config, lambda: CATALOG, admission, picker,
                       httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    return flow, admission, picker


# -- redispatched only when another attempt starts --------------------------------------------------


async def test_one_hung_candidate_is_abandoned_not_redispatched() -> None:
    """The reviewer's case: one candidate, hung before its first byte: 503, counted ``abandoned``, no retry."""
    flow, _, _ = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}), _engines({"a"}), (A,))
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable, match=r"no first byte within 0\.2\d*s"):  # a loaded host: 0.21s
        async with flow.session(_request(True), META):
            pytest.fail("bound to a hung engine")
    assert _grew(before) == {"first_byte_timeout/abandoned": 1}
    await flow.aclose()


async def test_a_hung_first_candidate_is_redispatched_with_one_retry() -> None:
    flow, _, _ = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}), _engines({"a"}))
    before = _counts()
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == B.id and session.attempts == 2 and raw == SSE
    assert _grew(before) == {"first_byte_timeout/redispatched": 1, "retries": 1}
    await flow.aclose()


def _dead_health(answer: Callable[[httpx.Request], httpx.Response]) -> Callable[[httpx.Request], httpx.Response]:
    """``answer``, with every ``/health`` answered 503 (vLLM's dead engine: a fast verdict)."""
    return lambda request: httpx.Response(503) if request.url.path == "/health" else answer(request)


async def test_every_candidate_hung_counts_one_redispatch_and_one_abandon() -> None:
    """Two hung candidates (their /health failing): the first moved on, the last had nowhere to go."""
    flow, _, _ = _flow(FAST, _dead_health(_engines({"a", "b"})))
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable, match="after 2 attempt"):
        async with flow.session(_request(False), META):
            pytest.fail("bound to a hung engine")
    assert _grew(before) == {"health_probe_failed/redispatched": 1, "health_probe_failed/abandoned": 1, "retries": 1}
    await flow.aclose()


async def test_candidates_whose_health_never_answers_are_redispatched_then_abandoned() -> None:
    """The timeouts-only verdict (/health unanswered past engine_health_slow_fail_seconds) before the first
    byte moves the request on, as a fast verdict does (the cut closes the engine connection either way:
    vLLM aborts the request, so a 503 would save no work): the first redispatched, the last abandoned."""
    flow, _, _ = _flow(FAST.model_copy(update={"engine_health_slow_fail_seconds": 0.3}), _engines({"a", "b"}))
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable, match=r"after 2 attempt.*its /health gave no answer for"):
        async with flow.session(_request(False), META):
            pytest.fail("bound to a hung engine")
    assert _grew(before) == {"health_probe_timed_out/redispatched": 1, "health_probe_timed_out/abandoned": 1,
                             "retries": 1}
    await flow.aclose()


async def test_the_attempt_budget_spent_is_abandoned() -> None:
    """Another candidate exists but ``max_fallback_attempts`` = 1: no attempt follows, so no redispatch."""
    config = FAST.model_copy(update={"max_fallback_attempts": 1, "engine_health_probe_after_seconds": 10.0})
    flow, _, _ = _flow(config, _engines({"a"}))
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable):
        async with flow.session(_request(True), META):
            pytest.fail("bound to a hung engine")
    assert _grew(before) == {"first_byte_timeout/abandoned": 1}
    await flow.aclose()


async def test_a_refused_last_candidate_is_no_retry() -> None:
    """The sibling without a stall: a refused connection on the only candidate is not a retry."""

    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    flow, _, _ = _flow(FAST, answer, (A,))
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable):
        async with flow.session(_request(True), META):
            pytest.fail("bound to a refusing engine")
    assert _grew(before) == {}
    await flow.aclose()


async def test_a_client_gone_during_the_repick_is_abandoned_not_redispatched() -> None:
    """A failed attempt, then the client goes away while the re-pick runs: no attempt followed."""
    flow, _, picker = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}), _engines({"a"}), (A,))
    repicking = asyncio.Event()
    pick = picker.pick

    async def slow_repick(query):  # type: ignore[no-untyped-def]
        if query.exclude_endpoint_ids:
            repicking.set()
            await asyncio.Event().wait()
        return await pick(query)

    picker.pick = slow_repick  # type: ignore[method-assign]
    before = _counts()

    async def one() -> None:
        async with flow.session(_request(True), META):
            pytest.fail("bound")

    task = asyncio.ensure_future(one())
    await asyncio.wait_for(repicking.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _grew(before) == {"first_byte_timeout/abandoned": 1}
    await flow.aclose()


async def test_passthrough_counts_redispatched_only_when_another_endpoint_is_tried() -> None:
    """The passthrough routes' sibling: /tokenize on two hung engines, a stored response on a hung one."""
    answer = _engines({"a", "b"})
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    config = FAST.model_copy(update={"engine_health_slow_fail_seconds": 0.3})
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    passthrough = Passthrough(config, http, lambda model: (A, B), LocalPicker(), flow.await_engine)
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable, match="after 2 attempt"):
        await passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r1")
    assert _grew(before) == {"health_probe_timed_out/redispatched": 1, "health_probe_timed_out/abandoned": 1, "retries": 1}
    before = _counts()
    with pytest.raises(errors.NoEndpointsAvailable, match="its /health gave no answer for"):
        await passthrough.to_endpoint("GET", "/v1/responses/resp_1", "tiny", A.id, "r2")
    assert _grew(before) == {"health_probe_timed_out/abandoned": 1}
    await flow.aclose()


# -- a whole answer is a success, whatever the engine does after it ----------------------------------


async def _stream(flow: RequestFlow) -> bytes:
    got: list[bytes] = []
    async with flow.session(_request(True), META) as session:
        async for chunk in session.iter_events():
            got.append(chunk.raw)
    return b"".join(got)


def _success_everywhere(admission: FakeAdmission, picker: RecordingPicker) -> None:
    """flow_control and epp were both told the request succeeded."""
    reports = [r for t in admission.tickets for r in t.reports]
    assert len(reports) == 1 and reports[0] is not None and reports[0].success
    assert reports[0].completion_tokens == 2
    assert [c.outcome.value for c in picker.completions] == ["success"]


@pytest.mark.parametrize("why", ["silence", "probe", "reset"])
async def test_silence_after_done_ends_the_stream_as_a_success(why: str) -> None:
    """After ``[DONE]``: silent past the idle limit (the reviewer's case), silent past the probe threshold
    with /health hanging, or a reset: the client had the whole answer; nothing is appended, no stall."""
    config = FAST if why == "probe" else FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0})

    async def tail() -> AsyncIterator[bytes]:
        if why == "reset":
            raise httpx.ReadError("connection reset by peer")
        await asyncio.Event().wait()
        yield b""

    hung_health = {"a"} if why == "probe" else set()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" and request.url.host in hung_health:
            return httpx.Response(200, content=_forever())
        return _engines(set(), tail)(request)

    flow, admission, picker = _flow(config, answer, (A,))
    before, success, failed = _counts(), outcome_count("success"), outcome_count("upstream_error")
    started = asyncio.get_running_loop().time()
    raw = await _stream(flow)
    assert raw == SSE  # byte for byte: no error event, no second [DONE]
    assert asyncio.get_running_loop().time() - started < 5.0  # ended within the after-whole wait, not a limit
    assert _grew(before) == {}
    assert outcome_count("success") == success + 1 and outcome_count("upstream_error") == failed
    _success_everywhere(admission, picker)
    await flow.aclose()


async def test_silence_before_done_still_ends_as_a_stalled_engine() -> None:
    """The control: the same silence one event before ``[DONE]`` is a failure (``EngineStalled``), and
    its message gives the wait with its precision ("no data for 0.3s", not "0s")."""
    events = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]
    flow, _, _ = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}),
                       _engines(set(), _forever, body=b"".join(events[:-1])), (A,))
    before = _counts()
    with pytest.raises(EngineStalled, match=r"no data for 0\.\d+s\)"):
        await _stream(flow)
    assert _grew(before) == {"idle_timeout/ended": 1}
    await flow.aclose()


async def test_a_whole_non_streamed_body_then_silence_is_a_success() -> None:
    """The non-streamed sibling: the body reached its content-length, the engine never closes it."""
    headers = {"content-type": "application/json", "content-length": str(len(JSON_BODY))}
    flow, admission, picker = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}),
                                    _engines(set(), _forever, body=JSON_BODY, headers=headers), (A,))
    before = _counts()
    async with flow.session(_request(False), META) as session:
        body = await session.read_all()
    assert body == JSON_BODY and _grew(before) == {}
    _success_everywhere(admission, picker)
    await flow.aclose()


async def test_a_short_non_streamed_body_then_silence_is_still_a_stall() -> None:
    """The control: fewer bytes than its content-length, then silence: not whole, so ``EngineStalled``."""
    headers = {"content-type": "application/json", "content-length": str(len(JSON_BODY) + 10)}
    flow, _, _ = _flow(FAST.model_copy(update={"engine_health_probe_after_seconds": 10.0}),
                       _engines(set(), _forever, body=JSON_BODY, headers=headers), (A,))
    with pytest.raises(EngineStalled):
        async with flow.session(_request(False), META) as session:
            await session.read_all()
    await flow.aclose()


async def test_the_router_stopping_after_done_ends_the_stream_as_a_success() -> None:
    """Shutdown (``end_all``) while a whole answer waits for its close: no "shutting down" event."""
    flow, admission, picker = _flow(FAST.model_copy(update={"engine_stream_idle_timeout_seconds": 300.0,
                                                            "engine_health_probe_after_seconds": 300.0}),
                                    _engines(set(), _forever), (A,))
    got: list[bytes] = []
    done = asyncio.Event()

    async def stop() -> None:
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.05)  # the stream waits on the engine again
        assert flow.end_all() == 1

    stopper = asyncio.ensure_future(stop())
    async with flow.session(_request(True), META) as session:
        async for chunk in session.iter_events():
            got.append(chunk.raw)
            if b"[DONE]" in chunk.raw:
                done.set()
    await stopper
    assert b"".join(got) == SSE
    _success_everywhere(admission, picker)
    await flow.aclose()


@pytest.mark.parametrize(("seconds", "text"), [(0.0, "0s"), (0.004, "0.004s"), (0.23, "0.23s"), (1.0, "1s"),
                                               (11.26, "11s"), (9.94, "9.9s"), (125.4, "125s")])
def test_waits_are_printed_with_meaningful_precision(seconds: float, text: str) -> None:
    assert seconds_text(seconds) == text
