"""A hung engine (accepts, then says nothing): ``RequestFlow``'s watch re-dispatches a request that has no
first byte, ends an answer that went silent, reacts to the endpoint leaving membership (cut only when its ``/health`` probe fails too: a draining
engine is not cut), probes the ``/health`` of an engine that keeps its lease but gives no byte past
``engine_health_probe_after_seconds`` (cut only when the probe fails: a slow engine is not), and ends what is left at shutdown. Engines are ``httpx.MockTransport`` answers that
stall on an event; the integration side (real processes, SIGSTOP) is
``tests/integration/test_router_hung_engine.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from services.router import request_flow
from services.router.config import RouterConfig
from services.router.request_flow import SHUTDOWN_MESSAGE, EngineStalled, RequestFlow, RequestMeta, ShuttingDown
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, SSE, A, B, FakeAdmission, FakePicker

META = RequestMeta(request_id="r-hung", flow_id="f", priority=0)
FAST = RouterConfig(etcd_endpoints=[], engine_first_byte_timeout_seconds=0.2, engine_stream_idle_timeout_seconds=0.3,
                    engine_departed_idle_seconds=0.1, request_timeout_seconds=30,
                    engine_health_probe_timeout_seconds=0.2, engine_health_probe_interval_seconds=0.2)
SLOW = FAST.model_copy(update={"engine_first_byte_timeout_seconds": 300, "engine_stream_idle_timeout_seconds": 300})


def _request(stream: bool) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream},
                            CATALOG, 1024)


def _stalled(reason: str, action: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_engine_stalled_total", {"reason": reason, "action": action}) or 0.0


def _engines(hung_host: str, events_before_stall: int | None, stall: asyncio.Event,
             health_hangs: bool = True) -> Callable[[httpx.Request], httpx.Response]:
    """``hung_host`` answers 200 and then waits on ``stall`` after that many SSE events (None: answers at
    once, like every other host); its ``GET /health`` never answers when ``health_hangs`` (a SIGSTOPped
    engine), else answers 200 at once (a draining engine, slow on its requests)."""
    pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            async def health() -> AsyncIterator[bytes]:
                if request.url.host == hung_host and health_hangs:
                    await asyncio.Event().wait()
                yield b""

            return httpx.Response(200, content=health())

        async def body() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                if request.url.host == hung_host and events_before_stall is not None and i == events_before_stall:
                    await stall.wait()
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return answer


async def _waiting(flow: RequestFlow, endpoint_id: str) -> request_flow._EngineWatch:
    """The watch of a request once it waits on ``endpoint_id`` (polled, bounded)."""
    async with asyncio.timeout(5):
        while True:
            for watch in list(flow._watches):
                if watch.endpoint_id == endpoint_id and watch.since is not None:
                    return watch
            await asyncio.sleep(0.005)


def _flow(config: RouterConfig, answer: Callable[[httpx.Request], httpx.Response]) -> RequestFlow:
    return RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker((A, B)),
                       httpx.AsyncClient(transport=httpx.MockTransport(answer)))


async def test_no_first_byte_moves_to_the_next_candidate() -> None:
    flow = _flow(FAST, _engines("a", 0, asyncio.Event()))
    before = _stalled("first_byte_timeout", "redispatched")
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == B.id and session.attempts == 2 and raw == SSE
    assert _stalled("first_byte_timeout", "redispatched") == before + 1
    await flow.aclose()


async def test_silent_mid_answer_ends_with_engine_stalled() -> None:
    flow = _flow(FAST, _engines("a", 1, asyncio.Event()))
    before = _stalled("idle_timeout", "ended")
    got: list[bytes] = []
    with pytest.raises(EngineStalled, match="stopped answering mid-stream"):
        async with flow.session(_request(True), META) as session:
            async for chunk in session.iter_events():
                got.append(chunk.raw)
    assert session.endpoint.id == A.id and len(got) == 1
    assert _stalled("idle_timeout", "ended") == before + 1
    await flow.aclose()


async def test_endpoint_left_and_not_answering_health_ends_a_wait_already_past_the_limit() -> None:
    """The wait is already past ``engine_departed_idle_seconds`` when membership says the endpoint left:
    the /health probe starts at once and, as it does not answer, the wait ends (long before any timeout)."""
    flow = _flow(SLOW, _engines("a", 1, asyncio.Event()))
    before = _stalled("endpoint_left", "ended")
    got: list[bytes] = []

    first_seen = asyncio.Event()

    async def leave() -> None:  # once the request waits for its second event
        await first_seen.wait()
        watch = await _waiting(flow, A.id)
        await asyncio.sleep(0.15)  # past departed_idle (0.1 s), far from the 300 s timeouts
        assert flow.endpoints_left(["b:1"]) == 0  # another endpoint: nothing waits on it
        assert flow.endpoints_left([A.id]) == 1
        assert watch.departed and flow._probes[A.id].task is not None  # probed now, not at the next tick

    leaver = asyncio.ensure_future(leave())
    with pytest.raises(EngineStalled, match="left the pool"):
        async with flow.session(_request(True), META) as session:
            async for chunk in session.iter_events():
                got.append(chunk.raw)
                first_seen.set()
    await leaver
    assert session.endpoint.id == A.id and len(got) == 1
    assert _stalled("endpoint_left", "ended") == before + 1
    await flow.aclose()


async def test_endpoint_left_before_the_wait_is_cut_once_departed_limit_and_probe_fail() -> None:
    """Left while the request waits but before the departed limit: the reaper ends the wait once past
    that limit and the probe failed; before its first byte the request moves to the next candidate."""
    flow = _flow(SLOW, _engines("a", 0, asyncio.Event()))
    assert flow.endpoints_left([A.id]) == 0  # nothing waits yet: nothing marked
    before = _stalled("endpoint_left", "redispatched")

    async def leave() -> None:
        await _waiting(flow, A.id)
        assert flow.endpoints_left([A.id]) == 1  # marked; cut by the reaper after departed_idle + a failed probe

    leaver = asyncio.ensure_future(leave())
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    await leaver
    assert session.endpoint.id == B.id and session.attempts == 2 and raw == SSE
    assert _stalled("endpoint_left", "redispatched") == before + 1
    await flow.aclose()


async def test_a_draining_engine_that_answers_health_is_not_cut() -> None:
    """An engine that deregistered (graceful drain) but still finishes a non-streamed request that takes
    far longer than engine_departed_idle_seconds: no byte until the whole answer, yet /health answers,
    so the request is not cut nor re-sent (the defect: every such request was re-run elsewhere)."""
    stall = asyncio.Event()
    flow = _flow(SLOW, _engines("a", 0, stall, health_hangs=False))
    before = {reason: _stalled(reason, action) for reason in ("endpoint_left", "first_byte_timeout")
              for action in ("redispatched", "ended")}

    async def drain() -> None:
        await _waiting(flow, A.id)
        assert flow.endpoints_left([A.id]) == 1
        await asyncio.sleep(1.0)  # 10 x departed_idle, several probes (interval 0.2 s), all answered
        assert A.id in flow._probes and flow._probes[A.id].alive is True
        stall.set()  # the answer completes

    drainer = asyncio.ensure_future(drain())
    async with flow.session(_request(False), META) as session:
        body = await session.read_all()
    await drainer
    assert session.endpoint.id == A.id and session.attempts == 1 and body == SSE
    assert {reason: _stalled(reason, action) for reason in ("endpoint_left", "first_byte_timeout")
            for action in ("redispatched", "ended")} == before
    await flow.aclose()


async def test_the_local_picker_counts_a_request_waiting_on_its_engine() -> None:
    """The degraded least-request pick sees a request from its engine's headers on (queued / in
    prefill), not only from its first byte; the count drops when the attempt is abandoned."""
    stall = asyncio.Event()
    flow = _flow(FAST, _engines("a", 0, stall))

    async def one() -> None:
        async with flow.session(_request(False), META) as session:
            await session.read_all()

    task = asyncio.ensure_future(one())
    await _waiting(flow, A.id)
    assert flow.local_picker.in_flight(A.id) == 1
    stall.set()
    await task
    assert flow.local_picker.in_flight(A.id) == 0
    # abandoned before its first byte (first_byte_timeout on A, then B): A's count drops back too
    flow = _flow(FAST, _engines("a", 0, asyncio.Event()))
    async with flow.session(_request(True), META) as session:
        assert session.endpoint.id == B.id
        assert flow.local_picker.in_flight(A.id) == 0 and flow.local_picker.in_flight(B.id) == 1
        await session.read_all()
    assert flow.local_picker.in_flight(B.id) == 0
    await flow.aclose()


def _end_during_abandon(flow: RequestFlow, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the race: while an attempt's abandoned answer closes, the reaper (here called by hand)
    ends every watch again."""
    real = request_flow._abandon

    async def racing(response: object, span: object) -> None:
        now = request_flow._now()
        for watch in list(flow._watches):
            flow._end(watch, "endpoint_left", now)
        await asyncio.sleep(0)  # the await where a second cancel would land
        await real(response, span)  # type: ignore[arg-type]

    monkeypatch.setattr(request_flow, "_abandon", racing)


