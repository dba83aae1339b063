"""An engine that stops answering without dying, a client that stops sending, and the router stopping
mid-stream: real router, flow_control and simulator processes, real etcd (docs/degraded-modes.md,
"an engine hung").

The hung engine is either the real simulator paused with SIGSTOP (its membership lease then
expires and it leaves the pool) or an in-test OpenAI-wire engine that goes silent while its lease
is kept alive (a hung engine whose registration lives on, as vLLM behind the registration sidecar:
the router's ``/health`` probe past ``engine_health_probe_after_seconds`` or its timeouts tell).
epp is an in-test grpc.aio picker (``FakeEpp``) so each case chooses the target and the fallback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.http_server import HttpServer
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module
from tests.integration.test_router import FakeEpp, _start, serve_fake_epp
from tests.support import serve_registered, stop_registered, wait_until_async

MODEL = "hung"
FIRST_BYTE_S, IDLE_S, DEPARTED_S, PROBE_AFTER_S, BODY_S, HEADER_S, GRACE_S = 9, 10, 1, 1, 2, 2, 2
PROBE_TIMEOUT_S = PROBE_INTERVAL_S = 0.5
SLOW_FAIL_S = 5.0
"""A ``/health`` unanswered this long within a wait fails an endpoint whose lease lives (default 60 s), at
PROBE_AFTER_S + this (6 s) after a SIGSTOP: well after the SIGSTOPped simulator leaves membership (lease TTL
2 s + the router's 2 s departure grace: 3.3-4.5 s, more on a loaded 2-core box), when its unanswered
/health fails it at once (``endpoint_left``). FIRST_BYTE_S (9 s) and IDLE_S (10 s) stay above
PROBE_AFTER_S + this (plus ticks and load), so a wait on an engine hung with its lease alive ends on the
probes' verdict, not on the first-byte or idle limit."""
ROUTER_FLAGS = ("--engine-health-probe-timeout-seconds", str(PROBE_TIMEOUT_S), "--engine-health-probe-interval-seconds",
                str(PROBE_INTERVAL_S), "--engine-health-slow-fail-seconds", str(SLOW_FAIL_S),
                "--engine-first-byte-timeout-seconds", str(FIRST_BYTE_S), "--engine-stream-idle-timeout-seconds",
                str(IDLE_S), "--engine-departed-idle-seconds", str(DEPARTED_S), "--engine-health-probe-after-seconds",
                str(PROBE_AFTER_S), "--request-body-timeout-seconds", str(BODY_S), "--request-header-timeout-seconds",
                str(HEADER_S), "--shutdown-http-grace-seconds", str(GRACE_S))


@dataclass
class ScriptedEngine:
    """An OpenAI-wire engine of ``MODEL``: streams ``tok0 tok1 ...`` every ``delay`` s; after
    ``stall_after`` events (0: before any byte; a non-streamed answer never comes) it goes silent,
    its etcd lease still kept alive. Its ``GET /health`` answers 200 (a wedged engine core behind a
    live API server, or one merely slow) unless ``health_hangs`` (the whole process hung)."""

    stall_after: int | None = None
    delay: float = 0.05
    plain_delay: float = 0.0
    """Seconds a non-streamed answer takes (a long generation: no byte until it is done)."""
    health_hangs: bool = False
    health_delay: float = 0.0
    """Seconds its ``GET /health`` takes to answer 200 (vLLM under high load: 30-40 s, vllm-project/vllm PR #38157)."""
    hang_after_done: bool = False
    """Silent once the whole answer is sent (``[DONE]``, or a non-streamed body of its content-length),
    the body never closed: a pause, a GC or SIGSTOP after the last write."""
    health_checks: int = 0
    server: HttpServer | None = None
    registration: LeaseRegistration | None = None
    endpoint: Endpoint | None = None
    served: int = 0
    stalled: int = 0
    _forever: asyncio.Event = field(default_factory=asyncio.Event)

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        n = int(body.get("max_tokens") or 8)
        stall = self.stall_after
        if not body.get("stream"):
            if stall is not None:
                self.stalled += 1
                await self._forever.wait()
            await asyncio.sleep(self.plain_delay)
            self.served += 1
            answer = {"id": "cmpl-s", "object": "text_completion", "model": MODEL, "choices": [
                {"index": 0, "text": "ok", "finish_reason": "length"}]}
            return _UnclosedJSON(answer, self._forever) if self.hang_after_done else JSONResponse(answer)

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                if stall is not None and i == stall:
                    self.stalled += 1
                    await self._forever.wait()
                await asyncio.sleep(self.delay)
                yield f"data: {json.dumps({'id': 'cmpl-s', 'choices': [{'index': 0, 'text': f'tok{i} '}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            self.served += 1
            if self.hang_after_done:
                await self._forever.wait()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _health(self, request: Request) -> Response:
        self.health_checks += 1
        if self.health_hangs:
            await self._forever.wait()
        await asyncio.sleep(self.health_delay)
        return Response(status_code=200)

    async def start(self, etcd: str) -> ScriptedEngine:
        app = Starlette(routes=[Route("/v1/completions", self._handle, methods=["POST"]),
                                Route("/health", self._health)])
        self.server, self.endpoint, self.registration = await serve_registered(
            app, etcd, MODEL, {"engine": "test", "max_model_len": "4096"})
        return self

    async def stop(self) -> None:
        await stop_registered(self.server, self.registration)


class _UnclosedJSON(JSONResponse):
    """A JSON answer sent whole (its content-length) and then never ended (``more_body`` stays True).
    ``connection: close``: the router's pool must not send the next request on a connection whose
    handler never finishes (uvicorn would hold that request behind it, a hang of its own)."""

    def __init__(self, content: object, forever: asyncio.Event) -> None:
        super().__init__(content, headers={"connection": "close"})
        self._forever_event = forever

    async def __call__(self, scope: object, receive: object, send: Callable[[dict], Awaitable[None]]) -> None:  # type: ignore[override]
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await self._forever_event.wait()


@dataclass
class HungMesh:
    http: str
    grpc_address: str
    metrics: str
    epp: FakeEpp
    epp_address: str
    flow_control: str
    sim: ManagedProcess
    sim_endpoint: Endpoint
    good: ScriptedEngine
    silent: ScriptedEngine
    router: ManagedProcess


@pytest.fixture(scope="module")
async def hung(etcd: str, run_dir: Path) -> AsyncIterator[HungMesh]:
    epp = FakeEpp()
    epp_server, epp_port = await serve_fake_epp(epp)
    good, silent = await ScriptedEngine().start(etcd), await ScriptedEngine().start(etcd)
    port = free_port()
    sim = ManagedProcess("engine", python_module(
        "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--events-endpoint", "",
        "--etcd-endpoints", etcd, "--lease-ttl-seconds", "2", "--max-model-len", "4096", "--time-scale", "0.2"),
        run_dir / f"hung-sim-{port}.log").start()
    procs: list[ManagedProcess] = [sim]
    try:
        fc_proc, fc_addr = _start("flow_control", run_dir, etcd, "--max-in-flight", "16", "--max-queue-size", "100")
        procs.append(fc_proc)
        http_port, metrics_port = free_port(), free_port()
        router, router_addr = _start("router", run_dir, etcd, "--http-port", str(http_port), "--flow-control-address",
                                     fc_addr, "--epp-address", f"127.0.0.1:{epp_port}", *ROUTER_FLAGS,
                                     metrics_port=metrics_port)
        procs.append(router)
        sim_ep = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=MODEL)
        mesh = HungMesh(f"http://127.0.0.1:{http_port}", router_addr, f"http://127.0.0.1:{metrics_port}", epp,
                        f"127.0.0.1:{epp_port}", fc_addr, sim, sim_ep, good, silent, router)
        await _all_listed(mesh)
        yield mesh
    finally:
        if sim.alive():
            os.killpg(sim.pid, signal.SIGCONT)
        for proc in reversed(procs):
            proc.stop()
        await good.stop()
        await silent.stop()
        await epp_server.stop(0)


