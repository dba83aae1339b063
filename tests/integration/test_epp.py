"""epp as a process against real etcd and real HTTP engines (small starlette servers in this process).

Each fake engine serves vLLM-format ``/metrics`` (values the test sets) and ``/tokenize``, and is
registered in etcd with a real lease, exactly as an engine registers itself. Every test uses its own
model name so the session-wide etcd stays shared without interference.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from tests.support import wait_until, wait_until_async

pytestmark = pytest.mark.integration

SCRAPE = ("--metrics-scrape-interval-seconds", "0.05")


@dataclass
class FakeEngine:
    """A real HTTP server on 127.0.0.1 with vLLM's /metrics and /tokenize."""

    model: str
    waiting: float = 0.0
    running: float = 0.0
    usage: float = 0.0
    port: int = field(default_factory=free_port)
    tokenize_calls: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(id=EndpointId(f"127.0.0.1:{self.port}"), url=f"http://127.0.0.1:{self.port}", model=self.model)

    async def _metrics(self, request: Request) -> Response:
        labels = f'engine="0",model_name="{self.model}"'
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {self.running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {self.waiting}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.usage}\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="64",{labels}}} 1.0\n'
        )

    async def _tokenize(self, request: Request) -> Response:
        self.tokenize_calls += 1
        body = await request.json()
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        tokens = [1, *(ord(ch) for ch in text)]
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    def start(self) -> FakeEngine:
        app = Starlette(routes=[Route("/metrics", self._metrics), Route("/tokenize", self._tokenize, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        server = self._server
        wait_until(lambda: server.started, 10, "the fake engine to start", interval=0.01)
        return self

    def kill(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(10)


@pytest.fixture
async def engines(etcd: str) -> AsyncIterator[Callable[..., asyncio.Future[tuple[FakeEngine, LeaseRegistration]]]]:
    started: list[tuple[FakeEngine, LeaseRegistration]] = []

    async def start(model: str, **load: float) -> tuple[FakeEngine, LeaseRegistration]:
        engine = FakeEngine(model, **load).start()
        ep = engine.endpoint
        reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
        await reg.start()
        started.append((engine, reg))
        return engine, reg

    yield start  # type: ignore[misc]
    for engine, reg in started:
        await reg.stop()
        engine.kill()


def _model() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


async def _wait_scraped(stub: epp_pb2_grpc.EndpointPickerStub, ids: set[str], timeout: float = 15.0) -> None:
    async def scraped() -> set[str]:
        reply = await stub.ListEndpoints(epp_pb2.ListEndpointsRequest(), timeout=2)
        return {s.endpoint.id for s in reply.endpoints if s.metrics_age_seconds >= 0}

    await wait_until_async(scraped, timeout, f"epp to scrape {sorted(ids)}", until=ids.issubset)


async def _pick(stub: epp_pb2_grpc.EndpointPickerStub, model: str, **kw: object) -> epp_pb2.PickResponse:
    return await stub.Pick(epp_pb2.PickRequest(model=model, **kw), timeout=5)  # type: ignore[arg-type]


async def test_load_only_prefers_least_loaded(start_service, engines) -> None:  # type: ignore[no-untyped-def]
    _, address = start_service("epp", "--scheduling-config", "load-only", *SCRAPE)
    model = _model()
    busy, _ = await engines(model, waiting=5, running=8, usage=0.7)
    idle, _ = await engines(model, waiting=0, running=1, usage=0.1)
    mid, _ = await engines(model, waiting=1, running=4, usage=0.3)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        await _wait_scraped(stub, {busy.endpoint.id, idle.endpoint.id, mid.endpoint.id})
        reply = await _pick(stub, model, request_id="r1")
        assert reply.target.id == idle.endpoint.id
        assert [f.id for f in reply.fallbacks] == [mid.endpoint.id, busy.endpoint.id]
        assert reply.profile == "default"
        by_id = {b.endpoint_id: b for b in reply.breakdown}
        assert by_id[idle.endpoint.id].scores["queue"] == 1.0
        assert by_id[busy.endpoint.id].scores["queue"] == 0.0
        assert by_id[idle.endpoint.id].scores["kv-utilization"] == pytest.approx(0.9)
        # Load moves: the busy engine drains, the idle one fills up.
        busy.waiting, busy.running, busy.usage = 0, 0, 0.0
        idle.waiting, idle.running, idle.usage = 9, 9, 0.9
        await wait_until_async(
            lambda: _pick(stub, model), 5, "epp to follow the new load", until=lambda r: r.target.id == busy.endpoint.id
        )
        # Pick latency as seen by a gRPC client on the same machine.
        latencies = []
        for _ in range(200):
            started = time.perf_counter()
            await _pick(stub, model)
            latencies.append(time.perf_counter() - started)
        latencies.sort()
        print(f"pick latency p50={statistics.median(latencies) * 1e3:.2f}ms p99={latencies[197] * 1e3:.2f}ms")


async def test_dead_or_deregistered_endpoint_is_never_picked(start_service, engines) -> None:  # type: ignore[no-untyped-def]
    _, address = start_service("epp", "--scheduling-config", "round-robin", *SCRAPE)
    model = _model()
    crashed, _ = await engines(model)
    leaving, leaving_reg = await engines(model)
    stays, _ = await engines(model)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        await _wait_scraped(stub, {crashed.endpoint.id, leaving.endpoint.id, stays.endpoint.id})
        crashed.kill()  # process gone, its etcd lease still alive: scrape failures must drop it
        await leaving_reg.stop()  # clean deregistration
        gone = {crashed.endpoint.id, leaving.endpoint.id}

        async def targets() -> set[str]:
            return {(await _pick(stub, model)).target.id for _ in range(6)}

        await wait_until_async(targets, 5, f"epp to stop picking {sorted(gone)}", until=lambda t: not t & gone)
        for _ in range(50):
            reply = await _pick(stub, model)
            assert reply.target.id == stays.endpoint.id
            assert not {f.id for f in reply.fallbacks} & gone
        listed = {s.endpoint.id for s in (await stub.ListEndpoints(epp_pb2.ListEndpointsRequest())).endpoints}
        assert leaving.endpoint.id not in listed


async def test_bad_requests_get_statuses_and_service_stays_up(start_service, engines) -> None:  # type: ignore[no-untyped-def]
    proc, address = start_service("epp", "--scheduling-config", "load-only", *SCRAPE)
    model = _model()
    engine, _ = await engines(model)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        await _wait_scraped(stub, {engine.endpoint.id})
        cases = [
            (epp_pb2.PickRequest(model=""), grpc.StatusCode.INVALID_ARGUMENT),
            (epp_pb2.PickRequest(model="no-such-model"), grpc.StatusCode.NOT_FOUND),
            (epp_pb2.PickRequest(model=model, exclude_endpoint_ids=[engine.endpoint.id]), grpc.StatusCode.UNAVAILABLE),
        ]
        for request, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Pick(request, timeout=5)
            assert info.value.code() == code, info.value.details()
        assert (await _pick(stub, model)).target.id == engine.endpoint.id
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
    proc.check_alive()


async def test_round_robin_cycles(start_service, engines) -> None:  # type: ignore[no-untyped-def]
    _, address = start_service("epp", "--scheduling-config", "round-robin", *SCRAPE)
    model = _model()
    started = [await engines(model, waiting=w) for w in (0, 5, 9)]
    ids = sorted(e.endpoint.id for e, _ in started)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        await _wait_scraped(stub, set(ids))
        targets = [(await _pick(stub, model)).target.id for _ in range(9)]
        first = ids.index(targets[0])
        assert targets == [ids[(first + i) % 3] for i in range(9)]
        assert (await _pick(stub, model)).profile == "default"


@pytest.mark.parametrize("indexer", ["running", "unreachable"])
async def test_precise_prefix_tokenizes_through_engine(start_service, engines, indexer: str) -> None:  # type: ignore[no-untyped-def]
    """Text prompts are tokenized by the engine's /tokenize (once, then cached); a missing kv_indexer
    only zeroes the prefix scores, the pick still succeeds on load."""
    if indexer == "running":
        _, indexer_address = start_service("kv_indexer", "--events-bind-endpoint", f"tcp://127.0.0.1:{free_port()}")
    else:
        indexer_address = f"127.0.0.1:{free_port()}"
    epp, address = start_service(
        "epp", "--scheduling-config", "precise-prefix", "--kv-indexer-address", indexer_address, *SCRAPE
    )
    model = _model()
    busy, _ = await engines(model, waiting=4, usage=0.5)
    idle, _ = await engines(model)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        await _wait_scraped(stub, {busy.endpoint.id, idle.endpoint.id})
        prompt = "hello " * 40
        reply = await _pick(stub, model, prompt=prompt)
        assert reply.target.id == idle.endpoint.id
        assert reply.prompt_tokens == 1 + len(prompt)
        assert {b.endpoint_id: b.scores["prefix"] for b in reply.breakdown} == {
            busy.endpoint.id: 0.0, idle.endpoint.id: 0.0
        }
        await _pick(stub, model, prompt=prompt)
        assert busy.tokenize_calls + idle.tokenize_calls == 1
        chat = await _pick(stub, model, messages=[{"role": "user", "content": "hi"}])
        assert chat.prompt_tokens == 3
        ids = await _pick(stub, model, prompt_token_ids=list(range(300)))
        assert ids.prompt_tokens == 0 and ids.target.id == idle.endpoint.id
    assert ("kv_indexer score failed" in epp.log_tail(200)) == (indexer == "unreachable")


@pytest.mark.parametrize(("config", "needs_prompt"), [("round-robin", False), ("prefill-cost", True)])
async def test_get_picker_info_says_whether_the_prompt_is_needed(start_service, config: str, needs_prompt: bool) -> None:  # type: ignore[no-untyped-def]
    """A caller asks once and sends the prompt only when some configured plugin reads it."""
    _, address = start_service(
        "epp", "--scheduling-config", config, "--kv-indexer-address", f"127.0.0.1:{free_port()}", *SCRAPE
    )
    async with grpc.aio.insecure_channel(address) as channel:
        info = await epp_pb2_grpc.EndpointPickerStub(channel).GetPickerInfo(epp_pb2.GetPickerInfoRequest(), timeout=5)
    assert info.needs_prompt is needs_prompt
    assert list(info.profiles) == ["default"]
