"""Tokenizes prompts through the engine's own vLLM-compatible ``POST /tokenize``: bounded, never fanned out.

Request bodies (vLLM 0.32's ``vllm/entrypoints/serve/tokenize/protocol.py``)::

    {"model": M, "prompt": TEXT}                                              # completions
    {"model": M, "messages": [{"role", "content"}], "add_generation_prompt": true}   # chat
    ... plus the request's token-changing fields (tools, chat_template_kwargs, add_special_tokens...)

Reply: ``{"count", "max_model_len", "tokens": [int]}``. Asking the engine guarantees the token ids
(BOS and chat template included) are exactly those it will hash into KV blocks. The cache key is the
model plus the prompt (or the messages' JSON), so repeated prompts (multi-turn chats resend history)
skip the round trip.

Bounds (issue 14: nothing one request does may stall an engine or epp):

* **size first**: a prompt (or the sum of the messages' contents) longer than ``max_prompt_chars``
  characters is never sent (:class:`TokenizeSkipped` ``too_large``); the caller scores by load.
* **one engine, not the pool**: the least-loaded live candidate of the model is asked. Another one
  is tried only when the first could not be *connected* (the request never reached it); a timeout,
  an HTTP error status or a malformed reply ends the attempt (the same prompt would cost every
  engine the same). At most ``max_attempts`` engines are contacted.
* **time**: the whole call (all attempts) has one deadline, ``timeout_seconds``; the HTTP request
  is cancelled with the pick (the servicer's task is cancelled when the caller goes away).
* **credentials**: the pool's engine key (``EppConfig.engine_key_for``, the router's ``engine_api_key(s)``)
  is sent as ``Authorization: Bearer`` on every call. vLLM 0.32's ``--api-key`` guards ``/v1/*`` only, so
  ``/tokenize`` is open on vLLM itself; the key matters when the engine sits behind an authenticating
  proxy (a gateway, an ingress) that checks every path. A 401/403 is a :class:`TokenizeError` naming it.
* **per-engine concurrency**: at most ``max_concurrency_per_endpoint`` tokenize calls in flight per
  engine; a full engine is skipped without waiting, and when every eligible engine is full the call
  fails at once (:class:`TokenizeSkipped` ``busy``).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence

import httpx

from services.epp.framework.interfaces import Candidate, SchedulingRequest


class TokenizeError(RuntimeError):
    """No endpoint could tokenize the prompt (each failure is in the message)."""

    reason = "error"


class TokenizeSkipped(TokenizeError):
    """Tokenization was not attempted: ``reason`` is ``too_large`` or ``busy`` (a closed set, a metric label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def prompt_chars(request: SchedulingRequest) -> int:
    """Characters the engine would tokenize: the prompt's, or the sum of the messages' contents and roles
    (verbatim messages in ``request.render``: their JSON length)."""
    if "messages" in request.render:
        return len(json.dumps(request.render["messages"], default=str))
    if request.messages:
        return sum(len(m.content) + len(m.role) for m in request.messages)
    return len(request.prompt)


def _load(candidate: Candidate) -> float:
    m = candidate.metrics
    return m.num_requests_waiting + m.num_requests_running + m.pending_picks


class EngineTokenizer:
    """The engine-side tokenizer behind the framework's ``Tokenizer`` protocol.

    Args:
        client: shared httpx client (its connection pool bounds sockets per engine).
        timeout_seconds: deadline of one ``tokenize`` call, all attempts included (seconds).
        cache_entries: LRU entries kept (0 disables the cache).
        max_prompt_chars: longer prompts are not tokenized (characters).
        max_concurrency_per_endpoint: tokenize calls in flight per engine.
        max_attempts: engines contacted at most per call (only connect failures move on).
        engine_key: model -> the pool's engine API key (None: send no ``authorization``).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_seconds: float,
        cache_entries: int,
        max_prompt_chars: int = 262_144,
        max_concurrency_per_endpoint: int = 4,
        max_attempts: int = 2,
        engine_key: Callable[[str], str | None] = lambda model: None,
    ) -> None:
        self._client = client
        self._timeout = timeout_seconds
        self._cache_entries = cache_entries
        self._max_chars = max_prompt_chars
        self._max_concurrency = max_concurrency_per_endpoint
        self._max_attempts = max(1, max_attempts)
        self._engine_key = engine_key
        self._cache: OrderedDict[tuple[str, str, str], list[int]] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        self._rotation = 0

    @staticmethod
    def _body_and_key(request: SchedulingRequest) -> tuple[dict[str, object], tuple[str, str, str]]:
        """vLLM's ``/tokenize`` body: the prompt or messages plus every token-changing field the client sent
        (``tools``, ``chat_template_kwargs``, ``add_special_tokens``...: ``request.render``)."""
        render = dict(request.render)
        render.pop("truncate_prompt_tokens", None)  # not a /tokenize field: applied by the caller
        if request.messages or "messages" in render:
            messages = render.pop("messages", None) or [{"role": m.role, "content": m.content} for m in request.messages]
            body: dict[str, object] = {"model": request.model, "messages": messages, "add_generation_prompt": True}
            body.update(render)
            # Key order kept in the cache key: a template's ``tojson`` renders it (an order-blind key served
            # one chat's tokens for another's).
            return body, (request.model, "chat", json.dumps(body, default=str))
        body = {"model": request.model, "prompt": request.prompt, **render}
        return body, (request.model, "text", request.prompt if not render else json.dumps(body, default=str))

    def in_flight(self, endpoint_id: str) -> int:
        """Tokenize calls now in flight to ``endpoint_id``."""
        return self._in_flight.get(endpoint_id, 0)

    def _order(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Candidates of the model, least loaded first (ties rotate so equal engines share the work)."""
        own = [c for c in candidates if c.endpoint.model == request.model]
        if not own:
            return []
        self._rotation = (self._rotation + 1) % len(own)
        rotated = own[self._rotation:] + own[: self._rotation]
        return sorted(rotated, key=_load)

    async def tokenize(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> list[int]:
        """Token ids of the request's prompt or messages.

        Raises:
            TokenizeSkipped: ``too_large`` (over ``max_prompt_chars``, nothing sent) or ``busy`` (every
                eligible engine already has ``max_concurrency_per_endpoint`` calls in flight).
            TokenizeError: the engine failed, timed out or answered something that is not token ids.
        """
        chars = prompt_chars(request)
        if chars > self._max_chars:
            raise TokenizeSkipped("too_large", f"prompt of {chars} characters exceeds {self._max_chars}")
        body, key = self._body_and_key(request)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        ordered = self._order(request, candidates)
        if not ordered:
            raise TokenizeError(f"no endpoint of model {request.model!r} to tokenize with")
        try:
            async with asyncio.timeout(self._timeout):
                engine_key = self._engine_key(request.model)
                auth = {"authorization": f"Bearer {engine_key}"} if engine_key else {}
                tokens = await self._ask(ordered, body, auth)
        except TimeoutError as exc:
            raise TokenizeError(f"tokenize timed out after {self._timeout}s") from exc
        if self._cache_entries > 0:
            self._cache[key] = tokens
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return tokens

    async def _ask(self, ordered: Sequence[Candidate], body: dict[str, object], headers: dict[str, str]) -> list[int]:
        errors: list[str] = []
        attempts = 0
        for cand in ordered:
            if attempts >= self._max_attempts:
                break
            if self.in_flight(cand.id) >= self._max_concurrency:
                errors.append(f"{cand.id}: busy")
                continue
            attempts += 1
            self._in_flight[cand.id] = self.in_flight(cand.id) + 1
            try:
                reply = await self._client.post(cand.endpoint.url.rstrip("/") + "/tokenize", json=body, headers=headers)
            except httpx.ConnectError as exc:  # never reached the engine: the next one may answer
                errors.append(f"{cand.id}: {exc!r}")
                continue
            except httpx.HTTPError as exc:
                raise TokenizeError(f"{cand.id}: {exc!r}") from exc
            finally:
                left = self._in_flight.get(cand.id, 1) - 1
                if left > 0:
                    self._in_flight[cand.id] = left
                else:
                    self._in_flight.pop(cand.id, None)
            if reply.status_code in (401, 403):
                raise TokenizeError(f"{cand.id}: HTTP {reply.status_code}: the engine refused epp's credentials "
                                    "(engine_api_key / engine_api_keys)")
            if reply.status_code != 200:
                raise TokenizeError(f"{cand.id}: HTTP {reply.status_code}: {reply.text[:200]}")
            try:
                return [int(t) for t in reply.json()["tokens"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise TokenizeError(f"{cand.id}: malformed /tokenize reply: {exc!r}") from exc
        if attempts == 0:
            raise TokenizeSkipped("busy", "; ".join(errors))
        raise TokenizeError("; ".join(errors))
