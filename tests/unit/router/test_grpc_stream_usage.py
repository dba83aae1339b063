"""gRPC ``Inference/CompleteStream`` ends with the engine's own usage: the router asks the engine for
``stream_options.include_usage`` and folds vLLM's usage-only chunk (``choices: []`` before ``[DONE]``)
into the last ``CompletionChunk`` (finish reason + usage), never passing it on as an empty chunk.

The engine simulator (held to vLLM 0.32's streaming wire: the usage chunk only when asked) serves the
router's ``RequestFlow`` in process (its ASGI app behind httpx); the router's ``InferenceServicer`` runs
on a real grpc.aio server with the shared interceptors, called over a loopback channel."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from engine_simulator.app import EngineSimulator
from engine_simulator.engine import AsyncEngine
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.server import EngineHttpApi, ServerState
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.clock import ScaledClock
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow
from services.router.servicer import openai_body
from tests.unit.router._support import inference_stub
from tests.unit.router.fakes import CATALOG, MODEL, FakeAdmission, FakePicker

IDS = list(range(1, 131))  # 130 token ids: two whole 64-token blocks, so a repeat hits the prefix cache


@dataclass
class Router:
    stub: router_pb2_grpc.InferenceStub
    bodies: list[dict]


@pytest.fixture
async def router(sim: EngineSimulator) -> AsyncIterator[Router]:
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(sim.config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    app = EngineHttpApi(ServerState(engine, sim.renderer, MODEL, 512, sim.tokenizer_dir, 1700000000)).app()
    bodies: list[dict] = []

    async def seen(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), event_hooks={"request": [seen]})
    config = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30)
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    try:
        async with inference_stub(config, flow) as stub:
            yield Router(stub, bodies)
    finally:
        await flow.aclose()
        await http.aclose()
        await engine.stop()


REQUESTS = {
    "text": router_pb2.CompletionRequest(model=MODEL, prompt="hello there, how are you", max_tokens=4),
    "token-ids": router_pb2.CompletionRequest(model=MODEL, prompt_token_ids=IDS, max_tokens=4),
    "chat": router_pb2.CompletionRequest(model=MODEL, max_tokens=4, messages=[
        common_pb2.ChatMessage(role="system", content="be brief"), common_pb2.ChatMessage(role="user", content="hi")]),
}


@pytest.mark.parametrize("form", list(REQUESTS))
async def test_the_last_chunk_carries_the_engines_usage(router: Router, form: str) -> None:
    request = REQUESTS[form]
    unary = await router.stub.Complete(request, timeout=10)
    assert unary.usage.prompt_tokens > 0
    chunks = [c async for c in router.stub.CompleteStream(request, timeout=10)]
    assert router.bodies[-1]["stream_options"] == {"include_usage": True}  # asked of the engine
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (unary.usage.prompt_tokens, 4)
    assert "".join(c.text for c in chunks) == unary.text
    # the usage-only chunk is folded in, not passed on: every chunk but the last has text, only the last has usage
    assert all(c.text for c in chunks[:-1]) and not any(c.HasField("usage") for c in chunks[:-1])
    assert not any(c.finish_reason for c in chunks[:-1])


async def test_a_repeated_prompt_streams_its_cached_tokens(router: Router) -> None:
    request = REQUESTS["token-ids"]
    [c async for c in router.stub.CompleteStream(request, timeout=10)]
    chunks = [c async for c in router.stub.CompleteStream(request, timeout=10)]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.cached_tokens) == (len(IDS), 128)  # two blocks (the last token is computed)


def test_only_streams_ask_for_usage() -> None:
    assert openai_body(REQUESTS["text"], stream=True)[1]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in openai_body(REQUESTS["text"], stream=False)[1]


async def test_an_engine_without_the_usage_chunk_still_ends_with_finish_and_a_count() -> None:
    """An engine that ignores include_usage: the finishing chunk still goes out last, with the router's
    count of the pieces (as before), and nothing is lost."""
    sse = (b'data: {"id":"c1","choices":[{"text":"he","finish_reason":null}]}\n\n'
           b'data: {"id":"c1","choices":[{"text":"llo","finish_reason":"length"}]}\n\n'
           b"data: [DONE]\n\n")
    http = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse)))
    config = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30)
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    try:
        async with inference_stub(config, flow) as stub:
            chunks = [c async for c in stub.CompleteStream(REQUESTS["text"], timeout=10)]
    finally:
        await flow.aclose()
    assert [(c.text, c.finish_reason) for c in chunks] == [("he", ""), ("llo", "length")]
    assert chunks[-1].usage.completion_tokens == 2 and not chunks[0].HasField("usage")
