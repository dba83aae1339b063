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

**A grown chat costs its new messages, not its history.** Per chat the tokenizer remembers what the
last call handed the renderer (:class:`_Seen`, LRU, found by the last message's key like the
renderer's entries): a call whose first ``k`` messages equal a remembered call's (plain messages: the
role and content strings, compared at C speed; verbatim ones: ``==``) reuses that call's message
dicts and size count, so it builds dicts and counts characters only for its new messages, and the
renderer's own check of the cached prefix's messages is an identity scan. Reused dicts are those of
plain messages only (strings: ``==`` is exact); verbatim messages are handed over as given (their
size count alone is reused, a bound, not tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from kvmesh.chat_template import MultimodalContent, prefix_key, same_as_rendered
from kvmesh.errors import InvalidRequest
from services.epp.framework.interfaces import Candidate, SchedulingRequest, Tokenizer
from services.epp.tokenization.local import LocalTokenizer, message_chain
from services.epp.tokenize_client import TokenizeSkipped, prompt_chars

logger = logging.getLogger(__name__)

TOKENIZER_LABEL = "tokenizer"
"""Endpoint registration label: a local directory holding the model's tokenizer files."""

_THREAD_CHARS = 16_384
_ROLE = attrgetter("role")
_CONTENT = attrgetter("content")
_SEEN_BACK = 8
"""How many messages a chat may add since its last call and still reuse that call's :class:`_Seen`."""
_SEEN_ENTRIES = 4096
_SEEN_CHARS = 32 << 20
"""Bounds of the remembered chats: entries, and characters of the messages they hold (LRU)."""


@dataclass(slots=True)
class _Seen:
    """What one chat call handed the renderer, reused by a later call that extends it.

    ``roles``/``contents``: the plain messages' strings (None for verbatim messages); ``messages``: the
    list handed to the renderer (plain: the dicts built for it; verbatim: the request's own);
    ``chars``: :func:`~services.epp.tokenize_client.prompt_chars`'s count for ``messages`` (verbatim:
    the sum of each message's JSON length, the list's separators excluded).
    """

    roles: list[str] | None
    contents: list[str] | None
    messages: list[Any]
    chars: int


def _plain_key(root: Any, k: int, roles: list[str], contents: list[str]) -> int:
    return hash((root, k, roles[k - 1], contents[k - 1], roles[k - 2] if k > 1 else None))


def _json_len(values: Sequence[Any]) -> int:
    return sum(len(json.dumps(v, default=str)) for v in values)


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
        self._seen: OrderedDict[int, _Seen] = OrderedDict()
        self._seen_chars = 0
        self.fallbacks = 0
        self.remember_chats = True
        """Reuse a remembered call's messages for a chat that extends it (off: every call builds them all;
        the benchmark's A/B switch)."""
        self.seen_stats = {"reused": 0, "built": 0}
        """Chat calls that reused a remembered call's messages (``reused``) or built them all (``built``)."""

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
        local = self.local(request.model, candidates)
        chat: tuple[list[Any], Any, int] | None = None
        if local is not None and (request.messages or "messages" in request.render):
            chat = self._messages(request)
            chars = chat[2]
        else:
            chars = prompt_chars(request)
        if chars > self._max_chars:
            raise TokenizeSkipped("too_large", f"prompt of {chars} characters exceeds {self._max_chars}")
        if local is None:
            if self._fallback is None:
                raise TokenizeSkipped("unsupported", f"no tokenizer for model {request.model!r}")
            self.fallbacks += 1
            return await self._fallback.tokenize(request, candidates)
        try:
            if chat is not None:
                ids = await self._chat(local, request, chat, chars)
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

    def _messages(self, request: SchedulingRequest) -> tuple[Any, Any, int]:
        """(the messages to render, the chat's cache root, :func:`prompt_chars`'s count), reusing a remembered
        call's messages and count where this chat extends it (:class:`_Seen`). O(messages) in C, plus
        O(new messages) in Python."""
        render = request.render
        root = (request.model, json.dumps({k: v for k, v in render.items() if k != "messages"},
                                          default=str))  # key order kept: a template's ``tojson`` renders it
        verbatim = render.get("messages")
        if not self.remember_chats:
            if verbatim is None:
                verbatim = [{"role": m.role, "content": m.content} for m in request.messages]
            return verbatim, root, prompt_chars(request)
        if verbatim is not None:
            if not isinstance(verbatim, list) or not verbatim:
                return verbatim, root, prompt_chars(request)
            return verbatim, root, self._verbatim(root, verbatim)
        msgs = request.messages
        n = len(msgs)
        roles: list[str] = list(map(_ROLE, msgs))
        contents: list[str] = list(map(_CONTENT, msgs))
        seen = self._seen
        for k in range(n - 1, max(1, n - _SEEN_BACK) - 1, -1):  # k >= 1 messages in common
            found = seen.get(_plain_key(root, k, roles, contents))
            if found is not None and found.contents is not None and found.roles is not None \
                    and len(found.contents) == k and found.contents == contents[:k] and found.roles == roles[:k]:
                self.seen_stats["reused"] += 1
                messages = found.messages + [{"role": r, "content": c} for r, c in zip(roles[k:], contents[k:], strict=True)]
                chars = found.chars + sum(map(len, roles[k:])) + sum(map(len, contents[k:]))
                break
        else:
            self.seen_stats["built"] += 1
            messages = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
            chars = sum(map(len, roles)) + sum(map(len, contents))
        self._remember(_plain_key(root, n, roles, contents), _Seen(roles, contents, messages, chars))
        return messages, root, chars

    def _verbatim(self, root: Any, messages: list[Any]) -> int:
        """``len(json.dumps(messages))`` (:func:`prompt_chars`), encoding only the messages a remembered call lacked."""
        n = len(messages)
        seen = self._seen
        items = None
        for k in range(n - 1, max(1, n - _SEEN_BACK) - 1, -1):  # k >= 1 messages in common
            found = seen.get(hash((root, prefix_key(root, messages, k))))
            if found is not None and found.roles is None and len(found.messages) == k \
                    and same_as_rendered(found.messages, messages):
                self.seen_stats["reused"] += 1
                items = found.chars + _json_len(messages[k:])
                break
        if items is None:
            self.seen_stats["built"] += 1
            items = _json_len(messages)
        self._remember(hash((root, prefix_key(root, messages, n))), _Seen(None, None, list(messages), items))
        return items + 2 * n  # "[" + ", ".join(items) + "]"

    def _remember(self, key: int, entry: _Seen) -> None:
        seen = self._seen
        old = seen.pop(key, None)
        if old is not None:
            self._seen_chars -= old.chars
        if entry.chars > _SEEN_CHARS:
            return
        seen[key] = entry
        self._seen_chars += entry.chars
        while (len(seen) > _SEEN_ENTRIES or self._seen_chars > _SEEN_CHARS) and seen:
            _, dropped = seen.popitem(last=False)
            self._seen_chars -= dropped.chars

    async def _chat(self, local: LocalTokenizer, request: SchedulingRequest, chat: tuple[Any, Any, int],
                    chars: int) -> Sequence[int]:
        messages, root, _ = chat
        body = {**request.render, "messages": messages}
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
