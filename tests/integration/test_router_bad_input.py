"""Bad input at the router's front door, over the wire: a clear error, nothing lost, the router stays up.

The router runs as a real process with a real etcd and a real flow_control (the mesh of
``tests/integration/test_router.py``: its fixtures are reused); engines are real HTTP servers in the test,
one of them answering errors the way a broken engine or a proxy in front of one would (plain text, HTML,
JSON without ``error``, huge bodies).

Matches: vLLM 0.32.0's request models (``CompletionRequest`` / ``ChatCompletionRequest``, pydantic v2 lax
mode: what they accept is served, what they refuse is a 400 naming the field; verdicts from running those
models, see ``tests/unit/router/test_validation_coercion.py``) and ``SamplingParams._verify_args`` ranges,
with kvmesh's one tightening (non-finite numbers refused); the OpenAI error shape (``{"error": {"message",
"type", "param", "code"}}``); ``content-encoding`` per RFC 9110 8.4 and RFC 7694 (415 + ``accept-encoding``).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.http_server import HttpServer
from kvmesh.membership import LeaseRegistration
from kvmesh.types import Endpoint
from kvmesh_cli.launcher import free_port, start_etcd
from tests.integration.test_router import (  # noqa: F401  (fixtures: mesh, client, _reset)
    BODY_LIMIT,
    MODEL,
    Mesh,
    _healthy,
    _models,
    _reset,
    _start,
    _until,
    _zero,
    client,
    mesh,
)
from tests.support import serve_registered, stop_registered

BROKEN = "broken"
"""The model only the error engine serves (so picks and /tokenize both reach it)."""


@dataclass
class ErrorEngine:
    """A real HTTP engine whose every answer is the status, body and content type the test sets."""

    status: int = 500
    body: bytes = b"boom"
    content_type: str = "text/plain"
    server: HttpServer | None = None
    registration: LeaseRegistration | None = None
    endpoint: Endpoint | None = None
    hits: list[str] = field(default_factory=list)

    async def _handle(self, request: Request) -> Response:
        self.hits.append(request.url.path)
        return Response(self.body, self.status, media_type=self.content_type)

    async def start(self, etcd: str) -> ErrorEngine:
        paths = ("/v1/completions", "/v1/chat/completions", "/tokenize")
        app = Starlette(routes=[Route(p, self._handle, methods=["POST"]) for p in paths])
        self.server, self.endpoint, self.registration = await serve_registered(
            app, etcd, BROKEN, {"engine": "test", "max_model_len": "256"})
        return self

    async def stop(self) -> None:
        await stop_registered(self.server, self.registration)


@pytest.fixture(scope="module")
async def broken(mesh: Mesh, etcd: str) -> AsyncIterator[ErrorEngine]:  # noqa: F811
    engine = await ErrorEngine().start(etcd)
    async with httpx.AsyncClient() as http:
        async def listed() -> bool:
            data = (await http.get(f"{mesh.http}/v1/models")).json()["data"]
            return any(m["id"] == BROKEN for m in data)

        await _until(listed, 15, "router to see the error engine")
    yield engine
    await engine.stop()


def _error(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of ``reply``, checked for shape."""
    assert reply.headers["content-type"].startswith("application/json"), reply.text[:200]
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["code"] == reply.status_code
    return error


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

