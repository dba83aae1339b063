"""The simulator's HTTP surface: vLLM 0.32's OpenAI server, the parts the mesh uses.

| route | what |
| --- | --- |
| ``POST /v1/completions`` | ``prompt`` text or token ids (or a batch); ``stream`` (SSE, ``data: [DONE]``) or not; ``n``, ``echo``, ``use_beam_search``, the stop fields (``stop``, ``stop_token_ids``, ``include_stop_str_in_output``, ``min_tokens``: ``engine_simulator/stopping.py``) as vLLM 0.32 (``engine_simulator/README.md``) |
| ``POST /v1/chat/completions`` | ``messages`` through the documented template (``rendering.py``); ``n``, ``echo``, ``use_beam_search``, the stop fields likewise |
| ``POST /v1/embeddings`` (``--runner pooling``), ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``POST /detokenize`` | ``engine_simulator/openai_extras.py`` |
| ``POST /tokenize`` | ``{"model","prompt"}`` or ``{"model","messages","add_generation_prompt"}`` -> ``{"count","max_model_len","tokens","token_strs"}`` |
| ``POST /v1/completions/render``, ``POST /v1/chat/completions/render`` | token ids the engine would run, without running |
| ``GET /v1/models``, ``GET /health``, ``GET /metrics`` | as vLLM (``vllm:*`` families) |
| ``POST /reset_prefix_cache`` | vLLM's dev-mode route; ``AllBlocksCleared`` goes out at the next step |
| ``GET /debug/kv_cache`` | kvmesh's: the exact cached block hashes (to compare an index with) and the publisher's next seq |
| ``POST /debug/kv_events/drop`` | kvmesh's: ``{"count": n}`` withholds the next n KV-event messages from PUB (replayable): a crafted gap |

Bodies are OpenAI-shaped; errors are vLLM's ``{"error": {"message","type","param","code"}}`` with 400
(bad input) or 404 (unknown model). ``usage`` always carries ``prompt_tokens_details.cached_tokens``
(vLLM needs ``--enable-prompt-tokens-details`` for it). Streams carry usage only with
``stream_options.include_usage`` (vLLM's rule). A client that disconnects aborts its request.

Bounded work (issue 14): a prompt is never encoded on the event loop once it is longer than
``_INLINE_CHARS``: the encoding (GIL released) and the rendering of a long ``/tokenize`` reply run
in a worker thread, so ``/health``, ``/metrics``, running streams and the etcd lease keep going.
Generation and render routes refuse a prompt whose token count certainly reaches ``max_model_len``
(token ids: their number; text: :meth:`Renderer.min_tokens` of its length) with vLLM's 400 before
encoding anything; ``/tokenize`` keeps vLLM's behaviour (no context-length check).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_simulator.beam_search import beam_search, candidates
from engine_simulator.engine import AsyncEngine, EngineDeadError
from engine_simulator.openai_extras import (
    ApiKeyMiddleware,
    ExtraRoutes,
    VllmValidationError,
    chat_echo,
    check_max_logprobs,
    check_min_tokens,
    check_stop_token_ids,
    choices_per_prompt,
    read_generation_fields,
    simulated_logprob,
    simulated_logprobs,
    split_batch,
    stop_params,
)
from engine_simulator.rendering import Renderer
from engine_simulator.scheduler import FinishReason, LoraAdapter, Request, RequestOutput
from engine_simulator.stopping import OutputText, StopParams
from engine_simulator.tokenizer import EOS_ID
from kvmesh.errors import InvalidRequest, UnknownModel

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache"}
_INLINE_CHARS = 8192
"""Prompts up to this many characters are encoded on the event loop (a thread hop costs more)."""


def _prompt_chars(value: Any) -> int:
    """Characters of a prompt or messages body value (strings, nested lists and dicts; token-id lists count 0)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_prompt_chars(v) for v in value if not isinstance(v, int))
    if isinstance(value, dict):
        return sum(_prompt_chars(v) for v in value.values())
    return 0


