"""Incremental parsing of OpenAI server-sent events and usage extraction (pure).

An OpenAI stream is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``
(vLLM ``serving_completion.py`` / ``serving_chat.py``). The router passes the bytes through
untouched and feeds a copy here to learn the usage and the number of content chunks, which
stands in for ``completion_tokens`` when the engine sends no usage (one token per chunk, as
vLLM streams without ``stream_options.include_usage``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SseParser:
    """Feed byte chunks, get complete ``data:`` payloads (str) back, in order."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buffer += chunk
        while True:
            cut = self._find_event_end()
            if cut is None:
                return
            end, sep_len = cut
            event, self._buffer = self._buffer[:end], self._buffer[end + sep_len :]
            data_lines = [
                line[5:].lstrip(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")
            ]
            if data_lines:
                yield b"\n".join(data_lines).decode("utf-8", errors="replace")

    def _find_event_end(self) -> tuple[int, int] | None:
        candidates = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := self._buffer.find(sep)) >= 0]
        return min(candidates) if candidates else None


@dataclass
class Usage:
    """Token accounting of one response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
        )


@dataclass(frozen=True, slots=True)
class StreamPiece:
    """One parsed stream event: text delta, finish reason, usage (None when absent)."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    id: str


def parse_event(payload: str) -> StreamPiece | None:
    """Parse one ``data:`` payload (completions or chat chunk); None for ``[DONE]`` or non-JSON."""
    if payload.strip() == DONE:
        return None
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    text, finish = "", None
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or ""
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason")
    return StreamPiece(text, finish, Usage.from_json(data.get("usage")), str(data.get("id", "")))


def parse_completion(body: bytes) -> tuple[str, str | None, Usage | None, str]:
    """``(text, finish_reason, usage, id)`` of a non-streamed completions or chat response."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "", None, None, ""
    if not isinstance(data, dict):
        return "", None, None, ""
    text, finish = "", None
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        message = choice.get("message")
        text = (message.get("content") or "") if isinstance(message, dict) else (choice.get("text") or "")
        finish = choice.get("finish_reason")
    return text, finish, Usage.from_json(data.get("usage")), str(data.get("id", ""))
