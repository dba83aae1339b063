"""Request validation for the OpenAI-compatible API (pure: bytes/dicts in, RouterRequest or a domain error out).

Both front doors end here: the HTTP layer passes the raw body, the gRPC servicer the equivalent
OpenAI body built from its protobuf. Checks, in order (the first failure wins):

| check | error (HTTP) |
| --- | --- |
| body is a JSON object | InvalidRequest (400) |
| every string is valid Unicode (no lone UTF-16 surrogate from a ``\\ud800`` escape) | InvalidRequest (400) |
| ``model`` present, a non-empty string | InvalidRequest (400) |
| no live endpoint at all | NoEndpointsAvailable (503) |
| ``model`` served by a live endpoint | UnknownModel (404) for a name never served |
| ``model`` served recently (its endpoints left less than ``model_memory_seconds`` ago) | ModelUnavailable (503 + ``retry-after``) |
| completions: ``prompt`` is a string, a list of token ids, or a batch (a list of strings or of token-id lists, at most ``max_batch_prompts``); no ``messages`` | InvalidRequest (400) |
| chat: ``messages`` a non-empty list of ``{role, content}``, ``role`` any non-empty string (vLLM 0.32's ``CustomChatCompletionMessageParam``: ``ipython``, ``function``, a model's own role; one rule with epp and ext_proc, :mod:`kvmesh.chat_messages`); no ``prompt`` | InvalidRequest (400) |
| embeddings: ``input`` a string, token ids, or a list of either; responses: ``input`` a string or a list of items | InvalidRequest (400) |
| no ``NaN`` / ``Infinity`` / float-overflowing number anywhere (kvmesh's one tightening over vLLM 0.32) | InvalidRequest (400) naming its path (``param``) |
| typed fields (:data:`SCALAR_FIELDS`, ``stream_options.*``, ``logit_bias``) read exactly as vLLM 0.32's pydantic models read them (lax: ``"yes"`` / ``1`` is a boolean, ``"5"`` / ``true`` / ``5.0`` an integer), float fields finite; ranges of penalties, ``min_p``, ``top_k``, logprobs, ``logit_bias`` keys as vLLM 0.32 | InvalidRequest (400) naming the field (``param``) |
| ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``: in [1, min(max_model_len, max_tokens_limit)]; 0 only as completions' ``echo`` of the prompt (vLLM 0.32's ``echo_without_generation``) | InvalidRequest (400) |
| ``temperature`` in [0, 2]; ``top_p`` in (0, 1]; ``n`` in [1, ``max_n``] (vLLM 0.32 ``sampling_params.py`` 46-58, 653-675) | InvalidRequest (400) |
| prompt (+ max_tokens) over the model's context | InvalidRequest (400) |

Prompt length. Token ids are counted exactly (vLLM's rule: ``prompt_tokens + max_tokens <=
max_model_len``). Text is not tokenized here: the router rejects text only when a *lower bound*
of its token count already exceeds the context, ``ceil(utf8_bytes / 16) + 1`` (BOS), so it never
rejects a prompt the engine would accept with any byte-level BPE whose average token on the
prompt is under 16 bytes. The exact check happens after Pick when epp reports the tokenized
length (``PickResponse.prompt_tokens``), and otherwise at the engine, whose 400 passes through.
Admission sizing uses the usual estimate of ``ceil(utf8_bytes / 4) + 1`` tokens, summed over a
batch's prompts; the output side is ``max_tokens x n x prompts`` (:attr:`RouterRequest.admission_max_tokens`).
A batch or ``n`` > 1 is forwarded whole to one engine (vLLM answers it in one response: choices
indexed ``prompt_index * n + i``, usage summed); epp picks by the first prompt. The over-context
message says which it is: "at least N tokens (estimated)" for text, the exact count for token ids
(and for epp's tokenized count).
"""

from __future__ import annotations

import enum
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pydantic import TypeAdapter, ValidationError

from kvmesh.chat_messages import chat_messages, chat_role, content_text
from kvmesh.chat_messages import utf8_or_invalid as _utf8_or_invalid
from kvmesh.errors import InvalidRequest, NoEndpointsAvailable, UnknownModel, quoted
from services.router.catalog import ModelCatalog

BYTES_PER_TOKEN_ESTIMATE = 4
"""Typical English text with a byte-level BPE: about 4 bytes per token (admission sizing only)."""
BYTES_PER_TOKEN_LOWER_BOUND = 16
"""Bytes per token assumed when rejecting text as over-context (a deliberate over-estimate)."""
CHAT_TOKENS_PER_MESSAGE = 4
"""Chat-template overhead per message (role markers), added to the estimate."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate; only bodies containing one need the full Unicode walk."""


class ModelUnavailable(NoEndpointsAvailable):
    """The model was served recently but no endpoint of it is live now: 503 + ``retry-after`` (retryable)."""