def _dumps(obj: Any) -> str:
    """Compact JSON, as vLLM's pydantic ``model_dump_json`` writes SSE chunks."""
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class ServerState:
    """What the routes need."""

    engine: AsyncEngine
    renderer: Renderer
    model: str
    max_model_len: int
    root: str
    created: int
    metrics_delay_seconds: float = 0.0
    """Fault injection: /metrics answers this late (seconds)."""
    lora_adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    """Served LoRA adapters by name (``--lora-adapters``): a body naming one as ``model`` runs under it."""
    api_key: str = ""
    """vLLM's ``--api-key``: ``/v1/*`` needs ``Authorization: Bearer <key>`` (``openai_extras.ApiKeyMiddleware``)."""
    runner: str = "generate"
    """vLLM's ``--runner``: ``generate`` serves completions, chat and responses; ``pooling`` serves embeddings."""


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = error_body(message, status)
    body["error"]["param"] = param
    return JSONResponse(body, status_code=status)


async def _json_body(request: HttpRequest) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer longer than Python's int-string limit (4300 digits)
        raise InvalidRequest(f"request body is not valid JSON: {str(exc)[:200]}") from exc
    except RecursionError:  # nested deeper than the parser's recursion limit
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is not None and model != state.model and model not in state.lora_adapters:
        raise UnknownModel(f"The model `{model}` does not exist.")


def request_scope(state: ServerState, body: dict[str, Any]) -> tuple[LoraAdapter | None, str | None]:
    """The LoRA adapter (``model`` naming one) and ``cache_salt`` of a generation body (vLLM's rules:
    the salt must be a non-empty string when given)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("Parameter 'cache_salt' must be a non-empty string if provided.")
    return state.lora_adapters.get(str(body.get("model"))), salt


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be an integer")
    return value


def _max_tokens(state: ServerState, body: dict[str, Any], n_prompt: int, chat: bool) -> int:
    if n_prompt >= state.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {state.max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages."
        )
    if chat:
        value = _int_field(body, "max_completion_tokens", None)
        if value is None:
            value = _int_field(body, "max_tokens", None)
        if value is None:
            value = state.max_model_len - n_prompt
    else:
        value = _int_field(body, "max_tokens", 16)
        assert value is not None
    if value < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {value}.")
    if value > state.max_model_len:
        raise InvalidRequest(f"max_tokens={value} cannot be greater than max_model_len={state.max_model_len}. "
                             "Please request fewer output tokens.")
    return min(value, state.max_model_len - n_prompt)  # vLLM 0.32's get_max_tokens clamps to the room left


def summed_usage(reqs: list[Request], n: int = 1, cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM 0.32's usage over a request's choices (``serving.py`` of completion and chat): each prompt's tokens
    once, the generated tokens of every choice summed (``reqs`` are prompt-major, ``n`` per prompt; an echoed
    prompt is not counted as generated). ``cached_tokens`` is one ``RequestOutput``'s ``num_cached_tokens``, not a
    sum: the last prompt's (its last choice to finish) in a plain answer, the first output's in a stream; None
    takes the last prompt's first choice."""
    prompts = reqs[::n]
    n_prompt = sum(req.num_prompt_tokens for req in prompts)
    n_out = sum(len(req.output_token_ids) for req in reqs)
    cached = prompts[-1].num_cached_tokens if cached_tokens is None else cached_tokens
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": {"cached_tokens": max(cached, 0)},
    }


@dataclass
class _Shape:
    """How a completions/chat request's choices are written (vLLM 0.32 ``completion/serving.py``,
    ``chat_completion/serving.py``)."""

    chat: bool
    n: int
    """Choices per prompt."""
    k: int | None
    """Logprobs per token (None: no logprobs)."""
    echo: bool = False
    echo_only: bool = False
    """Completions' ``echo`` with ``max_tokens: 0``: each choice is the prompt alone (the engine ran one token)."""
    echo_texts: list[str] = field(default_factory=list)
    """Per prompt, the text ``echo`` prepends (completions: the prompt's text; chat: the echoed message or "")."""
    role: str = "assistant"
    """Chat: the answer's role (vLLM's ``get_chat_request_role``)."""


