"""epp's tokenizer: the model's own tokenizer in-process, the engine's ``/tokenize`` only as a fallback.

Per model, the tokenizer directory comes from ``--tokenizer-paths`` (``model=dir``) or else from the
``tokenizer`` label of one of the model's registered endpoints (the engine simulator registers its
files; a sidecar can register a shared path). Loaded once per (model, directory).

What it produces is what vLLM 0.32 caches:

* completions: ``prompt`` encoded with ``add_special_tokens`` (default True), token-id prompts as given;
* chat: the whole request through the model's chat template (``kvmesh.chat_template``) and
  ``add_special_tokens`` (default False), incrementally (:class:`~services.epp.tokenization.local.LocalTokenizer`);
* then ``truncate_prompt_tokens`` = k keeps the last k tokens (the special tokens, when added, kept
  and counted; ``-1``: the endpoint's ``max_model_len`` label).

Refusals are :class:`~services.epp.tokenize_client.TokenizeSkipped` with a metric reason, so the pick is
scored by load: ``multimodal`` (media content parts: their placeholder tokens and hashes need the
model's processor), ``unsupported`` (a field value kvmesh cannot reproduce, e.g. a malformed template
or ``truncate_prompt_tokens=-1`` without a known ``max_model_len``), ``too_large`` (over the character bound).
Long texts are encoded in a worker thread (HF ``tokenizers`` releases the GIL), so the event loop
goes on; the incremental path normally encodes only a turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.chat_template import MultimodalContent
from kvmesh.errors import InvalidRequest
from services.epp.framework.interfaces import Candidate, SchedulingRequest, Tokenizer
from services.epp.tokenization.local import LocalTokenizer, message_chain
from services.epp.tokenize_client import TokenizeSkipped, prompt_chars

logger = logging.getLogger(__name__)

TOKENIZER_LABEL = "tokenizer"
"""Endpoint registration label: a local directory holding the model's tokenizer files."""

_THREAD_CHARS = 16_384


class InProcessTokenizer:
    """``Tokenizer`` protocol: local first, ``fallback`` (the engine's ``/tokenize``) when no files are known.

    Args:
        paths: model -> tokenizer directory (configured).
        fallback: the engine tokenizer, or None (then an unknown model fails the tokenization).
        max_prompt_chars: longer prompts are not tokenized (characters).
        cache_max_tokens: per model, token ids the incremental chat cache keeps.
    """

    def __init__(self, paths: Mapping[str, str], fallback: Tokenizer | None, max_prompt_chars: int = 262_144,
                 cache_max_tokens: int = 2_000_000) -> None:
        self._paths = dict(paths)
        self._fallback = fallback
        self._max_chars = max_prompt_chars
        self._cache_max_tokens = cache_max_tokens
        self._loaded: dict[tuple[str, str], LocalTokenizer | None] = {}
        self.fallbacks = 0

    def local(self, model: str, candidates: Sequence[Candidate] = ()) -> LocalTokenizer | None:
        """The model's loaded tokenizer, or None when no directory is known (or it failed to load)."""
        path = self._paths.get(model)
        if path is None:
            path = next((c.endpoint.labels[TOKENIZER_LABEL] for c in candidates
                         if c.endpoint.model == model and c.endpoint.labels.get(TOKENIZER_LABEL)), None)
        if path is None:
            return None
        key = (model, path)
        if key not in self._loaded:
            try:
                self._loaded[key] = LocalTokenizer(path, self._cache_max_tokens)
                logger.info("tokenizer loaded in-process model=%s path=%s", model, path)
            except (OSError, ValueError, InvalidRequest) as exc:
                logger.warning("tokenizer files unusable; using the engine's /tokenize model=%s path=%s error=%r",
                               model, path, exc)
                self._loaded[key] = None
        return self._loaded[key]

    async def tokenize(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> Sequence[int]:
        """Token ids the engine will cache for this request.

        Raises:
            TokenizeSkipped: ``too_large``, ``multimodal``, ``unsupported`` (and the fallback's reasons).
            TokenizeError: the fallback failed.
        """
        chars = prompt_chars(request)
        if chars > self._max_chars:
            raise TokenizeSkipped("too_large", f"prompt of {chars} characters exceeds {self._max_chars}")
        local = self.local(request.model, candidates)
        if local is None:
            if self._fallback is None:
                raise TokenizeSkipped("unsupported", f"no tokenizer for model {request.model!r}")
            self.fallbacks += 1
            return await self._fallback.tokenize(request, candidates)
        try:
            if request.messages or "messages" in request.render:
                ids = await self._chat(local, request, chars)
                added = request.render.get("add_special_tokens") is True
            else:
                added = request.render.get("add_special_tokens", True) is not False
                if chars > _THREAD_CHARS:
                    ids = await asyncio.to_thread(local.encode_text, request.prompt, added)
                else:
                    ids = local.encode_text(request.prompt, added)
            return self._truncate(local, ids, request, candidates, added)
        except MultimodalContent as exc:
            raise TokenizeSkipped("multimodal", str(exc)) from exc
        except InvalidRequest as exc:
            raise TokenizeSkipped("unsupported", str(exc)) from exc

    async def _chat(self, local: LocalTokenizer, request: SchedulingRequest, chars: int) -> Sequence[int]:
        render = request.render
        messages: Any = render.get("messages")
        if messages is None:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
        body = {**render, "messages": messages}
        root = (request.model, json.dumps({k: v for k, v in render.items() if k != "messages"}, sort_keys=True,
                                          default=str))
        chain = message_chain(root, messages)
        if chars > _THREAD_CHARS and not local.has_cached_prefix(chain):
            return await asyncio.to_thread(local.chat_ids, body, chain)
        return local.chat_ids(body, chain)

    @staticmethod
    def _truncate(local: LocalTokenizer, ids: Sequence[int], request: SchedulingRequest,
                  candidates: Sequence[Candidate], added: bool) -> Sequence[int]:
        k = request.render.get("truncate_prompt_tokens")
        if k is None:
            return ids
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise InvalidRequest("truncate_prompt_tokens must be an integer >= -1")
        if k == -1:
            limit = next((c.endpoint.labels.get("max_model_len") for c in candidates
                          if c.endpoint.model == request.model and c.endpoint.labels.get("max_model_len")), None)
            if limit is None:
                raise InvalidRequest("truncate_prompt_tokens=-1 needs the engine's max_model_len")
            k = int(limit)
        if len(ids) <= k:
            return ids
        specials = local.special_count() if added else 0
        if specials and k >= specials:
            prefix = list(ids[: specials])  # BOS-style prefix kept (HF truncation keeps special tokens)
            return prefix + list(ids[len(ids) - (k - specials):]) if k > specials else prefix
        return list(ids[len(ids) - k:]) if k > 0 else []