async def test_a_stall_ended_again_while_abandoning_still_moves_to_the_next_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    flow = _flow(FAST, _engines("a", 0, asyncio.Event()))
    _end_during_abandon(flow, monkeypatch)
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == B.id and raw == SSE
    await flow.aclose()


async def test_a_client_cancel_ended_again_while_abandoning_is_cancelled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's cancel while waiting on the engine: the watch must not cancel the task a second time
    during the abandon (then ``uncancel()`` != 0 and the HTTP front door could not answer 499)."""
    flow = _flow(SLOW, _engines("a", 0, asyncio.Event()))
    _end_during_abandon(flow, monkeypatch)
    cancelling: list[int] = []

    async def one() -> None:
        try:
            async with flow.session(_request(True), META):
                pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            cancelling.append(task.cancelling())
            raise

    task = asyncio.ensure_future(one())
    await _waiting(flow, A.id)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelling == [1]
    assert not flow._watches
    await flow.aclose()


async def test_shutdown_ends_a_wait_on_the_engine_with_the_shutdown_message() -> None:
    flow = _flow(SLOW, _engines("a", 0, asyncio.Event()))
    picker_order = (A,)
    flow._picker = FakePicker(picker_order)  # one endpoint: nothing to move to

    async def stop_soon() -> None:
        await _waiting(flow, A.id)
        assert flow.end_all() == 1

    stopper = asyncio.ensure_future(stop_soon())
    with pytest.raises(ShuttingDown, match=SHUTDOWN_MESSAGE) as info:
        async with flow.session(_request(True), META):
            pass
    assert isinstance(info.value, errors.NoEndpointsAvailable)  # 503 + retry-after
    await stopper
    await flow.aclose()


async def test_a_client_cancel_is_not_taken_for_a_stall() -> None:
    flow = _flow(SLOW, _engines("a", 0, asyncio.Event()))

    async def one() -> None:
        async with flow.session(_request(True), META):
            pass

    task = asyncio.ensure_future(one())
    await _waiting(flow, A.id)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not flow._watches
    await flow.aclose()


# -- a hung engine whose membership lease lives on: found by its /health probe -----------------------

PROBE = SLOW.model_copy(update={"engine_health_probe_after_seconds": 0.1})
"""First-byte / idle limits at 300 s, request timeout 30 s: only the probe can end a wait in these tests."""


@dataclass
class _Engine:
    """Host ``a``: its answers (SSE pieces) wait on ``go`` before the piece number ``stall_at`` (None: no
    wait); its ``GET /health`` answers ``health`` after ``health_delay`` s (None: never answers, as a
    SIGSTOPped engine). Every other host answers at once. Counts the probes and the most that ran at once,
    and records the host of every other request (``posts``), in order."""

    stall_at: int | None = 0
    health: int | None = None
    health_delay: float = 0.0
    go: asyncio.Event = field(default_factory=asyncio.Event)
    probes: int = 0
    probing: int = 0
    most_probing: int = 0
    posts: list[str] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        hung = request.url.host == "a"
        if request.url.path == "/health":
            if not hung:
                return httpx.Response(200)
            self.probes += 1
            if self.health == REFUSED:
                raise httpx.ConnectError("connection refused", request=request)
            if self.health not in (None, 200):
                return httpx.Response(self.health or 503)
            return httpx.Response(200, content=self._probe())
        self.posts.append(request.url.host)
        pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]

        async def body() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                if hung and i == self.stall_at:
                    await self.go.wait()
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async def _probe(self) -> AsyncIterator[bytes]:
        """The /health answer's body: never (``health`` None), else after ``health_delay``."""
        self.probing += 1
        self.most_probing = max(self.most_probing, self.probing)
        try:
            if self.health is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.health_delay)
            yield b""
        finally:
            self.probing -= 1


