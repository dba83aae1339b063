"""In-process tokenization (issue 7 cases 2-3, issue 10): epp's ids are exactly the engine's.

The engine side is the simulator's ``Renderer`` (held to vLLM 0.32: ``kvmesh.chat_template``) and the
recorded vLLM 0.32 answers (``tests/compat/fixtures/vllm-0.32.0/script.json``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine_simulator.rendering import Renderer
from engine_simulator.tokenizer import synthetic_corpus
from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.interfaces import Candidate, ChatMessage, SchedulingRequest
from services.epp.tokenization.in_process import TOKENIZER_LABEL, InProcessTokenizer
from services.epp.tokenization.local import LocalTokenizer, message_chain
from services.epp.tokenize_client import TokenizeSkipped

SCRIPT = Path(__file__).resolve().parents[2] / "compat" / "fixtures" / "vllm-0.32.0" / "script.json"

CASE3 = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "chat_template_kwargs": {"enable_thinking": False},
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "weather in"}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, clear"},
        {"role": "user", "content": "thanks"},
    ],
}


def _candidate(tok_dir: Path) -> Candidate:
    return Candidate(Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="tiny",
                              block_size_tokens=32, labels={TOKENIZER_LABEL: str(tok_dir), "max_model_len": "4096"}))


def test_case3_renders_every_field_like_vllm(tok_dir: Path, engine: Renderer) -> None:
    local = LocalTokenizer(tok_dir)
    text = local.chat_text(CASE3)
    assert "weather in\nParis?" in text  # vLLM joins text parts with a newline
    assert '<|tool_call|>{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "[call_1] 18C, clear" in text and '"get_weather"' in text.split("<|system|>")[0]
    assert text.endswith("<|assistant|>\n<think></think>\n")  # chat_template_kwargs reached the template
    assert local.chat_ids(CASE3) == engine.chat_request_ids(CASE3)


async def test_pick_tokens_follow_every_token_changing_field(tok_dir: Path, engine: Renderer) -> None:
    tokenizer = InProcessTokenizer({}, None)
    cands = [_candidate(tok_dir)]
    bodies = [
        CASE3,
        {**CASE3, "add_generation_prompt": False},
        {**CASE3, "add_special_tokens": True},
        {**CASE3, "truncate_prompt_tokens": 20},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"messages": CASE3["messages"], "documents": [{"title": "t", "text": "doc"}]},
    ]
    seen = set()
    for body in bodies:
        req = SchedulingRequest(model="tiny", render=body)
        ids = await tokenizer.tokenize(req, cands)
        assert ids == engine.chat_request_ids(body), body
        seen.add(tuple(ids))
    assert len(seen) == len(bodies)  # each field changed the keys


async def test_completions_add_special_tokens_matches_recorded_vllm(tok_dir: Path, engine: Renderer) -> None:
    tokenizer = InProcessTokenizer({"tiny": str(tok_dir)}, None)
    steps = [s for s in json.loads(SCRIPT.read_text())
             if isinstance(s.get("request"), dict) and isinstance(s["request"].get("prompt"), str)
             and isinstance(s.get("prompt_token_ids"), list)]
    assert steps
    for step in steps:
        prompt = step["request"]["prompt"]
        ids = await tokenizer.tokenize(SchedulingRequest(model="tiny", prompt=prompt), [])
        assert ids == step["prompt_token_ids"]  # recorded from vLLM 0.32: BOS first
        bare = await tokenizer.tokenize(
            SchedulingRequest(model="tiny", prompt=prompt, render={"add_special_tokens": False}), [])
        assert bare == step["prompt_token_ids"][1:]  # issue 7 case 2: the engine caches no BOS
        assert bare == engine.completion_request_ids({"prompt": prompt, "add_special_tokens": False})


async def test_multimodal_parts_are_scored_by_load(tok_dir: Path) -> None:
    tokenizer = InProcessTokenizer({"tiny": str(tok_dir)}, None)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    with pytest.raises(TokenizeSkipped) as err:
        await tokenizer.tokenize(SchedulingRequest(model="tiny", render=body), [])
    assert err.value.reason == "multimodal"


def test_growing_chat_encodes_only_the_new_turn(tok_dir: Path) -> None:
    local = LocalTokenizer(tok_dir)
    reference = LocalTokenizer(tok_dir)
    rng = random.Random(7)
    docs = synthetic_corpus(documents=200)
    messages: list[dict[str, str]] = [{"role": "system", "content": "  spaced  system\n\n"}]
    for turn in range(30):
        messages.append({"role": "user", "content": rng.choice(docs) + " " * rng.randint(0, 3)})
        body = {"messages": list(messages)}
        before = local.stats["encoded_chars"]
        ids = local.chat_ids(body, message_chain("r", messages))
        assert ids == reference.encode_text(reference.chat_text(body), add_special_tokens=False)
        if turn > 2:
            # the turn since the last call: the assistant's reply and the new user message (+ template)
            new_turn = len(messages[-1]["content"]) + len(messages[-2]["content"])
            assert local.stats["encoded_chars"] - before < new_turn + 64
        messages.append({"role": "assistant", "content": rng.choice(docs)})
    assert local.stats["incremental"] >= 28
    assert local.renderer is not None and local.renderer.incremental  # the simulator's template renders windowed
    assert local.renderer.stats["incremental"] >= 25 and local.renderer.stats["fallback"] == 0


async def test_plain_messages_use_the_same_path(tok_dir: Path, engine: Renderer) -> None:
    tokenizer = InProcessTokenizer({}, None)
    req = SchedulingRequest(model="tiny", messages=(ChatMessage("user", "hello there"),))
    assert await tokenizer.tokenize(req, [_candidate(tok_dir)]) == engine.chat_ids([{"role": "user", "content": "hello there"}])


async def test_a_chat_equal_in_python_but_rendered_apart_gets_its_own_tokens(tok_dir: Path, engine: Renderer) -> None:
    """Tools in another key order, and tool-call arguments ``1`` then ``1.0`` or ``true`` (Python ``==``, other
    text under ``tojson``), each get the engine's tokens: no cache (root, rendered prefix, remote key)
    serves another chat's."""
    from services.epp.tokenize_client import EngineTokenizer

    tokenizer = InProcessTokenizer({}, None)
    cands = [_candidate(tok_dir)]
    turns = [m for i in range(8) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})]

    def body(tools: list, arguments: object, extra: int) -> dict:
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
        return {"tools": tools, "messages": [CASE3["messages"][0], {"role": "user", "content": "go"}, call,
                                             {"role": "tool", "tool_call_id": "c", "content": "ok"},
                                             *turns[: 2 * extra + 1]]}

    ordered = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    reordered = [{"function": {"parameters": {"type": "object"}, "name": "get_weather"}, "type": "function"}]
    bodies = [body(ordered, {"n": 1}, 4), body(reordered, {"n": 1}, 5), body(reordered, {"n": 1.0}, 6),
              body(reordered, {"n": True}, 7)]
    for b in bodies:
        assert await tokenizer.tokenize(SchedulingRequest(model="tiny", render=b), cands) == engine.chat_request_ids(b)
    keys = {EngineTokenizer._body_and_key(SchedulingRequest(model="tiny", render=b))[1]
            for b in (body(ordered, {"n": 1}, 4), body(reordered, {"n": 1}, 4), body(reordered, {"n": 1.0}, 4))}
    assert len(keys) == 3  # the engine /tokenize fallback's cache keys them apart too