async def _all_listed(mesh: HungMesh, timeout: float = 60) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        async def listed() -> bool:
            try:
                data = (await client.get(f"{mesh.http}/v1/models")).json()["data"]
            except httpx.HTTPError:
                return False
            return any(m["id"] == MODEL and m["endpoints"] == 3 for m in data)

        await wait_until_async(listed, timeout, "router to list the simulator and both scripted engines", interval=0.1)


@pytest.fixture(autouse=True)
def _reset(hung: HungMesh) -> None:
    hung.good.stall_after = None
    hung.good.delay = hung.silent.delay = 0.05
    hung.silent.stall_after = 0
    hung.silent.plain_delay = 0.0
    hung.silent.health_hangs = False
    hung.silent.health_delay = 0.0
    hung.good.hang_after_done = hung.silent.hang_after_done = False
    assert hung.good.endpoint is not None
    hung.epp.order = [hung.good.endpoint]


def _stalled(metrics_url: str) -> dict[tuple[str, str], float]:
    """``kvmesh_router_engine_stalled_total`` by (reason, action)."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{metrics_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("kvmesh_router_engine_stalled_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["reason"].strip('"'), labels["action"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def _samples(metrics_url: str, name: str) -> dict[str, float]:
    """One metric's samples, by their label text (``""`` for an unlabelled one)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{metrics_url}/metrics", timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels = line[line.index("{") + 1:line.index("}")] if "{" in line else ""
            out[labels] = float(line.rsplit(" ", 1)[1])
    return out


def _grew(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], key: tuple[str, str]) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    async with client.stream("POST", url, json=body) as reply:
        raw = b"".join([chunk async for chunk in reply.aiter_bytes()])
        return reply.status_code, dict(reply.headers), raw