REFUSED = -1
"""``_Engine.health``: its /health connection is refused (the server process gone)."""
TIMED_OUT = PROBE.model_copy(update={"engine_health_slow_fail_seconds": 0.6})
"""Probes that only time out fail the endpoint once they span 0.6 s (threshold 0.1 s, probe timeout 0.2 s)."""


def _probe_flow(engine: _Engine, config: RouterConfig = PROBE) -> RequestFlow:
    return RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker((A, B)),
                       httpx.AsyncClient(transport=httpx.MockTransport(engine)))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
@pytest.mark.parametrize("health", [503, REFUSED], ids=["health-503", "health-refused"])
async def test_no_byte_past_the_probe_threshold_and_a_failed_probe_moves_the_request(stream: bool, health: int) -> None:
    """The engine keeps its lease (no membership change at all) and says nothing, before its first byte;
    its /health answers 503 (vLLM's dead engine) or is refused: a fast verdict, the request moves to B at
    about the threshold (one probe), not after the 300 s first-byte or 30 s request timeout."""
    engine = _Engine(stall_at=0, health=health)
    flow = _probe_flow(engine)
    before = _stalled("health_probe_failed", "redispatched")
    started = asyncio.get_running_loop().time()
    async with flow.session(_request(stream), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    elapsed = asyncio.get_running_loop().time() - started
    assert session.endpoint.id == B.id and session.attempts == 2 and raw == SSE
    assert _stalled("health_probe_failed", "redispatched") == before + 1
    assert engine.probes == 1
    assert 0.1 <= elapsed < 3.0, elapsed  # 0.1 s threshold + one probe + a 0.05 s tick, plus a loaded host
    await flow.aclose()


@pytest.mark.parametrize("health", [503, None], ids=["health-503", "health-silent"])
async def test_silent_mid_stream_and_a_failed_probe_ends_the_answer(health: int | None) -> None:
    engine = _Engine(stall_at=1, health=health)
    flow = _probe_flow(engine, TIMED_OUT)
    reason = "health_probe_failed" if health else "health_probe_timed_out"
    before = _stalled(reason, "ended")
    got: list[bytes] = []
    why = "its /health does not answer" if health else r"its /health gave no answer for 0\.\d+s"
    with pytest.raises(EngineStalled, match=rf"stopped answering mid-stream .*{why}"):
        async with flow.session(_request(True), META) as session:
            async for chunk in session.iter_events():
                got.append(chunk.raw)
    assert session.endpoint.id == A.id and len(got) == 1
    assert _stalled(reason, "ended") == before + 1
    await flow.aclose()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
async def test_a_health_that_never_answers_ends_the_wait_after_the_slow_span_and_resends(stream: bool) -> None:
    """A SIGSTOP-like engine (accepts, never answers, /health included) with its lease alive: the wait is
    ended once its /health has gone unanswered for engine_health_slow_fail_seconds (0.6 s) within the
    wait (not at the 0.2 s probe timeout), and the request, of which the client saw nothing, is re-sent
    to B (the cut closes A's connection either way): counted ``health_probe_timed_out`` /
    ``redispatched`` and a retry. One /health GET, never cancelled nor re-queued behind it."""
    engine = _Engine(stall_at=0, health=None)
    flow = _probe_flow(engine, TIMED_OUT)
    before = _stalled("health_probe_timed_out", "redispatched")
    abandoned = _stalled("health_probe_timed_out", "abandoned")
    retries = REGISTRY.get_sample_value("kvmesh_router_upstream_retries_total") or 0.0
    started = asyncio.get_running_loop().time()
    async with flow.session(_request(stream), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    elapsed = asyncio.get_running_loop().time() - started
    assert session.endpoint.id == B.id and session.attempts == 2 and raw == SSE
    assert engine.posts == ["a", "b"]
    assert _stalled("health_probe_timed_out", "redispatched") == before + 1
    assert _stalled("health_probe_timed_out", "abandoned") == abandoned
    assert (REGISTRY.get_sample_value("kvmesh_router_upstream_retries_total") or 0.0) == retries + 1
    assert engine.probes == 1 and engine.most_probing == 1  # the one GET kept running, no second behind it
    assert 0.1 + 0.6 <= elapsed < 4.0, elapsed
    await flow.aclose()


async def test_one_health_get_at_a_time_and_a_late_answer_counts_as_alive() -> None:
    """The reviewer's repro (/tmp/v11/test_slow_health_cut.py): an alive engine whose /health always
    answers 200 after 0.4 s (over the 0.2 s probe timeout, under engine_health_slow_fail_seconds 0.6 s; as
    vLLM's answers in 30-40 s against the 60 s default) and whose non-streamed request sends nothing for
    2 s. Each GET runs to its late 2xx (never cancelled at the probe timeout and re-queued: that run of
    timeouts would never end), which counts as alive: the request is not cut, the engine answers it, and
    no two GETs to the endpoint run at once."""
    engine = _Engine(stall_at=0, health=200, health_delay=0.4)
    flow = _probe_flow(engine, TIMED_OUT)
    before = _no_stall()
    asyncio.get_running_loop().call_later(2.0, engine.go.set)
    async with flow.session(_request(False), META) as session:
        raw = await session.read_all()
    assert session.endpoint.id == A.id and session.attempts == 1 and raw == SSE and engine.posts == ["a"]
    assert engine.probes >= 2 and engine.most_probing == 1 and _no_stall() == before
    await flow.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
async def test_a_busy_engine_whose_health_is_slower_than_the_timeout_is_not_cut(stream: bool) -> None:
    """The reviewer's repro (/tmp/v10/slow_health_cut.py): a busy, alive engine whose /health answers in
    0.5 s, past the 0.2 s probe timeout, and whose only request sends nothing for 2 s (a whole non-streamed
    generation; a stream's queue and prefill): probes time out again and again, but for less than
    engine_health_slow_fail_seconds (the default, 60 s): the request is not cut, the engine gets it once."""
    config = PROBE.model_copy(update={"engine_health_probe_after_seconds": 0.3})
    engine = _Engine(stall_at=0, health=200, health_delay=0.5)
    flow = _probe_flow(engine, config)
    before = _no_stall()
    asyncio.get_running_loop().call_later(2.0, engine.go.set)
    async with flow.session(_request(stream), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == A.id and session.attempts == 1 and raw == SSE and engine.posts == ["a"]
    assert engine.probes >= 2 and _no_stall() == before
    await flow.aclose()


@pytest.mark.parametrize("stall_at", [0, 1], ids=["before-first-byte", "mid-stream"])
async def test_a_slow_engine_that_answers_health_is_not_cut_and_is_probed_once_at_a_time(stall_at: int) -> None:
    """A long queue or prefill (no first byte), or a long gap mid-answer, on an engine whose /health
    answers (slowly: 0.1 s, half the probe timeout): three requests wait 1 s, 10 x the threshold; none
    is cut or moved, the probes run one at a time for the endpoint (not one per request) and again
    every engine_health_probe_interval_seconds (0.2 s) while the requests wait."""
    engine = _Engine(stall_at=stall_at, health=200, health_delay=0.1)
    flow = _probe_flow(engine)
    before = {(r, a): _stalled(r, a) for r in request_flow.STALL_REASONS for a in ("redispatched", "ended")}

    async def one(stream: bool) -> tuple[str, int, bytes]:
        async with flow.session(_request(stream), META) as session:
            raw = b"".join([c.raw async for c in session.iter_events()])
        return session.endpoint.id, session.attempts, raw

    tasks = [asyncio.ensure_future(one(stream)) for stream in (True, True, False)]
    await asyncio.sleep(1.0)
    engine.go.set()
    results = await asyncio.gather(*tasks)
    assert results == [(A.id, 1, SSE)] * 3
    assert engine.most_probing == 1 and 2 <= engine.probes <= 8, (engine.probes, engine.most_probing)
    assert {(r, a): _stalled(r, a) for r in request_flow.STALL_REASONS for a in ("redispatched", "ended")} == before
    await flow.aclose()


async def test_an_engine_that_answers_before_the_threshold_is_never_probed() -> None:
    engine = _Engine(stall_at=None, health=None)
    flow = _probe_flow(engine, SLOW)  # the default threshold (10 s)
    for stream in (True, False):
        async with flow.session(_request(stream), META) as session:
            assert b"".join([c.raw async for c in session.iter_events()]) == SSE
    assert engine.probes == 0 and not flow._probes
    await flow.aclose()


async def test_a_wait_that_began_after_a_failed_probe_is_probed_again() -> None:
    """The engine hung (probe failed: the request moved to B), then came back: a later request that waits
    on it past the threshold gets a probe of its own, which answers, so it is not cut by the old verdict."""
    engine = _Engine(stall_at=0, health=503)
    flow = _probe_flow(engine)
    async with flow.session(_request(True), META) as session:
        assert session.endpoint.id == B.id
        await session.read_all()
    assert engine.probes == 1  # a 503 fails at once
    engine.health = 200
    engine.go = asyncio.Event()

    async def release() -> None:
        await asyncio.sleep(0.6)
        engine.go.set()

    releaser = asyncio.ensure_future(release())
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    await releaser
    assert session.endpoint.id == A.id and session.attempts == 1 and raw == SSE
    assert engine.probes >= 2
    await flow.aclose()


# -- a live engine whose /health is slow (vLLM under high load: vllm-project/vllm PR #38157) is not cut -----

SLOW_HEALTH = SLOW.model_copy(update={"engine_health_probe_after_seconds": 0.2, "engine_health_probe_timeout_seconds": 0.2,
                                      "engine_health_probe_interval_seconds": 1.0})


def _prompted(prompt: str) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True},
                            CATALOG, 1024)


def _no_stall() -> dict[tuple[str, str], float]:
    return {(r, a): _stalled(r, a) for r in request_flow.STALL_REASONS for a in ("redispatched", "ended", "abandoned")}


async def test_a_single_slow_probe_does_not_cut_a_live_stream() -> None:
    """The reviewer's case: the engine sends one event, pauses 0.8 s alive, then finishes; its /health answers
    200 after 0.3 s, past the 0.2 s probe timeout. One slow probe is not a failure (the next is due an interval,
    1 s, later, and the stream went on before it): the client gets the whole answer, nothing is counted."""
    engine = _Engine(stall_at=1, health=200, health_delay=0.3)
    flow = _probe_flow(engine, SLOW_HEALTH)
    before = _no_stall()
    asyncio.get_running_loop().call_later(0.8, engine.go.set)
    async with flow.session(_request(True), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == A.id and session.attempts == 1 and raw == SSE
    assert engine.probes == 1 and _no_stall() == before
    await flow.aclose()


@pytest.mark.parametrize("health_delay", [0.3, None], ids=["health-slow", "health-silent"])
async def test_a_silent_request_is_not_cut_while_another_to_its_engine_streams(health_delay: float | None) -> None:
    """Engine ``a`` holds one request silent for 1 s (queued behind a long prefill, or preempted) while it
    streams another one (an event every 50 ms); its /health never answers in time (slow, or not at all).
    Bytes to any request prove the endpoint alive: neither request is cut, whatever the probes say."""
    config = SLOW_HEALTH.model_copy(update={"engine_health_probe_interval_seconds": 0.2})
    go = asyncio.Event()
    probes = 0
    pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]
    event = pieces[0]

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal probes
        if request.url.path == "/health":
            async def health() -> AsyncIterator[bytes]:
                await asyncio.sleep(health_delay) if health_delay is not None else await asyncio.Event().wait()
                yield b""

            probes += request.url.host == "a"
            return httpx.Response(200, content=health())

        async def body() -> AsyncIterator[bytes]:
            if b"drip" in request.content:
                for _ in range(25):
                    yield event
                    await asyncio.sleep(0.05)
                yield pieces[1]
                yield pieces[2]
                return
            yield pieces[0]
            await go.wait()
            yield pieces[1]
            yield pieces[2]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    flow = _flow(config, answer)
    before = _no_stall()

    async def one(prompt: str) -> tuple[str, int, bytes]:
        async with flow.session(_prompted(prompt), META) as session:
            raw = b"".join([c.raw async for c in session.iter_events()])
        return session.endpoint.id, session.attempts, raw

    silent = asyncio.ensure_future(one("hi"))
    drip = asyncio.ensure_future(one("drip"))
    await asyncio.sleep(1.0)
    go.set()
    (silent_at, silent_tries, silent_raw), (drip_at, drip_tries, _) = await asyncio.gather(silent, drip)
    assert (silent_at, silent_tries, silent_raw) == (A.id, 1, SSE) and (drip_at, drip_tries) == (A.id, 1)
    # probed past the threshold (again and again when /health answers late; a silent one is one GET kept
    # running, never a second behind it), never cut
    assert probes >= (2 if health_delay is not None else 1) and _no_stall() == before
    await flow.aclose()


async def test_silent_probes_spanning_the_slow_limit_end_every_silent_request_on_the_engine() -> None:
    """The hung case still ends: two requests on ``a``, both silent, its /health silent: one GET for the
    endpoint (not one per request, never a second behind it), and once it has gone unanswered for
    engine_health_slow_fail_seconds (0.5 s) within the waits both end and are re-sent to ``b``, within the
    threshold + that span + a tick, plus a loaded host."""
    config = SLOW_HEALTH.model_copy(update={"engine_health_probe_interval_seconds": 0.2,
                                            "engine_health_slow_fail_seconds": 0.5})
    engine = _Engine(stall_at=0, health=None)
    flow = _probe_flow(engine, config)
    before = _stalled("health_probe_timed_out", "redispatched")
    started = asyncio.get_running_loop().time()

    async def one() -> tuple[str, bytes]:
        async with flow.session(_request(True), META) as session:
            return session.endpoint.id, await session.read_all()

    results = await asyncio.gather(one(), one())
    elapsed = asyncio.get_running_loop().time() - started
    assert results == [(B.id, b""), (B.id, b"")], results
    assert engine.most_probing == 1 and engine.probes <= 2, engine.probes
    assert _stalled("health_probe_timed_out", "redispatched") == before + 2
    assert 0.6 <= elapsed < 3.0, elapsed
    await flow.aclose()


async def test_a_departed_endpoint_with_silent_probes_is_still_a_fast_verdict() -> None:
    """Leaving membership is the second signal: once the endpoint left, two silent probes an interval apart
    fail it (``endpoint_left``) and the request is re-sent to B, long before engine_health_slow_fail_seconds."""
    engine = _Engine(stall_at=0, health=None)
    flow = _probe_flow(engine, PROBE)  # slow limit: the default 60 s
    before = _stalled("endpoint_left", "redispatched")

    async def leave() -> None:
        await asyncio.sleep(0.05)
        flow.endpoints_left([A.id])

    leaving = asyncio.ensure_future(leave())
    started = asyncio.get_running_loop().time()
    async with flow.session(_request(False), META) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    await leaving
    assert session.endpoint.id == B.id and raw == SSE
    assert _stalled("endpoint_left", "redispatched") == before + 1
    assert asyncio.get_running_loop().time() - started < 5.0
    await flow.aclose()


async def test_engine_health_says_alive_while_a_request_to_the_endpoint_receives_bytes() -> None:
    """The passthrough routes' probe (:meth:`RequestFlow.engine_health`): a silent /health is ``slow``, a 503
    is ``dead``, but while a request bound to the endpoint through the flow receives bytes it is ``alive``."""
    health_status: list[int | None] = [None]
    pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            async def never() -> AsyncIterator[bytes]:
                await asyncio.Event().wait()
                yield b""

            status = health_status[0]
            return httpx.Response(200, content=never()) if status is None else httpx.Response(status)

        async def body() -> AsyncIterator[bytes]:
            for _ in range(20):
                yield pieces[0]
                await asyncio.sleep(0.05)
            yield pieces[1]
            yield pieces[2]

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    flow = _flow(SLOW_HEALTH, answer)
    assert await flow.engine_health(A) == "slow"
    health_status[0] = 503
    assert await flow.engine_health(A) == "dead"
    health_status[0] = None

    async def stream() -> None:
        async with flow.session(_request(True), META) as session:
            await session.read_all()

    streaming = asyncio.ensure_future(stream())
    await _waiting(flow, A.id)
    assert await flow.engine_health(A) == "alive"
    await streaming
    await flow.aclose()


def _never() -> httpx.Response:
    """A ``/health`` answer whose body never comes (a SIGSTOPped or saturated API server)."""
    async def never() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    return httpx.Response(200, content=never())


SLOW_FAIL = TIMED_OUT.model_copy(update={"engine_health_slow_fail_seconds": 1.5})
"""Probes that only time out fail the endpoint once they span 1.5 s within a wait: the slow-run tests'
silences (0.35-0.5 s) stay a second short of it, so a stalled event loop on a loaded box cannot cut them."""


async def test_an_old_slow_run_does_not_cut_a_later_wait() -> None:
    """The reviewer's repro (/tmp/v11/test_slow_run_spans_gap.py): /health never answers; request H stays
    bound to A (the endpoint's probe state kept); request X waits silent and its client leaves at 0.4 s
    (one unanswered GET, sent at about 0.1 s and kept running up to engine_health_slow_fail_seconds (1.5 s) +
    the probe timeout); 1.8 s later, at about 2.2 s, request Y is silent for 0.5 s and then answered. By
    then the old run, begun at 0.1 s, spans more than 1.5 s: counted, it would cut Y at Y's threshold.
    It says nothing of Y's wait (nobody probed in between, and a run is measured within the wait): Y may
    only be cut after 1.5 s of its own, a second after its answer, so it is answered. X and Y send no
    byte at all while silent (not even headers: a byte heard from the endpoint would end the run itself)."""
    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return _never()
        prompt = request.content
        if b'"x"' in prompt:
            await asyncio.Event().wait()
        if b'"y"' in prompt:
            await asyncio.sleep(0.5)  # y: answered whole after 0.5 s of silence

        async def body() -> AsyncIterator[bytes]:
            if b'"hold"' in prompt:
                yield SSE.split(b"\n\n")[0] + b"\n\n"
                await asyncio.Event().wait()
            yield SSE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    flow = RequestFlow(SLOW_FAIL, lambda: CATALOG, FakeAdmission(), FakePicker((A,)),
                       httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    before = _no_stall()
    hold = flow.session(_prompted("hold"), RequestMeta("h", "f", 0))
    await hold.__aenter__()  # bound to A, its first byte received, not read further

    async def x() -> None:
        async with flow.session(_prompted("x"), RequestMeta("x", "f", 0)):
            pass

    xt = asyncio.ensure_future(x())
    await asyncio.sleep(0.4)
    xt.cancel()  # X's client leaves after one unanswered GET
    await asyncio.gather(xt, return_exceptions=True)
    await asyncio.sleep(1.8)
    async with flow.session(_prompted("y"), RequestMeta("y", "f", 0)) as session:
        raw = b"".join([c.raw async for c in session.iter_events()])
    assert session.endpoint.id == A.id and session.attempts == 1 and raw == SSE
    assert _no_stall() == before
    await hold.__aexit__(None, None, None)
    await flow.aclose()


async def test_bytes_between_probes_end_the_slow_run() -> None:
    """The sibling (/tmp/v11/test_slow_run_spans_bytes.py): /health never answers while the engine answers
    every request after 0.35 s of silence, a new one every 0.3 s (so the endpoint's probe state stays
    bound): each answer is a byte heard from the endpoint, which ends the run, so no request is cut,
    though the unanswered /health spans 2.7 s, far more than engine_health_slow_fail_seconds (1.5 s); so
    is request L, silent 2.2 s from the start: a run not ended by those bytes would span its wait past
    1.5 s (cut at about 1.6 s), but each byte starts a new one, so its runs last about 0.3 s."""
    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return _never()
        # vLLM non-streamed: headers and body only once generated
        await asyncio.sleep(2.2 if b'"long"' in request.content else 0.35)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=SSE)

    flow = RequestFlow(SLOW_FAIL, lambda: CATALOG, FakeAdmission(), FakePicker((A,)),
                       httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    before = _no_stall()

    async def one(i: int, request: RouterRequest) -> tuple[str, bytes]:
        async with flow.session(request, RequestMeta(f"r{i}", "f", 0)) as session:
            return session.endpoint.id, await session.read_all()

    long = validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": "long", "max_tokens": 2}, CATALOG, 1024)
    tasks = [asyncio.ensure_future(one(-1, long))]
    for i in range(8):
        tasks.append(asyncio.ensure_future(one(i, _request(False))))
        await asyncio.sleep(0.3)
    assert await asyncio.gather(*tasks) == [(A.id, SSE)] * 9
    assert _no_stall() == before
    await flow.aclose()
