"""An engine that refuses connections (killed, its etcd lease still alive) is not a live endpoint for
``/health`` until it answers again (docs/degraded-modes.md, "an engine refuses"), and the client's
error names the engine in plain words, not the HTTP client's internals.

The real mesh is in ``tests/integration/test_refused_engine_health.py``; here the pieces: the
engine client's wording, the request flow's refused set (a request's answer or a ``/health`` 2xx
ends it) and the readiness rule over it.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from kvmesh import errors
from kvmesh.types import Endpoint
from services.router.engine_client import AiohttpEngineClient, EngineUnreachable
from services.router.readiness import ReadinessProbe
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, validate_request
from tests.unit.router.fakes import CATALOG, CONFIG, JSON_BODY, MODEL, A, B, FakeAdmission, FakePicker

META = RequestMeta(request_id="r1", flow_id="f", priority=0)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_aiohttp_refused_connect_is_named_plainly() -> None:
    client = AiohttpEngineClient(4, 2.0, 5.0)
    try:
        with pytest.raises(EngineUnreachable) as info:
            await client.post(f"http://127.0.0.1:{_closed_port()}/v1/completions", b"{}", [])
    finally:
        await client.aclose()
    assert info.value.refused and str(info.value) == "refused the connection"
    assert "ssl:default" in str(info.value.__cause__)  # the transport's own words stay in the cause (the log)


class _Engine:
    """Endpoint A refuses while ``down``; otherwise it (and B) answer requests and ``/health``."""

    def __init__(self) -> None:
        self.down = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return httpx.Response(200, content=JSON_BODY, headers={"content-type": "application/json"})


def _flow(engine: _Engine, order: tuple[Endpoint, ...] = (A,)) -> RequestFlow:
    return RequestFlow(CONFIG, lambda: CATALOG, FakeAdmission(), FakePicker(order=order),
                       httpx.AsyncClient(transport=httpx.MockTransport(engine)))


async def _complete(flow: RequestFlow) -> bytes:
    req = validate_request(RequestKind.COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": 2}, CATALOG, 1024)
    async with flow.session(req, META) as session:
        return await session.read_all()


async def test_a_refused_connect_marks_the_endpoint_and_a_health_2xx_clears_it() -> None:
    engine = _Engine()
    flow = _flow(engine)
    with pytest.raises(errors.NoEndpointsAvailable) as info:
        await _complete(flow)
    message = str(info.value)
    assert "engine a:1 at http://a:1 refused the connection" in message, message
    assert "ConnectError" not in message and "Errno" not in message
    assert flow.refused_endpoints() == {A.id: A.url}
    await flow.recheck_refused(0.5)  # still refused: kept
    assert flow.refused_endpoints() == {A.id: A.url}
    engine.down = False
    await flow.recheck_refused(0.5)  # back on its address without registering again (a sidecar kept the lease)
    assert flow.refused_endpoints() == {}
    await flow.aclose()


async def test_a_fallback_that_answers_leaves_only_the_refusing_endpoint_marked_and_an_answer_clears_it() -> None:
    engine = _Engine()
    flow = _flow(engine, (A, B))
    assert await _complete(flow) == JSON_BODY  # A refused, B answered
    assert flow.refused_endpoints() == {A.id: A.url}
    engine.down = False
    assert await _complete(flow) == JSON_BODY  # A answers a request: no longer refused
    assert flow.refused_endpoints() == {}
    with pytest.raises(errors.NoEndpointsAvailable):
        engine.down = True
        await _complete(_flow(engine))
    flow.forget_refused([A.id])  # membership changed (registered again, or left)
    assert flow.refused_endpoints() == {}
    await flow.aclose()


async def _serving(timeout_seconds: float) -> str:
    return "SERVING"


async def test_readiness_counts_refused_endpoints_out_at_once_and_rechecks_them() -> None:
    refused: list[str] = []
    registered = [2]
    rechecks: list[float] = []

    async def refresh(timeout_seconds: float) -> None:
        rechecks.append(timeout_seconds)

    now = [0.0]
    probe = ReadinessProbe({"flow_control": _serving, "epp": _serving}, lambda: registered[0] - len(refused), 0.5, 1.0,
                           lambda: now[0], unreachable_endpoints=lambda: refused, refresh=refresh)
    state = await probe.readiness()
    assert state.body() == {"status": "ok", "endpoints": 2, "dependencies": {"flow_control": "SERVING", "epp": "SERVING"}}
    assert rechecks == [0.5]

    refused.append("a:1")  # one of two refuses: served by the other, degraded
    state = await probe.readiness()  # within the cache: read at once, no new checks
    assert rechecks == [0.5] and state.ready
    body = state.body()
    assert body["status"] == "degraded" and body["degraded"] == ["endpoints"], body
    assert body["endpoints"] == 1 and body["unreachable_endpoints"] == ["a:1"]

    refused.append("b:1")  # every endpoint refuses: not ready
    state = await probe.readiness()
    assert not state.ready and state.failing == ["endpoints"]
    assert "(registered but refusing connections: a:1, b:1)" in state.body()["error"]["message"]  # type: ignore[index]

    refused.clear()  # back (a request answered, a recheck, a new registration)
    now[0] = 1.5
    state = await probe.readiness()
    assert state.ready and state.body()["status"] == "ok" and rechecks == [0.5, 0.5]