async def test_paused_engine_requests_move_to_another_endpoint(hung: HungMesh) -> None:
    """The issue's repro: SIGSTOP an engine, 4 concurrent completions (2 streamed) picked for it: every one
    is answered by the other endpoint, once its /health probe (past engine_health_probe_after_seconds, or
    past engine_departed_idle_seconds once its lease expired) gives no answer: well before the first-byte
    timeout, and the non-streamed ones (silent for a whole generation legitimately) as soon."""
    assert hung.good.endpoint is not None
    hung.epp.order = [hung.sim_endpoint, hung.good.endpoint]
    before = _stalled(hung.metrics)
    served_before = hung.good.served
    os.killpg(hung.sim.pid, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(timeout=40) as client:
            url = f"{hung.http}/v1/completions"
            started = time.monotonic()
            streamed = [_stream(client, url, {"model": MODEL, "prompt": f"s{i}", "max_tokens": 4, "stream": True})
                        for i in range(2)]
            plain = [client.post(url, json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 4}) for i in range(2)]
            results = await asyncio.gather(*streamed, *plain)
            elapsed = time.monotonic() - started
        for status, headers, raw in results[:2]:
            assert status == 200 and headers["x-kvmesh-endpoint"] == hung.good.endpoint.id, raw[-300:]
            assert _events(raw)[-1] == "data: [DONE]" and b'"error"' not in raw
        for reply in results[2:]:
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-endpoint"] == hung.good.endpoint.id
        assert hung.good.served - served_before == 4
        assert elapsed < FIRST_BYTE_S + 6, elapsed
        after = _stalled(hung.metrics)
        # The lease (TTL 2 s) expires 1.3-2.5 s after the stop, the router drops it 2 s later: its /health
        # unanswered (a SIGSTOPped process still accepts TCP connects), the endpoint is failed once it left
        # (endpoint_left), before the unanswered /health alone spans SLOW_FAIL_S (5 s; on a box too loaded
        # for that, health_probe_timed_out, which re-sends as well). Every request moved, none ended.
        moved = {reason: _grew(before, after, (reason, "redispatched"))
                 for reason in ("first_byte_timeout", "endpoint_left", "health_probe_failed", "health_probe_timed_out")}
        assert sum(moved.values()) == 4 and moved["first_byte_timeout"] <= 2, after
        assert sum(after.values()) - sum(before.values()) == 4, after  # nothing abandoned or ended
    finally:
        os.killpg(hung.sim.pid, signal.SIGCONT)
    await _all_listed(hung)  # the simulator re-establishes its lease


async def test_draining_engine_that_deregistered_is_not_cut(hung: HungMesh, etcd: str) -> None:
    """Graceful drain: the engine leaves membership (its lease revoked, as the simulator does on SIGTERM)
    but still finishes a non-streamed request that takes far longer than engine_departed_idle_seconds
    (no byte until the whole answer is done). Its /health answers, so the request is not cut nor re-run
    elsewhere: it is answered by the draining engine itself."""
    silent = hung.silent
    assert silent.endpoint is not None and silent.registration is not None
    silent.stall_after, silent.plain_delay = None, DEPARTED_S + 4
    hung.epp.order = [silent.endpoint]
    before = _stalled(hung.metrics)
    served_before = silent.served
    try:
        async with httpx.AsyncClient(timeout=40) as client:
            reply_task = asyncio.ensure_future(client.post(f"{hung.http}/v1/completions",
                                                           json={"model": MODEL, "prompt": "drain", "max_tokens": 4}))
            await asyncio.sleep(0.5)  # the request waits on the engine
            await silent.registration.stop()  # deregistered: the router sees it leave at once
            reply = await reply_task
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvmesh-endpoint"] == silent.endpoint.id
        assert silent.served - served_before == 1
        after = _stalled(hung.metrics)
        assert after == before, after  # nothing cut, nothing re-sent
    finally:
        silent.registration = LeaseRegistration([etcd], endpoint_key(silent.endpoint), silent.endpoint.to_json(),
                                                ttl_seconds=3)
        await silent.registration.start()
    await _all_listed(hung)


async def test_paused_engine_mid_stream_ends_with_error_event(hung: HungMesh) -> None:
    """SIGSTOP mid-stream: once its /health probe fails (silent past the probe threshold, or after it left
    membership) the stream ends with the in-stream error event + [DONE] (not an SSE gap until the 600 s
    request timeout); counted as health_probe_failed or endpoint_left / ended."""
    hung.epp.order = [hung.sim_endpoint]
    before = _stalled(hung.metrics)
    raw = b""
    paused_at = 0.0
    try:
        async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", f"{hung.http}/v1/completions", json={
                "model": MODEL, "prompt": "a long one", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as s:
            assert s.status_code == 200
            async for chunk in s.aiter_bytes():
                raw += chunk
                if not paused_at and raw.count(b"\n\n") >= 2:
                    os.killpg(hung.sim.pid, signal.SIGSTOP)
                    paused_at = time.monotonic()
        ended_after = time.monotonic() - paused_at
    finally:
        os.killpg(hung.sim.pid, signal.SIGCONT)
    events = _events(raw)
    assert events[-1] == "data: [DONE]", raw[-300:]
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503 and "mid-stream" in error["message"]
    for event in events[:-2]:
        assert "choices" in json.loads(event[6:])  # whole events before the error
    assert ended_after < IDLE_S + 5, ended_after
    after = _stalled(hung.metrics)
    ended = sum(_grew(before, after, (reason, "ended"))
                for reason in ("endpoint_left", "health_probe_failed", "health_probe_timed_out", "idle_timeout"))
    assert ended == 1, after
    if ended_after < IDLE_S:
        assert "its /health" in error["message"], error
    await _all_listed(hung)