async def _wait_disconnect(request: HttpRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s outcome as seen, so asyncio logs no "exception was never retrieved" traceback."""
    if not future.cancelled():
        future.exception()


def error_body(message: str, status: int = 500) -> dict[str, Any]:
    """vLLM's OpenAI error object (``{"error": {"message","type","param","code"}}``) for ``status``."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def engine_dead_event() -> str:
    """The SSE event a stream ends with when the engine died under it (then ``data: [DONE]``), as vLLM's
    ``create_streaming_error_response`` writes an ``EngineDeadError``."""
    return f"data: {_dumps(error_body(str(EngineDeadError())))}\n\n"


async def _collect(queue: asyncio.Queue[RequestOutput]) -> None:
    """Wait for a request's last output.

    Raises:
        EngineDeadError: the engine died before the request finished (its error output).
    """
    while True:
        out = await queue.get()
        if out.error is not None:
            raise EngineDeadError(out.error)
        if out.finished:
            return


class EngineHttpApi:
    """The routes of the table above, as methods over one engine (``app()`` builds the Starlette app).

    Args:
        state: the engine, its renderer and the served model's identity.
    """

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._engine = state.engine
        self._renderer = state.renderer

    def app(self) -> Starlette:
        extras = ExtraRoutes(self._state, self._prepare_bounded, self._run_one)
        if self._state.runner == "pooling":  # vLLM registers the routes of the tasks the model supports
            task_routes = [Route("/v1/embeddings", extras.embeddings, methods=["POST"])]
        else:
            task_routes = [
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/responses", extras.responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", extras.retrieve_response, methods=["GET"]),
                Route("/v1/responses/{response_id}/cancel", extras.cancel_response, methods=["POST"]),
            ]
        return Starlette(
            routes=[
                *task_routes,
                Route("/v1/completions/render", self.completions_render, methods=["POST"]),
                Route("/v1/chat/completions/render", self.chat_render, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", extras.detokenize, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
                Route("/debug/kv_cache", self.debug_kv_cache, methods=["GET"]),
                Route("/debug/kv_events/drop", self.debug_drop_events, methods=["POST"]),
            ],
            exception_handlers={InvalidRequest: self._invalid_request, UnknownModel: self._unknown_model,
                                EngineDeadError: self._engine_dead,
                                VllmValidationError: self._vllm_validation, ClientDisconnect: self._client_disconnected},
            middleware=[Middleware(ApiKeyMiddleware, api_key=self._state.api_key)] if self._state.api_key else None,
        )

    async def _run_one(self, ids: list[int], max_tokens: int, body: dict[str, Any]) -> AsyncIterator[tuple[list[int], Request]]:
        """Run one sequence; yield ``(new token ids, request)`` per step until it finishes (aborted if abandoned)."""
        lora, salt = request_scope(self._state, body)
        req = Request("resp-" + uuid.uuid4().hex, ids, max_tokens, ignore_eos=bool(body.get("ignore_eos", False)),
                      lora=lora, cache_salt=salt)
        try:
            queue = self._engine.submit(req)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if out.error is not None:
                    raise EngineDeadError(out.error)
                finished = out.finished
                yield list(out.new_token_ids), req
        finally:
            if not finished:
                self._engine.abort(req.request_id)

    # -- errors (vLLM's bodies) ---------------------------------------------------------------

    async def _client_disconnected(self, request: HttpRequest, exc: Exception) -> Response:
        """The client went away while sending its request: logged as such, nothing answered (499)."""
        logger.info("client disconnected while sending the request path=%s", request.url.path)
        return Response(status_code=499)

    async def _engine_dead(self, request: HttpRequest, exc: Exception) -> Response:
        """The engine died (before or while running the request): vLLM's 500 for an ``EngineDeadError``."""
        return _error(500, str(exc))

    async def _invalid_request(self, request: HttpRequest, exc: Exception) -> Response:
        return _error(400, str(exc))

    async def _vllm_validation(self, request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, VllmValidationError)
        return JSONResponse(exc.body, status_code=400)

    async def _unknown_model(self, request: HttpRequest, exc: Exception) -> Response:
        return _error(404, str(exc), "model")

    # -- generation ---------------------------------------------------------------------------

    def _refuse_certainly_too_long(self, body: dict[str, Any], chat: bool) -> int:
        """Characters to encode; raises vLLM's context-length 400 when the prompt certainly reaches ``max_model_len``."""
        limit = self._state.max_model_len
        value = body.get("messages") if chat else body.get("prompt")
        ids = value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) else value
        if not chat and isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids[:1]):
            if len(ids) >= limit:
                raise InvalidRequest(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{len(ids)} input tokens. Please reduce the length of the input messages."
                )
            return 0
        chars = _prompt_chars(value)
        at_least = self._renderer.min_tokens(chars)
        if at_least >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, your request has at least "
                f"{at_least} input tokens. Please reduce the length of the input messages."
            )
        return chars

    async def _prepare_bounded(self, body: dict[str, Any], chat: bool) -> tuple[list[int], int]:
        """:meth:`_prepare`, refused early when certainly too long, encoded off the loop when long."""
        _check_model(self._state, body)
        chars = self._refuse_certainly_too_long(body, chat)
        if chars > _INLINE_CHARS:
            return await asyncio.to_thread(self._prepare, body, chat)
        return self._prepare(body, chat)

    def _prepare(self, body: dict[str, Any], chat: bool) -> tuple[list[int], int]:
        """Token ids and ``max_tokens`` of a completion or chat body.

        Raises:
            UnknownModel: ``model`` names another model.
            InvalidRequest: no prompt, or a length/``max_tokens`` vLLM would refuse.
        """
        _check_model(self._state, body)
        ids = self._renderer.chat_request_ids(body) if chat else self._renderer.completion_request_ids(body)
        return ids, _max_tokens(self._state, body, len(ids), chat)

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: HttpRequest, chat: bool) -> Response:
        """One completions/chat request: every prompt of a batch times ``n`` choices (vLLM 0.32's shapes:
        choice ``index`` = ``prompt_index * n + i``; usage summed, a prompt's tokens counted once), with
        ``echo`` (:class:`_Shape`).

        Raises:
            InvalidRequest: what vLLM 0.32 refuses with a 400 before running: a streamed completions request
                with ``use_beam_search`` (``Streaming is not currently supported with beam search``), a bad
                prompt, a length over ``max_model_len``, ``max_tokens < 1`` (0 is allowed with completions'
                ``echo``: the prompt alone); the sampling checks are :func:`read_generation_fields`'.
        """
        body, logprobs = read_generation_fields(await _json_body(request), chat, self._renderer.vocab_size)
        streamed = bool(body.get("stream"))
        if streamed and not chat and body.get("use_beam_search"):  # serving.py _create_completion, before rendering
            raise InvalidRequest("Streaming is not currently supported with beam search")
        n = choices_per_prompt(body)
        try:
            check_max_logprobs(logprobs, self._renderer.vocab_size)
            if body.get("use_beam_search"):  # each round's requests ask logprobs=2 * width (beam_search/online.py)
                check_max_logprobs(2 * n, self._renderer.vocab_size)
            check_stop_token_ids(body.get("stop_token_ids"), self._renderer.vocab_size)
        except VllmValidationError as exc:
            if not streamed:
                raise
            return StreamingResponse(iter([f"data: {_dumps(exc.body)}\n\n", "data: [DONE]\n\n"]),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        echo = bool(body.get("echo"))
        # completions: echo with max_tokens 0 returns the prompt alone; the engine still runs one token
        echo_only = echo and not chat and body.get("max_tokens") == 0
        subs = split_batch({**body, "max_tokens": 1} if echo_only else body, chat)
        prepared = [await self._prepare_bounded(sub, chat) for sub in subs]
        stops = stop_params(body)
        if not body.get("use_beam_search"):  # to_sampling_params, per prompt (beam search takes no min_tokens)
            for _, max_tokens in prepared:
                check_min_tokens(stops.min_tokens, max_tokens)
        shape = _Shape(chat, n, logprobs, echo, echo_only)
        if chat:
            shape.role, echo_text = chat_echo(body)
            shape.echo_texts = [echo_text]
        elif echo:
            shape.echo_texts = [self._prompt_text(sub, ids) for sub, (ids, _) in zip(subs, prepared, strict=True)]
        # vLLM sets prompt_logprobs (so skip_reading_prefix_cache) for echo: completions' logprobs, chat's top_logprobs
        skip_cache = echo and (chat or logprobs is not None)
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex
        lora, salt = request_scope(self._state, body)
        if body.get("use_beam_search"):
            return await self._beam_answer(request, rid, prepared, shape, body, streamed)
        reqs: list[Request] = []
        queues: list[asyncio.Queue[RequestOutput]] = []
        try:
            for p_idx, (ids, max_tokens) in enumerate(prepared):
                for j in range(n):
                    sub_id = rid if len(prepared) * n == 1 else f"{rid}-{p_idx}-{j}"
                    req = Request(sub_id, ids, max_tokens, ignore_eos=bool(body.get("ignore_eos", False)), lora=lora,
                                  cache_salt=salt, sample_index=j, skip_reading_prefix_cache=skip_cache,
                                  stop=stops, output_text=self._output_text(stops))
                    queues.append(self._engine.submit(req))
                    reqs.append(req)
        except ValueError as exc:
            for req in reqs:
                self._engine.abort(req.request_id)
            raise InvalidRequest(str(exc)) from exc
        created = int(time.time())
        if streamed:
            opts = body.get("stream_options") or {}
            include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
            return StreamingResponse(
                self._stream(rid, reqs, queues, shape, created, include_usage),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        finish_order: list[int] = []

        async def collect(index: int, queue: asyncio.Queue[RequestOutput]) -> None:
            await _collect(queue)
            finish_order.append(index)

        waiter: asyncio.Future[list[None]] = asyncio.ensure_future(
            asyncio.gather(*(collect(i, q) for i, q in enumerate(queues))))
        disconnect = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait([waiter, disconnect], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        finally:
            disconnect.cancel()
            if not waiter.done():
                waiter.cancel()
                for req in reqs:
                    self._engine.abort(req.request_id)
            waiter.add_done_callback(_retrieve)  # a gather cancelled here finishes with CancelledError: read it
        if not waiter.done() or waiter.cancelled():
            logger.info("client disconnected request_id=%s: request aborted", rid)
            return Response(status_code=499)
        waiter.result()  # EngineDeadError: the engine died under the request (500)
        # vLLM reports the last prompt's RequestOutput, built when its last choice finished
        last_prompt = [i for i in finish_order if i // n == len(prepared) - 1]
        cached = reqs[last_prompt[-1]].num_cached_tokens
        return JSONResponse(self._completion_body(rid, reqs, shape, created, cached))

    async def _beam_answer(self, request: HttpRequest, rid: str, prepared: list[tuple[list[int], int]], shape: _Shape,
                           body: dict[str, Any], streamed: bool) -> Response:
        """``use_beam_search`` (:mod:`engine_simulator.beam_search`): each prompt's ``n`` best beams as its
        choices, one prompt after another as vLLM's merged generators; usage counts the beams' tokens (the
        rounds' engine requests are not counted), cached tokens 0 (vLLM's beam output carries none). A streamed
        chat request gets the whole answer at once, one chunk per choice (vLLM streams the single final output)."""
        lora, salt = request_scope(self._state, body)
        table = self._engine.core.config.sampled_token_ids
        penalty = body.get("length_penalty", 1.0)
        penalty = float(penalty) if isinstance(penalty, (int, float)) and not isinstance(penalty, bool) else 1.0

        async def run_prompt(ids: list[int], max_tokens: int) -> list[Request]:
            async def step(prefixes: list[list[int]]) -> list[int]:
                batch = f"{rid}-{uuid.uuid4().hex[:16]}"
                reqs = [Request(f"{batch}-beam-{i}", ids + p, 1, lora=lora, cache_salt=salt)
                        for i, p in enumerate(prefixes)]
                queues = []
                try:
                    for req in reqs:
                        queues.append(self._engine.submit(req))
                    for queue in queues:
                        await _collect(queue)
                finally:
                    for req in reqs[:len(queues)]:
                        if req.finish_reason is None:
                            self._engine.abort(req.request_id)
                return [req.output_token_ids[0] for req in reqs]

            beams = await beam_search(len(ids), shape.n, max_tokens, step, table, EOS_ID,
                                      bool(body.get("ignore_eos", False)), penalty)
            out = []
            for beam in beams:
                req = Request(rid, ids, max_tokens, num_cached_tokens=0,
                              finish_reason=FinishReason.STOP if beam.finish_reason else FinishReason.LENGTH)
                req.output_token_ids = beam.tokens
                req.stop_reason = EOS_ID if beam.finish_reason else None  # online.py: stop_reason=eos_token_id
                out.append(req)
            return out

        async def run_all() -> list[Request]:
            reqs: list[Request] = []
            for ids, max_tokens in prepared:
                reqs += await run_prompt(ids, max_tokens)
            return reqs

        task = asyncio.ensure_future(run_all())
        disconnect = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait([task, disconnect], return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not task.done():
                task.cancel()
            task.add_done_callback(_retrieve)
        if task.cancelled() or not task.done():
            logger.info("client disconnected request_id=%s: beam search aborted", rid)
            return Response(status_code=499)
        try:
            reqs = task.result()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        created = int(time.time())
        answer = self._completion_body(rid, reqs, shape, created, 0)
        if not streamed:
            return JSONResponse(answer)
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self._state.model}
        chunks = [{**head, "choices": [{"index": i, "delta": {"role": shape.role, "content": ""}, "logprobs": None,
                                        "finish_reason": None}]} for i in range(len(reqs))]
        chunks += [{**head, "choices": [{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                         "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
                                         "stop_reason": c["stop_reason"]}]} for c in answer["choices"]]
        if include_usage:
            chunks.append({**head, "choices": [], "usage": answer["usage"]})
        lines = [f"data: {_dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(lines), media_type="text/event-stream", headers=_SSE_HEADERS)

    def _output_text(self, params: StopParams) -> OutputText:
        """A request's output text with stop-string matching (vLLM's detokenizer, :mod:`engine_simulator.stopping`)."""
        return OutputText(params, self._renderer.token_table, self._renderer.special_token_ids)

    def _text(self, req: Request) -> str:
        """A finished request's output text: its tracked text (stop strings applied, a terminating EOS or stop
        token left out) or, for requests without one (beam search), the decode of its tokens."""
        if req.output_text is not None:
            return req.output_text.text
        return self._renderer.detokenize(req.output_token_ids)

    def _prompt_text(self, body: dict[str, Any], ids: list[int]) -> str:
        """The text completions' ``echo`` prepends: the prompt string as sent, or the tokenizer's decode of a
        token-id prompt (vLLM 0.32 ``renderers/base.py`` ``_detokenize_prompt``, before truncation: the ids sent)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        return self._renderer.decode(prompt if isinstance(prompt, list) else ids)

    def _logprobs(self, ids: list[int], k: int | None, chat: bool, text_offset: int = 0,
                  first_unscored: bool = False) -> dict[str, Any] | None:
        """vLLM's logprobs object for ``ids`` when the request asked for it (``k`` not None), else None;
        ``first_unscored``: ``ids`` start with an echoed prompt, whose first token has no logprob."""
        if k is None:
            return None
        vocab = self._renderer.vocab_size
        count = vocab if k == -1 else k
        return simulated_logprobs(ids, lambda t: self._renderer.detokenize([t % vocab]), count, chat, text_offset,
                                  first_unscored, self._alternatives)

    def _alternatives(self, token_id: int, count: int) -> list[int]:
        """A step's ``count`` ranked candidate ids, ``token_id`` first, the others sampleable (printable) tokens."""
        return candidates(token_id, count, self._engine.core.config.sampled_token_ids)

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
        """A completions choice's ``prompt_logprobs`` (echo with logprobs: vLLM's ``prompt_logprobs = logprobs``):
        None for the first token, then ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the prompt
        token and the top ``k`` (vLLM's ``Logprob``), simulated as :func:`simulated_logprobs` (the prompt token
        the most likely, so ``max(k, 1)`` entries)."""
        vocab = self._renderer.vocab_size
        count = max(vocab if k == -1 else k, 1)
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for tid in ids[1:]:
            out.append({str(a): {"logprob": simulated_logprob(a, r), "rank": r + 1,
                                 "decoded_token": self._renderer.detokenize([a])}
                        for r, a in enumerate(self._alternatives(tid, count))})
        return out

    def _choice(self, req: Request, index: int, shape: _Shape) -> dict[str, Any]:
        text = self._text(req)
        finish = str(req.finish_reason)
        if shape.chat:
            return {
                "index": index,
                "message": {
                    "role": shape.role,
                    "content": shape.echo_texts[0] + text if shape.echo else text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": self._logprobs(list(req.output_token_ids), shape.k, True),
                "finish_reason": finish,
                "stop_reason": req.stop_reason,
            }
        ids = list(req.output_token_ids)
        prompt_logprobs = None
        if shape.echo:  # serving.py request_output_to_completion_response
            prompt_ids = list(req.prompt_token_ids)
            prompt_text = shape.echo_texts[index // shape.n]
            text, ids = (prompt_text, prompt_ids) if shape.echo_only else (prompt_text + text, prompt_ids + ids)
            if shape.k is not None:
                prompt_logprobs = self._prompt_logprobs(prompt_ids, shape.k)
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(ids, shape.k, False, first_unscored=shape.echo),
            "finish_reason": finish,
            "stop_reason": req.stop_reason,
            "prompt_logprobs": prompt_logprobs,
        }

    def _completion_body(self, rid: str, reqs: list[Request], shape: _Shape, created: int,
                         cached_tokens: int) -> dict[str, Any]:
        """The non-streaming answer of finished requests (vLLM 0.32's field set)."""
        return {
            "id": rid,
            "object": "chat.completion" if shape.chat else "text_completion",
            "created": created,
            "model": self._state.model,
            "choices": [self._choice(req, i, shape) for i, req in enumerate(reqs)],
            "usage": summed_usage(reqs, shape.n, cached_tokens),
            "kv_transfer_params": None,
        }

    async def _stream(
        self,
        rid: str,
        reqs: list[Request],
        queues: list[asyncio.Queue[RequestOutput]],
        shape: _Shape,
        created: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE chunks as vLLM writes them, one choice per chunk (its ``index``), the usage chunk summed (cached
        tokens: the first output's, as vLLM's stream generators); a client gone before the end aborts every
        unfinished choice. ``echo``: completions prepend the prompt to each choice's first chunk; chat sends,
        after the role chunks, one chunk per choice with the echoed message."""
        chat = shape.chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": self._state.model}
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(index: int, queue: asyncio.Queue[RequestOutput]) -> None:
            while True:
                out = await queue.get()
                await merged.put((index, out))
                if out.finished:
                    return

        pumps = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
        open_choices = len(queues)
        offsets = [0] * len(queues)
        echoed = [False] * len(queues)
        cached: int | None = None
        try:
            if chat:
                for i in range(len(reqs)):
                    first = {**head, "choices": [
                        {"index": i, "delta": {"role": shape.role, "content": ""}, "logprobs": None, "finish_reason": None}
                    ]}
                    yield f"data: {_dumps(first)}\n\n"
                if shape.echo and shape.echo_texts[0]:
                    for i in range(len(reqs)):
                        echo_chunk = {**head, "choices": [
                            {"index": i, "delta": {"content": shape.echo_texts[0]}, "logprobs": None,
                             "finish_reason": None}
                        ]}
                        yield f"data: {_dumps(echo_chunk)}\n\n"
            while open_choices:
                index, out = await merged.get()
                if out.error is not None:  # the engine died: vLLM's error event, then [DONE]
                    open_choices = 0  # nothing left to abort
                    yield engine_dead_event()
                    yield "data: [DONE]\n\n"
                    return
                req = reqs[index]
                if cached is None:
                    cached = req.num_cached_tokens
                if out.finished:
                    open_choices -= 1
                text = out.text if out.text is not None else self._renderer.detokenize(out.new_token_ids)
                ids = list(out.new_token_ids)
                reason = str(req.finish_reason) if out.finished else None
                stop_reason = req.stop_reason if out.finished else None
                first_unscored = False
                if not chat and shape.echo and not echoed[index]:  # serving.py completion_stream_generator
                    echoed[index] = first_unscored = True
                    prompt_text = shape.echo_texts[index // shape.n]
                    prompt_ids = list(req.prompt_token_ids)
                    text, ids = (prompt_text, prompt_ids) if shape.echo_only else (prompt_text + text, prompt_ids + ids)
                logprobs = self._logprobs(ids, shape.k, chat, offsets[index], first_unscored)
                if logprobs is not None and not chat:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                else:
                    offsets[index] += len(text)
                choice: dict[str, Any]
                if chat:
                    choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": reason}
                    if out.finished:
                        choice["stop_reason"] = stop_reason
                else:
                    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                              "stop_reason": stop_reason}
                yield f"data: {_dumps({**head, 'choices': [choice]})}\n\n"
            if include_usage:
                usage = summed_usage(reqs, shape.n, cached or 0)
                yield f"data: {_dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            if open_choices:  # the client went away mid-stream (the response was cancelled)
                logger.info("client disconnected request_id=%s: stream aborted", rid)
                for req in reqs:
                    self._engine.abort(req.request_id)

    # -- render and tokenize ------------------------------------------------------------------

    def _render_body(self, body: dict[str, Any], ids: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "request_id": uuid.uuid4().hex,
            "model": self._state.model,
            "token_ids": ids,
            "prompt_token_ids": ids,
            "count": len(ids),
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": bool(body.get("ignore_eos", False))},
            "stream": bool(body.get("stream", False)),
        }

    async def completions_render(self, request: HttpRequest) -> Response:
        body = await _json_body(request)
        ids, max_tokens = await self._prepare_bounded(body, chat=False)
        return JSONResponse([self._render_body(body, ids, max_tokens)])

    async def chat_render(self, request: HttpRequest) -> Response:
        body = await _json_body(request)
        ids, max_tokens = await self._prepare_bounded(body, chat=True)
        return JSONResponse(self._render_body(body, ids, max_tokens))

    async def tokenize(self, request: HttpRequest) -> Response:
        body = await _json_body(request)
        _check_model(self._state, body)
        if _prompt_chars(body.get("messages")) + _prompt_chars(body.get("prompt")) > _INLINE_CHARS:
            content = await asyncio.to_thread(self._tokenize_reply, body)
            return Response(content, media_type="application/json")
        return Response(self._tokenize_reply(body), media_type="application/json")

    def _tokenize_reply(self, body: dict[str, Any]) -> bytes:
        """The ``/tokenize`` answer as JSON bytes (runs in a worker thread for long prompts)."""
        renderer = self._renderer
        if "messages" in body:
            ids = renderer.chat_request_ids(body)
        elif "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise InvalidRequest("'prompt' must be a string")
            ids = renderer.completion_request_ids(body)
        else:
            raise InvalidRequest("either 'prompt' or 'messages' is required")
        strs = renderer.token_strs(ids) if body.get("return_token_strs") else None
        reply = {"count": len(ids), "max_model_len": self._state.max_model_len, "tokens": ids, "token_strs": strs}
        return json.dumps(reply, ensure_ascii=False, separators=(",", ":")).encode()

    # -- models, health, metrics, cache reset -------------------------------------------------

    async def models(self, request: HttpRequest) -> Response:
        state = self._state
        card = {
            "id": state.model,
            "object": "model",
            "created": state.created,
            "owned_by": "vllm",
            "root": state.root,
            "parent": None,
            "max_model_len": state.max_model_len,
            "permission": [
                {
                    "id": "modelperm-" + uuid.uuid4().hex,
                    "object": "model_permission",
                    "created": state.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HttpRequest) -> Response:
        """200, or 503 once the engine loop died (vLLM: ``check_health`` raises ``EngineDeadError``)."""
        return Response(status_code=503 if self._engine.dead is not None else 200)

    async def metrics(self, request: HttpRequest) -> Response:
        assert self._engine.metrics is not None
        if self._state.metrics_delay_seconds:
            await asyncio.sleep(self._state.metrics_delay_seconds)
        return Response(self._engine.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def debug_kv_cache(self, request: HttpRequest) -> Response:
        """The engine's exact cache state: ``{"block_hashes": [uint64...], "next_seq": n, "pending_events": n}``
        (``pending_events``: taken at the next step, not yet published)."""
        cache = self._engine.core.cache
        return JSONResponse({
            "block_hashes": cache.cached_hashes(),
            "next_seq": getattr(self._engine.publisher, "next_seq", None),
            "pending_events": cache.pending_events(),
        })

    async def debug_drop_events(self, request: HttpRequest) -> Response:
        """``{"count": n}``: withhold the next n KV-event messages from PUB (still replayable): a crafted gap."""
        body = await _json_body(request)
        count = _int_field(body, "count", 1) or 0
        drop = getattr(self._engine.publisher, "drop_next", None)
        if drop is None:
            raise InvalidRequest("this engine publishes no KV events")
        drop(count)
        return JSONResponse({"withholding": count})

    async def reset_prefix_cache(self, request: HttpRequest) -> Response:
        return JSONResponse({"success": self._engine.reset_prefix_cache()})
