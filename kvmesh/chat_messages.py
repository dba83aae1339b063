"""OpenAI chat messages as every kvmesh service reads them: a message's role and text (pure, no I/O).

One rule for the router's validation (``/v1/chat/completions``, ``/v1/responses`` input items, gRPC
``Complete``) and epp's ``Pick`` (``PickRequest.messages``, and the verbatim ``messages`` of
``render_json``) and ext_proc, so the same mistake gets the same status (``InvalidRequest``: HTTP
400 / ``INVALID_ARGUMENT``) and the same words from every service (docs/degraded-modes.md).

| function | checks | error (``where`` is the JSON path, e.g. ``messages[2]``) |
| --- | --- | --- |
| :func:`chat_role` | a non-empty string (any: see below) | ``'<where>.role' must be a non-empty string`` |
| :func:`content_text` | a string, null, or a list of parts (bare strings, or objects with a string ``type``; a text part needs a string ``text``) | ``'<where>.content' must be a string or a list of text parts`` ... |
| :func:`chat_messages` | a non-empty list of objects, each checked as above | ``'messages' must be a non-empty list``, ``'messages[i]' must be an object`` |

Roles follow vLLM 0.32, the engine kvmesh fronts, not OpenAI's closed list: its chat request's
``messages`` admit ``CustomChatCompletionMessageParam`` ("Enables custom roles in the Chat Completion
API", ``role: Required[str]``; ``vllm/renderers/chat_utils.py``), and ``_parse_chat_message_content``
there passes any role string through to the model's chat template as given (``ConversationMessage.role``
is a ``str``), special-casing only ``system``, ``assistant``, ``tool`` and ``developer``. So Llama 3.x's
``ipython`` tool results, OpenAI's legacy ``function`` and any role a model's template knows are served;
a role the template does not know is the engine's answer (its template error), not kvmesh's. Only what
vLLM's schema refuses too is refused here: a role that is not a string, and (kvmesh's own rule, no
template renders it) an empty one.

Content parts follow vLLM 0.32's chat utils (``vllm/renderers/chat_utils.py``): text parts (``text``,
``input_text``, ``output_text``, ``refusal``) joined with a newline; other parts (images, audio,
files) add no text: the engine decides whether it serves them.
"""

from __future__ import annotations

from typing import Any

from kvmesh.errors import InvalidRequest

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})
"""Content part types whose ``text`` (``refusal``: its ``refusal``) is the message's text."""


def utf8_or_invalid(text: str, where: str) -> str:
    """``text`` unchanged when it encodes as UTF-8.

    Raises:
        InvalidRequest: naming ``where`` when it holds a lone surrogate.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{where}' is not valid Unicode: it contains a lone UTF-16 surrogate") from None
    return text


def chat_role(role: Any, where: str) -> str:
    """``role`` of the message at ``where`` (e.g. ``messages[0]``), checked: any non-empty string, as
    vLLM 0.32's ``CustomChatCompletionMessageParam`` takes it (``system``, ``user``, ``assistant``,
    ``tool``, ``developer``, ``function``, ``ipython``, a model's own role; module docstring).

    Raises:
        InvalidRequest: ``'<where>.role' must be a non-empty string`` (absent, null, a number, a list,
            an object, ``""``); a lone UTF-16 surrogate (``'<where>.role' is not valid Unicode...``).
    """
    if not isinstance(role, str) or not role:
        raise InvalidRequest(f"'{where}.role' must be a non-empty string")
    return utf8_or_invalid(role, f"{where}.role")


def content_text(content: Any, where: str) -> str:
    """The text of the ``content`` of the message at ``where``: a string as is, null as "", text
    parts joined with a newline (vLLM's rule; a bare string is a text part too).

    Raises:
        InvalidRequest: another type; a part neither a string nor an object with a string ``type``;
            a text part without a string ``text``; a lone UTF-16 surrogate.
    """
    if isinstance(content, str):
        return utf8_or_invalid(content, f"{where}.content")
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):  # vLLM also takes a bare string as a text part
                parts.append(part)
                continue
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidRequest(f"'{where}.content': each part must be an object with a 'type'")
            if part["type"] in TEXT_PART_TYPES:
                text = part.get("text", part.get("refusal"))
                if not isinstance(text, str):
                    raise InvalidRequest(f"'{where}.content': a {part['type']} part needs a string 'text'")
                parts.append(text)
        return utf8_or_invalid("\n".join(parts), f"{where}.content")
    if content is None:
        return ""
    raise InvalidRequest(f"'{where}.content' must be a string or a list of text parts")


def chat_messages(messages: Any) -> tuple[tuple[str, str], ...]:
    """A chat body's ``messages`` as ``(role, text)`` pairs, each checked (:func:`chat_role`, :func:`content_text`).

    Raises:
        InvalidRequest: not a non-empty list, an item not an object, or a bad role or content.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object")
        where = f"messages[{i}]"
        out.append((chat_role(message.get("role"), where), content_text(message.get("content"), where)))
    return tuple(out)
