"""A hung engine (accepts, then says nothing): ``RequestFlow``'s watch re-dispatches a request that has no
first byte, ends an answer that went silent, reacts to the endpoint leaving membership, and ends what is
left at shutdown. Engines are ``httpx.MockTransport`` answers that stall on an event; the integration
side (real processes, SIGSTOP) is ``tests/integration/test_router_hung_engine.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from services.router.config import RouterConfig
from services.router.request_flow import SHUTDOWN_MESSAGE, EngineStalled, RequestFlow, RequestMeta, ShuttingDown
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.router.fakes import CATALOG, SSE, A, B, FakeAdmission, FakePicker

META = RequestMeta(request_id="r-hung", flow_id="f", priority=0)
FAST = RouterConfig(etcd_endpoints=[], engine_first_byte_timeout_seconds=0.2, engine_stream_idle_timeout_seconds=0.3,
                    engine_departed_idle_seconds=0.1, request_timeout_seconds=30)


def _request(stream: bool) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": stream},
                            CATALOG, 1024)


def _stalled(reason: str, action: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_engine_stalled_total", {"reason": reason, "action": action}) or 0.0


def _engines(hung_host: str, events_before_stall: int | None, stall: asyncio.Event) -> Callable[[httpx.Request], httpx.Response]:
    """``hung_host`` answers 200 and then waits on ``stall`` after that many SSE events (None: answers at
    once, like every other host)."""
    pieces = [e + b"\n\n" for e in SSE.split(b"\n\n") if e]

    def answer(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for i, piece in enumerate(pieces):
                if request.url.host == hung_host and events_before_stall is not None and i == events_before_stall:
                    await stall.wait()
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return answer


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


async def test_endpoint_leaving_membership_ends_the_wait_before_any_timeout() -> None:
    slow = RouterConfig(etcd_endpoints=[], engine_first_byte_timeout_seconds=300, engine_stream_idle_timeout_seconds=300,
                        engine_departed_idle_seconds=0.1)
    flow = _flow(slow, _engines("a", 1, asyncio.Event()))
    before = _stalled("endpoint_left", "ended")
    with pytest.raises(EngineStalled, match="left the pool"):
        async with flow.session(_request(True), META) as session:
            async for _ in session.iter_events():
                await asyncio.sleep(0.15)  # the next read waits on the engine for longer than departed_idle
                assert flow.endpoints_left(["b:1"]) == 0  # another endpoint: nothing ends
                flow.endpoints_left([A.id])
    assert _stalled("endpoint_left", "ended") == before + 1
    await flow.aclose()


async def test_shutdown_ends_a_wait_on_the_engine_with_the_shutdown_message() -> None:
    flow = _flow(FAST.model_copy(update={"engine_first_byte_timeout_seconds": 300}), _engines("a", 0, asyncio.Event()))
    picker_order = (A,)
    flow._picker = FakePicker(picker_order)  # one endpoint: nothing to move to

    async def stop_soon() -> None:
        await asyncio.sleep(0.1)
        assert flow.end_all() == 1

    stopper = asyncio.ensure_future(stop_soon())
    with pytest.raises(ShuttingDown, match=SHUTDOWN_MESSAGE) as info:
        async with flow.session(_request(True), META):
            pass
    assert isinstance(info.value, errors.NoEndpointsAvailable)  # 503 + retry-after
    await stopper
    await flow.aclose()


async def test_a_client_cancel_is_not_taken_for_a_stall() -> None:
    flow = _flow(FAST.model_copy(update={"engine_first_byte_timeout_seconds": 300}), _engines("a", 0, asyncio.Event()))

    async def one() -> None:
        async with flow.session(_request(True), META):
            pass

    task = asyncio.ensure_future(one())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not flow._watches
    await flow.aclose()
