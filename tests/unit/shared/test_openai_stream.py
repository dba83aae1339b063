"""kvmesh.openai_stream: SSE framing (byte-exact, whole events), chunk parsing, usage, [DONE]."""

from __future__ import annotations

import json

import pytest

from kvmesh.openai_stream import (
    DONE,
    DONE_EVENT,
    Completion,
    SseFramer,
    StreamPiece,
    Usage,
    event_boundary,
    parse_completion,
    parse_event,
    sse_event,
)

CHUNK = {"id": "c1", "choices": [{"text": "he", "finish_reason": None}]}
LAST = {"id": "c1", "choices": [{"text": "llo", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}}
STREAM = sse_event(json.dumps(CHUNK).encode()) + sse_event(json.dumps(LAST).encode()) + DONE_EVENT


def feed_all(framer: SseFramer, data: bytes, step: int) -> tuple[list[bytes], list[str]]:
    raws, payloads = [], []
    for i in range(0, len(data), step):
        cut = framer.feed(data[i : i + step])
        if cut.raw:
            raws.append(cut.raw)
        payloads += cut.data
    return raws, payloads


@pytest.mark.parametrize("step", [1, 3, 7, 64, len(STREAM)], ids=lambda s: f"step{s}")
def test_framer_releases_whole_events_byte_exact(step: int) -> None:
    framer = SseFramer()
    raws, payloads = feed_all(framer, STREAM, step)
    assert b"".join(raws) == STREAM and framer.flush() == b""
    assert all(raw.endswith(b"\n\n") for raw in raws)
    assert payloads == [json.dumps(CHUNK), json.dumps(LAST), DONE]


def test_framer_crlf_and_multi_line_data_and_non_data_fields() -> None:
    stream = b": keep-alive\r\n\r\nevent: message\r\nid: 7\r\ndata: first line\r\ndata:second line\r\n\r\ndata: [DONE]\r\n\r\n"
    framer = SseFramer()
    raws, payloads = feed_all(framer, stream, 5)
    assert b"".join(raws) == stream
    assert payloads == ["first line\nsecond line", DONE]  # comments and events without data yield nothing


def test_framer_holds_an_incomplete_event_until_flush() -> None:
    framer = SseFramer()
    first = framer.feed(b"data: 1\n\ndata: 2")
    assert (first.raw, first.data) == (b"data: 1\n\n", ("1",))
    assert framer.feed(b"").raw == b""
    assert framer.flush() == b"data: 2" and framer.flush() == b""


def test_framer_passes_a_non_sse_body_on_at_flush() -> None:
    framer = SseFramer()
    body = b'{"error": {"message": "bad request"}}'
    assert framer.feed(body).raw == b""
    assert framer.flush() == body


@pytest.mark.parametrize(
    ("data", "cut"),
    [(b"", 0), (b"data: {", 0), (b"data: 1\n\n", 9), (b"data: 1\n\ndata: 2", 9), (b"data: 1\r\n\r\ndata", 11)],
)
def test_event_boundary(data: bytes, cut: int) -> None:
    assert event_boundary(data) == cut


def test_parse_event_completions_chat_usage_and_done() -> None:
    assert parse_event(DONE) is None and parse_event(" [DONE] ") is None
    assert parse_event("not json") is None and parse_event("[1, 2]") is None
    piece = parse_event(json.dumps(LAST))
    assert piece == StreamPiece("llo", "length", Usage(3, 2, 1), "c1")
    chat = parse_event(json.dumps({"id": "x", "choices": [{"delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}]}))
    assert chat is not None and (chat.text, chat.finish_reason, chat.usage) == ("hi", None, None)
    usage_only = parse_event(json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}))
    assert usage_only is not None and usage_only.text == "" and usage_only.usage == Usage(5, 4, 0)


def test_parse_event_in_stream_error() -> None:
    piece = parse_event(json.dumps({"error": {"message": "engine died", "type": "service_unavailable", "code": 503}}))
    assert piece is not None and piece.error["code"] == 503 and piece.text == ""


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ("nope", None),
        ({}, Usage()),
        ({"prompt_tokens": 7, "completion_tokens": None, "prompt_tokens_details": None}, Usage(7, 0, 0)),
        ({"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}, Usage(7, 2, 4)),
    ],
    ids=["absent", "not-an-object", "empty", "nulls", "cached"],
)
def test_usage_from_json(usage: object, expected: Usage | None) -> None:
    assert Usage.from_json(usage) == expected


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", '"12"', "[3]", "-4", "2.5", "true", "{}", "1e400"])
def test_a_malformed_usage_count_counts_zero_and_never_fails_the_answer(bad: str) -> None:
    """An engine's ``usage`` count that is not a non-negative integer (Python's json accepts NaN and Infinity)
    counts 0 in the answer and in each stream chunk; the rest of the answer is kept."""
    body = ('{"id": "x", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], '
            f'"usage": {{"prompt_tokens": {bad}, "completion_tokens": 3, "prompt_tokens_details": {{"cached_tokens": {bad}}}}}}}')
    assert parse_completion(body.encode()) == Completion("hi", "stop", Usage(0, 3, 0), "x")
    piece = parse_event('{"id": "x", "choices": [{"text": "t", "finish_reason": null}], '
                        f'"usage": {{"prompt_tokens": 5, "completion_tokens": {bad}}}}}')
    assert piece is not None and piece.usage == Usage(5, 0, 0) and piece.text == "t"
    assert Usage.from_json({"prompt_tokens": 7.0}) == Usage(7, 0, 0)  # an integral float is its integer


def test_parse_completion() -> None:
    chat = json.dumps({"id": "x", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 4, "completion_tokens": 1}}).encode()
    assert parse_completion(chat) == Completion("hi", "stop", Usage(4, 1, 0), "x")
    text, finish, usage, rid = parse_completion(json.dumps({"choices": [{"text": "yo", "finish_reason": "length"}]}).encode())
    assert (text, finish, usage, rid) == ("yo", "length", None, "")
    assert parse_completion(b"\xff not json") == Completion("", None, None, "")


def test_writing_events() -> None:
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    framer = SseFramer()
    assert framer.feed(DONE_EVENT).data == (DONE,)


@pytest.mark.parametrize("payload", ["[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000, "1" * 5000])
def test_an_undecodable_engine_payload_is_no_answer_never_an_exception(payload: str) -> None:
    """JSON nested past the parser's recursion limit, or an integer past Python's digit limit: a chunk
    or an answer that reads as not-JSON, as malformed JSON does (the request is not failed by a raise)."""
    assert parse_event(payload) is None
    assert parse_completion(payload.encode()) == Completion("", None, None, "")