async def test_silent_engine_without_first_byte_is_redispatched(hung: HungMesh) -> None:
    """An engine that accepts the request and never answers, its lease alive: the first-byte timeout moves
    the streamed request to the next candidate; the client sees one clean answer."""
    assert hung.silent.endpoint is not None and hung.good.endpoint is not None
    hung.epp.order = [hung.silent.endpoint, hung.good.endpoint]
    before = _stalled(hung.metrics)
    async with httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        status, headers, raw = await _stream(client, f"{hung.http}/v1/completions",
                                             {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
        elapsed = time.monotonic() - started
    assert status == 200 and headers["x-kvmesh-endpoint"] == hung.good.endpoint.id
    assert _events(raw)[-1] == "data: [DONE]" and b'"error"' not in raw
    assert FIRST_BYTE_S <= elapsed < FIRST_BYTE_S + 6, elapsed
    assert _grew(before, _stalled(hung.metrics), ("first_byte_timeout", "redispatched")) == 1


async def test_silent_engine_mid_stream_idle_timeout_http_and_grpc(hung: HungMesh) -> None:
    """An engine silent mid-answer with its lease alive: after engine_stream_idle_timeout_seconds the SSE
    stream ends with the in-stream error + [DONE], and gRPC CompleteStream with UNAVAILABLE."""
    assert hung.silent.endpoint is not None
    hung.silent.stall_after = 2
    hung.epp.order = [hung.silent.endpoint]
    before = _stalled(hung.metrics)

    async def over_grpc() -> grpc.StatusCode | None:
        async with grpc.aio.insecure_channel(hung.grpc_address) as channel:
            call = router_pb2_grpc.InferenceStub(channel).CompleteStream(
                router_pb2.CompletionRequest(model=MODEL, prompt="g", max_tokens=8), timeout=IDLE_S + 20)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                assert "stopped answering mid-stream" in (exc.details() or ""), exc.details()
                return exc.code()
        return None

    async with httpx.AsyncClient(timeout=IDLE_S + 20) as client:
        started = time.monotonic()
        (status, _, raw), code = await asyncio.gather(
            _stream(client, f"{hung.http}/v1/completions", {"model": MODEL, "prompt": "h", "max_tokens": 8, "stream": True}),
            over_grpc())
        elapsed = time.monotonic() - started
    assert code == grpc.StatusCode.UNAVAILABLE
    events = _events(raw)
    assert status == 200 and events[-1] == "data: [DONE]", raw[-300:]
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and f"no data for {IDLE_S}s" in error["message"], error
    assert len(events) == 4  # two tokens, the error, [DONE]
    assert IDLE_S <= elapsed < IDLE_S + 6, elapsed
    assert _grew(before, _stalled(hung.metrics), ("idle_timeout", "ended")) == 2


async def _grpc_stream(address: str, prompt: str, max_tokens: int, timeout: float,
                       chunks: list[router_pb2.CompletionChunk] | None = None) -> grpc.aio.AioRpcError | None:
    """A gRPC ``CompleteStream`` read to its end: the error that ended it (None: OK); ``chunks`` gets the chunks."""
    got = chunks if chunks is not None else []
    async with grpc.aio.insecure_channel(address) as channel:
        call = router_pb2_grpc.InferenceStub(channel).CompleteStream(
            router_pb2.CompletionRequest(model=MODEL, prompt=prompt, max_tokens=max_tokens), timeout=timeout)
        try:
            async for chunk in call:
                got.append(chunk)
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


@pytest.mark.parametrize("when", ["non-streamed", "before-first-byte", "mid-stream"])
async def test_hung_engine_with_its_lease_alive_is_found_by_its_health_probe(hung: HungMesh, when: str) -> None:
    """The issue: an engine that hangs whole (its /health silent too) while its lease lives on (vLLM behind
    the registration sidecar) is found once a request waited engine_health_probe_after_seconds without a
    byte and its /health gave no answer for engine_health_slow_fail_seconds within the wait: before its
    first byte the request is re-sent to the next candidate and answered there (non-streamed: before, only
    the 600 s request timeout ended it), mid-stream the answer ends with the in-stream error (HTTP) /
    UNAVAILABLE (gRPC), well within the idle timeout. Membership never changes."""
    silent, good = hung.silent, hung.good
    assert silent.endpoint is not None and good.endpoint is not None
    silent.health_hangs = True
    silent.stall_after = 2 if when == "mid-stream" else 0
    hung.epp.order = [silent.endpoint, good.endpoint]
    before = _stalled(hung.metrics)
    url = f"{hung.http}/v1/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        served = good.served
        if when == "non-streamed":
            reply = await client.post(url, json={"model": MODEL, "prompt": "p", "max_tokens": 3})
            elapsed = time.monotonic() - started
            assert reply.status_code == 200 and reply.headers["x-kvmesh-endpoint"] == good.endpoint.id, reply.text
            action, count, resent = "redispatched", 1, 1
        elif when == "before-first-byte":
            status, headers, raw = await _stream(client, url, {"model": MODEL, "prompt": "s", "max_tokens": 3, "stream": True})
            elapsed = time.monotonic() - started
            assert status == 200 and headers["x-kvmesh-endpoint"] == good.endpoint.id, raw
            assert _events(raw)[-1] == "data: [DONE]" and b'"error"' not in raw, raw
            action, count, resent = "redispatched", 1, 1
        else:
            chunks: list[router_pb2.CompletionChunk] = []
            (status, headers, raw), grpc_error = await asyncio.gather(
                _stream(client, url, {"model": MODEL, "prompt": "m", "max_tokens": 8, "stream": True}),
                _grpc_stream(hung.grpc_address, "g", 8, 30, chunks))
            elapsed = time.monotonic() - started
            events = _events(raw)
            assert status == 200 and headers["x-kvmesh-endpoint"] == silent.endpoint.id
            assert events[-1] == "data: [DONE]" and len(events) == 4, raw[-300:]  # two tokens, the error, [DONE]
            error = json.loads(events[-2][6:])["error"]
            assert error["code"] == 503 and "its /health gave no answer for" in error["message"], error
            assert grpc_error is not None and grpc_error.code() == grpc.StatusCode.UNAVAILABLE
            assert "its /health gave no answer for" in (grpc_error.details() or ""), grpc_error.details()
            assert [c.text for c in chunks] == ["tok0 ", "tok1 "]
            action, count, resent = "ended", 2, 0
    assert good.served == served + resent  # re-sent only before the first byte
    # one GET /health, kept running, unanswered for SLOW_FAIL_S within this wait: threshold + that, plus ticks
    # and load; at least SLOW_FAIL_S (not threshold + it): an earlier case's GET to this engine may still run
    # unanswered, and the slow run is then measured from this wait's own start (docs/degraded-modes.md)
    assert SLOW_FAIL_S <= elapsed < PROBE_AFTER_S + SLOW_FAIL_S + 3, elapsed
    after = _stalled(hung.metrics)
    assert _grew(before, after, ("health_probe_timed_out", action)) == count, after
    assert sum(after.values()) - sum(before.values()) == count, after  # nothing else cut
    assert silent.health_checks > 0


@pytest.mark.parametrize("when", ["non-streamed", "mid-stream-gap"])
async def test_slow_engine_that_answers_health_is_not_cut(hung: HungMesh, when: str) -> None:
    """A long wait that is not a hang (a whole non-streamed generation; a long gap between two events, a
    preempted request) on an engine whose /health answers: probed past the threshold, answered, not cut
    nor moved; the client gets the engine's own whole answer."""
    silent = hung.silent
    assert silent.endpoint is not None
    silent.stall_after = None
    hung.epp.order = [silent.endpoint]
    before = _stalled(hung.metrics)
    checks = silent.health_checks
    url = f"{hung.http}/v1/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        if when == "non-streamed":
            silent.plain_delay = PROBE_AFTER_S + 2
            reply = await client.post(url, json={"model": MODEL, "prompt": "slow", "max_tokens": 3})
            assert reply.status_code == 200 and reply.headers["x-kvmesh-endpoint"] == silent.endpoint.id, reply.text
        else:
            silent.delay = PROBE_AFTER_S + 1.5  # between two events
            status, headers, raw = await _stream(client, url, {"model": MODEL, "prompt": "gap", "max_tokens": 2, "stream": True})
            assert status == 200 and headers["x-kvmesh-endpoint"] == silent.endpoint.id
            assert _events(raw) == [*(f"data: {json.dumps({'id': 'cmpl-s', 'choices': [{'index': 0, 'text': f'tok{i} '}]})}"
                                      for i in range(2)), "data: [DONE]"], raw[-300:]
        elapsed = time.monotonic() - started
    assert elapsed >= PROBE_AFTER_S + 2, elapsed
    assert silent.health_checks > checks  # it was probed, and answered
    assert _stalled(hung.metrics) == before


async def test_engine_with_slow_health_is_not_cut_while_it_streams_another_request(hung: HungMesh) -> None:
    """An overloaded engine: its /health answers only after 2 s (every probe times out at 0.5 s), one request
    gets no byte for 3.5 s (a whole non-streamed generation) while the engine streams another one. Bytes to
    any request prove the endpoint alive: neither is cut nor moved, nothing is counted stalled."""
    silent = hung.silent
    assert silent.endpoint is not None
    silent.stall_after = None
    silent.health_delay = 2.0
    silent.plain_delay = PROBE_AFTER_S + 2.5
    silent.delay = 0.1
    hung.epp.order = [silent.endpoint]
    before = _stalled(hung.metrics)
    checks = silent.health_checks
    url = f"{hung.http}/v1/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        plain, (status, headers, raw) = await asyncio.gather(
            client.post(url, json={"model": MODEL, "prompt": "slow", "max_tokens": 3}),
            _stream(client, url, {"model": MODEL, "prompt": "drip", "max_tokens": 40, "stream": True}))
    assert plain.status_code == 200 and plain.headers["x-kvmesh-endpoint"] == silent.endpoint.id, plain.text
    assert status == 200 and headers["x-kvmesh-endpoint"] == silent.endpoint.id
    assert len(_events(raw)) == 41 and _events(raw)[-1] == "data: [DONE]", raw[-300:]
    assert silent.health_checks > checks  # probed past the threshold; the probes timed out, the stream spoke
    assert _stalled(hung.metrics) == before


def _raw_request(http: str, head: bytes, body: bytes) -> tuple[bytes, float, bool]:
    """Send ``head`` + ``body`` on a raw socket kept open; the answer, when it came, and whether the
    router closed the connection after it."""
    host, port = http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=BODY_S + 10) as sock:
        started = time.monotonic()
        sock.sendall(head + body)
        answer = b""
        while True:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return answer, time.monotonic() - started, False
            if not data:
                return answer, time.monotonic() - started, True
            answer += data


