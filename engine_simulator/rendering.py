"""Prompts to token ids and token ids to text, as the engine does it. Pure (no I/O after load).

* Text prompts are encoded with the tokenizer's post-processor, which prepends ``<s>`` (id 1),
  as vLLM does with ``add_special_tokens=True``. Token-id prompts are used as given.
* Chat messages go through a fixed, documented template (the tiny tokenizer has none)::

      <s><|system|>\\n{content}</s>\\n<|user|>\\n{content}</s>\\n ... <|assistant|>\\n

  ``<s>`` and ``</s>`` in the template are the special tokens; the rest is ordinary text. The
  template text is encoded *without* adding special tokens (vLLM's chat default), so the ids
  start with exactly one ``<s>``. The trailing ``<|assistant|>\\n`` appears when
  ``add_generation_prompt`` is true (the default).
* Output text is the concatenation of each token's own decoded string (a table built once), so
  streamed chunks concatenate to the non-streamed text.
* Encoding goes through ``encode_batch``, which releases the GIL while the Rust tokenizer works (the
  single ``encode`` holds it), so a long prompt encoded in a worker thread does not stall the event
  loop or the lease keepalive thread. :meth:`Renderer.min_tokens` is a sound lower bound on a text's
  token count without encoding it (a byte-level BPE token covers at most ``max_token_chars``
  characters), so an over-long prompt is refused before any encoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from kvmesh.errors import InvalidRequest


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequest("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest("message content must be a string or a list of text parts")


def apply_chat_template(messages: Any, add_generation_prompt: bool = True) -> str:
    """The chat template above.

    Raises:
        InvalidRequest: when ``messages`` is not a non-empty list of ``{"role", "content"}`` maps.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    out = ["<s>"]
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidRequest("each message needs a string 'role'")
        out.append(f"<|{msg['role']}|>\n{_content_text(msg.get('content'))}</s>\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


class Renderer:
    """Tokenization for one engine.

    Args:
        tokenizer: the loaded ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self._token_text = [tokenizer.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)]
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
        """Token ids of chat ``messages`` through the template.

        Raises:
            InvalidRequest: for malformed messages.
        """
        return self.encode_text(
            apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def detokenize(self, ids: Sequence[int]) -> str:
        table = self._token_text
        return "".join(table[i] for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]
