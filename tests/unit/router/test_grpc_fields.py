"""Every ``CompletionRequest`` field reaches the engine with the meaning the HTTP front door gives it, and a field
the servicer cannot carry is refused with ``INVALID_ARGUMENT`` naming it, never dropped silently.

The router's ``InferenceServicer`` on a real grpc.aio server (the shared interceptors, a loopback channel) in front
of the engine simulator (vLLM 0.32's behaviour: stop strings cut the text, ``ignore_eos`` runs past EOS,
``max_tokens`` bounds the answer), served in process over ASGI; the engine's request bodies are recorded. Each
gRPC answer is compared with the simulator's answer to the equivalent HTTP body sent to it directly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from engine_simulator.app import EngineSimulator
from engine_simulator.engine import AsyncEngine
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.server import EngineHttpApi, ServerState
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.clock import ScaledClock
from services.router import servicer
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow
from services.router.servicer import BODY_FIELDS, METADATA_FIELDS, openai_body
from tests.support import eos_prompt
from tests.unit.router._support import inference_stub
from tests.unit.router.fakes import CATALOG, MODEL, FakeAdmission, FakePicker


@dataclass
class Router:
    stub: router_pb2_grpc.InferenceStub
    engine: httpx.AsyncClient
    """The simulator itself (no router): the equivalent HTTP body's answer."""
    bodies: list[dict[str, Any]]
    """Every body the engine received, in order."""


@pytest.fixture
async def router(sim: EngineSimulator) -> AsyncIterator[Router]:
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(sim.config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    app = EngineHttpApi(ServerState(engine, sim.renderer, MODEL, 512, sim.tokenizer_dir, 1700000000)).app()
    bodies: list[dict[str, Any]] = []

    async def seen(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), event_hooks={"request": [seen]})
    direct = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
    config = RouterConfig(etcd_endpoints=[], request_timeout_seconds=30)
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    try:
        async with inference_stub(config, flow) as stub:
            yield Router(stub, direct, bodies)
    finally:
        await flow.aclose()
        await http.aclose()
        await direct.aclose()
        await engine.stop()


def test_the_servicer_carries_every_field_of_the_proto() -> None:
    """A field added to ``CompletionRequest`` fails here until the servicer maps it (or refuses it on purpose)."""
    proto_fields = {f.name for f in router_pb2.CompletionRequest.DESCRIPTOR.fields}
    assert proto_fields == BODY_FIELDS | METADATA_FIELDS
    assert not BODY_FIELDS & METADATA_FIELDS