@pytest.mark.parametrize("mode", ["short", "chunked", "headers-only"],
                         ids=["short-content-length", "chunked-drip", "headers-only"])
async def test_body_shorter_than_declared_is_408_and_closed(hung: HungMesh, mode: str) -> None:
    """A body that never completes (58 bytes of a declared 200; a chunked body stopping midway; no body
    byte at all after the headers: the first receive() itself waits) is a 408 after
    request_body_timeout_seconds and the connection is closed, not held forever."""
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()[:58].ljust(58, b" ")
    if mode == "headers-only":
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n"
        payload = b""
    elif mode == "chunked":
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        payload = b"%x\r\n%s\r\n" % (len(body), body)
    else:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n"
        payload = body
    answer, elapsed, closed = await asyncio.to_thread(_raw_request, hung.http, head, payload)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", answer[:300]
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "not received within" in error["message"]
    assert closed and BODY_S <= elapsed < BODY_S + 5, (closed, elapsed)


def _held_open(http: str, first: bytes, drip: bytes) -> tuple[bytes, float, bool]:
    """Send ``first``, read its answer if any, then ``drip`` one byte a second; the bytes received, the
    seconds the connection stayed open after ``first``, and whether the router closed it."""
    host, port = http.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=1) as sock:
        started = time.monotonic()
        if first:
            sock.sendall(first)
        received = b""
        for i in range(HEADER_S + 10):
            try:
                data = sock.recv(65536)
                if not data:
                    return received, time.monotonic() - started, True
                received += data
                continue
            except TimeoutError:
                pass
            except ConnectionResetError:  # closed with a dripped byte unread: the kernel answers RST, not FIN
                return received, time.monotonic() - started, True
            try:
                if i < len(drip):
                    sock.sendall(drip[i:i + 1])
            except OSError:
                return received, time.monotonic() - started, True
        return received, time.monotonic() - started, False