# (id, body fields (JSON text, so NaN literals reach the router as sent), param named in the 400): what
# vLLM 0.32.0 refuses (its pydantic 422 / model validators / SamplingParams._verify_args, answered as 400)
TYPE_CASES = [
    ("stream-maybe", '"stream": "maybe"', "stream"), ("stream-2", '"stream": 2', "stream"),  # bool: pydantic's words, 0/1
    ("include-usage-maybe", '"stream": true, "stream_options": {"include_usage": "maybe"}', "stream_options.include_usage"),
    ("stream-options-string", '"stream_options": "usage"', "stream_options"),
    ("max-tokens-fraction", '"max_tokens": 2.5', "max_tokens"), ("max-tokens-word", '"max_tokens": "five"', "max_tokens"),
    ("max-tokens-false", '"max_tokens": false', "max_tokens"),  # read as 0: SamplingParams wants at least 1
    ("n-fraction", '"n": 1.5', "n"), ("temperature-word", '"temperature": "warm"', "temperature"),
    ("seed-float", '"seed": 1.5', "seed"), ("seed-int64", '"seed": 9223372036854775808', "seed"),  # Field(le=2**63 - 1)
    ("echo-2", '"echo": 2', "echo"), ("user-number", '"user": 5', "user"),
    ("logit-bias-key", '"logit_bias": {"hello": 1}', "logit_bias"),  # SamplingParams.from_optional: int(key)
    ("logit-bias-negative-key", '"logit_bias": {"-1": 1}', "logit_bias"),  # _validate_logit_bias: out of vocabulary
    ("frequency-range", '"frequency_penalty": 2.5', "frequency_penalty"),
    ("presence-range", '"presence_penalty": -3', "presence_penalty"),
    # kvmesh's one tightening: non-finite numbers (Python's json reads these literals; vLLM reads "nan" / "inf")
    ("temperature-nan", '"temperature": NaN', "temperature"), ("top-p-inf", '"top_p": Infinity', "top_p"),
    ("frequency-nan", '"frequency_penalty": NaN', "frequency_penalty"),
    ("presence-inf", '"presence_penalty": -Infinity', "presence_penalty"),
    ("presence-overflow", '"presence_penalty": 1e999', "presence_penalty"),
    ("temperature-nan-string", '"temperature": "nan"', "temperature"),
    ("logit-bias-nan", '"logit_bias": {"5": NaN}', "logit_bias.5"),
    ("logit-bias-inf-string", '"logit_bias": {"5": "inf"}', "logit_bias"),
]
CHAT_ONLY = [("logprobs-2", '"logprobs": 2', "logprobs"),  # chat logprobs: bool | None
             ("top-logprobs-string", '"logprobs": true, "top_logprobs": "2"', "top_logprobs"),  # check_logprobs
             ("max-completion-tokens-word", '"max_completion_tokens": "many"', "max_completion_tokens")]
CMPL_ONLY = [("logprobs-string", '"logprobs": "1"', "logprobs"),  # check_logprobs refuses strings
             ("echo-string", '"echo": "maybe"', "echo")]

# (id, body fields, streamed?): what vLLM 0.32.0's lax models accept, so the router serves it too (the body
# goes to the engine as sent). These were refused for an hour in wave 7; the lead's rule is vLLM parity.
LAX_CASES = [
    ("stream-yes", '"stream": "yes"', True), ("stream-1", '"stream": 1', True), ("stream-true-string", '"stream": "true"', True),
    ("include-usage-yes", '"stream": true, "stream_options": {"include_usage": "yes"}', True),
    ("max-tokens-true", '"max_tokens": true', False), ("max-tokens-string", '"max_tokens": "2"', False),
    ("n-true", '"n": true', False), ("n-string", '"n": "1"', False),
    ("temperature-string", '"temperature": "0.5"', False), ("temperature-true", '"temperature": true', False),
    ("top-p-string", '"top_p": "1"', False), ("seed-true", '"seed": true', False), ("echo-1", '"echo": 1', False),
    ("logit-bias-out-of-range", '"logit_bias": {"5": 100.5}', False),  # SamplingParams.from_optional clamps to 100
    ("logit-bias-value-string", '"logit_bias": {"5": "1"}', False),
]
LAX_CHAT_ONLY = [("logprobs-1", '"logprobs": 1', False), ("top-logprobs-true", '"logprobs": true, "top_logprobs": true', False),
                 ("max-completion-tokens-true", '"max_completion_tokens": true', False)]
LAX_CMPL_ONLY = [("logprobs-true", '"logprobs": true', False), ("echo-yes", '"echo": "yes"', False)]


