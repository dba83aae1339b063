"""The passthrough routes (``/tokenize``, ``/detokenize``, a stored response's routes) on a hung engine:
no answer past ``engine_health_probe_after_seconds`` and a failed ``/health`` probe end the wait (the
next endpoint, or 503), where a hung engine held them for ``request_timeout_seconds``; an engine whose
``/health`` answers is waited for. The waits run under the request flow's watch
(:meth:`RequestFlow.await_engine`): one probe per endpoint at a time however many wait. Engines are
``httpx.MockTransport`` answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from services.router.config import RouterConfig
from services.router.degraded import LocalPicker
from services.router.passthrough import Passthrough
from services.router.request_flow import RequestFlow
from tests.unit.router.fakes import CATALOG, A, B, FakeAdmission, FakePicker

CONFIG = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30, engine_health_probe_after_seconds=0.1,
                      engine_health_probe_timeout_seconds=0.2, engine_health_probe_interval_seconds=0.2,
                      engine_health_slow_fail_seconds=0.3)
"""A /health unanswered for 0.3 s within a wait fails the endpoint (one GET, kept running past the 0.2 s probe timeout)."""


def _stalled(reason: str, action: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_engine_stalled_total", {"reason": reason, "action": action}) or 0.0


@dataclass
class _Engines:
    """Host ``a`` answers after ``go`` is set, its /health answers only when ``health`` (after
    ``health_delay`` s; ``status``: that status at once instead); ``b`` at once."""

    health: bool = False
    go: asyncio.Event = field(default_factory=asyncio.Event)
    probes: int = 0
    health_delay: float = 0.0
    status: int | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        hung = request.url.host == "a"
        if request.url.path == "/health":
            self.probes += hung
            if hung and self.status is not None:
                return httpx.Response(self.status)
            return httpx.Response(200, content=self._health() if hung else b"")
        if hung:
            return httpx.Response(200, headers={"content-type": "application/json"}, content=self._late())
        return httpx.Response(200, json={"tokens": [1, 2], "host": request.url.host})

    async def _health(self) -> AsyncIterator[bytes]:
        if not self.health:
            await asyncio.Event().wait()
        await asyncio.sleep(self.health_delay)
        yield b""

    async def _late(self) -> AsyncIterator[bytes]:
        await self.go.wait()
        yield b'{"tokens": [1, 2], "host": "a"}'


def _passthrough(engines: _Engines, config: RouterConfig = CONFIG) -> tuple[Passthrough, RequestFlow]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    picker = LocalPicker()
    picker.note_start(B.id)  # A is the least loaded: tried first
    return Passthrough(config, http, lambda model: (A, B), picker, flow.await_engine), flow


async def test_tokenize_on_a_hung_engine_moves_to_the_next_endpoint() -> None:
    engines = _Engines(health=False)
    passthrough, flow = _passthrough(engines)
    before = _stalled("health_probe_timed_out", "redispatched")
    started = asyncio.get_running_loop().time()
    answer = await passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r1")
    assert answer.endpoint_id == B.id and answer.status_code == 200
    assert asyncio.get_running_loop().time() - started < 3.0  # 0.1 s + the 0.3 s slow span + a tick, plus a loaded host
    assert engines.probes == 1 and _stalled("health_probe_timed_out", "redispatched") == before + 1
    await flow.aclose()


async def test_a_stored_response_on_a_hung_engine_is_503() -> None:
    engines = _Engines(health=False)
    passthrough, flow = _passthrough(engines)
    before = _stalled("health_probe_timed_out", "abandoned")
    with pytest.raises(errors.NoEndpointsAvailable, match="its /health gave no answer for"):
        await passthrough.to_endpoint("GET", "/v1/responses/resp_1", "tiny", A.id, "r2")
    assert _stalled("health_probe_timed_out", "abandoned") == before + 1
    await flow.aclose()


async def test_a_slow_engine_that_answers_health_is_waited_for() -> None:
    engines = _Engines(health=True)
    passthrough, flow = _passthrough(engines)
    asyncio.get_running_loop().call_later(0.7, engines.go.set)
    answer = await passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r3")
    assert answer.endpoint_id == A.id and answer.status_code == 200
    assert engines.probes >= 2  # probed past 0.1 s, then every 0.2 s, answered each time
    await flow.aclose()


async def test_a_503_health_moves_a_tokenize_after_one_probe() -> None:
    """A refused or 5xx /health is a dead server, not a slow one: one probe suffices."""
    engines = _Engines(status=503)
    passthrough, flow = _passthrough(engines)
    answer = await passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r4")
    assert answer.endpoint_id == B.id and engines.probes == 1
    await flow.aclose()


async def test_a_late_health_answer_does_not_move_a_tokenize() -> None:
    """/health answers after 0.3 s, past the 0.2 s probe timeout but within engine_health_slow_fail_seconds
    (0.6 s here; vLLM under load answers it in 30-40 s against the 60 s default): the GET is not cancelled at
    the probe timeout, its late 200 counts as alive, and the engine answers the tokenize at 0.7 s."""
    engines = _Engines(health=True, health_delay=0.3)
    passthrough, flow = _passthrough(engines, CONFIG.model_copy(update={"engine_health_probe_interval_seconds": 1.0,
                                                                        "engine_health_slow_fail_seconds": 0.6}))
    before = _stalled("health_probe_timed_out", "redispatched")
    asyncio.get_running_loop().call_later(0.7, engines.go.set)
    answer = await passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r5")
    assert answer.endpoint_id == A.id and answer.status_code == 200
    assert engines.probes == 1 and _stalled("health_probe_timed_out", "redispatched") == before
    await flow.aclose()


async def test_many_waits_on_a_hung_engine_share_one_probe_per_interval() -> None:
    """Eight tokenize calls hang on ``a`` at once (and an inference request could too): the endpoint's
    /health is probed once at a time for all of them (the request flow's shared probe), not once per
    waiting call; every call then moves to B."""
    engines = _Engines(health=False)
    passthrough, flow = _passthrough(engines)
    picker = passthrough._picker
    calls = [passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, f"r-many-{i}")
             for i in range(8)]
    for _ in range(8):  # keep A the least loaded while the calls start (each one counts on A)
        picker.note_start(B.id)
    answers = await asyncio.gather(*calls)
    assert all(a.endpoint_id == B.id for a in answers)
    assert engines.probes == 1, engines.probes  # one GET, kept running, for the eight waits (was 16)
    await flow.aclose()


async def test_a_client_leaving_during_the_resent_attempt_counts_the_stall_once() -> None:
    """A tokenize moves off hung ``a`` (counted ``redispatched``); its client leaves while ``b`` answers: the
    stall is not counted ``abandoned`` too (the moved-on failure is no longer the last error)."""
    engines = _Engines(health=False)
    slow_b, b_asked = asyncio.Event(), asyncio.Event()

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b" and request.url.path != "/health":
            b_asked.set()

            async def late() -> AsyncIterator[bytes]:
                await slow_b.wait()
                yield b"{}"

            return httpx.Response(200, content=late())
        return engines(request)

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    flow = RequestFlow(CONFIG, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    picker = LocalPicker()
    picker.note_start(B.id)
    passthrough = Passthrough(CONFIG, http, lambda model: (A, B), picker, flow.await_engine)
    moved = _stalled("health_probe_timed_out", "redispatched")
    abandoned = _stalled("health_probe_timed_out", "abandoned")
    call = asyncio.ensure_future(passthrough.forward("/tokenize", "tiny", {"model": "tiny", "prompt": "hi"}, "r-gone"))
    await asyncio.wait_for(b_asked.wait(), 5)  # the call moved on to b, which holds it
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert _stalled("health_probe_timed_out", "redispatched") == moved + 1
    assert _stalled("health_probe_timed_out", "abandoned") == abandoned
    await flow.aclose()


async def test_a_refused_engine_is_said_in_words_not_the_http_clients_text() -> None:
    """A dead engine (nothing listens at its port): the 503 says it refused the connection, naming it, and not
    httpx's exception class or text (a fresh user found ``ClientConnectorError ... ssl:default`` in a 503)."""
    import socket

    from kvmesh.types import Endpoint, EndpointId

    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=A.model, labels={})
    async with httpx.AsyncClient() as http:
        flow = RequestFlow(CONFIG, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
        passthrough = Passthrough(CONFIG, http, lambda model: (dead,), LocalPicker(), flow.await_engine)
        for call in (passthrough.forward("/tokenize", A.model, {"model": A.model, "prompt": "hi"}, "r1"),
                     passthrough.to_endpoint("GET", "/v1/responses/resp_1", A.model, dead.id, "r2")):
            with pytest.raises(errors.NoEndpointsAvailable) as caught:
                await call
            message = str(caught.value)
            assert f"engine {dead.id} refused the connection" in message, message
            assert "ConnectError" not in message and "Errno" not in message, message