_GET_MODELS = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.mark.parametrize(("first", "drip"), [
    (b"", b""),
    (b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 40),
    (_GET_MODELS, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 40),
], ids=["silent-connection", "header-drip", "header-drip-after-a-request"])
async def test_slow_headers_are_cut_at_the_header_deadline(hung: HungMesh, first: bytes, drip: bytes) -> None:
    """Slowloris siblings: a connection that sends nothing, or drips header bytes (first request or the
    next one on a kept-alive connection), is closed once request_header_timeout_seconds passed since
    its request began; uvicorn alone held the dripping ones forever."""
    received, held, closed = await asyncio.to_thread(_held_open, hung.http, first, drip)
    assert closed, (held, received[:200])
    assert held < HEADER_S + 3, held
    if first:
        assert received.startswith(b"HTTP/1.1 200 OK"), received[:200]  # the complete request was answered


async def _router_lists_model(client: httpx.AsyncClient, http: str) -> None:
    """Wait (20 s) until the router's ``/v1/models`` lists :data:`MODEL`: it has the engines."""

    async def listed() -> bool:
        data = (await client.get(f"{http}/v1/models")).json()["data"]
        return any(m["id"] == MODEL for m in data)

    await wait_until_async(listed, 20, "router to list the model", interval=0.1)