class RequestKind(enum.StrEnum):
    """Which OpenAI endpoint a request targets; the value is its path."""

    COMPLETION = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"


@dataclass(frozen=True, slots=True)
class RouterRequest:
    """A validated request, ready to admit, pick and forward.

    Attributes:
        kind: completions or chat.
        model: served model name.
        body: the client's JSON body, unchanged (forwarded as is).
        stream: whether the answer is SSE.
        prompt_text: completions text prompt ("" otherwise).
        prompt_token_ids: completions token-id prompt (empty otherwise).
        messages: chat messages as ``(role, text content)`` (empty otherwise).
        max_tokens: requested max new tokens, None for the engine default.
        prompt_tokens_estimate: prompt length in tokens (exact for token ids).
        lora_name: the LoRA adapter the body's ``model`` names (then ``model`` is its base model,
            whose pool serves it; the body still names the adapter, as vLLM expects), else None.
        cache_salt: the body's ``cache_salt`` (vLLM/SGLang: isolates the request's prefix cache), else None.
        n: choices per prompt (``n``).
        prompt_count: prompts in the request (a completions batch; 1 otherwise).
        previous_response_id: ``/v1/responses``' ``previous_response_id`` (the stored response it continues), else None.
        pinned_endpoint_id: the endpoint this request must go to (the holder of ``previous_response_id``,
            :mod:`services.router.response_affinity`); None: picked as usual.
    """

    kind: RequestKind
    model: str
    body: dict[str, Any]
    stream: bool
    prompt_text: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = field(default=())
    max_tokens: int | None = None
    prompt_tokens_estimate: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    n: int = 1
    prompt_count: int = 1
    previous_response_id: str | None = None
    pinned_endpoint_id: str | None = None

    @property
    def admission_max_tokens(self) -> int:
        """Output tokens the request may produce in all: ``max_tokens x n x prompts`` (0 when unset)."""
        return (self.max_tokens or 0) * self.n * self.prompt_count


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects accepted in a request body (OpenAI bodies, tool schemas
included, stay far below; deeper bodies are a 400 before anything walks them recursively)."""


def json_depth_exceeds(data: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``data`` nests containers deeper than ``limit`` (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body.

    Raises:
        InvalidRequest: when it is not UTF-8 JSON, not an object, nested deeper than
            :data:`MAX_JSON_DEPTH` (also when the parser's own recursion limit is hit first), or holds
            ``NaN`` / ``Infinity`` / an out-of-range number (RFC 8259 has none; Python's json reads them),
            naming its path.
    """
    fallback = False
    try:  # msgspec first (~4x faster on a token-id prompt); what it refuses gets the json module's verdict
        data = _JSON_DECODER.decode(raw)
    except msgspec.DecodeError:
        data = _json_loads(raw)
        fallback = True
    except RecursionError:
        raise InvalidRequest(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth_exceeds(data):
        raise InvalidRequest(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(raw):  # paired escapes (emoji) decode fine; lone ones cannot be re-encoded
        where = find_lone_surrogate(data)
        if where is not None:
            raise InvalidRequest(f"'{where}' is not valid Unicode: it contains a lone UTF-16 surrogate escape")
    if fallback:  # msgspec refuses NaN, Infinity and numbers past the float range; json reads them as non-finite
        where = find_non_finite(data)
        if where is not None:
            raise InvalidRequest(f"'{where}' must be a finite number: NaN and Infinity are not JSON numbers (RFC 8259) "
                                 "and a number beyond the float range reads as infinite; kvmesh refuses non-finite numbers")
    return data


_JSON_DECODER = msgspec.json.Decoder()


def _json_loads(raw: bytes) -> Any:
    """The json module's decode (NaN/Infinity, integers beyond 64 bits, UTF-16/32 bodies, lone
    surrogate escapes: what msgspec refuses) and its errors as :class:`InvalidRequest`."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer longer than Python's int-string limit (4300 digits)
        if "digits" in str(exc):  # the interpreter's wording names a Python setting a client cannot change
            raise InvalidRequest(
                f"request body is not acceptable JSON: an integer has more than {sys.get_int_max_str_digits()} "
                "digits") from exc
        raise InvalidRequest(f"request body is not acceptable JSON: {str(exc)[:200]}") from exc
    except RecursionError:
        raise InvalidRequest(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None


def find_non_finite(value: Any, path: str = "") -> str | None:
    """The JSON path (``logit_bias.50256``, ``tools[0].x``) of the first non-finite number, else None."""
    return _first_path(value, _non_finite, path, keys=False)


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The JSON path (``messages[0].content``) of the first string or key holding a lone surrogate, else None."""
    return _first_path(value, _has_lone_surrogate, path, keys=True)


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _has_lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first_path(value: Any, bad: Callable[[Any], bool], path: str, *, keys: bool) -> str | None:
    """The JSON path of the first leaf (and, with ``keys``, object key: ``<path> key``) for which ``bad`` holds."""
    if isinstance(value, dict):
        for key, item in value.items():
            if keys and bad(key):
                return (path or "body") + " key"
            found = _first_path(item, bad, f"{path}.{key}" if path else str(key), keys=keys)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_path(item, bad, f"{path}[{i}]", keys=keys)
            if found is not None:
                return found
        return None
    return (path or "body") if bad(value) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_Scalar = type[int] | type[float] | type[bool] | type[str]

_JSON_TYPE_NAMES: dict[type, str] = {
    bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object",
}


def _adapter(typ: _Scalar, nullable: bool) -> TypeAdapter[Any]:
    annotation: Any = typ | None if nullable else typ
    return TypeAdapter(annotation)


_ADAPTERS = {(t, nullable): _adapter(t, nullable) for t in (int, float, bool, str) for nullable in (True, False)}
"""pydantic v2 lax validators of vLLM's scalar field types (each Optional or not): the same pydantic
(2.14) vLLM 0.32 validates its request models with, so a value reads here exactly as it reads there."""


def _got(value: Any) -> str:
    """How a refused value is quoted: its JSON type and (cut to 40 characters) its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"a non-finite number ({value!r})"
    kind = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    try:
        text = json.dumps(value, allow_nan=True, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON, or an int past Python's 4300-digit str limit
        text = "..."
    return f"{kind} ({text[:40]})"


_GENERATION_FIELDS: dict[str, tuple[_Scalar, bool]] = {
    "max_tokens": (int, True), "n": (int, False), "temperature": (float, True), "top_p": (float, True),
    "top_k": (int, True), "min_p": (float, True), "min_tokens": (int, False), "seed": (int, True),
    "stream": (bool, True), "echo": (bool, True), "ignore_eos": (bool, False), "priority": (int, False),
    "presence_penalty": (float, True), "frequency_penalty": (float, True), "repetition_penalty": (float, True),
    "length_penalty": (float, False), "use_beam_search": (bool, False), "include_stop_str_in_output": (bool, False),
    "skip_special_tokens": (bool, False), "spaces_between_special_tokens": (bool, False),
    "add_special_tokens": (bool, False), "truncate_prompt_tokens": (int, True), "prompt_logprobs": (int, True),
    "logprobs": (int, True), "suffix": (str, True), "user": (str, True),
}
_CHAT_FIELDS: dict[str, tuple[_Scalar, bool]] = {
    **{k: v for k, v in _GENERATION_FIELDS.items() if k != "suffix"},
    "max_completion_tokens": (int, True), "n": (int, True), "echo": (bool, False), "logprobs": (bool, True),
    "top_logprobs": (int, True), "parallel_tool_calls": (bool, True), "include_reasoning": (bool, False),
    "add_generation_prompt": (bool, False), "continue_final_message": (bool, False),
}
SCALAR_FIELDS: dict[RequestKind, dict[str, tuple[_Scalar, bool]]] = {
    RequestKind.COMPLETION: _GENERATION_FIELDS,
    RequestKind.CHAT: _CHAT_FIELDS,
    RequestKind.RESPONSES: {"max_output_tokens": (int, True), "temperature": (float, True), "top_p": (float, True),
                            "stream": (bool, True), "priority": (int, False), "user": (str, True)},
    RequestKind.EMBEDDINGS: {"priority": (int, False), "user": (str, True)},
}
"""Per endpoint, the scalar fields checked here and vLLM 0.32's declared type ``(type, Optional?)``:
``entrypoints/openai/completion/protocol.py`` ``CompletionRequest``, ``chat_completion/protocol.py``
``ChatCompletionRequest`` (``n`` is ``int | None`` there, ``echo`` a plain ``bool``, ``logprobs`` a bool,
not the completions' int; ``top_logprobs`` reads ``null`` as 0), ``responses/protocol.py``
``ResponsesRequest``, ``pooling/base/protocol.py`` (embeddings' ``priority``).

vLLM's models are pydantic v2 in lax mode, and the router reads these fields with the same pydantic
validators (:data:`_ADAPTERS`), so it accepts exactly what vLLM 0.32 accepts: an ``int`` takes an int,
a bool, an integral float (``5.0``) or an integer string (``"5"``, ``" 5 "``, ``"5.0"``), not ``5.5`` /
``"five"`` / ``1e20``; a ``float`` takes numbers, bools and numeric strings (``"2.5"``, ``"1e3"``); a
``bool`` takes true/false, 0/1 and pydantic's strings (``"true"``, ``"yes"``, ``"on"``, ``"1"``, ...); a
``str`` only a string; ``null`` only where vLLM's field is Optional. The body is forwarded as sent, and
the engine reads it the same way. One deliberate tightening: a ``float`` field that reads as NaN or
an infinity (``"nan"``, ``"inf"``, ``"1e400"``; the JSON literals ``NaN`` / ``Infinity`` are refused
by :func:`parse_json_body`) is refused with a 400, where vLLM either refuses it later (penalties,
``top_p``, ``min_p``, ``temperature`` fail ``SamplingParams._verify_args``) or samples with it
(``length_penalty``, ``logit_bias`` values, which it clamps)."""

_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "seed": (INT64_MIN, INT64_MAX), "priority": (INT64_MIN, INT64_MAX),  # protocol.py: Field(ge=-(2**63), le=2**63 - 1)
    "truncate_prompt_tokens": (-1, INT64_MAX),  # protocol.py: Annotated[int, Field(ge=-1, le=2**63 - 1)]
}
"""pydantic ``Field`` bounds of vLLM 0.32's models (checked with the type: a pydantic 422 there)."""

_NUMERIC_ONLY: dict[RequestKind, frozenset[str]] = {
    RequestKind.COMPLETION: frozenset({"logprobs", "prompt_logprobs"}),
    RequestKind.CHAT: frozenset({"prompt_logprobs", "top_logprobs"}),
}
"""Integer fields vLLM 0.32's ``check_logprobs`` model validator (``mode="before"``) refuses as strings
before pydantic reads them (``"5"`` is refused there, ``true`` and ``5.0`` pass)."""

_NESTED_BOOL_FIELDS = {"stream_options": ("include_usage", "continuous_usage_stats")}
"""Objects with ``bool | None`` members (vLLM 0.32 ``generate/base/protocol.py`` ``StreamOptions``)."""

_MODEL_RANGES: dict[str, tuple[int, str]] = {
    "logprobs": (-1, "at least 0, or -1 (all)"),  # completions: check_logprobs, sampling_params.py:709
    "top_logprobs": (-1, "at least 0, or -1 (all)"),  # chat: check_logprobs
    "prompt_logprobs": (-1, "at least 0, or -1 (all)"),  # check_logprobs, sampling_params.py:715
}
"""Lower bounds vLLM 0.32's models check themselves (the ``check_logprobs`` validators), so they are part
of reading the request (:func:`coerce_fields`); the chat ``logprobs`` (a bool) has none."""

_SAMPLING_RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "presence_penalty": (-2.0, 2.0, "in [-2, 2]"),  # vLLM 0.32 sampling_params.py:635-642
    "frequency_penalty": (-2.0, 2.0, "in [-2, 2]"),
    "min_p": (0.0, 1.0, "in [0, 1]"),  # sampling_params.py:686
    "top_k": (-1, None, "-1 or 0 (disabled) or at least 1"),  # sampling_params.py:678
    "min_tokens": (0, None, "at least 0"),  # sampling_params.py:694
}
"""Ranges of vLLM 0.32's ``SamplingParams._verify_args`` (bounds inclusive), checked by
:func:`check_sampling_ranges` after the fields are read; ``max_tokens``, ``temperature``, ``top_p`` and
``n`` are checked by :func:`validate_request`."""


def _finite(value: Any) -> bool:
    return math.isfinite(value)


def _in_bounds(name: str, value: Any) -> bool:
    low, high = _INT_BOUNDS[name]
    return bool(low <= value <= high)


def _read_scalar(name: str, value: Any, typ: _Scalar, nullable: bool, numeric_only: bool = False) -> Any:
    """``value`` read as vLLM 0.32 reads a field of type ``typ`` (``"5"`` -> 5, ``"yes"`` -> True), or InvalidRequest."""
    null = " or null" if nullable else ""
    if numeric_only and value is not None and not isinstance(value, int | float):
        raise InvalidRequest(f"'{name}' must be an integer{null}, got {_got(value)}")  # vLLM's check_logprobs
    try:
        read = _ADAPTERS[typ, nullable].validate_python(value)
    except ValidationError:
        raise InvalidRequest(f"'{name}' must be {_JSON_TYPE_NAMES[typ]}{null}, got {_got(value)}") from None
    if typ is float and read is not None and not math.isfinite(read):
        raise InvalidRequest(f"'{name}' must be a finite number, got {_got(value)}: kvmesh refuses NaN and infinities")
    bounds = _INT_BOUNDS.get(name)
    if bounds is not None and read is not None and not bounds[0] <= read <= bounds[1]:
        low = "-2^63" if bounds[0] == INT64_MIN else str(bounds[0])
        raise InvalidRequest(f"'{name}' must be an integer in [{low}, 2^63 - 1]{null}, got {str(read)[:40]}")
    return read


def _check_logit_bias(value: Any) -> None:
    """vLLM 0.32's ``logit_bias``: ``dict[str, float] | None`` (values read laxly, as :func:`_read_scalar`).

    Keys: vLLM's ``SamplingParams.from_optional`` turns each into a token id with Python's ``int()`` (so
    ``" 5"`` and ``"+5"`` pass, ``"five"`` / ``"5.0"`` / ``""`` are refused) and ``_validate_logit_bias``
    refuses ids outside the vocabulary: a negative id or one of 2^32 or more is refused here (no
    vocabulary is that large; the vocabulary bound itself is the engine's). Values outside [-100, 100]
    are accepted: vLLM clamps them. A value that reads as NaN or an infinity is refused (kvmesh's tightening).
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequest(f"'logit_bias' must be an object mapping token ids to numbers, or null, got {_got(value)}")
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"'logit_bias' keys must be integer token ids, got {str(key)[:40]!r}") from None
        if not 0 <= token < 2**32:
            raise InvalidRequest(f"'logit_bias' token id {str(token)[:40]} is outside any vocabulary")
        read: float
        if type(bias) is float or type(bias) is int:
            read = bias
        else:
            try:
                read = _ADAPTERS[float, False].validate_python(bias)
            except ValidationError:
                raise InvalidRequest(f"'logit_bias' value for token {str(key)[:40]} must be a number, got {_got(bias)}") from None
        if not math.isfinite(read):
            raise InvalidRequest(f"'logit_bias' value for token {str(key)[:40]} must be a finite number, got {_got(bias)}: "
                                 "kvmesh refuses NaN and infinities")


STREAM_OPTIONS_WITHOUT_STREAM = "Stream options can only be defined when `stream=True`."
"""vLLM 0.32's ``validate_stream_options`` (a ``mode="before"`` model validator of ``CompletionRequest`` and
``ChatCompletionRequest``, ``vllm/entrypoints/openai/protocol.py``): a truthy ``stream_options`` with a falsy
``stream``, both as the JSON holds them (``{}`` passes; ``"stream": "false"``, a non-empty string, passes too)."""


def _stream_options_without_stream() -> InvalidRequest:
    exc = InvalidRequest(STREAM_OPTIONS_WITHOUT_STREAM)
    exc.param = "stream_options"  # type: ignore[attr-defined]  # vLLM's VLLMValidationError(parameter=...)
    return exc


def coerce_fields(kind: RequestKind, body: dict[str, Any]) -> dict[str, Any]:
    """The scalar fields of :data:`SCALAR_FIELDS` present in ``body``, read as vLLM 0.32's pydantic models read
    them (``{"max_tokens": "5"}`` -> ``{"max_tokens": 5}``, ``{"stream": "yes"}`` -> ``{"stream": True}``);
    for kvmesh's own reading only: the body is forwarded unchanged. Also checks ``stream_options``' members,
    ``logit_bias`` and the bounds vLLM's models check (:data:`_INT_BOUNDS`, :data:`_MODEL_RANGES`); the
    ``SamplingParams`` ranges come after (:func:`check_sampling_ranges`, :func:`validate_request`). Values
    already of the declared type skip pydantic (the hot path: ~0.1 µs a field).

    Raises:
        InvalidRequest: a value vLLM's model refuses, a float field that reads as NaN or an infinity
            (kvmesh's one tightening), or a value out of a bound vLLM's model checks; the message starts
            with the field's name (``'stream' must be a boolean or null, got a string ("maybe")``), which
            becomes the error's ``param``.
    """
    if (kind is RequestKind.COMPLETION or kind is RequestKind.CHAT) and body.get("stream_options") \
            and not body.get("stream"):
        raise _stream_options_without_stream()
    out: dict[str, Any] = {}
    fields = SCALAR_FIELDS[kind]
    numeric_only = _NUMERIC_ONLY.get(kind, frozenset())
    for name, value in body.items():  # the body's few keys, not the table's many
        spec = fields.get(name)
        if spec is None:
            continue
        typ, nullable = spec
        if type(value) is typ and (typ is not float or _finite(value)) and (name not in _INT_BOUNDS or _in_bounds(name, value)):
            read: Any = value  # the hot path: already the declared type
        else:
            read = _read_scalar(name, value, typ, nullable, name in numeric_only)
        out[name] = read
        floor = _MODEL_RANGES.get(name)
        if floor is not None and read is not None and type(read) is not bool and read < floor[0]:
            raise InvalidRequest(f"'{name}' must be {floor[1]}, got {read!r}")
    if kind is RequestKind.COMPLETION or kind is RequestKind.CHAT:
        for parent, members in _NESTED_BOOL_FIELDS.items():
            nested = body.get(parent)
            if nested is None:
                continue
            if not isinstance(nested, dict):
                raise InvalidRequest(f"'{parent}' must be an object or null, got {_got(nested)}")
            for member in members:
                if member in nested:
                    _read_scalar(f"{parent}.{member}", nested[member], bool, True)
        if "logit_bias" in body:
            _check_logit_bias(body["logit_bias"])
    return out


def check_sampling_ranges(fields: dict[str, Any]) -> None:
    """The ranges of :data:`_SAMPLING_RANGES` and ``repetition_penalty`` > 0 on fields read by :func:`coerce_fields`.

    Raises:
        InvalidRequest: naming the field and its range, as vLLM 0.32's ``SamplingParams._verify_args`` refuses it.
    """
    for name, (low, high, words) in _SAMPLING_RANGES.items():
        read = fields.get(name)
        if read is not None and ((low is not None and read < low) or (high is not None and read > high)):
            raise InvalidRequest(f"'{name}' must be {words}, got {read!r}")
    repetition = fields.get("repetition_penalty")
    if repetition is not None and repetition <= 0:  # vLLM 0.32 sampling_params.py:648
        raise InvalidRequest(f"'repetition_penalty' must be greater than 0, got {repetition!r}")


def estimate_text_tokens(text: str) -> int:
    """Admission-sizing estimate of a text's token count (BOS included); never raises."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN_ESTIMATE) + 1


def text_tokens_lower_bound(text: str) -> int:
    """A deliberately low count of a text's tokens, used to reject over-context prompts; never raises."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN_LOWER_BOUND) + 1


@dataclass(frozen=True, slots=True)
class _Prompt:
    """What a body asks the engine to read: the first prompt (for the pick), and sizes over all of them."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()
    count: int = 1
    estimate: int = 0
    """Admission-sizing estimate over every prompt (exact for token ids)."""
    lower_bounds: tuple[tuple[int, bool], ...] = ()
    """Per prompt: (token count lower bound, exact?) for the context check."""


_PLAIN_INT = frozenset((int,))


def _token_ids(value: list[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise InvalidRequest(f"'{where}' must not be empty")
    if _PLAIN_INT.issuperset(map(type, value)):  # every id a plain int (a JSON body's): the checks in C
        if min(value) < 0 or max(value) >= 2**32:
            raise InvalidRequest(f"'{where}' token ids must be in [0, 2^32)")
        return tuple(value)
    if not all(_is_int(t) for t in value):
        raise InvalidRequest(f"'{where}' must be a string or a list of token ids")
    if any(t < 0 or t >= 2**32 for t in value):
        raise InvalidRequest(f"'{where}' token ids must be in [0, 2^32)")
    return tuple(value)


def _text_or_ids(value: Any, where: str, max_batch: int) -> _Prompt:
    """A completions ``prompt`` / embeddings ``input``: text, token ids, or a batch of either (vLLM 0.32's
    ``str | list[str] | list[int] | list[list[int]]``)."""
    if isinstance(value, str):
        if not value:
            raise InvalidRequest(f"'{where}' must not be empty")
        text = _utf8_or_invalid(value, where)
        return _Prompt(text=text, estimate=estimate_text_tokens(text), lower_bounds=((text_tokens_lower_bound(text), False),))
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"'{where}' must be a non-empty string or list (text, token ids, or a batch of either)")
    if _is_int(value[0]):
        ids = _token_ids(value, where)
        return _Prompt(token_ids=ids, estimate=len(ids), lower_bounds=((len(ids), True),))
    if len(value) > max_batch:
        raise InvalidRequest(f"'{where}' holds {len(value)} prompts; at most {max_batch} per request")
    items: list[_Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            items.append(_text_or_ids(item, f"{where}[{i}]", max_batch))
        elif isinstance(item, list):
            ids = _token_ids(item, f"{where}[{i}]")
            items.append(_Prompt(token_ids=ids, estimate=len(ids), lower_bounds=((len(ids), True),)))
        else:
            raise InvalidRequest(f"'{where}[{i}]' must be a string or a list of token ids")
    if len({bool(p.text) for p in items}) > 1:
        raise InvalidRequest(f"'{where}' must be a list of strings or a list of token-id lists, not a mix")
    first = items[0]
    return _Prompt(text=first.text, token_ids=first.token_ids, count=len(items), estimate=sum(p.estimate for p in items),
                   lower_bounds=tuple(b for p in items for b in p.lower_bounds))


def _messages_prompt(messages: tuple[tuple[str, str], ...]) -> _Prompt:
    text = "".join(content for _, content in messages)
    estimate = estimate_text_tokens(text) + CHAT_TOKENS_PER_MESSAGE * len(messages)
    return _Prompt(messages=messages, estimate=estimate, lower_bounds=((text_tokens_lower_bound(text), False),))


def _responses_input(body: dict[str, Any]) -> _Prompt:
    """``/v1/responses``: ``input`` a string or a list of items (messages with role/content, or other
    item types the engine interprets); ``instructions`` a string (a system message). A message item
    (``type`` ``message`` or none) with a ``role`` is read by :mod:`kvmesh.chat_messages`' rule, its
    errors naming ``input[i].role`` / ``input[i].content``."""
    value = body.get("input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string")
    head: list[tuple[str, str]] = [("system", _utf8_or_invalid(instructions, "instructions"))] if instructions else []
    if isinstance(value, str):
        if not value and not head:
            raise InvalidRequest("'input' must not be empty")
        return _messages_prompt((*head, ("user", _utf8_or_invalid(value, "input"))))
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string or list of input items")
    out = list(head)
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"'input[{i}]' must be an object")
        if item.get("type", "message") != "message" or "role" not in item:
            continue  # another item type (function_call_output, reasoning, ...): the engine interprets it
        where = f"input[{i}]"
        out.append((chat_role(item["role"], where), content_text(item.get("content"), where)))
    return _messages_prompt(tuple(out))


def _validate_prompt(kind: RequestKind, body: dict[str, Any], max_batch: int) -> _Prompt:
    if kind is RequestKind.COMPLETION:
        if "messages" in body:
            raise InvalidRequest("'messages' belongs to /v1/chat/completions; send 'prompt' here")
        if "prompt" not in body or body["prompt"] is None:
            raise InvalidRequest("'prompt' is required")
        return _text_or_ids(body["prompt"], "prompt", max_batch)
    if kind is RequestKind.EMBEDDINGS:
        if "messages" in body:  # vLLM's chat-style embeddings request
            return _messages_prompt(chat_messages(body["messages"]))
        if body.get("input") is None:
            raise InvalidRequest("'input' is required")
        return _text_or_ids(body["input"], "input", max_batch)
    if kind is RequestKind.RESPONSES:
        if body.get("input") is None:
            raise InvalidRequest("'input' is required")
        return _responses_input(body)
    if "prompt" in body:
        raise InvalidRequest("'prompt' belongs to /v1/completions; send 'messages' here")
    return _messages_prompt(chat_messages(body.get("messages")))


def resolve_model(model: Any, catalog: ModelCatalog) -> tuple[str, str | None]:
    """``(served model, LoRA adapter or None)`` for a body's ``model``.

    Raises:
        InvalidRequest: missing or not a non-empty string.
        NoEndpointsAvailable: no endpoint is live and none was recently (nothing is known yet).
        ModelUnavailable: the model (or adapter) was served recently and has no live endpoint now.
        UnknownModel: a name never served.
    """
    if model is None:
        raise InvalidRequest("'model' is required")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string")
    _utf8_or_invalid(model, "model")
    if catalog.get(model) is not None:
        return model, None
    base = catalog.base_model(model)
    if base is not None and catalog.get(base) is not None:
        return base, model
    if catalog.recently_served(model):
        raise ModelUnavailable(f"model '{quoted(model)}' has no live endpoint right now (it was served recently); retry later")
    if not catalog.models and not catalog.departed:  # nothing known yet (start-up): retryable, not a verdict
        raise NoEndpointsAvailable("no model endpoints are live")
    served = ", ".join(catalog.names()) or f"none live now; recently {', '.join(sorted(catalog.departed))}"
    raise UnknownModel(f"The model '{quoted(model)}' does not exist (served: {served})")


def validate_request(
    kind: RequestKind, body: dict[str, Any], catalog: ModelCatalog, max_tokens_limit: int, max_n: int = 128,
    max_batch_prompts: int = 1024,
) -> RouterRequest:
    """Check ``body`` against the OpenAI schema subset kvmesh reads and the served models.

    Raises:
        InvalidRequest: malformed or out-of-range fields, or a prompt over the model's context.
        UnknownModel: the model was never served by a live endpoint.
        ModelUnavailable: the model was served recently, not now (503, retryable).
        NoEndpointsAvailable: no endpoint is live at all.
    """
    model, lora_name = resolve_model(body.get("model"), catalog)
    info = catalog.get(model)
    assert info is not None
    cache_salt = body.get("cache_salt")
    if cache_salt is not None:
        if not isinstance(cache_salt, str) or not cache_salt:
            raise InvalidRequest("'cache_salt' must be a non-empty string if provided")
        _utf8_or_invalid(cache_salt, "cache_salt")

    prompt = _validate_prompt(kind, body, max_batch_prompts)

    fields = coerce_fields(kind, body)
    check_sampling_ranges(fields)
    max_tokens: int | None = None
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = fields.get(name)
        if value is None:
            continue
        if value == 0 and name == "max_tokens" and kind is RequestKind.COMPLETION and fields.get("echo"):
            pass  # the prompt echoed, nothing generated: vLLM 0.32 protocol.py (echo_without_generation)
        elif value < 1:  # vLLM 0.32 sampling_params.py:688 (SamplingParams._verify_args)
            raise InvalidRequest(f"'{name}' must be at least 1, got {value}")
        cap = min(max_tokens_limit, info.max_model_len or max_tokens_limit)
        if value > cap:
            raise InvalidRequest(f"'{name}' = {value} exceeds the limit of {cap} tokens for model '{model}'")
        max_tokens = value if max_tokens is None else min(max_tokens, value)

    temperature = fields.get("temperature")
    if temperature is not None and not 0 <= temperature <= 2:  # vLLM 0.32 sampling_params.py:653-670 (NaN fails too)
        raise InvalidRequest(f"'temperature' must be in [0, 2], got {temperature}")
    top_p = fields.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:  # vLLM 0.32 sampling_params.py:671
        raise InvalidRequest(f"'top_p' must be in (0, 1], got {top_p}")
    n = fields.get("n")
    if n is None:
        n = 1
    if not 1 <= n <= max_n:  # vLLM 0.32 sampling_params.py:46-58 (>= 1); the upper bound is kvmesh's max_n
        raise InvalidRequest(f"'n' must be an integer in [1, {max_n}], got {n}")
    stream = bool(fields.get("stream"))

    previous_response_id = body.get("previous_response_id") if kind is RequestKind.RESPONSES else None
    if previous_response_id is not None and (not isinstance(previous_response_id, str) or not previous_response_id):
        raise InvalidRequest("'previous_response_id' must be a non-empty string")

    for lower, exact in prompt.lower_bounds:
        check_context(model, info.max_model_len, lower, max_tokens, exact=exact)

    return RouterRequest(
        kind=kind,
        model=model,
        body=body,
        stream=stream,
        prompt_text=prompt.text,
        prompt_token_ids=prompt.token_ids,
        messages=prompt.messages,
        max_tokens=max_tokens,
        prompt_tokens_estimate=prompt.estimate,
        lora_name=lora_name,
        cache_salt=cache_salt,
        n=n,
        prompt_count=prompt.count,
        previous_response_id=previous_response_id,
    )


def check_context(
    model: str, max_model_len: int | None, prompt_tokens: int, max_tokens: int | None, exact: bool = True
) -> None:
    """vLLM 0.32's rule: the prompt must leave room for one completion token, ``prompt_tokens < max_model_len``.

    vLLM 0.32 refuses a prompt over ``max_model_len`` (``renderers/params.py`` ``_token_len_check``) and
    one of exactly ``max_model_len`` (its ``max_tokens`` clamps to 0, which ``SamplingParams`` refuses);
    a ``max_tokens`` beyond the room left is **clamped** to ``max_model_len - prompt_tokens``
    (``entrypoints/serve/utils/api_utils.get_max_tokens``), not refused, so it is served here too
    (``max_tokens`` over ``max_model_len`` itself is refused by :func:`validate_request`, as vLLM does).
    ``exact`` is False when ``prompt_tokens`` is the text lower bound: the message then says
    "at least N prompt tokens (estimated)" rather than stating the estimate as a count.

    Raises:
        InvalidRequest: naming both numbers, when the prompt does not fit.
    """
    if max_model_len is None:
        return
    if prompt_tokens >= max_model_len:
        count = f"{prompt_tokens} prompt tokens" if exact else f"at least {prompt_tokens} prompt tokens (estimated)"
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; the request has "
            f"{count} and leaves no room for the {max_tokens or 1} completion tokens asked (model '{model}')"
        )


_COMPLETION_RENDER_FIELDS = ("add_special_tokens", "truncate_prompt_tokens")
_CHAT_RENDER_FIELDS = (
    "tools", "documents", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "truncate_prompt_tokens",
)


def render_fields_json(kind: RequestKind, body: dict[str, Any]) -> bytes:
    """``PickRequest.render_json``: the body's fields that change the engine's token sequence (vLLM 0.32).

    Completions: ``add_special_tokens``, ``truncate_prompt_tokens``. Chat: those plus ``tools``,
    ``documents``, ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
    ``continue_final_message``, and ``messages`` verbatim unless every message is exactly a string
    ``role`` and a string ``content`` (those travel as ``PickRequest.messages``). Only keys present;
    b"" when none (other kinds: always b"").
    """
    if kind is RequestKind.CHAT:
        out = {k: body[k] for k in _CHAT_RENDER_FIELDS if k in body}
        messages = body.get("messages")
        if not (isinstance(messages, list) and all(
            isinstance(m, dict) and len(m) == 2 and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )):
            out["messages"] = messages
    elif kind is RequestKind.COMPLETION:
        out = {k: body[k] for k in _COMPLETION_RENDER_FIELDS if k in body}
    else:
        return b""
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode() if out else b""
