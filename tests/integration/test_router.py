"""The router as a real process against a real etcd and a real flow_control process.

epp and the engines are small real servers inside the test (a grpc.aio ``EndpointPicker`` whose
choice the test sets, and Starlette engines speaking the OpenAI wire format), so each scenario
controls exactly where a request goes: a killed engine first in the list, a slow stream to
disconnect from, no endpoint at all. The whole mesh with the real epp and simulator is
``tests/integration/test_mesh.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.channels import ERROR_CLASS_TRAILER
from kvmesh.http_server import HttpServer
from kvmesh.membership import LeaseRegistration
from kvmesh.openai_stream import DONE, SseFramer, parse_event
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_grpc_healthy, wait_http_ok
from tests.support import serve_registered, stop_registered, wait_until_async

MODEL = "tiny"
MAX_MODEL_LEN = 256
BODY_LIMIT = 65536


async def _until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    await wait_until_async(predicate, timeout, what, interval=0.02)


@dataclass
class FakeEngine:
    """An OpenAI-wire engine: ``n`` tokens ``tok0 tok1 ...``, one every ``token_delay`` seconds."""

    token_delay: float = 0.0
    server: HttpServer | None = None
    registration: LeaseRegistration | None = None
    endpoint: Endpoint | None = None
    requests: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    finished: int = 0

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        n = int(body.get("max_tokens") or 16)
        chat = request.url.path.endswith("chat/completions")
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n, "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n)
            text = " ".join(f"tok{i}" for i in range(n))
            choice = {"index": 0, "finish_reason": "length", **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            self.finished += 1
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            done = False
            try:
                for i in range(n):
                    await asyncio.sleep(self.token_delay)
                    piece = f"tok{i} "
                    choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None,
                              **({"delta": {"content": piece}} if chat else {"text": piece})}
                    chunk = {"id": "cmpl-1", "model": MODEL, "choices": [choice]}
                    if i == n - 1:
                        chunk["usage"] = usage
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"
                done = True
                self.finished += 1
            finally:
                if not done:
                    self.cancelled += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def start(self, etcd: str) -> FakeEngine:
        app = Starlette(routes=[Route("/v1/completions", self._handle, methods=["POST"]),
                                Route("/v1/chat/completions", self._handle, methods=["POST"])])
        self.server, self.endpoint, self.registration = await serve_registered(
            app, etcd, MODEL, {"engine": "test", "max_model_len": str(MAX_MODEL_LEN)})
        return self

    async def stop(self) -> None:
        await stop_registered(self.server, self.registration)
        self.server = None


def _ep_pb(ep: Endpoint) -> common_pb2.Endpoint:
    return common_pb2.Endpoint(id=ep.id, url=ep.url, model=ep.model, block_size_tokens=ep.block_size_tokens, role="both")


class FakeEpp(epp_pb2_grpc.EndpointPickerServicer):
    """Picks ``order`` (minus excluded ids): the first is the target, the rest fallbacks."""

    def __init__(self) -> None:
        self.order: list[Endpoint] = []
        self.picks: list[epp_pb2.PickRequest] = []

    async def Pick(self, request: epp_pb2.PickRequest, context: grpc.aio.ServicerContext) -> epp_pb2.PickResponse:
        self.picks.append(request)
        candidates = [ep for ep in self.order if ep.id not in set(request.exclude_endpoint_ids)]
        if not candidates:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no endpoint for model {request.model}",
                                trailing_metadata=((ERROR_CLASS_TRAILER, "NoEndpointsAvailable"),))  # as epp's interceptor
        return epp_pb2.PickResponse(target=_ep_pb(candidates[0]), fallbacks=[_ep_pb(e) for e in candidates[1:]], profile="test")


@dataclass
class Mesh:
    http: str
    grpc_address: str
    flow_control: str
    epp: FakeEpp
    epp_address: str
    engines: list[FakeEngine]
    router: ManagedProcess
    metrics: str = ""

    async def in_flight(self) -> int:
        async with grpc.aio.insecure_channel(self.flow_control) as channel:
            stats = await flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest(), timeout=2)
        return stats.in_flight


async def serve_fake_epp(epp: epp_pb2_grpc.EndpointPickerServicer) -> tuple[grpc.aio.Server, int]:
    """Serve ``epp`` (with gRPC health SERVING) on a free 127.0.0.1 port; returns the started server and its port."""
    server = grpc.aio.server()
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(epp, server)
    epp_health = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(epp_health, server)
    await epp_health.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _start(name: str, run_dir: Path, etcd: str, *args: str, metrics_port: int = 0) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = ManagedProcess(
        name,
        python_module(f"services.{name}", "--grpc-port", str(port), "--metrics-port", str(metrics_port or free_port()),
                      "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", *args),
        run_dir / f"router-test-{name}-{port}.log",
    ).start()
    try:
        wait_grpc_healthy(f"127.0.0.1:{port}", 30.0)
    except TimeoutError as exc:
        proc.stop()
        raise RuntimeError(f"{name} did not become healthy:\n{proc.log_tail()}") from exc
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
async def mesh(etcd: str, run_dir: Path) -> AsyncIterator[Mesh]:
    epp = FakeEpp()
    epp_server, epp_port = await serve_fake_epp(epp)
    engines = [await FakeEngine().start(etcd), await FakeEngine().start(etcd)]
    procs: list[ManagedProcess] = []
    try:
        fc_proc, fc_addr = _start("flow_control", run_dir, etcd, "--max-in-flight", "8", "--max-queue-size", "100")
        procs.append(fc_proc)
        http_port, metrics_port = free_port(), free_port()
        router, router_addr = _start("router", run_dir, etcd, "--http-port", str(http_port), "--flow-control-address",
                                     fc_addr, "--epp-address", f"127.0.0.1:{epp_port}", "--connect-timeout-seconds", "1",
                                     "--max-request-body-bytes", str(BODY_LIMIT), metrics_port=metrics_port)
        procs.append(router)
        http = f"http://127.0.0.1:{http_port}"
        mesh = Mesh(http, router_addr, fc_addr, epp, f"127.0.0.1:{epp_port}", engines, router, f"http://127.0.0.1:{metrics_port}")
        async with httpx.AsyncClient() as client:
            await _until(lambda: _models(client, http), 15, "router to see the engines")
            await _until(lambda: _healthy(client, http), 10, "router /health 200")  # async: epp runs in this loop
        yield mesh
    finally:
        for proc in reversed(procs):
            proc.stop()
        for engine in engines:
            await engine.stop()
        await epp_server.stop(0)


async def _healthy(client: httpx.AsyncClient, http: str) -> bool:
    return (await client.get(f"{http}/health")).status_code == 200


async def _models(client: httpx.AsyncClient, http: str) -> bool:
    data = (await client.get(f"{http}/v1/models")).json()["data"]
    return any(m["id"] == MODEL for m in data)


@pytest.fixture
def client() -> Iterator[httpx.AsyncClient]:
    yield httpx.AsyncClient(timeout=20)


@pytest.fixture(autouse=True)
def _reset(mesh: Mesh) -> None:
    mesh.epp.order = [e.endpoint for e in mesh.engines]  # type: ignore[misc]
    for engine in mesh.engines:
        engine.token_delay = 0.0


async def test_models_and_health(mesh: Mesh, client: httpx.AsyncClient) -> None:
    models = (await client.get(f"{mesh.http}/v1/models")).json()
    assert models["object"] == "list"
    (tiny,) = [m for m in models["data"] if m["id"] == MODEL]
    assert tiny["max_model_len"] == MAX_MODEL_LEN
    health = (await client.get(f"{mesh.http}/health")).json()
    assert health["status"] == "ok" and health["endpoints"] >= 2


BAD = [
    ("malformed-json", "/v1/completions", b"{not json", 400, "invalid_request_error"),
    ("missing-model", "/v1/completions", {"prompt": "hi"}, 400, "invalid_request_error"),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "not_found_error"),
    ("both-prompt-forms", "/v1/chat/completions", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ("negative-max-tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "invalid_request_error"),
    ("absurd-max-tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, "invalid_request_error"),
    ("over-context", "/v1/completions", {"model": MODEL, "prompt": list(range(300)), "max_tokens": 4}, 400, "invalid_request_error"),
    ("bad-temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "invalid_request_error"),
    ("non-bool-stream", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "maybe"}, 400, "invalid_request_error"),
]


@pytest.mark.parametrize(("path", "body", "status", "etype"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_malformed_requests_get_the_right_status(mesh: Mesh, client: httpx.AsyncClient, path: str, body: object, status: int, etype: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = await client.post(f"{mesh.http}{path}", content=content, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == etype and error["code"] == status and error["message"]
    assert (await client.get(f"{mesh.http}/health")).status_code == 200
    mesh.router.check_alive()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
async def test_non_streaming_and_streaming(mesh: Mesh, client: httpx.AsyncClient, path: str) -> None:
    prompt = {"messages": [{"role": "user", "content": "hello"}]} if "chat" in path else {"prompt": "hello"}
    reply = await client.post(f"{mesh.http}{path}", json={"model": MODEL, **prompt, "max_tokens": 4},
                              headers={"x-request-id": "req-nonstream", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 4
    target = mesh.engines[0]
    assert reply.headers["x-kvmesh-endpoint"] == target.endpoint.id  # type: ignore[union-attr]
    assert reply.headers["x-request-id"] == "req-nonstream"
    sent = target.headers[-1]
    assert sent["x-request-id"] == "req-nonstream"
    assert sent["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"  # same trace, router's span as parent

    async with client.stream("POST", f"{mesh.http}{path}", json={"model": MODEL, **prompt, "max_tokens": 5, "stream": True}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        raw = b"".join([chunk async for chunk in stream.aiter_bytes()])
    framer = SseFramer()
    events = framer.feed(raw).data
    assert framer.flush() == b""  # whole events only
    assert events[-1] == DONE and len(events) == 6
    pieces = [p for p in map(parse_event, events) if p is not None]
    assert "".join(p.text for p in pieces) == "tok0 tok1 tok2 tok3 tok4 " and pieces[-1].usage is not None
    await _until(lambda: _zero(mesh), 5, "slots released")


async def _zero(mesh: Mesh) -> bool:
    return await mesh.in_flight() == 0


async def _in_flight_is(mesh: Mesh, n: int) -> bool:
    return await mesh.in_flight() == n


async def test_engine_killed_before_first_byte_falls_back(mesh: Mesh, client: httpx.AsyncClient, etcd: str) -> None:
    doomed = await FakeEngine().start(etcd)
    await doomed.stop()  # killed: its port refuses connections, its registration may still linger
    live = mesh.engines[1]
    mesh.epp.order = [doomed.endpoint, live.endpoint]  # type: ignore[list-item]
    before = len(live.requests)
    reply = await client.post(f"{mesh.http}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-endpoint"] == live.endpoint.id  # type: ignore[union-attr]
    assert len(live.requests) == before + 1

    mesh.epp.order = [doomed.endpoint]  # type: ignore[list-item]  # nothing left to fall back to
    reply = await client.post(f"{mesh.http}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 503
    assert reply.json()["error"]["type"] == "service_unavailable"
    await _until(lambda: _zero(mesh), 5, "slots released")


async def test_no_endpoint_from_epp_is_503(mesh: Mesh, client: httpx.AsyncClient) -> None:
    mesh.epp.order = []
    reply = await client.post(f"{mesh.http}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert reply.status_code == 503
    await _until(lambda: _zero(mesh), 5, "slot released")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_client_disconnect_releases_slot_and_cancels_engine(mesh: Mesh, stream: bool) -> None:
    engine = mesh.engines[0]
    engine.token_delay = 0.05  # 200 tokens: 10 s unless cancelled
    cancelled_before, requests_before = engine.cancelled, len(engine.requests)
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 200, "stream": stream}
    async with httpx.AsyncClient(timeout=20) as client:
        if stream:
            async with client.stream("POST", f"{mesh.http}/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                async for _ in reply.aiter_bytes():
                    break  # first token arrived: hang up
        else:
            task = asyncio.create_task(client.post(f"{mesh.http}/v1/completions", json=body))
            await _until(lambda: len(engine.requests) > requests_before, 5, "engine to receive the request")
            # admitted on a credit, it reaches flow_control's count with the stream's next write
            # (within the router's admission_credit_flush_seconds; the credit counted meanwhile)
            await _until(lambda: _in_flight_is(mesh, 1), 5, "flow_control to count the request")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    await _until(lambda: _zero(mesh), 5, "flow-control slot released")
    if stream:
        await _until(lambda: engine.cancelled > cancelled_before, 5, "engine request cancelled")


async def test_grpc_complete_stream_and_models(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        models = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
        assert MODEL in models.models
        reply = await stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="hi", max_tokens=3, flow_id="t1"), timeout=10)
        assert reply.text == "tok0 tok1 tok2" and reply.usage.completion_tokens == 3
        assert reply.endpoint_id == mesh.engines[0].endpoint.id  # type: ignore[union-attr]
        chat = await stub.Complete(router_pb2.CompletionRequest(
            model=MODEL, messages=[common_pb2.ChatMessage(role="user", content="hi")], max_tokens=2), timeout=10)
        assert chat.text == "tok0 tok1"
        chunks = [c async for c in stub.CompleteStream(router_pb2.CompletionRequest(model=MODEL, prompt_token_ids=[1, 2], max_tokens=4), timeout=10)]
        assert "".join(c.text for c in chunks) == "tok0 tok1 tok2 tok3 "
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="x", prompt_token_ids=[1]), timeout=5)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await stub.Complete(router_pb2.CompletionRequest(model="nope", prompt="x"), timeout=5)
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND
    await _until(lambda: _zero(mesh), 5, "slots released")


async def test_admission_rejection_is_429_and_queue_ttl_is_429(mesh: Mesh, start_service) -> None:
    """One slot, a queue of one: a held slot makes the next request queue (-> 429 at its TTL), the one after 429."""
    _, flow = start_service("flow_control", "--shutdown-grace-seconds", "0.5", "--max-in-flight", "1", "--max-queue-size", "1", "--queue-ttl-seconds", "1")
    http_port = free_port()
    router, _ = start_service("router", "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5", "--http-port", str(http_port), "--flow-control-address", flow,
                              "--epp-address", mesh.epp_address, "--retry-after-seconds", "3")
    http = f"http://127.0.0.1:{http_port}"
    small = Mesh(http, "", flow, mesh.epp, mesh.epp_address, mesh.engines, router)
    mesh.engines[0].token_delay = 0.05
    async with httpx.AsyncClient(timeout=20) as client:
        await _until(lambda: _models(client, http), 15, "router to see the engines")
        async with client.stream("POST", f"{http}/v1/completions", json={"model": MODEL, "prompt": "hold", "max_tokens": 100, "stream": True}) as held:
            assert held.status_code == 200
            queued = asyncio.create_task(client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "q"}))

            async def one_queued() -> bool:
                async with grpc.aio.insecure_channel(flow) as channel:
                    stats = await flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest())
                return stats.queued == 1

            await _until(one_queued, 5, "a request to queue")
            rejected = await client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "r"})
            assert rejected.status_code == 429, rejected.text
            assert rejected.headers["retry-after"] == "3"
            assert rejected.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
            assert rejected.json()["error"]["type"] == "rate_limit_exceeded"
            assert "rejected by admission" in rejected.json()["error"]["message"]
            expired = await queued  # TTL expiry answers 429 as llm-d does (issue 12), saying which
            assert expired.status_code == 429, expired.text
            assert expired.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
            assert expired.headers["retry-after"] == "3"
            assert expired.json()["error"]["type"] == "rate_limit_exceeded"
    await _until(lambda: _zero(small), 5, "slots released")


async def test_grpc_stream_cancel_releases_slot_and_cancels_engine(mesh: Mesh) -> None:
    engine = mesh.engines[0]
    engine.token_delay = 0.05
    cancelled_before = engine.cancelled
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        call = router_pb2_grpc.InferenceStub(channel).CompleteStream(
            router_pb2.CompletionRequest(model=MODEL, prompt="slow", max_tokens=200), timeout=20)
        first = await call.read()
        assert first.text == "tok0 "
        call.cancel()
    await _until(lambda: _zero(mesh), 5, "flow-control slot released")
    await _until(lambda: engine.cancelled > cancelled_before, 5, "engine request cancelled")


async def test_grpc_binds_api_keys_to_tenants(mesh: Mesh, start_service, tmp_path: Path) -> None:
    """A router with tenants: gRPC metadata binds as HTTP headers do (flows seen in flow_control's Stats)."""
    key = "sk-acme-grpc-0001"
    config = tmp_path / "router.yaml"  # JSON is YAML
    config.write_text(json.dumps({"tenants": [{"name": "acme", "api_keys": [key], "max_priority": 5}],
                                  "anonymous_max_priority": 1}))
    _, address = start_service("router", "--config", str(config), "--shutdown-grace-seconds", "0.5",
                               "--shutdown-http-grace-seconds", "0.5", "--http-port", str(free_port()),
                               "--flow-control-address", mesh.flow_control, "--epp-address", mesh.epp_address)
    for engine in mesh.engines:  # both requests stay in flight wherever they are sent
        engine.token_delay = 0.05
    picks_before = len(mesh.epp.picks)
    held = router_pb2.CompletionRequest(model=MODEL, prompt="hold", max_tokens=200, flow_id="spoof", priority=50)
    async with grpc.aio.insecure_channel(address) as channel, grpc.aio.insecure_channel(mesh.flow_control) as fc:
        stub = router_pb2_grpc.InferenceStub(channel)

        async def listed() -> bool:
            return MODEL in (await stub.ListModels(router_pb2.ListModelsRequest(), timeout=2)).models

        await _until(listed, 15, "router to see the engines")
        anonymous = stub.CompleteStream(held, metadata=(("x-gateway-inference-objective", "critical"),), timeout=20)
        keyed = stub.CompleteStream(held, metadata=(("authorization", f"Bearer {key}"),
                                                    ("x-gateway-inference-fairness-id", "spoof")), timeout=20)
        assert (await anonymous.read()).text == "tok0 " and (await keyed.read()).text == "tok0 "
        flows: list[tuple[str, int, int]] = []

        async def both_flows() -> bool:
            # A request dispatched on an admission credit reaches its flow when its Enqueue lands, just after
            # its first token can: the per-flow figures are eventually exact, never wrong.
            stats = await flow_control_pb2_grpc.FlowControlStub(fc).Stats(flow_control_pb2.StatsRequest(), timeout=2)
            flows[:] = sorted((f.flow_id, f.priority, f.in_flight) for f in stats.flows)
            return len(flows) == 2

        await _until(both_flows, 5, "both requests' flows in flow_control's Stats")
        assert flows == [("acme", 5, 1), ("default", 1, 1)]
        # This epp has no PickMany: both picks were asked of it with unary calls (never a degraded local pick).
        assert len(mesh.epp.picks) - picks_before == 2
        anonymous.cancel()
        keyed.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="x", max_tokens=1),
                                metadata=(("authorization", "Bearer sk-not-a-tenant-0"),), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (ERROR_CLASS_TRAILER, "Unauthenticated") in tuple(info.value.trailing_metadata() or ())
    await _until(lambda: _zero(mesh), 5, "flow-control slots released")