async def _direct(router: Router, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await router.engine.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _without_stream(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


async def test_each_body_field_reaches_the_engine_with_its_http_meaning(router: Router, sim: EngineSimulator) -> None:
    prompt, ids = eos_prompt(sim)
    eos_at = len(ids)
    # max_tokens and ignore_eos: the engine runs past EOS to exactly max_tokens
    request = router_pb2.CompletionRequest(model=MODEL, prompt_token_ids=prompt, max_tokens=eos_at + 6, ignore_eos=True)
    answer = await router.stub.Complete(request, timeout=10)
    http_body = {"model": MODEL, "prompt": prompt, "max_tokens": eos_at + 6, "ignore_eos": True}
    assert _without_stream(router.bodies[-1]) == http_body
    direct = await _direct(router, "/v1/completions", http_body)
    assert (answer.text, answer.finish_reason) == (direct["choices"][0]["text"], "length")
    assert answer.usage.completion_tokens == eos_at + 6
    # without ignore_eos the same prompt stops at EOS: the field, not a default, made the difference
    stopped = await router.stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt_token_ids=prompt,
                                                                      max_tokens=eos_at + 6), timeout=10)
    assert (stopped.finish_reason, stopped.usage.completion_tokens) == ("stop", eos_at)
    assert "ignore_eos" not in router.bodies[-1]
    # stop: a string from the middle of the answer cuts it there, as the engine does for the HTTP body
    stop = answer.text[3:6]
    cut = await router.stub.Complete(router_pb2.CompletionRequest(
        model=MODEL, prompt_token_ids=prompt, max_tokens=eos_at + 6, ignore_eos=True, stop=[stop, "zzzz"]),
        timeout=10)
    assert router.bodies[-1]["stop"] == [stop, "zzzz"]
    assert cut.finish_reason == "stop" and cut.text == answer.text[:answer.text.index(stop)]
    # temperature: the decimal the client wrote (not the float32's expansion), in the engine's bounds
    warm = await router.stub.Complete(router_pb2.CompletionRequest(
        model=MODEL, prompt="hello there", max_tokens=3, temperature=0.7), timeout=10)
    assert router.bodies[-1]["temperature"] == 0.7 and warm.usage.completion_tokens == 3
    greedy = await router.stub.Complete(router_pb2.CompletionRequest(
        model=MODEL, prompt="hello there", max_tokens=3, temperature=0.0), timeout=10)
    assert router.bodies[-1]["temperature"] == 0.0 and greedy.text == warm.text  # set to 0: sent, not dropped
    count = len(router.bodies)
    with pytest.raises(grpc.aio.AioRpcError) as hot:
        await router.stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="x", temperature=2.5), timeout=10)
    assert hot.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'temperature'" in (hot.value.details() or "")
    assert len(router.bodies) == count  # refused as the HTTP front door refuses it: before the engine
    # messages: the chat route with the messages as sent
    chat = router_pb2.CompletionRequest(model=MODEL, max_tokens=4, stop=["\n\n"], messages=[
        common_pb2.ChatMessage(role="system", content="be brief"), common_pb2.ChatMessage(role="user", content="hi")])
    chunks = [c async for c in router.stub.CompleteStream(chat, timeout=10)]
    chat_body = {"model": MODEL, "max_tokens": 4, "stop": ["\n\n"],
                 "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert _without_stream(router.bodies[-1]) == chat_body
    direct_chat = await _direct(router, "/v1/chat/completions", chat_body)
    assert "".join(c.text for c in chunks) == direct_chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("field", sorted(BODY_FIELDS - {"model", "prompt", "prompt_token_ids", "messages"}))
async def test_a_field_the_servicer_cannot_carry_is_refused_by_name(
    router: Router, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """The proto grew a field the servicer does not forward (simulated: the field taken out of the table): a request
    setting it is ``INVALID_ARGUMENT`` naming it, unary and streamed, and the engine is not asked."""
    monkeypatch.setattr(servicer, "BODY_FIELDS", BODY_FIELDS - {field})
    values: dict[str, Any] = {"max_tokens": 4, "temperature": 0.5, "stop": ["."], "ignore_eos": True, "top_p": 0.9,
                              "top_k": 5, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.1, "min_tokens": 1}
    request = router_pb2.CompletionRequest(model=MODEL, prompt="hello", **{field: values[field]})
    for call in ("Complete", "CompleteStream"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            if call == "Complete":
                await router.stub.Complete(request, timeout=10)
            else:
                [c async for c in router.stub.CompleteStream(request, timeout=10)]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"'{field}' is not supported" in (refused.value.details() or "")
    assert router.bodies == []
    # unset, the same request without the field goes through
    assert (await router.stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=2)
                                       if field != "max_tokens" else
                                       router_pb2.CompletionRequest(model=MODEL, prompt="hello"), timeout=10)).text


def test_float32_fields_read_as_written() -> None:
    for name in servicer.FLOAT_SAMPLING_FIELDS:
        for value in (0.7, 0.1, 1.3, 2.0, 0.0, 1e-05, 0.123456):
            request = router_pb2.CompletionRequest(model=MODEL, prompt="p", **{name: value})
            assert openai_body(request, stream=False)[1][name] == value


async def test_sampling_fields_reach_the_engine_as_the_http_body_sends_them(router: Router) -> None:
    """``top_p``, ``top_k``, ``seed``, the penalties and ``min_tokens``: set, each is in the engine's body with the
    value written (0 included: proto3 ``optional`` tells set from unset); unset, none is sent. The engine's range
    checks (vLLM 0.32's ``SamplingParams``) answer a bad value as for the HTTP front door: ``INVALID_ARGUMENT``."""
    fields: dict[str, Any] = {"top_p": 0.9, "top_k": 5, "seed": 123456789012, "presence_penalty": -0.5,
                              "frequency_penalty": 0.0, "repetition_penalty": 1.1, "min_tokens": 2}
    answer = await router.stub.Complete(router_pb2.CompletionRequest(
        model=MODEL, prompt="hello there", max_tokens=4, **fields), timeout=10)
    assert answer.usage.completion_tokens >= 2
    assert _without_stream(router.bodies[-1]) == {"model": MODEL, "prompt": "hello there", "max_tokens": 4, **fields}
    direct = await _direct(router, "/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 4,
                                                        **fields})
    assert answer.text == direct["choices"][0]["text"]  # same seed, same body: the same answer
    await router.stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=2), timeout=10)
    assert not set(fields) & set(router.bodies[-1])
    for bad in ({"top_p": 1.5}, {"top_k": -2}, {"repetition_penalty": 0.0}, {"min_tokens": 9}):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router.stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=4, **bad),
                                       timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert f"{next(iter(bad))}" in (refused.value.details() or ""), (bad, refused.value.details())
