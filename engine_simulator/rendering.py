"""Prompts to token ids and token ids to text, as the engine does it. Pure (no I/O after load).

* Text prompts are encoded with the tokenizer's post-processor, which prepends ``<s>`` (id 1),
  as vLLM does with ``add_special_tokens=True``. Token-id prompts are used as given.
* Chat bodies are rendered as vLLM 0.32 renders them (``kvmesh.chat_template``: vLLM's message
  parsing — text parts joined with ``"\\n"``, tool calls with parsed arguments, ``tool_call_id`` —
  then the model's jinja template with ``tools``, ``documents``, ``chat_template_kwargs``,
  ``add_generation_prompt``, ``continue_final_message``). The tiny model's template is
  ``engine_simulator.tokenizer.CHAT_TEMPLATE`` (also written as ``chat_template.jinja`` so real vLLM
  serves the same one). The text is encoded with ``add_special_tokens`` (vLLM's chat default False:
  the template's own ``<s>`` is the only one), then ``truncate_prompt_tokens`` keeps the last k.
  Media content parts are a 400 (a text-only model).
* Output text is the concatenation of each token's own decoded string (a table built once), so
  streamed chunks concatenate to the non-streamed text. :meth:`Renderer.printable_token_ids` are the
  tokens generation draws from: those whose own text is whole (no lone UTF-8 byte, which decodes to
  U+FFFD) and free of control characters other than newline and tab, special tokens excluded, so the
  simulated output is text a real model would plausibly write (the byte tokens ``\x00``..``\x1f`` exist in
  the vocabulary but are never sampled).
* An ``echo`` of a token-id prompt is :meth:`Renderer.decode` of the ids (vLLM 0.32 detokenizes such a
  prompt with the tokenizer's ``decode``, special tokens kept: ``<s>`` shows).
* Encoding goes through ``encode_batch``, which releases the GIL while the Rust tokenizer works (the
  single ``encode`` holds it), so a long prompt encoded in a worker thread does not stall the event
  loop or the lease keepalive thread. :meth:`Renderer.min_tokens` is a sound lower bound on a text's
  token count without encoding it (a byte-level BPE token covers at most ``max_token_chars``
  characters), so an over-long prompt is refused before any encoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from engine_simulator.tokenizer import BOS, CHAT_TEMPLATE, EOS, UNK
from kvmesh.chat_template import ChatTemplate, render_request
from kvmesh.errors import InvalidRequest

BOS_ID = 1

SPECIAL_TOKENS = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
"""The template's special-token variables (transformers passes the tokenizer's special tokens map)."""


def _default_template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE, SPECIAL_TOKENS)


def apply_chat_template(messages: Any, add_generation_prompt: bool = True) -> str:
    """The tiny model's template applied to plain ``messages`` (see :func:`Renderer.chat_text` for whole bodies).

    Raises:
        InvalidRequest: when ``messages`` is not a non-empty list of messages with a string ``role``.
    """
    return render_request(_default_template(), {"messages": messages, "add_generation_prompt": add_generation_prompt})


class Renderer:
    """Tokenization for one engine.

    Args:
        tokenizer: the loaded ``tokenizers.Tokenizer``.
        chat_template: the model's chat template text (default: the tiny model's, :data:`CHAT_TEMPLATE`).
        trust_request_chat_template: honour a request's ``chat_template`` (vLLM's
            ``--trust-request-chat-template``; without it such a request is a 400, as in vLLM 0.32).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str = CHAT_TEMPLATE,
                 trust_request_chat_template: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate(chat_template, SPECIAL_TOKENS)
        self.trust_request_chat_template = trust_request_chat_template
        self.vocab_size = tokenizer.get_vocab_size()
        self._token_text = [tokenizer.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
        self.token_table: tuple[str, ...] = tuple(self._token_text)
        """Each token id's own text (special tokens as written, ``</s>``): output text is their concatenation."""
        self.special_token_ids = frozenset(
            i for i in (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS.values()) if i is not None)
        """Ids of the special tokens (``<unk>``, ``<s>``, ``</s>``): "" in output text with ``skip_special_tokens``."""
        self.max_token_chars = max(len(tokenizer.id_to_token(i) or "") for i in range(self.vocab_size)) or 1
        """Most characters one token covers (its byte-level form: one character per byte, so also per text character)."""

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the token count of any text of ``chars`` characters (no encoding)."""
        return -(-chars // self.max_token_chars)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; releases the GIL while encoding (``encode_batch``)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def prompt_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completions ``prompt``: a string or a list of ints (or a one-element list of either).

        Raises:
            InvalidRequest: for other shapes, batches, empty prompts or ids outside the vocabulary.
        """
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.encode_text(prompt, add_special_tokens)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            for t in ids:
                if t < 0 or t >= self.vocab_size:
                    raise InvalidRequest(f"Token id {t} is out of vocabulary")
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise InvalidRequest(
                "batched prompts are not supported by the simulator; send one prompt per request"
            )
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        if not ids:
            raise InvalidRequest("The prompt cannot be empty")
        return ids

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of plain chat ``messages`` through the template (see :meth:`chat_request_ids`)."""
        return self.chat_request_ids({"messages": messages, "add_generation_prompt": add_generation_prompt})

    def chat_text(self, body: Mapping[str, Any]) -> str:
        """A chat body's prompt text as vLLM 0.32 renders it (``kvmesh.chat_template``).

        Reads ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs`` and ``chat_template``.

        Raises:
            InvalidRequest: malformed messages/fields, media content parts (a text-only model), or a
                request ``chat_template`` without ``trust_request_chat_template``.
        """
        template = self.chat_template
        override = body.get("chat_template")
        if override is not None:
            if not self.trust_request_chat_template:
                raise InvalidRequest(
                    "Chat template is passed with request, but --trust-request-chat-template is not set. "
                    "Refused request with untrusted chat template."
                )
            if not isinstance(override, str):
                raise InvalidRequest("chat_template must be a string")
            template = ChatTemplate(override, SPECIAL_TOKENS)
        return render_request(template, body)

    def chat_request_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat body: :meth:`chat_text` encoded with ``add_special_tokens`` (default False),
        then ``truncate_prompt_tokens`` (:meth:`truncate`)."""
        ids = self.encode_text(self.chat_text(body), add_special_tokens=_flag(body, "add_special_tokens", False))
        return self.truncate(ids, body, _flag(body, "add_special_tokens", False))

    def completion_request_ids(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a completions body: ``prompt`` (:meth:`prompt_ids`, ``add_special_tokens`` default
        True) then ``truncate_prompt_tokens``.

        Raises:
            InvalidRequest: see :meth:`prompt_ids`; ``truncate_prompt_tokens`` not an int.
        """
        if "prompt" not in body:
            raise InvalidRequest("'prompt' is required")
        add = _flag(body, "add_special_tokens", True)
        ids = self.prompt_ids(body["prompt"], add)
        return self.truncate(ids, body, add and isinstance(_single(body["prompt"]), str))

    def truncate(self, ids: list[int], body: Mapping[str, Any], with_special: bool) -> list[int]:
        """vLLM's ``truncate_prompt_tokens`` = k: keep the last k tokens (left truncation); when the
        special tokens were added, they are kept and count against k (HF truncation)."""
        k = body.get("truncate_prompt_tokens")
        if k is None:
            return ids
        if not isinstance(k, int) or isinstance(k, bool) or k < -1:
            raise InvalidRequest("truncate_prompt_tokens must be an integer >= -1")
        if k == -1 or len(ids) <= k:
            return ids
        if with_special and ids and ids[0] == BOS_ID:
            return [BOS_ID, *ids[len(ids) - max(k - 1, 0):]][:k] if k > 0 else []
        return ids[len(ids) - k:] if k > 0 else []

    def printable_token_ids(self) -> tuple[int, ...]:
        """Ids whose own text is non-empty, holds no U+FFFD and no control character but newline and tab, and
        is not a special token (:data:`SPECIAL_TOKENS`); ascending."""
        special = set(SPECIAL_TOKENS.values())
        return tuple(
            i for i, text in enumerate(self._token_text)
            if text and text not in special and "\ufffd" not in text
            and not any((ord(ch) < 32 and ch not in "\n\t") or 127 <= ord(ch) < 160 for ch in text)
        )

    def decode(self, ids: Sequence[int]) -> str:
        """The tokenizer's decode of a whole sequence, special tokens kept (HF ``decode`` default)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The concatenation of each token's own text; ``skip_special_tokens``: special tokens read as ""."""
        table = self._token_text
        if skip_special_tokens:
            return "".join(table[i] for i in ids if i not in self.special_token_ids)
        return "".join(table[i] for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean")
    return value


def _single(prompt: Any) -> Any:
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) else prompt
