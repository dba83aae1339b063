"""A failing engine step kills the engine as vLLM 0.32's engine core dies (``EngineDeadError``), it never hangs:
every in-flight request ends with an error (non-streamed: 500 with vLLM's error body; streamed: the error event,
then ``[DONE]``), the failure is logged with its traceback, ``/health`` answers 503 and later requests get 500 at
once. Also SGLang's ``/generate`` text: an EOS-ended answer does not end with ``</s>`` (SGLang's
``trim_matched_stop`` and ``skip_special_tokens``).

The real engine loop (:class:`AsyncEngine` on a scaled clock) behind the real HTTP apps, in process over ASGI; the
failure is injected into :class:`EngineCore` (``schedule`` or ``update`` raising once every request is in it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engine_simulator.app import EngineSimulator, build_service
from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import ENGINE_DEAD_MESSAGE, AsyncEngine
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import EngineCore
from engine_simulator.server import EngineHttpApi, ServerState
from engine_simulator.sglang import SGLangHttpApi, server_args
from engine_simulator.tokenizer import EOS_ID
from kvmesh.clock import ScaledClock
from tests.support import eos_prompt

MODEL = "tiny"
MAX_MODEL_LEN = 512
DEADLINE = 10.0
"""Seconds within which every request must have its answer (before the fix: never)."""
DEAD_BODY = {"error": {"message": ENGINE_DEAD_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}}


@dataclass
class Served:
    sim: EngineSimulator
    engine: AsyncEngine
    client: httpx.AsyncClient


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("tok"))


async def _serve(tokenizer_dir: str, personality: str) -> AsyncIterator[Served]:
    """A fresh engine per test (a failed step leaves its core in an unknown state)."""
    sim = build_service(SimulatorConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, time_scale=20.0,
                                        personality=personality, tokenizer_path=tokenizer_dir, etcd_endpoints=[]))
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(sim.config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    state = ServerState(engine, sim.renderer, MODEL, MAX_MODEL_LEN, sim.tokenizer_dir, 1700000000)
    if personality == "sglang":
        args = server_args(model=MODEL, model_path=sim.tokenizer_dir, host="127.0.0.1", port=30000, page_size=16,
                           num_pages=64, max_running_requests=8, chunked_prefill_size=2048,
                           context_length=MAX_MODEL_LEN, kv_events_endpoint="", lora_paths=[])
        app = SGLangHttpApi(state, args).app()
    else:
        app = EngineHttpApi(state).app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim", timeout=30) as c:
        yield Served(sim, engine, c)
    await asyncio.wait_for(engine.stop(), DEADLINE)


@pytest.fixture
async def vllm(tokenizer_dir: str) -> AsyncIterator[Served]:
    async for served in _serve(tokenizer_dir, "vllm"):
        yield served


@pytest.fixture
async def sglang(tokenizer_dir: str) -> AsyncIterator[Served]:
    async for served in _serve(tokenizer_dir, "sglang"):
        yield served


def _fail_once_holding(monkeypatch: pytest.MonkeyPatch, method: str, requests: int) -> list[int]:
    """Make ``EngineCore.<method>`` raise once the core holds ``requests`` requests (running + waiting); returns
    the list the raise is recorded in."""
    original: Callable[..., Any] = getattr(EngineCore, method)
    raised: list[int] = []

    def failing(self: EngineCore, *args: Any) -> Any:
        if self.num_running + self.num_waiting >= requests:
            raised.append(1)
            raise RuntimeError(f"injected failure in {method}")
        return original(self, *args)

    monkeypatch.setattr(EngineCore, method, failing)
    return raised


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def _streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    async with client.stream("POST", path, json=body) as reply:
        await reply.aread()
        return reply


def _long(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, **extra}


@pytest.mark.parametrize("method", ["schedule", "update"])
async def test_a_failing_step_ends_every_request_with_an_error(
    vllm: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    raised = _fail_once_holding(monkeypatch, method, 4)
    client = vllm.client
    assert (await client.get("/health")).status_code == 200
    with caplog.at_level(logging.ERROR, logger="engine_simulator.engine"):
        plain, stream, chat, response = await asyncio.wait_for(asyncio.gather(
            client.post("/v1/completions", json=_long("one plain request")),
            _streamed(client, "/v1/completions", _long("one streamed request", stream=True)),
            _streamed(client, "/v1/chat/completions", {"model": MODEL, "max_tokens": 200, "ignore_eos": True,
                                                       "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
            _streamed(client, "/v1/responses", {"model": MODEL, "input": "hello", "stream": True,
                                                "max_output_tokens": 200, "ignore_eos": True}),
        ), DEADLINE)
    assert raised == [1]
    assert plain.status_code == 500 and plain.json() == DEAD_BODY
    for streamed in (stream, chat):  # vLLM's stream generators: the error event, then [DONE]
        assert streamed.status_code == 200
        events = _events(streamed.text)
        assert events[-1] == "[DONE]" and json.loads(events[-2]) == DEAD_BODY
    last = json.loads(_events(response.text)[-1])
    assert (last["type"], last["message"]) == ("error", ENGINE_DEAD_MESSAGE)
    failures = [r for r in caplog.records if r.name == "engine_simulator.engine" and r.levelno == logging.ERROR]
    assert len(failures) == 1 and "4 in-flight request(s)" in failures[0].getMessage()
    assert failures[0].exc_info is not None and f"injected failure in {method}" in str(failures[0].exc_info[1])
    assert vllm.engine.dead is not None
    assert (await client.get("/health")).status_code == 503
    # the engine stays dead: later requests are refused at once, streamed or not, beam search too
    later = await asyncio.wait_for(asyncio.gather(
        client.post("/v1/completions", json=_long("after the failure")),
        client.post("/v1/completions", json=_long("after the failure", stream=True)),
        client.post("/v1/completions", json=_long("beam", use_beam_search=True, n=2, max_tokens=4)),
    ), DEADLINE)
    assert [r.status_code for r in later] == [500, 500, 500] and all(r.json() == DEAD_BODY for r in later)


async def test_a_failure_while_beam_search_runs_answers_500(vllm: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    raised = _fail_once_holding(monkeypatch, "update", 2)  # a beam round's two requests
    reply = await asyncio.wait_for(vllm.client.post("/v1/completions", json=_long(
        "beam", use_beam_search=True, n=2, max_tokens=20)), DEADLINE)
    assert raised == [1]
    assert reply.status_code == 500 and reply.json() == DEAD_BODY


async def test_sglang_generate_ends_with_an_error_and_health_503(sglang: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    raised = _fail_once_holding(monkeypatch, "update", 2)
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    plain, stream = await asyncio.wait_for(asyncio.gather(
        sglang.client.post("/generate", json=body),
        _streamed(sglang.client, "/generate", {**body, "stream": True}),
    ), DEADLINE)
    assert raised == [1]
    assert plain.status_code == 500 and plain.json() == DEAD_BODY
    events = _events(stream.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2]) == DEAD_BODY
    assert (await sglang.client.get("/health")).status_code == 503
    again = await sglang.client.post("/generate", json=body)
    assert again.status_code == 500 and again.json() == DEAD_BODY


async def test_sglang_generate_text_leaves_eos_out(sglang: Served) -> None:
    """SGLang 0.5.23: the detokenizer trims the matched stop token (``trim_matched_stop``) and skips special tokens
    by default, so the text has no ``</s>``; ``output_ids`` keep the EOS; ``no_stop_trim`` with
    ``skip_special_tokens: false`` shows it. Streamed chunks (cumulative text) end the same way."""
    prompt, ids = eos_prompt(sglang.sim)
    before = sglang.sim.renderer.detokenize(ids[:-1])
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 30}}
    answer = (await sglang.client.post("/generate", json=body)).json()
    assert answer["output_ids"] == ids and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    assert answer["text"] == before and not answer["text"].endswith("</s>")
    stream = await _streamed(sglang.client, "/generate", {**body, "stream": True})
    assert json.loads(_events(stream.text)[-2])["text"] == before
    no_skip = {**body, "sampling_params": {"max_new_tokens": 30, "skip_special_tokens": False}}
    assert (await sglang.client.post("/generate", json=no_skip)).json()["text"] == before  # trimmed all the same
    shown = {**body, "sampling_params": {"max_new_tokens": 30, "skip_special_tokens": False, "no_stop_trim": True}}
    assert (await sglang.client.post("/generate", json=shown)).json()["text"] == before + "</s>"
    kept_skipped = {**body, "sampling_params": {"max_new_tokens": 30, "no_stop_trim": True}}
    assert (await sglang.client.post("/generate", json=kept_skipped)).json()["text"] == before
    # the OpenAI routes of the SGLang personality leave it out too
    completion = (await sglang.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": 30})).json()
    assert completion["choices"][0]["text"] == before
    bad = await sglang.client.post("/generate", json={**body, "sampling_params": {"skip_special_tokens": "no"}})
    assert bad.status_code == 400 and "skip_special_tokens" in bad.text