def _raw(base: dict[str, Any], extra: str) -> bytes:
    text = json.dumps(base)
    return (text[:-1] + ", " + extra + "}").encode()


@pytest.mark.parametrize(("path", "extra", "param"), [
    *[("/v1/chat/completions", c[1], c[2]) for c in TYPE_CASES + CHAT_ONLY],
    *[("/v1/completions", c[1], c[2]) for c in TYPE_CASES + CMPL_ONLY],
], ids=[f"chat-{c[0]}" for c in TYPE_CASES + CHAT_ONLY] + [f"cmpl-{c[0]}" for c in TYPE_CASES + CMPL_ONLY])
async def test_typed_fields_refused_naming_the_field(mesh: Mesh, client: httpx.AsyncClient, path: str, extra: str,  # noqa: F811
                                                    param: str) -> None:
    before = sum(len(e.requests) for e in mesh.engines)
    reply = await client.post(f"{mesh.http}{path}", content=_raw(CHAT if "chat" in path else CMPL, extra),
                              headers={"content-type": "application/json", "x-request-id": "bad-type"})
    assert reply.status_code == 400, reply.text
    error = _error(reply)
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert reply.headers["x-request-id"] == "bad-type"
    assert sum(len(e.requests) for e in mesh.engines) == before  # nothing reached an engine
    mesh.router.check_alive()


MESSAGE_PATH_CASES = [  # (id, path, body, param): a field inside a message is named by its path, as any other field
    ("chat-role", "/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    ("chat-role-empty", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat-message-string", "/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("chat-content-number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat-content-part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]}, "messages[0].content"),
    ("responses-role", "/v1/responses", {"input": [{"role": "", "content": "hi"}]}, "input[0].role"),
    ("responses-content", "/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ("responses-item", "/v1/responses", {"input": ["hi"]}, "input[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in MESSAGE_PATH_CASES], ids=[c[0] for c in MESSAGE_PATH_CASES])
