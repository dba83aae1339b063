"""The pure parts of the front door's bad-input rules (the wire-level checks: tests/integration/test_router_bad_input.py).

Matches: OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` and vLLM 0.32.0's
``ErrorResponse`` (passed unchanged); RFC 9110 8.4 content codings; RFC 6585 431.
"""

from __future__ import annotations

import gzip
import json
import logging
import socket
import zlib

import pytest

from kvmesh import errors
from kvmesh.listen import ListenError, bind_tcp
from services.router.config import RouterConfig
from services.router.degraded import DegradedLog
from services.router.http_app import MAX_FORWARDED_HEADER_BYTES, decode_body, request_meta
from services.router.http_errors import (
    MAX_ENGINE_MESSAGE_CHARS,
    HeadersTooLarge,
    RequestTooLarge,
    UnsupportedMediaType,
    body_snippet,
    error_from_engine,
    http_error,
    normalize_engine_error,
)

CONFIG = RouterConfig()
VLLM_400 = b'{"error":{"message":"bad n","type":"BadRequestError","param":"n","code":400}}'


def test_vllm_error_passes_unchanged() -> None:
    assert normalize_engine_error(400, VLLM_400, "fallback") is None


@pytest.mark.parametrize(("status", "payload", "client_status", "etype", "message"), [
    (500, b"Internal Server Error", 500, "internal_error", "fallback"),
    (502, b"<html>bad gateway</html>", 502, "upstream_error", "fallback"),
    (503, b"", 503, "service_unavailable", "fallback"),
    (400, b'{"detail": "Not Found"}', 400, "invalid_request_error", "Not Found"),
    (400, b'{"error": "Unauthorized"}', 400, "invalid_request_error", "Unauthorized"),
    (400, b'{"error": {"message": "x", "type": 5}}', 400, "invalid_request_error", "x"),
    (409, b'{"error": {"message": "conflict", "type": "Conflict", "param": 7}}', 409, "Conflict", "conflict"),
    (600, b"odd", 502, "upstream_error", "fallback"),
    (399, b"odd", 502, "upstream_error", "fallback"),
])
def test_other_engine_errors_rewritten(status: int, payload: bytes, client_status: int, etype: str, message: str) -> None:
    body = normalize_engine_error(status, payload, "fallback")
    assert body is not None
    error = body["error"]
    assert (error["code"], error["type"], error["message"], error["param"]) == (client_status, etype, message, None)
    json.dumps(body)


def test_oversized_or_cut_engine_messages_are_bounded() -> None:
    long = json.dumps({"error": {"message": "m" * 50_000, "type": "BadRequestError", "param": "n"}}).encode()
    body = normalize_engine_error(400, long, "fallback")
    assert body is not None and body["error"]["param"] == "n" and body["error"]["type"] == "BadRequestError"
    message = str(body["error"]["message"])
    assert len(message) <= MAX_ENGINE_MESSAGE_CHARS + 20 and message.endswith("(truncated)")
    cut = normalize_engine_error(400, VLLM_400[:30], "the fallback", truncated=True)
    assert cut is not None and cut["error"]["message"] == "the fallback"


def test_body_snippet_is_printable_text() -> None:
    html = b"<html>\n<head><title>502</title></head>\r\n<body>\x00bad\x1b[31m gateway</body></html>" + b"z" * 10_000
    snippet = body_snippet(html)
    assert "<" not in snippet and "\x00" not in snippet and "\n" not in snippet and snippet.startswith("502 bad")
    assert len(snippet) <= 200 + 20


def test_grpc_engine_error_message_bounded_with_excerpt() -> None:
    err = error_from_engine(500, b"<html>" + b"boom " * 100_000 + b"</html>")
    assert isinstance(err, errors.NoEndpointsAvailable) and str(err).startswith("engine answered HTTP 500: boom")
    assert len(str(err)) <= MAX_ENGINE_MESSAGE_CHARS + 20
    assert len(str(error_from_engine(400, json.dumps({"error": {"message": "x" * 10**6}}).encode()))) <= MAX_ENGINE_MESSAGE_CHARS + 20


