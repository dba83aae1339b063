"""The rest of vLLM 0.32's OpenAI surface the router passes on: request shapes, ``--api-key``,
``/v1/embeddings``, ``/detokenize`` and ``/v1/responses``.

| piece | vLLM 0.32 behaviour held here |
| --- | --- |
| :func:`split_batch` | completions ``prompt`` as ``list[str]`` or ``list[list[int]]``: one engine request per prompt |
| :func:`choices_per_prompt` | ``n`` an integer >= 1 (vLLM's ``CompletionRequest.n`` / ``ChatCompletionRequest.n``) |
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
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from starlette.datastructures import URL, Headers
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

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
        answer = self._response_object(rid, created, "completed", self._state.renderer.detokenize(text_ids), req, body)
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
        async for new_ids, step_req in self._run(ids, max_tokens, body):
            req = step_req
            delta = self._state.renderer.detokenize(new_ids)
            text += delta
            if delta:
                yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=delta,
                            logprobs=[])
        yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[])
        completed = self._response_object(rid, created, "completed", text, req, body)
        if stored_messages is not None:
            self.store.keep(completed, stored_messages)
        yield event("response.completed", response=completed)