def _running(engine_url: str) -> float:
    for line in httpx.get(f"{engine_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running missing")


async def test_real_epp_and_simulator(mesh: Mesh, start_service, etcd: str, run_dir: Path) -> None:
    """The real epp (round-robin) and a real simulated engine behind the router: both answer shapes, a disconnect."""
    port = free_port()
    engine = ManagedProcess("engine", python_module(
        "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", "sim", "--events-endpoint", "",
        "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", "--max-model-len", "4096", "--time-scale", "1"),
        run_dir / f"router-test-sim-{port}.log").start()
    try:
        engine_url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{engine_url}/health", 60)
        _, epp = start_service("epp", "--shutdown-grace-seconds", "0.5", "--scheduling-config", "round-robin", "--metrics-scrape-interval-seconds", "0.1")
        http_port = free_port()
        start_service("router", "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5",
                      "--http-port", str(http_port), "--flow-control-address", mesh.flow_control, "--epp-address", epp)
        http = f"http://127.0.0.1:{http_port}"
        async with httpx.AsyncClient(timeout=30) as client:
            async def sim_listed() -> bool:
                data = (await client.get(f"{http}/v1/models")).json()["data"]
                return any(m["id"] == "sim" and m["max_model_len"] == 4096 for m in data)

            await _until(sim_listed, 15, "router to list the simulator's model")
            reply = await client.post(f"{http}/v1/completions", json={"model": "sim", "prompt": [1, 2, 3, 4], "max_tokens": 3})
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvmesh-endpoint"] == f"127.0.0.1:{port}"
            assert reply.json()["usage"]["completion_tokens"] == 3
            over = await client.post(f"{http}/v1/completions", json={"model": "sim", "prompt": list(range(4096)), "max_tokens": 1})
            assert over.status_code == 400
            async with client.stream("POST", f"{http}/v1/chat/completions", json={
                    "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as s:
                raw = b"".join([c async for c in s.aiter_bytes()])
            assert raw.endswith(b"data: [DONE]\n\n")
            async with client.stream("POST", f"{http}/v1/completions",
                                     json={"model": "sim", "prompt": "a long one", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as s:
                assert s.status_code == 200
                async for _ in s.aiter_bytes():
                    break
                assert _running(engine_url) == 1
        await _until(lambda: _zero(mesh), 5, "flow-control slot released")
        await _until(lambda: _running(engine_url) == 0, 5, "the simulator to drop the cancelled request")
    finally:
        engine.stop()


HOSTILE: list[tuple[str, str, bytes, list[tuple[bytes, bytes]]]] = [
    ("priority-over-int32", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-kvmesh-priority", b"2147483648")]),
    ("priority-huge", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-kvmesh-priority", b"99999999999999999999999")]),
    ("priority-huge-negative", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-kvmesh-priority", b"-99999999999999999999")]),
    ("priority-underscore", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-kvmesh-priority", b"1_0")]),
    ("objective-over-int32", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-llm-d-inference-objective", b"2147483648")]),
    ("surrogate-prompt", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', []),
    ("surrogate-chat", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', []),
    ("surrogate-model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', []),
    ("non-ascii-request-id", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"x-request-id", b"\xe9\xff")]),
    ("text-content-type", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"content-type", b"text/plain")]),
    ("form-content-type", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', [(b"content-type", b"application/x-www-form-urlencoded")]),
    ("number-role", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": 5, "content": "x"}]}', []),
]


@pytest.mark.parametrize(("path", "raw", "headers"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
async def test_hostile_inputs_are_400_with_openai_bodies(mesh: Mesh, client: httpx.AsyncClient, path: str, raw: bytes,
                                                         headers: list[tuple[bytes, bytes]]) -> None:
    log_before = mesh.router.log_path.read_bytes().count(b"Traceback")
    reply = await client.post(f"{mesh.http}{path}", content=raw, headers=headers)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["message"]
    assert mesh.router.log_path.read_bytes().count(b"Traceback") == log_before
    mesh.router.check_alive()


async def test_text_over_context_says_estimated(mesh: Mesh, client: httpx.AsyncClient) -> None:
    reply = await client.post(f"{mesh.http}/v1/completions", json={"model": MODEL, "prompt": "x" * 16 * 300})
    assert reply.status_code == 400
    assert "at least 301 prompt tokens (estimated)" in reply.json()["error"]["message"]


async def test_unknown_paths_and_methods_are_openai_json(mesh: Mesh, client: httpx.AsyncClient) -> None:
    missing = await client.get(f"{mesh.http}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = await client.get(f"{mesh.http}/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert "POST" in wrong.headers["allow"]


async def test_body_size_cap_is_413(mesh: Mesh, client: httpx.AsyncClient) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    reply = await client.post(f"{mesh.http}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"] == {"message": reply.json()["error"]["message"], "type": "invalid_request_error", "param": None, "code": 413}

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: counted while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    reply = await client.post(f"{mesh.http}/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == 413
    ok = await client.post(f"{mesh.http}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": "u" * (BODY_LIMIT // 2)})
    assert ok.status_code == 200, ok.text


async def test_flow_control_hung_is_one_504_then_admitted_locally_and_dead_is_degraded(mesh: Mesh, start_service) -> None:
    """SIGSTOPped flow_control: the first request ends in 504 at the admission timeout (2 s), which opens
    the router's flow_control breaker: the next requests are admitted locally at once (200, fail-open as
    for a dead flow_control) and /health is 200 "degraded" naming it (dependencies.flow_control
    DEADLINE_EXCEEDED); after SIGCONT /health is "ok" again; killed flow_control: /health 200 "degraded"
    naming it, requests admitted locally (docs/degraded-modes.md)."""
    fc_proc, flow = start_service("flow_control", "--shutdown-grace-seconds", "0.5")
    http_port = free_port()
    start_service("router", "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5", "--http-port", str(http_port),
                  "--flow-control-address", flow, "--epp-address", mesh.epp_address, "--admission-timeout-seconds", "2",
                  "--health-cache-seconds", "0.2")
    http = f"http://127.0.0.1:{http_port}"
    async with httpx.AsyncClient(timeout=20) as client:
        await _until(lambda: _models(client, http), 15, "router to see the engines")
        await _until(lambda: _healthy(client, http), 10, "router ready")
        os.killpg(fc_proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            reply = await client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            assert reply.status_code == 504, reply.text
            assert time.monotonic() - started < 5
            assert reply.json()["error"]["type"] == "timeout" and reply.json()["error"]["code"] == 504
            for _ in range(3):  # the breaker is open: no wait on the hung flow_control
                started = time.monotonic()
                served = await client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                assert served.status_code == 200, served.text
                assert time.monotonic() - started < 1.5  # not the 2 s wait
            hung = await client.get(f"{http}/health")
            assert hung.status_code == 200, hung.text
            assert hung.json()["dependencies"]["flow_control"] == "DEADLINE_EXCEEDED"
            assert hung.json()["status"] == "degraded" and hung.json()["degraded"] == ["flow_control"]
        finally:
            os.killpg(fc_proc.pid, signal.SIGCONT)
        await _until(lambda: _healthy(client, http), 10, "router ready again after SIGCONT")
        ok = await client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        fc_proc.kill()

        async def degraded() -> bool:  # unreachable (not hung): the fail-open mode serves, so still ready
            reply = await client.get(f"{http}/health")
            return reply.status_code == 200 and reply.json()["dependencies"]["flow_control"] == "UNAVAILABLE"

        await _until(degraded, 10, "/health to report flow_control down")
        body = (await client.get(f"{http}/health")).json()
        assert body["status"] == "degraded" and body["degraded"] == ["flow_control"]
        assert body["dependencies"]["epp"] == "SERVING"
        admitted = await client.post(f"{http}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert admitted.status_code == 200, admitted.text  # admitted locally


def _counter(metrics_url: str, outcome: str) -> float:
    for line in httpx.get(f"{metrics_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'kvmesh_router_requests_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_engine_killed_mid_stream_ends_with_sse_error(mesh: Mesh, etcd: str, run_dir: Path) -> None:
    port = free_port()
    engine = ManagedProcess("engine", python_module(
        "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", "dying", "--events-endpoint", "",
        "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", "--max-model-len", "4096", "--time-scale", "0.2"),
        run_dir / f"router-test-dying-{port}.log").start()
    try:
        url = f"http://127.0.0.1:{port}"
        await _until(lambda: _http_ok(f"{url}/health"), 60, "simulator up")
        mesh.epp.order = [Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=url, model="dying")]
        async with httpx.AsyncClient(timeout=30) as client:
            async def listed() -> bool:
                return any(m["id"] == "dying" for m in (await client.get(f"{mesh.http}/v1/models")).json()["data"])

            await _until(listed, 15, "router to list the dying model")
            upstream_errors = _counter(mesh.metrics, "upstream_error")
            raw = b""
            async with client.stream("POST", f"{mesh.http}/v1/completions", json={
                    "model": "dying", "prompt": "a long one", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as s:
                assert s.status_code == 200
                async for chunk in s.aiter_bytes():
                    raw += chunk
                    if raw.count(b"\n\n") >= 2 and engine.alive():
                        engine.kill()
        events = [e for e in raw.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), raw[-300:]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["type"] == "service_unavailable", error
        # in the client's words, no HTTP client class names (was "failed mid-stream (ClientPayloadError)")
        assert "closed the connection mid-stream; the answer is incomplete" in error["message"], error
        assert "Error" not in error["message"], error
        for event in events[:-2]:
            assert "choices" in json.loads(event[6:])  # whole events only before the error
        await _until(lambda: _zero(mesh), 5, "slot released")
        assert _counter(mesh.metrics, "upstream_error") == upstream_errors + 1
    finally:
        engine.stop()


async def _http_ok(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as client:
            return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False
