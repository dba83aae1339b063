"""The rest of vLLM 0.32's OpenAI surface the router passes on: request shapes, ``--api-key``,
``/v1/embeddings``, ``/detokenize`` and ``/v1/responses``.

| piece | vLLM 0.32 behaviour held here |
| --- | --- |
| :func:`split_batch` | completions ``prompt`` as ``list[str]`` or ``list[list[int]]``: one engine request per prompt |
| :func:`choices_per_prompt` | ``n`` an integer >= 1 (vLLM's ``CompletionRequest.n`` / ``ChatCompletionRequest.n``); ``n > 1`` with ``temperature: 0`` is vLLM's 400 ``n must be 1 when using greedy sampling, got N.`` (``SamplingParams._verify_greedy_sampling``); ``best_of`` is no field of vLLM 0.32's requests (ignored, as any unknown field) |
| :func:`chat_echo` | chat's ``echo`` (``ChatCompletionRequest.echo``): the answer is prepended with the last message's content when that message has the answer's role (``assistant``, or the last message's own role with ``add_generation_prompt: false``) |
| :func:`read_generation_fields` | scalar fields read as vLLM's pydantic models read them (lax: ``"5"`` is 5, ``"false"`` is False), its type errors as its 400 (``"N validation error(s): ..."``, ``type`` "Bad Request"); ``stop`` a string or at most 4 strings, ``seed`` an int64; ``SamplingParams``' range checks (``temperature`` in [0, 2], ``top_p`` in (0, 1], ...) and ``logprobs`` at most ``MAX_LOGPROBS`` (20) with vLLM's messages (``BadRequestError``, ``param``) |
| :func:`stop_params`, :func:`check_stop_token_ids`, :func:`check_min_tokens` | ``stop``, ``stop_token_ids`` (``list[int]``, each in the vocabulary), ``include_stop_str_in_output``, ``min_tokens`` (at most the ``max_tokens`` the request runs with), ``skip_special_tokens``, applied by :mod:`engine_simulator.stopping` |
| :func:`simulated_logprobs` | ``logprobs: k`` (chat: ``logprobs: true`` + ``top_logprobs: k``) answers a logprobs object in vLLM's completion/chat shape, simulated values |
| :class:`ApiKeyMiddleware` | ``--api-key``: paths under ``/v1`` need ``Authorization: Bearer <key>``, else 401 ``{"error": "Unauthorized"}``; ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize`` stay open (``AuthenticationMiddleware``) |
| :meth:`ExtraRoutes.embeddings` | served only by the pooling runner (``--runner pooling``): ``input`` text, token ids or a batch -> ``{"object": "list", "data": [{"index", "object": "embedding", "embedding"}], "usage"}``; ``encoding_format`` float or base64 (little-endian float32) |
| :meth:`ExtraRoutes.detokenize` | ``{"model", "tokens"}`` -> ``{"prompt": text}`` |
| :meth:`ExtraRoutes.responses` | generate runner: ``input`` (string or message items) and ``instructions`` through the chat template, ``max_output_tokens``; answer ``object: "response"`` with one ``message`` output item; ``stream`` sends ``event: response.created`` / ``response.output_text.delta`` / ``response.completed`` |
| :class:`ResponseStore` | ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (vLLM's env): ``store`` (default true) keeps the response and its conversation in this server's memory; ``previous_response_id`` continues it (its messages, then the stored output as the assistant's turn), 404 ``Response with id '<id>' not found.`` (``invalid_request_error``, ``param`` ``response_id``) when this server does not hold it; ``GET /v1/responses/{id}`` returns it, ``POST /v1/responses/{id}/cancel`` answers 400 (no background mode here). Without the env, ``store`` is silently off and every ``previous_response_id`` is a 404 (vLLM 0.32's ``OpenAIServingResponses``) |

Embeddings are a deterministic function of the token ids (unit-norm, ``EMBEDDING_DIM`` floats): no
model weights are simulated, only the shapes and the token accounting.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from starlette.datastructures import URL, Headers
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_simulator.engine import EngineDeadError
from engine_simulator.stopping import StopParams
from kvmesh.errors import InvalidRequest

if TYPE_CHECKING:
    from engine_simulator.server import ServerState

EMBEDDING_DIM = 32
"""Length of a simulated embedding vector."""


def split_batch(body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """One body per prompt: a completions ``prompt`` that is a list of strings or of token-id lists
    becomes one body each (vLLM runs each prompt as its own engine request); anything else is itself.

    Raises:
        InvalidRequest: an empty batch.
    """
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list):
        return [body]
    if not prompt:
        raise InvalidRequest("The prompt cannot be empty")
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [{**body, "prompt": p} for p in prompt]
    return [body]


def chat_echo(body: dict[str, Any]) -> tuple[str, str]:
    """``(role, echoed text)`` of a chat body (vLLM 0.32 ``chat_completion/serving.py``: ``get_chat_request_role``
    and the ``request.echo`` blocks): the role is ``assistant`` unless ``add_generation_prompt`` is false (then the
    last message's role); the text is the last message's content when ``echo`` is set and that message has the
    role (list content: its text parts joined with ``"\n"``), else ""."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    role = "assistant" if body.get("add_generation_prompt", True) is not False else str(last.get("role", ""))
    if not body.get("echo") or last.get("role") != role:
        return role, ""
    return role, _text_of(last.get("content"))


def choices_per_prompt(body: dict[str, Any]) -> int:
    """``n``: an integer >= 1 (default 1).

    Raises:
        InvalidRequest: anything else.
    """
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequest(f"n must be an integer >= 1, got {n!r}")
    return n


class ApiKeyMiddleware:
    """vLLM's ``--api-key`` check: requests to ``/v1...`` need ``Authorization: Bearer <key>``.

    Keys are compared through SHA-256 digests with :func:`hmac.compare_digest` semantics (as vLLM does).
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _ok(self, headers: Headers) -> bool:
        import secrets

        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        path = URL(scope=scope).path.removeprefix(scope.get("root_path", ""))
        if path.startswith("/v1") and not self._ok(Headers(scope=scope)):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


def embedding_of(ids: list[int]) -> list[float]:
    """A deterministic unit vector of :data:`EMBEDDING_DIM` floats for a token sequence."""
    digest = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).digest()
    raw = [(digest[i % len(digest)] - 127.5) / 127.5 + (i + 1) * 1e-3 for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def _response_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """vLLM 0.32's ``ErrorResponse`` of the Responses API (``type`` ``invalid_request_error``)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": status}}, status_code=status)


def _not_found(response_id: str) -> JSONResponse:
    """vLLM 0.32's ``_make_not_found_error`` (any id this server does not hold, whatever its form)."""
    return _response_error(404, f"Response with id '{response_id}' not found.", "response_id")


class ResponseStore:
    """The stored responses of one server (vLLM keeps them in the API server's memory, unbounded).

    ``enabled`` is ``VLLM_ENABLE_RESPONSES_API_STORE=1`` in the environment, read once (as vLLM's
    ``envs`` does at start-up).
    """

    def __init__(self, enabled: bool | None = None) -> None:
        import os

        self.enabled = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") == "1" if enabled is None else enabled
        self.responses: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, list[dict[str, str]]] = {}
        """Response id -> the conversation it answered (its input messages, previous turns included)."""

    def conversation(self, previous_response_id: str) -> list[dict[str, str]] | None:
        """The messages a follow-up continues: the stored turn's messages, then its output as the
        assistant's message; None when not held here."""
        stored = self.responses.get(previous_response_id)
        if stored is None:
            return None
        text = "".join(part.get("text", "") for item in stored.get("output", []) if item.get("type") == "message"
                       for part in item.get("content", []) if part.get("type") == "output_text")
        return [*self.messages.get(previous_response_id, []), {"role": "assistant", "content": text}]

    def keep(self, response: dict[str, Any], messages: list[dict[str, str]]) -> None:
        self.responses[response["id"]] = response
        self.messages[response["id"]] = messages


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def responses_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Chat messages of a ``/v1/responses`` body: ``instructions`` as the system message, then ``input``.

    Raises:
        InvalidRequest: ``input`` missing or of another shape.
    """
    messages: list[dict[str, str]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for item in value:
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
    else:
        raise InvalidRequest("'input' must be a string or a non-empty list of input items")
    if not messages:
        raise InvalidRequest("'input' holds no message")
    return messages


class ExtraRoutes:
    """The routes of the module table over one simulated engine."""

    def __init__(self, state: ServerState, prepare: Any, run: Any) -> None:
        """``prepare(body, chat)`` -> (ids, max_tokens) and ``run(ids, max_tokens, body)`` -> an async
        iterator of new-token-id lists ending with the finished request (the server's own)."""
        self._state = state
        self._prepare = prepare
        self._run = run
        self.store = ResponseStore()

    async def detokenize(self, request: HttpRequest) -> Response:
        from engine_simulator.server import _check_model, _json_body

        body = await _json_body(request)
        _check_model(self._state, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequest("'tokens' must be a list of token ids")
        vocab = self._state.renderer.vocab_size
        for t in tokens:
            if t < 0 or t >= vocab:
                raise InvalidRequest(f"Token id {t} is out of vocabulary")
        return JSONResponse({"prompt": self._state.renderer.detokenize(tokens)})

    async def embeddings(self, request: HttpRequest) -> Response:
        from engine_simulator.server import _check_model, _json_body

        body = await _json_body(request)
        _check_model(self._state, body)
        if body.get("dimensions") is not None:
            raise InvalidRequest("Model does not support matryoshka representation, changing output dimensions "
                                 "will lead to poor results.")
        value = body.get("input")
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            items: list[Any] = [value]
        elif isinstance(value, list) and value:
            items = list(value)
        else:
            raise InvalidRequest("'input' must be a string, token ids, or a non-empty list of either")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise InvalidRequest(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
        data: list[dict[str, Any]] = []
        prompt_tokens = 0
        for i, item in enumerate(items):
            ids = self._state.renderer.prompt_ids(item, bool(body.get("add_special_tokens", True)))
            if len(ids) > self._state.max_model_len:
                raise InvalidRequest(f"This model's maximum context length is {self._state.max_model_len} tokens. "
                                     f"However, you requested {len(ids)} tokens in the input for embedding generation. "
                                     "Please reduce the length of the input.")
            prompt_tokens += len(ids)
            vector = embedding_of(ids)
            encoded: Any = vector if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": i, "object": "embedding", "embedding": encoded})
        return JSONResponse({
            "id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": self._state.model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None},
        })

    async def responses(self, request: HttpRequest) -> Response:
        from engine_simulator.server import _json_body

        body = await _json_body(request)
        messages = responses_messages(body)
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise InvalidRequest("'previous_response_id' must be a string")
            history = self.store.conversation(previous)
            if history is None:
                return _not_found(previous)
            messages = history + [m for m in messages if m["role"] != "system"]
        store = self.store.enabled and body.get("store", True) is not False
        chat_body = {"model": body.get("model"), "messages": messages}
        if body.get("max_output_tokens") is not None:
            chat_body["max_completion_tokens"] = body["max_output_tokens"]
        ids, max_tokens = await self._prepare(chat_body, True)
        rid = "resp_" + uuid.uuid4().hex
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(self._stream_response(rid, created, ids, max_tokens, body,
                                                           messages if store else None),
                                     media_type="text/event-stream")
        text_ids: list[int] = []
        req = None
        async for new_ids, step_req in self._run(ids, max_tokens, body):
            text_ids += new_ids
            req = step_req
        text = self._state.renderer.detokenize(text_ids, skip_special_tokens=True)  # EOS: "" (vLLM's default)
        answer = self._response_object(rid, created, "completed", text, req, body)
        if store:
            self.store.keep(answer, messages)
        return JSONResponse(answer)

    async def retrieve_response(self, request: HttpRequest) -> Response:
        """``GET /v1/responses/{response_id}``: a response this server stored (vLLM's ``retrieve_responses``)."""
        response_id = str(request.path_params["response_id"])
        stored = self.store.responses.get(response_id)
        if stored is None:
            return _not_found(response_id)
        return JSONResponse(stored)

    async def cancel_response(self, request: HttpRequest) -> Response:
        """``POST /v1/responses/{response_id}/cancel``: only background responses can be cancelled, and the
        simulator runs none, so a stored one is vLLM's 400 ``Cannot cancel a synchronous response.``"""
        response_id = str(request.path_params["response_id"])
        if response_id not in self.store.responses:
            return _not_found(response_id)
        return _response_error(400, "Cannot cancel a synchronous response.", "response_id")

    def _response_object(self, rid: str, created: int, status: str, text: str, req: Any,
                         body: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [] if status != "completed" else [{
            "id": "msg_" + rid.removeprefix("resp_"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
        }]
        n_in = req.num_prompt_tokens if req is not None else 0
        n_out = len(req.output_token_ids) if req is not None else 0
        return {
            "id": rid, "object": "response", "created_at": created, "model": self._state.model, "status": status,
            "output": output, "error": None, "incomplete_details": None, "instructions": None, "metadata": None,
            "parallel_tool_calls": True, "temperature": None, "tool_choice": "auto", "tools": [], "top_p": None,
            "max_output_tokens": None, "previous_response_id": (body or {}).get("previous_response_id"),
            "reasoning": None, "text": None, "truncation": "disabled",
            "usage": None if req is None else {
                "input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                "input_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    async def _stream_response(
        self, rid: str, created: int, ids: list[int], max_tokens: int, body: dict[str, Any],
        stored_messages: list[dict[str, str]] | None = None,
    ) -> AsyncIterator[str]:
        import json

        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        yield event("response.created", response=self._response_object(rid, created, "in_progress", "", None, body))
        text = ""
        req = None
        item_id = "msg_" + rid.removeprefix("resp_")
        try:
            async for new_ids, step_req in self._run(ids, max_tokens, body):
                req = step_req
                delta = self._state.renderer.detokenize(new_ids, skip_special_tokens=True)  # EOS: "" (vLLM's default)
                text += delta
                if delta:
                    yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                delta=delta, logprobs=[])
        except EngineDeadError as exc:  # the engine died under the stream: the Responses API's error event ends it
            yield event("error", code="InternalServerError", message=str(exc), param=None)
            return
        yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[])
        completed = self._response_object(rid, created, "completed", text, req, body)
        if stored_messages is not None:
            self.store.keep(completed, stored_messages)
        yield event("response.completed", response=completed)


# -- request fields as vLLM 0.32's pydantic models read them -----------------------------------------

_SAMPLING_EPS = 1e-5
"""``sampling_params._SAMPLING_EPS``: a temperature below it is greedy sampling."""
MAX_LOGPROBS = 20
"""vLLM 0.32's ``--max-logprobs`` default (``config/model.py`` ``ModelConfig.max_logprobs``)."""
MAX_STOP_STRINGS = 4
"""``VLLM_MAX_STOP_STRINGS`` default (``envs.py``): the longest ``stop`` list ``StopParam`` takes."""
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype",
})


class FieldError(Exception):
    """vLLM's ``VLLMValidationError`` raised in a model validator: not a ``ValueError``, so pydantic lets it
    through and vLLM answers it as ``BadRequestError`` (``create_error_response``), not as a validation error."""

    def __init__(self, message: str, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.message, self.parameter, self.value = message, parameter, value


class VllmValidationError(Exception):
    """A request vLLM's FastAPI layer refuses: carries the 400 body (``ErrorResponse``) to answer with."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.body = body


def _number_or_none(data: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise FieldError(f"`{name}` must be an integer.", name, value)


class _JsonSchemaFormat(BaseModel):
    """vLLM 0.32 ``JsonSchemaResponseFormat``: ``name``, ``description``, ``schema`` (its ``json_schema``), ``strict``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(BaseModel):
    """vLLM 0.32 ``ResponseFormat``: ``type`` one of ``text``, ``json_object``, ``json_schema``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


class _StructuralTag(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    begin: str
    structural_tag_schema: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class _LegacyStructuralTagFormat(BaseModel):
    """vLLM 0.32 ``LegacyStructuralTagResponseFormat``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["structural_tag"]
    structures: list[_StructuralTag]
    triggers: list[str]


class _StructuralTagFormat(BaseModel):
    """vLLM 0.32 ``StructuralTagResponseFormat``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["structural_tag"]
    format: Any


class _GenerationFields(BaseModel):
    """The scalar fields of vLLM 0.32's ``CompletionRequest`` the simulator reads, same types (lax pydantic v2),
    same ``Field`` bounds, same ``check_logprobs`` before-validator (``completion/protocol.py`` 59-136, 503-575)."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = 16
    n: int = 1
    stream: bool | None = False
    ignore_eos: bool = False
    echo: bool | None = False
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = []
    logprobs: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    use_beam_search: bool = False
    response_format: _ResponseFormat | _StructuralTagFormat | _LegacyStructuralTagFormat | None = None
    """vLLM 0.32's ``AnyResponseFormat``: its shape is checked (a 400 as vLLM's for an unknown ``type``); the
    simulated text does not follow the format (no grammar is simulated)."""

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("use_beam_search") and data.get("echo") and data.get("logprobs") is not None:
                raise FieldError("`echo` with `logprobs` is not supported with beam search because beam search does "
                                 "not compute prompt logprobs.", "echo")
            _number_or_none(data, ("prompt_logprobs", "logprobs"))
            logprobs = data.get("logprobs")
            if logprobs is not None and logprobs < 0 and logprobs != -1:
                raise FieldError("`logprobs` must be a positive value or -1.", "logprobs", logprobs)
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_stream_options(cls, data: Any) -> Any:
        """vLLM 0.32's ``validate_stream_options`` (``CompletionRequest`` and ``ChatCompletionRequest``): truthy
        ``stream_options`` with a falsy ``stream``, as the JSON holds them, is a ``VLLMValidationError``."""
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise FieldError("Stream options can only be defined when `stream=True`.", "stream_options")
        return data

    def num_logprobs(self) -> int | None:
        return self.logprobs


class _ChatFields(_GenerationFields):
    """``ChatCompletionRequest`` (``chat_completion/protocol.py`` 227-388, 835-890): ``max_tokens`` defaults to
    None, ``max_completion_tokens`` preferred; ``n`` Optional; ``echo`` a plain bool; ``logprobs`` a bool and
    ``top_logprobs`` the count (null -> 0), which needs ``logprobs: true``."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1  # type: ignore[assignment]
    echo: bool = False
    logprobs: bool | None = False
    top_logprobs: Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)] = 0

    @model_validator(mode="before")
    @classmethod
    def _check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _number_or_none(data, ("prompt_logprobs", "top_logprobs"))
            top = data.get("top_logprobs")
            if top is not None:
                if top < 0 and top != -1:
                    raise FieldError("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
                if (top == -1 or top > 0) and not data.get("logprobs"):
                    raise FieldError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        return data

    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None


def _clean_loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (re.search(r"[\[\]{}()]", str(p)) or str(p).lower() in _LOC_MARKERS)]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    """vLLM 0.32's 400 for a body its pydantic model refuses (``serve/exception_handling/handlers/validation.py``
    ``validation_exception_handler``): ``"N validation error(s):\\n  {error}"`` over at most 10 errors (locations
    under ``body``, union-branch markers dropped, inputs summarized), ``type`` "Bad Request", ``param`` the
    first error's location (``body.stop``)."""
    errors: list[dict[str, Any]] = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
    param = _clean_loc(errors[0]["loc"]) if errors else None
    label = "error" if len(errors) == 1 else "errors"
    lines = []
    for err in errors[:10]:
        shown = {**err, "loc": _clean_loc(err["loc"])}
        if "input" in shown:
            shown["input"] = _summarize(shown["input"])
        text = str(shown)
        lines.append(f"  {text[:1000]}...[truncated]" if len(text) > 1000 else f"  {text}")
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    if len(errors) > 10:
        message += f"\n  ...and {len(errors) - 10} more {label}"
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}


def _sampling_error(message: str, param: str | None = None, value: Any = None) -> VllmValidationError:
    """vLLM's answer to a ``VLLMValidationError``: ``BadRequestError``, its ``str()`` as the message (the text, then
    `` (parameter=P, value=V)`` for those set: ``vllm/exceptions.py``), ``param`` its parameter."""
    extras = [f"{k}={v}" for k, v in (("parameter", param), ("value", value)) if v is not None]
    text = f"{message} ({', '.join(extras)})" if extras else message
    return VllmValidationError({"error": {"message": text, "type": "BadRequestError", "param": param, "code": 400}})


def _check_sampling(fields: _GenerationFields, vocab_size: int) -> None:
    """``SamplingParams._verify_args`` and ``_validate_logprobs`` (vLLM 0.32 ``sampling_params.py`` 46-58, 632-735,
    919-935) for the fields read here; the first failure wins, as there."""
    n = 1 if fields.n is None else fields.n
    if n < 1:
        raise _sampling_error(f"n must be at least 1, got {n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(fields, name)
        value = 0.0 if value is None else value
        if not -2.0 <= value <= 2.0:
            raise _sampling_error(f"{name} must be in [-2, 2], got {value}.")
    repetition = 1.0 if fields.repetition_penalty is None else fields.repetition_penalty
    if not math.isfinite(repetition):
        raise _sampling_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise _sampling_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = 1.0 if fields.temperature is None else fields.temperature
    if not math.isfinite(temperature):
        raise _sampling_error(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise _sampling_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise _sampling_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    top_p = 1.0 if fields.top_p is None else fields.top_p
    if not 0.0 < top_p <= 1.0:
        raise _sampling_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = 0 if fields.top_k is None else fields.top_k
    if top_k < -1:
        raise _sampling_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if fields.min_p is None else fields.min_p
    if not 0.0 <= min_p <= 1.0:
        raise _sampling_error(f"min_p must be in [0, 1], got {min_p}.")
    if fields.min_tokens < 0:
        raise _sampling_error(f"min_tokens must be greater than or equal to 0, got {fields.min_tokens}.")
    stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop or []
    if any(not s for s in stop):
        raise _sampling_error("stop cannot contain an empty string.")
    if temperature < _SAMPLING_EPS and n > 1 and not fields.use_beam_search:  # _verify_greedy_sampling
        raise _sampling_error(f"n must be 1 when using greedy sampling, got {n}.")


def check_max_logprobs(k: int | None, vocab_size: int) -> None:
    """``SamplingParams._validate_logprobs`` (vLLM 0.32 ``sampling_params.py`` 919-935): ``k`` (-1: the vocabulary)
    at most ``MAX_LOGPROBS``. vLLM runs it in the engine's input processing, so a streamed request gets it as an
    in-stream ``data: {"error": ...}`` event after a 200, a plain one as this 400.

    Raises:
        VllmValidationError: ``Requested sample logprobs of K, which is greater than max allowed: 20``.
    """
    if k:
        requested = vocab_size if k == -1 else k
        if requested > MAX_LOGPROBS:
            raise _sampling_error(f"Requested sample logprobs of {requested}, which is greater than max allowed: "
                                  f"{MAX_LOGPROBS}", "logprobs", requested)


def stop_params(body: dict[str, Any]) -> StopParams:
    """The stop fields of a body :func:`read_generation_fields` returned (values already read and checked):
    ``stop`` (a string or a list), ``stop_token_ids`` (duplicates dropped, as ``SamplingParams``),
    ``include_stop_str_in_output``, ``min_tokens``, ``skip_special_tokens``."""
    stop = body.get("stop")
    return StopParams(
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=frozenset(body.get("stop_token_ids") or ()),
        include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
        min_tokens=int(body.get("min_tokens") or 0),
        skip_special_tokens=body.get("skip_special_tokens", True) is not False,
    )


def check_stop_token_ids(stop_token_ids: list[int] | None, vocab_size: int) -> None:
    """``SamplingParams._validate_stop_token_ids`` (vLLM 0.32 ``sampling_params.py`` 1047-1070): every id in
    ``[0, vocab_size)``. Run in the engine's input processing like :func:`check_max_logprobs` (a streamed
    request gets it in-stream).

    Raises:
        VllmValidationError: ``token_id(s) [..] in stop_token_ids contain out-of-vocab token ids. Vocabulary
            size: V``, ``param`` ``stop_token_ids``.
    """
    invalid = [t for t in stop_token_ids or () if t < 0 or t >= vocab_size]
    if invalid:
        raise _sampling_error(f"token_id(s) {invalid} in stop_token_ids contain out-of-vocab token ids. "
                              f"Vocabulary size: {vocab_size}", "stop_token_ids", invalid)


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """``SamplingParams._verify_args`` (vLLM 0.32 ``sampling_params.py`` 698-702) against the ``max_tokens`` the
    request runs with (vLLM's ``get_max_tokens``: the one asked for, or the room left in the context, or 1 for
    completions' ``echo`` with ``max_tokens: 0``). Checked in ``to_sampling_params``, before any answer starts.

    Raises:
        VllmValidationError: ``min_tokens must be less than or equal to max_tokens=M, got N.``
    """
    if min_tokens > max_tokens:
        raise _sampling_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")


def read_generation_fields(body: dict[str, Any], chat: bool, vocab_size: int) -> tuple[dict[str, Any], int | None]:
    """Validate a completions/chat body's scalar fields as vLLM 0.32 does and coerce them.

    Returns:
        ``(body with the read fields coerced, logprobs per token or None)``: ``{"n": "2"}`` reads as 2,
        ``{"stream": "false"}`` as False; for chat the count is ``top_logprobs`` when ``logprobs`` is true.

    Raises:
        VllmValidationError: with vLLM's 400 body (pydantic's type errors, its ``check_logprobs`` messages,
            ``SamplingParams``' range messages); ``logprobs`` over ``MAX_LOGPROBS`` is :func:`check_max_logprobs`.
    """
    model = _ChatFields if chat else _GenerationFields
    try:
        fields = model.model_validate(body)
    except ValidationError as exc:
        raise VllmValidationError(validation_error_body(exc)) from None
    except FieldError as exc:
        raise _sampling_error(exc.message, exc.parameter, exc.value) from None
    _check_sampling(fields, vocab_size)
    read = ("n", "stream", "ignore_eos", "max_tokens", "echo", "use_beam_search", "stop", "stop_token_ids",
            "include_stop_str_in_output", "min_tokens", "skip_special_tokens")
    coerced: dict[str, Any] = {name: getattr(fields, name) for name in read if name in body}
    if isinstance(fields, _ChatFields) and "max_completion_tokens" in body:
        coerced["max_completion_tokens"] = fields.max_completion_tokens
    return {**body, **coerced}, fields.num_logprobs()


def _first_wins(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """``{token: logprob}`` keeping a token string's first (most likely) value: distinct ids may decode alike."""
    out: dict[str, float] = {}
    for token, value in pairs:
        out.setdefault(token, value)
    return out


def simulated_logprob(token_id: int, rank: int) -> float:
    """The simulated logprob of ``token_id`` ranked ``rank`` (0: the most likely): deterministic, <= 0."""
    return -round(0.01 + (token_id % 50) / 100 + rank * 0.75, 4)


def simulated_logprobs(token_ids: list[int], token_text: Any, k: int, chat: bool, text_offset: int = 0,
                       first_unscored: bool = False, alternatives: Any = None) -> dict[str, Any]:
    """A logprobs object in vLLM 0.32's shape for sampled ``token_ids`` with ``k`` alternatives each.

    Completions (``CompletionLogProbs``): ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}``, each
    step's ``top_logprobs`` a ``{token: logprob}`` dict holding the sampled token and the top ``k``. Chat
    (``ChatCompletionLogProbs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [k entries]}]}``.
    Values are simulated (:func:`simulated_logprob`, the sampled token the most likely); tokens are the
    tokenizer's own strings (``token_text(id)``). ``first_unscored`` (completions, ``echo``: the ids start with
    the prompt): the first token's logprob and top_logprobs are None, as vLLM's first prompt logprob.
    ``alternatives(token_id, k)``: the ``k`` ranked ids of a step, the token first (default: the ids after it).
    """
    logprob = simulated_logprob
    ranked = alternatives or (lambda tid, count: [tid + r for r in range(count)])
    steps = []
    for tid in token_ids:
        top = [(a, logprob(a, r)) for r, a in enumerate(ranked(tid, k))]
        steps.append((token_text(tid), logprob(tid, 0), [(token_text(a), lp) for a, lp in top[:k]]))
    if chat:
        def entry(token: str, lp: float) -> dict[str, Any]:
            return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8", errors="replace"))}
        return {"content": [{**entry(tok, lp), "top_logprobs": [entry(t, v) for t, v in top]} for tok, lp, top in steps]}
    offsets: list[int] = []
    position = text_offset
    for tok, _, _ in steps:
        offsets.append(position)
        position += len(tok)
    token_logprobs: list[float | None] = [lp for _, lp, _ in steps]
    top_logprobs: list[dict[str, float] | None] = [_first_wins([(tok, lp), *top]) for tok, lp, top in steps]
    if first_unscored and steps:
        token_logprobs[0] = top_logprobs[0] = None
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": [tok for tok, _, _ in steps],
        "top_logprobs": top_logprobs,
    }
