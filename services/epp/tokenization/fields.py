"""Which OpenAI request fields change the engine's token sequence (vLLM 0.32), and picking them out of a body.

Completions: ``add_special_tokens`` (default True: the tokenizer's BOS), ``truncate_prompt_tokens``.
Chat: ``messages`` (all of each message: content parts, ``tool_calls``, ``tool_call_id``, ``name``...),
``tools``, ``documents``, ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``
(default True), ``continue_final_message``, ``add_special_tokens`` (default False),
``truncate_prompt_tokens``. Sources: vLLM 0.32 ``vllm/entrypoints/openai/chat_completion/protocol.py``
and ``completion/protocol.py`` (the request models), ``chat_utils.py`` (rendering).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COMPLETION_FIELDS = ("add_special_tokens", "truncate_prompt_tokens")
CHAT_FIELDS = (
    "tools", "documents", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "truncate_prompt_tokens",
)


def plain_messages(messages: Any) -> bool:
    """True when every message is exactly ``{"role": str, "content": str}`` (nothing else to carry)."""
    return isinstance(messages, list) and all(
        isinstance(m, dict) and len(m) == 2 and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )


def render_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The token-changing fields present in an OpenAI body (chat when it has ``messages``).

    Chat ``messages`` are included only when they are not :func:`plain_messages` (plain ones travel
    as role/content pairs).
    """
    if "messages" in body:
        out = {k: body[k] for k in CHAT_FIELDS if k in body}
        if not plain_messages(body["messages"]):
            out["messages"] = body["messages"]
        return out
    return {k: body[k] for k in COMPLETION_FIELDS if k in body}