@pytest.mark.parametrize(("coding", "data"), [
    ("gzip", gzip.compress(b'{"a": 1}')), ("GZIP", gzip.compress(b'{"a": 1}')), ("x-gzip", gzip.compress(b'{"a": 1}')),
    ("deflate", zlib.compress(b'{"a": 1}')), ("identity", b'{"a": 1}'), ("gzip, identity", gzip.compress(b'{"a": 1}')),
    (None, b'{"a": 1}'), ("", b'{"a": 1}'),
])
def test_decoded_codings(coding: str | None, data: bytes) -> None:
    assert decode_body(data, coding, 1000) == b'{"a": 1}'


def test_gzip_members_back_to_back() -> None:
    assert decode_body(gzip.compress(b'{"a":') + gzip.compress(b" 1}"), "gzip", 100) == b'{"a": 1}'


@pytest.mark.parametrize(("coding", "data", "error", "status"), [
    ("br", b"x", UnsupportedMediaType, 415), ("zstd", b"x", UnsupportedMediaType, 415),
    ("gzip, deflate", b"x", UnsupportedMediaType, 415), ("compress", b"x", UnsupportedMediaType, 415),
    ("gzip", gzip.compress(b"a" * 10_000_000), RequestTooLarge, 413),
    ("deflate", zlib.compress(b"a" * 10_000_000), RequestTooLarge, 413),
    ("gzip", b"plain text", errors.InvalidRequest, 400), ("gzip", gzip.compress(b"abc")[:-4], errors.InvalidRequest, 400),
    ("deflate", b"\x00\x01", errors.InvalidRequest, 400),
])
def test_refused_codings(coding: str, data: bytes, error: type[Exception], status: int) -> None:
    with pytest.raises(error) as caught:
        decode_body(data, coding, 65536)
    assert http_error(caught.value).status == status
    if status != 413:
        assert http_error(caught.value).body["error"]["param"] == "content-encoding"


def test_degraded_log_is_rate_limited_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = DegradedLog(lambda: now[0], log_interval_seconds=10.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            log.warn("flow_control", "action=timed_out", cause="timed_out")
        log.warn("flow_control", "action=admitted_locally")  # another cause: its own line
        now[0] = 11.0
        log.warn("flow_control", "action=timed_out", cause="timed_out")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[2].endswith("(+4 more since the last line)") and "timed_out" in lines[2]


def test_client_headers_bounds() -> None:
    with pytest.raises(errors.InvalidRequest, match="control characters"):
        request_meta({"x-llm-d-inference-fairness-id": "a\x1bb"}, CONFIG)
    with pytest.raises(HeadersTooLarge) as caught:
        request_meta({f"x-h{i}": "v" * 4096 for i in range(5)}, CONFIG)
    assert http_error(caught.value).status == 431
    meta = request_meta({"x-h": "v" * (MAX_FORWARDED_HEADER_BYTES - 100)}, CONFIG)
    assert meta.forward_headers == (("x-h", "v" * (MAX_FORWARDED_HEADER_BYTES - 100)),)
    with pytest.raises(errors.InvalidRequest) as bad_id:
        request_meta({"x-request-id": "a" * 1000}, CONFIG)
    assert http_error(bad_id.value).body["error"]["param"] == "x-request-id"


def test_listen_error_names_the_kernel_reason() -> None:
    held = bind_tcp("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(OSError):
            bind_tcp("127.0.0.1", port)
        err = ListenError.probe("grpc", "127.0.0.1", port, "fallback")
        assert isinstance(err, OSError) and err.what == "grpc"
        assert str(err) == f"cannot listen for grpc on 127.0.0.1:{port}: Address already in use"
    finally:
        held.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert ListenError.probe("grpc", "127.0.0.1", port, "gRPC could not bind").reason == "gRPC could not bind"
