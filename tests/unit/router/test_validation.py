"""Router validation and error bodies: table-driven, pure (no I/O)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.openai_stream import SseFramer, parse_completion, parse_event
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog
from services.router.config import RouterConfig
from services.router.http_app import request_meta
from services.router.http_errors import error_from_engine, http_error
from services.router.validation import RequestKind, parse_json_body, validate_request

C, CHAT = RequestKind.COMPLETION, RequestKind.CHAT


def _ep(port: int, model: str = "tiny", max_len: str | None = "128") -> Endpoint:
    labels = {"max_model_len": max_len} if max_len is not None else {}
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model, labels=labels)


CATALOG = ModelCatalog.from_endpoints([_ep(1), _ep(2, max_len="256"), _ep(3, model="other", max_len=None)])
EMPTY = ModelCatalog()

BAD_CASES: list[tuple[str, RequestKind, dict[str, Any], type[errors.KvmeshError], str]] = [
    ("missing-model", C, {"prompt": "hi"}, errors.InvalidRequest, "'model' is required"),
    ("model-not-string", C, {"model": 3, "prompt": "hi"}, errors.InvalidRequest, "'model' must be"),
    ("unknown-model", C, {"model": "nope", "prompt": "hi"}, errors.UnknownModel, "does not exist"),
    ("no-prompt", C, {"model": "tiny"}, errors.InvalidRequest, "'prompt' is required"),
    ("messages-on-completions", C, {"model": "tiny", "prompt": "x", "messages": []}, errors.InvalidRequest, "'messages' belongs"),
    ("prompt-on-chat", CHAT, {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, errors.InvalidRequest, "'prompt' belongs"),
    ("no-messages", CHAT, {"model": "tiny"}, errors.InvalidRequest, "'messages' must be"),
    ("empty-messages", CHAT, {"model": "tiny", "messages": []}, errors.InvalidRequest, "'messages' must be"),
    ("message-no-role", CHAT, {"model": "tiny", "messages": [{"content": "x"}]}, errors.InvalidRequest, "role"),
    ("message-part-no-type", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"text": "x"}]}]}, errors.InvalidRequest, "'type'"),
    ("message-text-part-no-text", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, errors.InvalidRequest, "string 'text'"),
    ("empty-prompt", C, {"model": "tiny", "prompt": ""}, errors.InvalidRequest, "must not be empty"),
    ("batch-mixed", C, {"model": "tiny", "prompt": ["a", [1, 2]]}, errors.InvalidRequest, "not a mix"),
    ("batch-empty-item", C, {"model": "tiny", "prompt": ["a", ""]}, errors.InvalidRequest, "'prompt[1]' must not be empty"),
    ("batch-item-dict", C, {"model": "tiny", "prompt": [{"a": 1}]}, errors.InvalidRequest, "'prompt[0]' must be"),
    ("batch-too-large", C, {"model": "tiny", "prompt": ["a"] * 1025}, errors.InvalidRequest, "at most 1024"),
    ("batch-one-over-context", C, {"model": "tiny", "prompt": [[1], list(range(129))]}, errors.InvalidRequest, "maximum context length"),
    ("prompt-dict", C, {"model": "tiny", "prompt": {"a": 1}}, errors.InvalidRequest, "'prompt' must be"),
    ("negative-token-id", C, {"model": "tiny", "prompt": [1, -2]}, errors.InvalidRequest, "token ids"),
    ("max-tokens-zero", C, {"model": "tiny", "prompt": "hi", "max_tokens": 0}, errors.InvalidRequest, "'max_tokens' must be at least 1"),
    # vLLM 0.32 accepts max_tokens 0 only as completions' echo of the prompt (echo_without_generation).
    ("max-tokens-zero-echo-false", C, {"model": "tiny", "prompt": "hi", "max_tokens": 0, "echo": False}, errors.InvalidRequest, "at least 1"),
    ("max-tokens-negative-echo", C, {"model": "tiny", "prompt": "hi", "max_tokens": -1, "echo": True}, errors.InvalidRequest, "at least 1"),
    ("chat-max-tokens-zero-echo", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "echo": True}, errors.InvalidRequest, "at least 1"),
    ("chat-max-completion-tokens-zero-echo", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0, "echo": True}, errors.InvalidRequest, "at least 1"),
    ("max-tokens-negative", C, {"model": "tiny", "prompt": "hi", "max_tokens": -5}, errors.InvalidRequest, "at least 1"),
    ("max-tokens-string", C, {"model": "tiny", "prompt": "hi", "max_tokens": "10.5"}, errors.InvalidRequest, "must be an integer"),
    ("max-tokens-bool-string", C, {"model": "tiny", "prompt": "hi", "max_tokens": "true"}, errors.InvalidRequest, "must be an integer"),
    ("max-tokens-absurd", C, {"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, errors.InvalidRequest, "exceeds the limit"),
    ("max-completion-tokens-absurd", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 129}, errors.InvalidRequest, "exceeds"),
    ("temperature-high", C, {"model": "tiny", "prompt": "hi", "temperature": 3}, errors.InvalidRequest, "'temperature'"),
    ("temperature-string", C, {"model": "tiny", "prompt": "hi", "temperature": "hot"}, errors.InvalidRequest, "'temperature'"),
    ("top-p-zero", C, {"model": "tiny", "prompt": "hi", "top_p": 0}, errors.InvalidRequest, "'top_p'"),
    ("n-zero", C, {"model": "tiny", "prompt": "hi", "n": 0}, errors.InvalidRequest, "'n' must be an integer in [1, 128]"),
    ("n-too-large", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 129}, errors.InvalidRequest, "'n' must be"),
    ("n-float", C, {"model": "tiny", "prompt": "hi", "n": 2.5}, errors.InvalidRequest, "'n' must be"),
    ("embeddings-no-input", RequestKind.EMBEDDINGS, {"model": "tiny"}, errors.InvalidRequest, "'input' is required"),
    ("embeddings-empty", RequestKind.EMBEDDINGS, {"model": "tiny", "input": []}, errors.InvalidRequest, "'input' must be"),
    ("responses-bad-input", RequestKind.RESPONSES, {"model": "tiny", "input": 3}, errors.InvalidRequest, "'input' must be"),
    ("responses-max-output", RequestKind.RESPONSES, {"model": "tiny", "input": "x", "max_output_tokens": 0}, errors.InvalidRequest, "'max_output_tokens'"),
    ("stream-string", C, {"model": "tiny", "prompt": "hi", "stream": "maybe"}, errors.InvalidRequest, "'stream' must be a boolean"),
    ("token-ids-over-context", C, {"model": "tiny", "prompt": list(range(129))}, errors.InvalidRequest, "maximum context length is 128"),
    ("token-ids-fill-context", C, {"model": "tiny", "prompt": list(range(128)), "max_tokens": 1}, errors.InvalidRequest, "maximum context length"),
    ("text-surely-over-context", C, {"model": "tiny", "prompt": "x" * 16 * 200}, errors.InvalidRequest, "maximum context length"),
]


@pytest.mark.parametrize(("kind", "body", "error", "message"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_requests_raise_domain_errors(kind: RequestKind, body: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as exc_info:
        validate_request(kind, body, CATALOG, max_tokens_limit=10_000)
    assert message in str(exc_info.value)
    assert type(exc_info.value) is error


def test_no_endpoints_is_unavailable() -> None:
    with pytest.raises(errors.NoEndpointsAvailable):
        validate_request(C, {"model": "tiny", "prompt": "hi"}, EMPTY, 100)


@pytest.mark.parametrize("raw", [b"{bad", b"[1, 2]", b"\xff\xfe", b"", b'"str"'], ids=["syntax", "array", "not-utf8", "empty", "string"])
def test_malformed_json(raw: bytes) -> None:
    with pytest.raises(errors.InvalidRequest):
        parse_json_body(raw)


GOOD_CASES = [
    ("text", C, {"model": "tiny", "prompt": "hello world", "max_tokens": 8}, False, 8),
    ("token-ids-fit-exactly", C, {"model": "tiny", "prompt": list(range(120)), "max_tokens": 8}, False, 8),
    ("chat-stream", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True}, True, None),
    ("unlabelled-model", C, {"model": "other", "prompt": list(range(5000)), "max_tokens": 5000}, False, 5000),
    ("temperature-zero", C, {"model": "tiny", "prompt": "x", "temperature": 0.0, "stream": False}, False, None),
    ("echo-without-generation", C, {"model": "tiny", "prompt": "x", "echo": True, "max_tokens": 0}, False, 0),
]


@pytest.mark.parametrize(("kind", "body", "stream", "max_tokens"), [c[1:] for c in GOOD_CASES], ids=[c[0] for c in GOOD_CASES])
def test_good_requests(kind: RequestKind, body: dict[str, Any], stream: bool, max_tokens: int | None) -> None:
    routed = validate_request(kind, body, CATALOG, max_tokens_limit=10_000)
    assert routed.stream is stream
    assert routed.max_tokens == max_tokens
    assert routed.body is body
    assert routed.prompt_tokens_estimate > 0


def test_catalog_takes_smallest_max_model_len() -> None:
    assert CATALOG.get("tiny").max_model_len == 128  # type: ignore[union-attr]
    assert CATALOG.get("tiny").endpoints == 2  # type: ignore[union-attr]
    assert CATALOG.get("other").max_model_len is None  # type: ignore[union-attr]
    assert CATALOG.names() == ["other", "tiny"]


ERROR_CASES = [
    ("invalid", errors.InvalidRequest("'max_tokens' must be at least 1"), 400, "invalid_request_error", "max_tokens", {}),
    ("unknown-model", errors.UnknownModel("The model 'x' does not exist"), 404, "not_found_error", None, {}),
    ("no-endpoints", errors.NoEndpointsAvailable("none"), 503, "service_unavailable", None, {"retry-after": "7"}),
    ("queue-full", errors.QueueFull("rejected by admission: capacity"), 429, "rate_limit_exceeded", None, {"retry-after": "7"}),
    ("shed", errors.Shed("shed"), 429, "rate_limit_exceeded", None, {"retry-after": "7"}),
    ("ttl", errors.QueueTTLExpired("waited"), 504, "timeout", None, {}),
    ("crash", RuntimeError("secret"), 500, "internal_error", None, {}),
]


@pytest.mark.parametrize(("exc", "status", "etype", "param", "headers"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_error_bodies(exc: BaseException, status: int, etype: str, param: str | None, headers: dict[str, str]) -> None:
    err = http_error(exc, retry_after_seconds=7)
    assert err.status == status
    assert err.headers == headers
    body = err.body["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == etype and body["param"] == param and body["code"] == status
    if status == 500:
        assert body["message"] == "internal error"  # never leak internals
    else:
        assert body["message"] == str(exc)


def test_engine_errors_map_back() -> None:
    err = error_from_engine(400, json.dumps({"error": {"message": "too long"}}).encode())
    assert isinstance(err, errors.InvalidRequest) and str(err) == "too long"
    assert isinstance(error_from_engine(503, b"oops"), errors.NoEndpointsAvailable)


@pytest.mark.parametrize(
    ("headers", "flow", "priority"),
    [
        ({}, "default", 0),
        ({"x-llm-d-inference-fairness-id": "tenant-a"}, "tenant-a", 0),
        ({"x-llm-d-inference-objective": "critical"}, "default", 10),
        ({"x-llm-d-inference-objective": "-3"}, "default", -3),
        ({"x-kvmesh-priority": "5", "x-llm-d-inference-objective": "sheddable"}, "default", 5),
    ],
    ids=["defaults", "fairness-id", "objective-name", "objective-number", "priority-wins"],
)
def test_request_meta(headers: dict[str, str], flow: str, priority: int) -> None:
    meta = request_meta(headers, RouterConfig(etcd_endpoints=[]))
    assert (meta.flow_id, meta.priority) == (flow, priority)
    assert meta.request_id


@pytest.mark.parametrize("headers", [{"x-kvmesh-priority": "high"}, {"x-llm-d-inference-objective": "vip"}], ids=["priority", "objective"])
def test_bad_priority_headers(headers: dict[str, str]) -> None:
    with pytest.raises(errors.InvalidRequest):
        request_meta(headers, RouterConfig(etcd_endpoints=[]))


def test_sse_parser_splits_across_chunks() -> None:
    stream = (
        b'data: {"id":"c1","choices":[{"text":"he","finish_reason":null}]}\n\n'
        b'data: {"id":"c1","choices":[{"text":"llo","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
        b"data: [DONE]\n\n"
    )
    framer = SseFramer()
    payloads = [p for i in range(0, len(stream), 7) for p in framer.feed(stream[i : i + 7]).data]
    assert payloads[-1] == "[DONE]"
    pieces = [parse_event(p) for p in payloads]
    assert pieces[-1] is None
    assert "".join(p.text for p in pieces if p) == "hello"
    assert pieces[1].usage.cached_tokens == 1 and pieces[1].finish_reason == "length"  # type: ignore[union-attr]


def test_parse_chat_completion() -> None:
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 4, "completion_tokens": 1}})
    text, finish, usage, rid = parse_completion(body.encode())
    assert (text, finish, rid) == ("hi", "stop", "x") and usage.completion_tokens == 1  # type: ignore[union-attr]
