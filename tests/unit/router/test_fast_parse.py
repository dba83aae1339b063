"""The hot path's JSON decoding and token-id checks (issue 10, wave 6): msgspec first, the json
module for what msgspec refuses, so every body reads exactly as ``json.loads`` read it before
(values, and the same 400s); token ids checked in C when they are all plain ints, with the same
answers as the per-id loop."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.errors import InvalidRequest
from kvmesh.openai_stream import Completion, parse_completion, parse_event
from services.router.validation import RequestKind, parse_json_body, validate_request
from tests.unit.router.fakes import CATALOG, MODEL

BODIES = [
    b'{"a":1}', b'{"a":' + b"9" * 30 + b"}",
    b'{"a":"\\ud83d\\ude00"}', '{"a":"x"}'.encode("utf-16"), '{"a":"x"}'.encode("utf-32"), b'{"a":1,"a":2}',
    b'{"a":-0.0}', b'{"a":1.0000000000000002}', b'{"a":12345678901234567890}', b'{"a":-9223372036854775809}',
    b'\xef\xbb\xbf{"a":1}', b' {"a": [1,2,3], "b": {"c": null, "d": true}} ', b'{"a":"\xc3\xa9"}', b'{"a":0.1e-400}',
    b'{"a":"\xed\xa0\x80"}',  # a UTF-8-encoded surrogate: json.loads reads bytes with surrogatepass
]
BAD_BODIES = [
    b'{"a":' + b"9" * 5000 + b"}", b"\xff\xfe", b'{"a":1} x', b'{"a":"\x01"}', b"", b'"s"', b"[1]",
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}", b'{"a":' + b"[" * 70 + b"]" * 70 + b"}",
    b'{"a":"\\ud800"}',
    # not JSON numbers (RFC 8259), read by Python's json as non-finite floats: a 400 naming the field. kvmesh's one
    # tightening over vLLM 0.32, whose Starlette json.loads reads them (docs/openai-compat.md, non-finite numbers)
    b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}', b'{"a":1e400}',
]


def _old_parse(raw: bytes) -> Any:
    """The json module's reading (the pre-msgspec decoder): the value, or None when it is a 400."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_reads_as_json_loads_read_it(raw: bytes) -> None:
    assert repr(parse_json_body(raw)) == repr(_old_parse(raw))


@pytest.mark.parametrize("raw", BAD_BODIES)
def test_a_bad_body_is_still_a_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_json_body(raw)


def _ids(prompt: Any) -> tuple[int, ...]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    return validate_request(RequestKind.COMPLETION, body, CATALOG, 1024).prompt_token_ids


def test_plain_token_ids_pass_and_keep_their_order() -> None:
    ids = [3 + (i * 7919) % 2000 for i in range(200)] + [0, 2**32 - 1]
    assert _ids(ids) == tuple(ids)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, -1, 2], "token ids must be in [0, 2^32)"),
        ([1, 2**32], "token ids must be in [0, 2^32)"),
        ([1, True, 2], "must be a string or a list of token ids"),
        ([1, 2.0], "must be a string or a list of token ids"),
        ([1, None], "must be a string or a list of token ids"),
        ([1, -5, 2.5], "must be a string or a list of token ids"),  # the type error wins, as before
        ([[1, 2], [3, -1]], "token ids must be in [0, 2^32)"),
    ],
)
def test_bad_token_ids_get_the_same_400(prompt: list[Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("^", r"\^").replace(")", r"\)")):
        _ids(prompt)


ANSWERS = [
    b'{"id":"c1","choices":[{"text":"hi","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}',
    b'{"id":"c2","choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1e400}}',
    b'{"id":"c3","choices":[],"usage":{"prompt_tokens":NaN}}', b"not json", b"\xff", b"[]", b'{"id":"\\ud800"}',
]


def _outcome(parse: Any, body: bytes) -> str:
    """What a parser made of ``body``: its value, or the type of the error it raised."""
    try:
        return repr(parse(body))
    except Exception as exc:
        return type(exc).__name__


def _old_completion(body: bytes) -> Completion:
    from kvmesh.openai_stream import Usage, _first_choice

    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return Completion("", None, None, "")
    if not isinstance(data, dict):
        return Completion("", None, None, "")
    text, finish = _first_choice(data, "message")
    return Completion(text, finish, Usage.from_json(data.get("usage")), str(data.get("id", "")))


@pytest.mark.parametrize("body", ANSWERS)
def test_an_engine_answer_parses_as_before(body: bytes) -> None:
    assert _outcome(parse_completion, body) == _outcome(_old_completion, body)


@pytest.mark.parametrize("payload", [
    '{"id":"x","choices":[{"delta":{"content":"a"},"finish_reason":null}]}', '{"a":NaN}', "[DONE]", "nope", "[1]",
    '{"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2},"error":{"message":"m"}}',
])
def test_a_stream_event_parses_as_before(payload: str) -> None:
    piece = parse_event(payload)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        data = None
    if payload == "[DONE]" or not isinstance(data, dict):
        assert piece is None
    else:
        assert piece is not None and piece.id == str(data.get("id", "")) and piece.error == data.get("error")