async def test_sigterm_mid_stream_ends_with_error_event_and_no_traceback(hung: HungMesh, etcd: str, run_dir: Path) -> None:
    """SIGTERM a router while a stream waits on a silent engine: the stream ends with the in-stream error
    (503 "shutting down") + [DONE] within the grace, and the router's log has no traceback."""
    assert hung.silent.endpoint is not None
    hung.silent.stall_after = 2
    hung.epp.order = [hung.silent.endpoint]
    http_port = free_port()
    router, _ = _start("router", run_dir, etcd, "--http-port", str(http_port), "--flow-control-address",
                       hung.flow_control, "--epp-address", hung.epp_address, *ROUTER_FLAGS)
    http = f"http://127.0.0.1:{http_port}"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            await _router_lists_model(client, http)
            raw = b""
            stopped_at = 0.0
            async with client.stream("POST", f"{http}/v1/completions",
                                     json={"model": MODEL, "prompt": "t", "max_tokens": 8, "stream": True}) as s:
                async for chunk in s.aiter_bytes():
                    raw += chunk
                    if not stopped_at and raw.count(b"\n\n") >= 2:
                        os.killpg(router.pid, signal.SIGTERM)
                        stopped_at = time.monotonic()
            ended_after = time.monotonic() - stopped_at
        events = _events(raw)
        assert events[-1] == "data: [DONE]", raw[-300:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and error["message"] == "the server is shutting down; retry the request"
        assert ended_after < GRACE_S + 2, ended_after
        assert router.proc is not None
        router.proc.wait(15)
        log = router.log_path.read_text(errors="replace")
        for bad in ("Traceback", "Exception in ASGI application", "timeout graceful shutdown exceeded"):
            assert bad not in log, log[-3000:]
    finally:
        router.stop()


async def test_sigterm_grpc_streams_drain_or_end_unavailable_as_http_does(hung: HungMesh, etcd: str, run_dir: Path) -> None:
    """SIGTERM a router while three streams run: a gRPC stream that finishes within the grace is drained
    to completion (OK, every chunk); a gRPC stream waiting on a silent engine ends, after the chunks it
    already had, with UNAVAILABLE "the server is shutting down; retry the request" near the end of the
    grace (before: cut by the gRPC server at its own grace, UNAVAILABLE "Cancelling all calls"), when and as the HTTP
    stream beside it gets the in-stream error event + [DONE]. Both doors drain together (one grace, not
    the gRPC grace and then the HTTP one); exit 0, no traceback."""
    silent, good = hung.silent, hung.good
    assert silent.endpoint is not None and good.endpoint is not None
    silent.stall_after = 2
    good.delay = 0.15  # 8 events: 1.2 s, within the grace
    http_port = free_port()
    router, address = _start("router", run_dir, etcd, "--http-port", str(http_port), "--flow-control-address",
                             hung.flow_control, "--epp-address", hung.epp_address, "--shutdown-grace-seconds",
                             str(GRACE_S), *ROUTER_FLAGS)
    http = f"http://127.0.0.1:{http_port}"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            await _router_lists_model(client, http)
            hung.epp.order = [silent.endpoint]
            stalled_chunks: list[router_pb2.CompletionChunk] = []
            stalled_grpc = asyncio.ensure_future(_grpc_stream(address, "stalled", 8, 30, stalled_chunks))
            http_raw = bytearray()
            http_two = asyncio.Event()

            async def over_http() -> None:
                async with client.stream("POST", f"{http}/v1/completions",
                                         json={"model": MODEL, "prompt": "h", "max_tokens": 8, "stream": True}) as s:
                    async for chunk in s.aiter_bytes():
                        http_raw.extend(chunk)
                        if http_raw.count(b"\n\n") >= 2:
                            http_two.set()

            http_stream = asyncio.ensure_future(over_http())
            await wait_until_async(lambda: len(stalled_chunks) >= 2 and http_two.is_set(), 20,
                                   "both stalled streams to get two events", interval=0.05)
            hung.epp.order = [good.endpoint]
            done_chunks: list[router_pb2.CompletionChunk] = []
            finishing = asyncio.ensure_future(_grpc_stream(address, "finishing", 8, 30, done_chunks))
            await wait_until_async(lambda: len(done_chunks) >= 1, 20, "the finishing stream to start", interval=0.02)
            os.killpg(router.pid, signal.SIGTERM)
            stopped_at = time.monotonic()
            ended: dict[str, float] = {}

            async def timed(name: str, task: Awaitable[object]) -> object:
                result = await task
                ended[name] = time.monotonic() - stopped_at
                return result

            finished_error, stalled_error, _ = await asyncio.gather(
                timed("finishing", finishing), timed("grpc", stalled_grpc), timed("http", http_stream))
        assert finished_error is None, finished_error
        assert [c.text for c in done_chunks] == [f"tok{i} " for i in range(8)]
        assert isinstance(stalled_error, grpc.aio.AioRpcError), stalled_error
        assert stalled_error.code() == grpc.StatusCode.UNAVAILABLE
        assert stalled_error.details() == "the server is shutting down; retry the request"
        assert [c.text for c in stalled_chunks] == ["tok0 ", "tok1 "]
        events = _events(bytes(http_raw))
        assert events[-1] == "data: [DONE]", http_raw[-300:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 503 and error["message"] == "the server is shutting down; retry the request"
        assert ended["finishing"] < GRACE_S, ended
        assert GRACE_S - 1.5 < ended["grpc"] < GRACE_S + 2 and GRACE_S - 1.5 < ended["http"] < GRACE_S + 2, ended
        assert abs(ended["grpc"] - ended["http"]) < 1.0, ended
        assert router.proc is not None
        assert router.proc.wait(15) == 0
        log = router.log_path.read_text(errors="replace")
        for bad in ("Traceback", "Exception in ASGI application", "timeout graceful shutdown exceeded", "on_stop hook"):
            assert bad not in log, log[-3000:]
        assert "shutting down: ended 2 request(s) still on an engine" in log, log[-3000:]
    finally:
        router.stop()


async def test_one_hung_candidate_is_counted_abandoned_not_redispatched(hung: HungMesh) -> None:
    """The only candidate hangs whole (lease alive, /health silent) before its first byte, HTTP and gRPC:
    the re-pick finds no other endpoint, the client gets 503 / UNAVAILABLE, and the metrics say so:
    ``health_probe_timed_out`` / ``abandoned``, no ``redispatched``, no retry (before: ``redispatched`` and
    a retry for a request answered 503)."""
    silent = hung.silent
    assert silent.endpoint is not None
    silent.health_hangs, silent.stall_after = True, 0
    hung.epp.order = [silent.endpoint]
    before = _stalled(hung.metrics)
    retries = _samples(hung.metrics, "kvmesh_router_upstream_retries_total").get("", 0.0)
    async with httpx.AsyncClient(timeout=30) as client:
        reply, grpc_error = await asyncio.gather(
            client.post(f"{hung.http}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3}),
            _grpc_stream(hung.grpc_address, "g", 3, 30))
    assert reply.status_code == 503 and "its /health gave no answer for" in reply.json()["error"]["message"], reply.text
    assert grpc_error is not None and grpc_error.code() == grpc.StatusCode.UNAVAILABLE, grpc_error
    after = _stalled(hung.metrics)
    assert _grew(before, after, ("health_probe_timed_out", "abandoned")) == 2, after
    assert sum(after.values()) - sum(before.values()) == 2, after  # no redispatched
    assert _samples(hung.metrics, "kvmesh_router_upstream_retries_total").get("", 0.0) == retries


@pytest.mark.parametrize("health_hangs", [False, True], ids=["health-answers", "health-silent"])
async def test_engine_silent_after_its_whole_answer_is_a_success(hung: HungMesh, health_hangs: bool) -> None:
    """An engine that sent its whole answer (``data: [DONE]``; a non-streamed body of its content-length)
    and then goes silent without closing the body (its /health answering or not): the HTTP stream, the
    non-streamed answer and a gRPC ``CompleteStream`` all end as successes within about a second, with
    exactly the engine's events (no error event, no second ``[DONE]``), no stall counted, outcome
    ``success`` (before: the idle timeout, or the probe, appended an error and counted ``upstream_error``)."""
    silent = hung.silent
    assert silent.endpoint is not None
    silent.stall_after, silent.hang_after_done, silent.health_hangs = None, True, health_hangs
    hung.epp.order = [silent.endpoint]
    before = _stalled(hung.metrics)
    outcomes = _samples(hung.metrics, "kvmesh_router_requests_total")
    url = f"{hung.http}/v1/completions"
    chunks: list[router_pb2.CompletionChunk] = []
    async with httpx.AsyncClient(timeout=IDLE_S + 20) as client:
        started = time.monotonic()
        (status, _, raw), plain, grpc_error = await asyncio.gather(
            _stream(client, url, {"model": MODEL, "prompt": "d", "max_tokens": 2, "stream": True}),
            client.post(url, json={"model": MODEL, "prompt": "p", "max_tokens": 2}),
            _grpc_stream(hung.grpc_address, "g", 2, IDLE_S + 20, chunks))
        elapsed = time.monotonic() - started
    assert status == 200 and _events(raw) == [
        *(f"data: {json.dumps({'id': 'cmpl-s', 'choices': [{'index': 0, 'text': f'tok{i} '}]})}" for i in range(2)),
        "data: [DONE]"], raw[-300:]
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "ok", plain.text
    assert grpc_error is None and [c.text for c in chunks] == ["tok0 ", "tok1 "], grpc_error
    assert elapsed < PROBE_AFTER_S + 3, elapsed  # the after-whole wait (1 s + a tick), far from IDLE_S
    assert _stalled(hung.metrics) == before
    now = _samples(hung.metrics, "kvmesh_router_requests_total")
    grew = {k: now[k] - outcomes.get(k, 0.0) for k in now if now[k] != outcomes.get(k, 0.0)}
    assert grew == {'outcome="success"': 3}, grew