async def test_message_fields_refused_naming_their_path(mesh: Mesh, client: httpx.AsyncClient, path: str,  # noqa: F811
                                                       body: dict[str, Any], param: str) -> None:
    reply = await client.post(f"{mesh.http}{path}", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = _error(reply)
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    mesh.router.check_alive()


async def test_no_live_engine_is_503_with_retry_after_on_every_route(run_dir: Path, mesh: Mesh) -> None:  # noqa: F811
    """A router whose etcd has no engine at all (its own etcd): ``/tokenize`` with or without ``model``
    answers as a completion does, 503 + ``retry-after`` (retryable: the engines may be starting), not a
    400 "'model' is required"; and the router stays up."""
    etcd_proc, lonely_etcd = start_etcd(run_dir / f"lonely-{free_port()}")
    http_port = free_port()
    try:
        router, _ = _start("router", run_dir, lonely_etcd, "--http-port", str(http_port), "--flow-control-address",
                           mesh.flow_control, "--epp-address", mesh.epp_address, "--shutdown-grace-seconds", "0.5",
                           "--shutdown-http-grace-seconds", "0.5")
        try:
            http = f"http://127.0.0.1:{http_port}"
            async with httpx.AsyncClient(timeout=10) as client:
                replies = {
                    "tokenize-no-model": await client.post(f"{http}/tokenize", json={"prompt": "hi"}),
                    "tokenize-model": await client.post(f"{http}/tokenize", json={"model": MODEL, "prompt": "hi"}),
                    "detokenize-no-model": await client.post(f"{http}/detokenize", json={"tokens": [1, 2]}),
                    "completions": await client.post(f"{http}/v1/completions", json=CMPL),
                }
            for name, reply in replies.items():
                assert reply.status_code == 503, (name, reply.text)
                assert reply.headers.get("retry-after"), name
                assert _error(reply)["type"] == "service_unavailable", name
            router.check_alive()
        finally:
            router.stop()
    finally:
        etcd_proc.stop()


@pytest.mark.parametrize(("path", "extra", "streamed"), [
    *[("/v1/chat/completions", c[1], c[2]) for c in LAX_CASES + LAX_CHAT_ONLY],
    *[("/v1/completions", c[1], c[2]) for c in LAX_CASES + LAX_CMPL_ONLY],
], ids=[f"chat-{c[0]}" for c in LAX_CASES + LAX_CHAT_ONLY] + [f"cmpl-{c[0]}" for c in LAX_CASES + LAX_CMPL_ONLY])
async def test_lax_fields_served_as_vllm_serves_them(mesh: Mesh, client: httpx.AsyncClient, path: str, extra: str,  # noqa: F811
                                                    streamed: bool) -> None:
    raw = _raw(CHAT if "chat" in path else CMPL, extra)
    request_id = f"lax-{abs(hash(raw))}"
    reply = await client.post(f"{mesh.http}{path}", content=raw,
                              headers={"content-type": "application/json", "x-request-id": request_id})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream" if streamed else "application/json")
    (sent,) = [body for e in mesh.engines for body, headers in zip(e.requests, e.headers, strict=True)
               if headers.get("x-request-id") == request_id]
    assert sent == json.loads(raw)  # forwarded as sent: the engine reads it the same lax way


async def test_well_typed_fields_still_served(mesh: Mesh, client: httpx.AsyncClient) -> None:  # noqa: F811
    body = {**CHAT, "stream": False, "n": 1, "temperature": 1, "top_p": 1.0, "seed": -5, "max_tokens": 2.0,
            "frequency_penalty": -2, "presence_penalty": 2.0, "logit_bias": {"5": -100, "7": 100.0}, "logprobs": False,
            "top_logprobs": 0, "stream_options": None, "user": "u"}
    reply = await client.post(f"{mesh.http}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    sent = mesh.engines[0].requests[-1]
    assert sent["max_tokens"] == 2.0 and sent["logit_bias"] == {"5": -100, "7": 100.0}  # forwarded as sent


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
async def test_grpc_non_finite_temperature_is_invalid_argument(mesh: Mesh, temperature: float) -> None:  # noqa: F811
    before = sum(len(e.requests) for e in mesh.engines)
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        for call in (stub.Complete, stub.CompleteStream):
            request = router_pb2.CompletionRequest(model=MODEL, prompt="hi", max_tokens=2, temperature=temperature)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                result = call(request, timeout=10)
                if call is stub.CompleteStream:
                    [_ async for _ in result]  # type: ignore[union-attr]
                else:
                    await result  # type: ignore[misc]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "'temperature'" in (caught.value.details() or "")
    assert sum(len(e.requests) for e in mesh.engines) == before


HUGE = b"<html><body>" + b"x" * 2_000_000 + b"</body></html>"
ENGINE_ERRORS = [
    # (id, engine status, engine body, content type, client status, message contains)
    ("plain-500", 500, b"Internal Server Error", "text/plain", 500, "Internal Server Error"),
    ("html-502", 502, b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>",
     "text/html", 502, "502 Bad Gateway"),
    ("html-503", 503, b"<html><body>upstream connect error</body></html>", "text/html", 503, "upstream connect error"),
    ("json-without-error-400", 400, b'{"reason": "prompt rejected"}', "application/json", 400, "prompt rejected"),
    ("json-detail-422", 422, b'{"detail": [{"loc": ["body", "n"], "msg": "bad"}]}', "application/json", 422, "HTTP 422"),
    ("error-string-400", 400, b'{"error": "no such lora"}', "application/json", 400, "no such lora"),
    ("error-message-number-400", 400, b'{"error": {"message": 5}}', "application/json", 400, "5"),
    ("huge-html-500", 500, HUGE, "text/html", 500, "HTTP 500"),
    ("huge-message-400", 400, json.dumps({"error": {"message": "m" * 100_000, "type": "BadRequestError"}}).encode(),
     "application/json", 400, "(truncated)"),
    ("empty-500", 500, b"", "text/plain", 500, "HTTP 500"),
    ("odd-status-418", 418, b"teapot", "text/plain", 418, "teapot"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize(("status", "body", "ctype", "client_status", "contains"), [c[1:] for c in ENGINE_ERRORS],
                         ids=[c[0] for c in ENGINE_ERRORS])
async def test_engine_error_bodies_reach_the_client_as_openai_errors(
    mesh: Mesh, broken: ErrorEngine, client: httpx.AsyncClient, stream: bool, status: int, body: bytes,  # noqa: F811
    ctype: str, client_status: int, contains: str,
) -> None:
    broken.status, broken.body, broken.content_type = status, body, ctype
    mesh.epp.order = [broken.endpoint]  # type: ignore[list-item]
    reply = await client.post(f"{mesh.http}/v1/chat/completions",
                              json={"model": BROKEN, "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    assert reply.status_code == client_status, reply.text[:300]
    error = _error(reply)
    assert contains in error["message"], error
    assert len(error["message"]) <= 1100 and len(reply.content) < 4000  # bounded, whatever the engine sent
    assert "<html" not in error["message"]
    if client_status in (429, 503):
        assert reply.headers["retry-after"].isdigit()
    await _until(lambda: _zero(mesh), 5, "slot released")
    mesh.router.check_alive()


async def test_vllm_error_body_passes_unchanged(mesh: Mesh, broken: ErrorEngine, client: httpx.AsyncClient) -> None:  # noqa: F811
    vllm = b'{"error":{"message":"max_tokens must be at least 1","type":"BadRequestError","param":"max_tokens","code":400}}'
    broken.status, broken.body, broken.content_type = 400, vllm, "application/json"
    mesh.epp.order = [broken.endpoint]  # type: ignore[list-item]
    reply = await client.post(f"{mesh.http}/v1/completions", json={"model": BROKEN, "prompt": "hi"})
    assert (reply.status_code, reply.content) == (400, vllm)


async def test_passthrough_and_grpc_engine_errors_normalised(mesh: Mesh, broken: ErrorEngine, client: httpx.AsyncClient) -> None:  # noqa: F811
    broken.status, broken.body, broken.content_type = 500, HUGE, "text/html"
    mesh.epp.order = [broken.endpoint]  # type: ignore[list-item]
    reply = await client.post(f"{mesh.http}/tokenize", json={"model": BROKEN, "prompt": "hi"})
    assert reply.status_code == 500 and len(reply.content) < 4000
    assert "HTTP 500" in _error(reply)["message"]
    broken.status, broken.body = 400, b"nope " * 100_000
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await router_pb2_grpc.InferenceStub(channel).Complete(
                router_pb2.CompletionRequest(model=BROKEN, prompt="hi", max_tokens=2), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in (caught.value.details() or "") and len(caught.value.details() or "") < 1200
    await _until(lambda: _zero(mesh), 5, "slot released")


async def test_request_id_and_header_bounds(mesh: Mesh, client: httpx.AsyncClient) -> None:  # noqa: F811
    ok = await client.post(f"{mesh.http}/v1/completions", json=CMPL, headers={"x-request-id": "r" * 256})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "r" * 256
    assert mesh.engines[0].headers[-1]["x-request-id"] == "r" * 256
    for value, words in (("r" * 257, "257 characters"), ("has space", "printable ASCII")):
        reply = await client.post(f"{mesh.http}/v1/completions", json=CMPL, headers={"x-request-id": value})
        assert reply.status_code == 400, reply.text
        error = _error(reply)
        assert error["param"] == "x-request-id" and words in error["message"]
        assert "x-request-id" not in reply.headers or reply.headers["x-request-id"] != value
    reply = await client.post(f"{mesh.http}/v1/completions", json=CMPL, headers={"x-gateway-inference-fairness-id": "a\tb"})
    assert reply.status_code == 400 and _error(reply)["param"] == "x-gateway-inference-fairness-id"
    big = {f"x-custom-{i}": "v" * 4000 for i in range(5)}  # 20 KB passed on: an engine's uvicorn would refuse it
    reply = await client.post(f"{mesh.http}/v1/completions", json=CMPL, headers=big)
    assert reply.status_code == 431, reply.text
    assert _error(reply)["type"] == "invalid_request_error"
    mesh.router.check_alive()


async def test_content_encoding(mesh: Mesh, client: httpx.AsyncClient) -> None:  # noqa: F811
    raw = json.dumps(CMPL).encode()
    for coding, data in (("gzip", gzip.compress(raw)), ("x-gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw)),
                         ("identity", raw)):
        reply = await client.post(f"{mesh.http}/v1/completions", content=data,
                                  headers={"content-type": "application/json", "content-encoding": coding})
        assert reply.status_code == 200, (coding, reply.text)
    assert "content-encoding" not in mesh.engines[0].headers[-1]  # the engine gets the decoded body
    for coding in ("br", "zstd", "gzip, gzip", "compress"):
        reply = await client.post(f"{mesh.http}/v1/completions", content=raw,
                                  headers={"content-type": "application/json", "content-encoding": coding})
        assert reply.status_code == 415, (coding, reply.text)
        assert coding in _error(reply)["message"] and reply.headers["accept-encoding"].startswith("gzip")
    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"a" * (BODY_LIMIT * 4) + b'"}')
    assert len(bomb) < BODY_LIMIT
    reply = await client.post(f"{mesh.http}/v1/completions", content=bomb,
                              headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert reply.status_code == 413 and "once decoded" in _error(reply)["message"]
    for junk in (b"not gzip at all", gzip.compress(raw)[:-6]):
        reply = await client.post(f"{mesh.http}/v1/completions", content=junk,
                                  headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert reply.status_code == 400 and _error(reply)["param"] == "content-encoding"
    mesh.router.check_alive()


def _metric(metrics_url: str, prefix: str) -> float:
    for line in httpx.get(f"{metrics_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_hung_flow_control_504s_are_logged_rate_limited_and_counted(mesh: Mesh, start_service) -> None:  # noqa: F811
    """A SIGSTOPped flow_control: every request is a 504 at the admission timeout; the router logs the
    first one at once (then one line per interval, with the count) and counts each one."""
    fc_proc, flow = start_service("flow_control", "--shutdown-grace-seconds", "0.5")
    http_port = free_port()
    router, _ = start_service("router", "--shutdown-grace-seconds", "0.5", "--shutdown-http-grace-seconds", "0.5",
                              "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address",
                              mesh.epp_address, "--admission-timeout-seconds", "0.5")
    metrics_port = json.loads(router.log_path.with_suffix(".json").read_text())["metrics"]
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    http = f"http://127.0.0.1:{http_port}"
    timed_out = 'kvmesh_router_degraded_total{action="timed_out",dependency="flow_control"}'
    async with httpx.AsyncClient(timeout=20) as client:  # noqa: F811
        await _until(lambda: _models(client, http), 15, "router to see the engines")
        await _until(lambda: _healthy(client, http), 10, "router ready")
        os.killpg(fc_proc.pid, signal.SIGSTOP)
        try:
            replies = await asyncio.gather(*(client.post(f"{http}/v1/completions", json=CMPL) for _ in range(3)))
        finally:
            os.killpg(fc_proc.pid, signal.SIGCONT)
    assert [r.status_code for r in replies] == [504] * 3, [r.text for r in replies]
    assert all(_error(r)["type"] == "timeout" for r in replies)
    assert _metric(metrics_url, timed_out) == 3
    log = router.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "dependency=flow_control action=timed_out" in line]
    assert len(lines) == 1, lines  # rate-limited: one line per 10 s interval, the rest counted for the next
    assert "status=504" in lines[0] and "not dispatched within 0.5s" in lines[0]
