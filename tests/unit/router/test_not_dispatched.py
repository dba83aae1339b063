"""Every pick the router asked epp for and did not dispatch is reported ``NOT_DISPATCHED`` (epp then drops
its load), where before the pick's active prompt tokens stayed counted for up to 600 s: admission refused
the request after its early pick, every attempt failed before a first byte, the client left before the
first byte. The router's ``PickerClient`` against the real epp servicer and scheduler on a real gRPC
server (loopback); engines are ``httpx.MockTransport`` answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh import errors
from services.epp.datastore import ScrapeSample
from services.epp.servicer import EndpointPickerServicer
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, RouterRequest, validate_request
from tests.unit.epp._support import real_scheduler
from tests.unit.router.fakes import CATALOG, SSE, A, B, FakeAdmission
from tests.unit.router.test_pick_many import _client, _Index, _serve, _until

PROMPT = list(range(1, 41))  # 40 prompt tokens, counted active on the picked endpoint until the completion
CONFIG = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30)


def _completions(result: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_epp_completions_total", {"result": result}) or 0.0


class _Epp:
    """A real epp (precise-prefix profile: it reads the prompt) serving ``A`` and ``B``, and a router
    ``RequestFlow`` whose picker is the real ``PickerClient`` to it."""

    def __init__(self, engine: Callable[[httpx.Request], httpx.Response], admission: FakeAdmission) -> None:
        self.scheduler, self.datastore = real_scheduler((A, B), _Index(), ScrapeSample(0, 0, 0.0, 16, 0, 0))
        self.engine, self.admission = engine, admission

    async def __aenter__(self) -> _Epp:
        self.server, port = await _serve(EndpointPickerServicer(self.scheduler))
        self.client = await _client(port)
        self.flow = RequestFlow(CONFIG, lambda: CATALOG, self.admission, self.client,
                                httpx.AsyncClient(transport=httpx.MockTransport(self.engine)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.flow.aclose()
        await self.client.close()
        await self.server.stop(0)

    def active(self) -> dict[str, int]:
        return {c.id: c.metrics.active_prompt_tokens for c in self.datastore.candidates(A.model)}

    def pending(self) -> int:
        return sum(c.metrics.pending_picks for c in self.datastore.candidates(A.model))

    def freed(self) -> bool:
        return not any(self.active().values()) and self.pending() == 0 and not self.datastore._in_flight


def _request(stream: bool = False) -> RouterRequest:
    return validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": stream},
                            CATALOG, 1024)


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE)


def _refusing(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def test_a_dispatched_request_frees_its_pick_as_before() -> None:
    """The baseline: a request an engine answered is reported with its own outcome and frees its pick."""
    async with _Epp(_answering, FakeAdmission()) as epp:
        async with epp.flow.session(_request(True), RequestMeta("r-ok", "f", 0)) as session:
            seen = epp.active()
            await session.read_all()
        assert seen[session.endpoint.id] == len(PROMPT)  # counted while it ran
        await _until(epp.freed)


@pytest.mark.parametrize("rejection", [errors.QueueFull("queue full"), errors.Shed("shed"),
                                       errors.RateLimited("rate limited")], ids=["queue-full", "shed", "rate-limited"])
async def test_admission_rejecting_after_the_early_pick_frees_the_pick(rejection: errors.KvmeshError) -> None:
    """The early pick runs beside admission and lands (epp counts 40 active tokens), then admission refuses
    the request: epp is told NOT_DISPATCHED and the tokens are freed at once, not after 600 s."""
    admission = FakeAdmission(reject=rejection, delay=0.3)
    async with _Epp(_answering, admission) as epp:
        matched = _completions("matched")
        task = asyncio.ensure_future(epp.flow.session(_request(), RequestMeta("r-refused", "f", 0)).__aenter__())
        await _until(lambda: any(epp.active().values()))  # the early pick was noted while admission decides
        with pytest.raises(type(rejection)):
            await task
        await _until(epp.freed)
        assert _completions("matched") == matched + 1


async def test_every_attempt_failing_frees_the_pick() -> None:
    """Both engines refuse the connection: the client gets 503 and epp is told the pick was not dispatched."""
    async with _Epp(_refusing, FakeAdmission()) as epp:
        matched = _completions("matched")
        with pytest.raises(errors.NoEndpointsAvailable):
            async with epp.flow.session(_request(), RequestMeta("r-refused-all", "f", 0)):
                pass
        await _until(epp.freed)
        assert _completions("matched") == matched + 1


async def test_the_client_leaving_before_the_first_byte_frees_the_pick() -> None:
    """The engine holds the request silent (queued), the client goes away: the engine request is cancelled
    and epp is told, so the tokens no longer count on that endpoint."""
    go = asyncio.Event()

    def silent(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            await go.wait()
            yield SSE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async with _Epp(silent, FakeAdmission()) as epp:
        async def client() -> None:
            async with epp.flow.session(_request(True), RequestMeta("r-gone", "f", 0)) as session:
                await session.read_all()

        task = asyncio.ensure_future(client())
        await _until(lambda: any(epp.active().values()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(epp.freed)
