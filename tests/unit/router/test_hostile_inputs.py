"""Router hardening against hostile input: headers, Unicode, content types, sizes, readiness (pure, no I/O)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.openai_stream import event_boundary
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog
from services.router.config import RouterConfig
from services.router.http_app import check_content_type, request_meta
from services.router.http_errors import RequestTooLarge, http_error, render_json
from services.router.readiness import ReadinessProbe
from services.router.validation import RequestKind, check_context, parse_json_body, validate_request

CONFIG = RouterConfig(etcd_endpoints=[])
CATALOG = ModelCatalog.from_endpoints(
    [Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="tiny", labels={"max_model_len": "128"})]
)

BAD_HEADERS: list[tuple[str, dict[str, str], str]] = [
    ("priority-int32-max-plus-1", {"x-kvmesh-priority": "2147483648"}, "int32 in [-2147483648, 2147483647]"),
    ("priority-huge", {"x-kvmesh-priority": "99999999999999999999999"}, "int32"),
    ("priority-huge-negative", {"x-kvmesh-priority": "-99999999999999999999"}, "int32"),
    ("priority-int32-min-minus-1", {"x-kvmesh-priority": "-2147483649"}, "int32"),
    ("priority-5000-digits", {"x-kvmesh-priority": "9" * 5000}, "int32"),
    ("priority-underscore", {"x-kvmesh-priority": "1_0"}, "plain decimal"),
    ("priority-spaces", {"x-kvmesh-priority": " 5 "}, "plain decimal"),
    ("priority-word", {"x-kvmesh-priority": "high"}, "must be an integer"),
    ("objective-out-of-int32", {"x-llm-d-inference-objective": "2147483648"}, "'x-llm-d-inference-objective' header must be an int32"),
    ("objective-underscore", {"x-llm-d-inference-objective": "1_0"}, "plain decimal"),
    ("objective-unknown", {"x-llm-d-inference-objective": "vip"}, "unknown inference objective"),
    ("request-id-latin1", {"x-request-id": "\xe9\xff"}, "'x-request-id' header must be printable ASCII"),
    ("request-id-space", {"x-request-id": "a b"}, "printable ASCII"),
]


@pytest.mark.parametrize(("headers", "message"), [c[1:] for c in BAD_HEADERS], ids=[c[0] for c in BAD_HEADERS])
def test_bad_headers_are_invalid_requests(headers: dict[str, str], message: str) -> None:
    with pytest.raises(errors.InvalidRequest) as exc_info:
        request_meta(headers, CONFIG)
    assert message in str(exc_info.value)
    assert http_error(exc_info.value).status == 400


GOOD_HEADERS = [
    ("int32-max", {"x-kvmesh-priority": "2147483647"}, 2147483647),
    ("int32-min", {"x-kvmesh-priority": "-2147483648"}, -2147483648),
    ("plus-sign-leading-zeros", {"x-kvmesh-priority": "+000000000007"}, 7),
    ("objective-int32-min", {"x-llm-d-inference-objective": "-2147483648"}, -2147483648),
    ("objective-name-any-case", {"x-llm-d-inference-objective": "Critical"}, 10),
]


@pytest.mark.parametrize(("headers", "priority"), [c[1:] for c in GOOD_HEADERS], ids=[c[0] for c in GOOD_HEADERS])
def test_good_priority_headers(headers: dict[str, str], priority: int) -> None:
    assert request_meta(headers, CONFIG).priority == priority


def test_request_id_kept_up_to_256_characters_longer_is_a_400() -> None:
    assert request_meta({"x-request-id": "r" * 256}, CONFIG).request_id == "r" * 256
    assert request_meta({"x-request-id": "abc-123"}, CONFIG).request_id == "abc-123"
    with pytest.raises(errors.InvalidRequest, match="'x-request-id' header is 257 characters"):
        request_meta({"x-request-id": "r" * 257}, CONFIG)


SURROGATE_BODIES: list[tuple[str, RequestKind, bytes, str]] = [
    ("prompt", RequestKind.COMPLETION, b'{"model": "tiny", "prompt": "\\ud800"}', "'prompt'"),
    ("chat-content", RequestKind.CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}]}', "'messages[0].content'"),
    ("model", RequestKind.COMPLETION, b'{"model": "\\ud800", "prompt": "x"}', "'model'"),
    ("other-field", RequestKind.COMPLETION, b'{"model": "tiny", "prompt": "x", "stop": ["\\uDBFF"]}', "'stop[0]'"),
]


@pytest.mark.parametrize(("raw", "where"), [(c[2], c[3]) for c in SURROGATE_BODIES], ids=[c[0] for c in SURROGATE_BODIES])
def test_lone_surrogates_are_400_at_parse(raw: bytes, where: str) -> None:
    with pytest.raises(errors.InvalidRequest) as exc_info:
        parse_json_body(raw)
    assert where in str(exc_info.value) and "surrogate" in str(exc_info.value)


@pytest.mark.parametrize(("kind", "raw"), [(c[1], c[2]) for c in SURROGATE_BODIES[:3]], ids=[c[0] for c in SURROGATE_BODIES[:3]])
def test_lone_surrogates_are_400_in_validation(kind: RequestKind, raw: bytes) -> None:
    body = json.loads(raw)  # as if it came from elsewhere than parse_json_body
    with pytest.raises(errors.InvalidRequest, match="surrogate"):
        validate_request(kind, body, CATALOG, 10_000)


def test_paired_surrogate_escape_is_fine() -> None:
    body = parse_json_body(b'{"model": "tiny", "prompt": "\\ud83d\\ude00 smile"}')
    assert validate_request(RequestKind.COMPLETION, body, CATALOG, 10_000).prompt_text.startswith("\U0001f600")


def test_error_body_renders_any_string() -> None:
    rendered = render_json(http_error(errors.UnknownModel("The model '\ud800' does not exist")).body)
    assert json.loads(rendered)["error"]["type"] == "not_found_error"


ROLES = [("", False), (5, False), (None, False), (["user"], False), ("system", True), ("user", True), ("assistant", True),
         ("tool", True), ("developer", True), ("function", True), ("ipython", True), ("wizard", True)]
"""Any non-empty string role is taken, as vLLM 0.32's ``CustomChatCompletionMessageParam`` takes it (kvmesh.chat_messages)."""


