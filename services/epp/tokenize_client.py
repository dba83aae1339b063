"""Tokenizes prompts through the engine's own vLLM-compatible ``POST /tokenize``, with an LRU cache.

Request bodies (vLLM's ``vllm/entrypoints/serve/tokenize/protocol.py``)::

    {"model": M, "prompt": TEXT}                                              # completions
    {"model": M, "messages": [{"role", "content"}], "add_generation_prompt": true}   # chat

Reply: ``{"count", "max_model_len", "tokens": [int]}``. Asking the engine guarantees the token ids
(BOS and chat template included) are exactly those it will hash into KV blocks. The live candidates
of the model are tried in order until one answers. The cache key is the model plus the prompt (or the
messages' JSON), so repeated prompts (multi-turn chats resend history) skip the round trip.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import httpx

from services.epp.framework.interfaces import Candidate, SchedulingRequest


class TokenizeError(RuntimeError):
    """No endpoint could tokenize the prompt."""


class EngineTokenizer:
    def __init__(self, client: httpx.AsyncClient, timeout_seconds: float, cache_entries: int) -> None:
        self._client = client
        self._timeout = timeout_seconds
        self._cache_entries = cache_entries
        self._cache: OrderedDict[tuple[str, str, str], list[int]] = OrderedDict()

    @staticmethod
    def _body_and_key(request: SchedulingRequest) -> tuple[dict[str, object], tuple[str, str, str]]:
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            body: dict[str, object] = {"model": request.model, "messages": messages, "add_generation_prompt": True}
            return body, (request.model, "chat", json.dumps(messages, sort_keys=True))
        return {"model": request.model, "prompt": request.prompt}, (request.model, "text", request.prompt)

    async def tokenize(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> list[int]:
        """Token ids of the request's prompt or messages.

        Raises:
            TokenizeError: no candidate answered with token ids (each failure is in the message).
        """
        body, key = self._body_and_key(request)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        errors: list[str] = []
        for cand in candidates:
            if cand.endpoint.model != request.model:
                continue
            try:
                reply = await self._client.post(
                    cand.endpoint.url.rstrip("/") + "/tokenize", json=body, timeout=self._timeout
                )
                reply.raise_for_status()
                tokens = [int(t) for t in reply.json()["tokens"]]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                errors.append(f"{cand.id}: {exc!r}")
                continue
            if self._cache_entries > 0:
                self._cache[key] = tokens
                while len(self._cache) > self._cache_entries:
                    self._cache.popitem(last=False)
            return tokens
        raise TokenizeError("; ".join(errors) or f"no endpoint of model {request.model!r} to tokenize with")