@pytest.mark.parametrize(("role", "ok"), ROLES, ids=[repr(r) for r, _ in ROLES])
def test_chat_roles(role: Any, ok: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": role, "content": "x"}]}
    if ok:
        validate_request(RequestKind.CHAT, body, CATALOG, 10_000)
    else:
        with pytest.raises(errors.InvalidRequest, match="role"):
            validate_request(RequestKind.CHAT, body, CATALOG, 10_000)


def test_context_message_estimate_vs_exact() -> None:
    with pytest.raises(errors.InvalidRequest) as text:
        validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": "x" * 16 * 200}, CATALOG, 10_000)
    assert "at least 201 prompt tokens (estimated)" in str(text.value)
    with pytest.raises(errors.InvalidRequest) as ids:
        validate_request(RequestKind.COMPLETION, {"model": "tiny", "prompt": list(range(130))}, CATALOG, 10_000)
    assert "the request has 130 prompt tokens and" in str(ids.value) and "estimated" not in str(ids.value)
    with pytest.raises(errors.InvalidRequest, match="has 300 prompt tokens and"):
        check_context("tiny", 128, 300, None)  # epp's tokenized count is exact


CONTENT_TYPES = [
    (None, b"{}", True),
    ("application/json", b"{}", True),
    ("application/json; charset=utf-8", b"{}", True),
    ("Application/JSON", b"{}", True),
    ("application/vnd.api+json", b"{}", True),
    ("text/plain", b"{}", False),
    ("application/x-www-form-urlencoded", b"{}", False),
    ("multipart/form-data; boundary=x", b"{}", False),
    ("text/plain", b"", True),
]


@pytest.mark.parametrize(("content_type", "body", "ok"), CONTENT_TYPES, ids=[f"{c}-{len(b)}" for c, b, _ in CONTENT_TYPES])
def test_content_type(content_type: str | None, body: bytes, ok: bool) -> None:
    if ok:
        check_content_type(content_type, body)
    else:
        with pytest.raises(errors.InvalidRequest, match="content-type"):
            check_content_type(content_type, body)


def test_too_large_is_413_invalid_request() -> None:
    err = http_error(RequestTooLarge("request body exceeds the limit of 10 bytes"))
    assert err.status == 413 and err.body["error"]["type"] == "invalid_request_error" and err.body["error"]["code"] == 413


def test_config_defaults() -> None:
    assert 30 < CONFIG.admission_timeout_seconds <= 40  # just above flow_control's 30 s queue TTL
    assert CONFIG.max_request_body_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize(
    ("data", "cut"),
    [(b"", 0), (b"data: {", 0), (b"data: 1\n\n", 9), (b"data: 1\n\ndata: 2", 9), (b"data: 1\r\n\r\ndata", 11), (b"data: 1\n\ndata: 2\n\n", 18)],
)
def test_event_boundary(data: bytes, cut: int) -> None:
    assert event_boundary(data) == cut


class _Check:
    def __init__(self, status: str) -> None:
        self.status = status
        self.calls = 0

    async def __call__(self, timeout_seconds: float) -> str:
        self.calls += 1
        return self.status


async def test_readiness_names_failures_and_caches() -> None:
    fc, epp = _Check("SERVING"), _Check("SERVING")
    now = [0.0]
    endpoints = [2]
    probe = ReadinessProbe({"flow_control": fc, "epp": epp}, lambda: endpoints[0], 0.5, 1.0, lambda: now[0])
    state = await probe.readiness()
    assert state.ready and state.body() == {"status": "ok", "endpoints": 2, "dependencies": {"flow_control": "SERVING", "epp": "SERVING"}}
    fc.status = "UNAVAILABLE"
    assert (await probe.readiness()).ready and fc.calls == 1  # cached for 1 s
    now[0] = 1.5
    state = await probe.readiness()
    assert not state.ready and state.failing == ["flow_control"]
    assert "flow_control is UNAVAILABLE" in state.body()["error"]["message"]  # type: ignore[index]
    fc.status, epp.status, endpoints[0], now[0] = "SERVING", "DEADLINE_EXCEEDED", 0, 3.0
    state = await probe.readiness()
    assert state.failing == ["epp", "endpoints"]
    assert "no live endpoint" in state.body()["error"]["message"]  # type: ignore[index]


@pytest.mark.parametrize(("epp", "fc", "status", "degraded"), [
    ("DEADLINE_EXCEEDED", "SERVING", "degraded", ["epp"]),  # a hung epp: picks fall back after the pick timeout
    ("UNAVAILABLE", "SERVING", "degraded", ["epp"]),
    ("SERVING", "UNAVAILABLE", "degraded", ["flow_control"]),
    ("SERVING", "DEADLINE_EXCEEDED", "unavailable", []),  # a hung flow_control: admission answers 504
    ("NOT_SERVING", "SERVING", "unavailable", []),
])
async def test_readiness_of_a_hung_or_unreachable_dependency(epp: str, fc: str, status: str, degraded: list[str]) -> None:
    """A fresh user saw /health 503 for a SIGSTOPped epp while every request was served (late, by the
    local pick), against docs/degraded-modes.md: a hung epp is degraded; a hung flow_control is not ready."""
    probe = ReadinessProbe({"flow_control": _Check(fc), "epp": _Check(epp)}, lambda: 2, 0.5, 1.0, lambda: 0.0,
                           degradable=frozenset({"flow_control", "epp"}), hang_tolerant=frozenset({"epp"}))
    state = await probe.readiness()
    assert state.body()["status"] == status and state.degraded == degraded
    assert state.ready == (status != "unavailable")


@pytest.mark.parametrize("where", ["max_tokens", "prompt-token-id"])
def test_an_integer_past_the_digit_limit_is_a_400_that_names_no_python_setting(where: str) -> None:
    big = b"9" * 5000
    raw = (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + big + b"}" if where == "max_tokens"
           else b'{"model": "tiny", "prompt": [1, ' + big + b"]}")
    with pytest.raises(errors.InvalidRequest) as exc_info:
        parse_json_body(raw)
    message = str(exc_info.value)
    assert "more than 4300 digits" in message and "sys." not in message and "set_int_max_str_digits" not in message
