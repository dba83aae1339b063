"""The OpenAI answer wire format in one place: SSE framing, chunk parsing and usage (pure, no I/O).

A streamed answer (``"stream": true``) is ``text/event-stream`` as the WHATWG HTML standard
defines it (section 9.2, "Server-sent events"): events separated by a blank line (``\\n\\n`` or
``\\r\\n\\r\\n``), each carrying ``data: <json chunk>`` lines, the last event ``data: [DONE]``
(OpenAI's convention, as vLLM sends it: ``vllm/entrypoints/openai/serving_completion.py`` and
``serving_chat.py``). A completions chunk holds ``choices[0].text``, a chat chunk
``choices[0].delta.content``; the final chunk carries ``usage`` when the request asked for
``stream_options.include_usage``. An engine that fails mid-stream sends ``data: {"error": {...}}``
and then ``data: [DONE]`` (vLLM's in-stream error convention). A non-streamed answer is one JSON
body (``choices[0].text`` or ``choices[0].message.content``).

| name | what |
| --- | --- |
| :class:`SseFramer` | cut a byte stream at event boundaries: whole events, byte-exact, plus their ``data`` payloads |
| :func:`event_boundary` | length of the prefix of a buffer made of whole events |
| :func:`sse_event`, :data:`DONE_EVENT` | write one event / the closing ``data: [DONE]`` event |
| :func:`parse_event` | one ``data`` payload -> :class:`StreamPiece` (text, finish reason, usage, error) |
| :func:`parse_completion` | a non-streamed body -> :class:`Completion` |
| :class:`Usage` | token accounting (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) |

The router passes engine bytes through unchanged (:class:`SseFramer` only decides where it may
cut) and parses a copy; a client that only reads a stream (the replay harness) decodes events with
``httpx-sse`` and parses each payload with :func:`parse_event`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

DONE = "[DONE]"
"""The payload of the last event of an OpenAI stream."""

DONE_EVENT = b"data: [DONE]\n\n"
"""The closing event, as bytes."""

_SEPARATORS = (b"\n\n", b"\r\n\r\n")


def sse_event(data: bytes) -> bytes:
    """One event carrying ``data`` (which must hold no newline, e.g. compact JSON): ``data: <data>\\n\\n``."""
    return b"data: " + data + b"\n\n"


def event_boundary(data: bytes) -> int:
    """Length of the prefix of ``data`` made of whole events (ending in a blank line); 0 when there is none."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _data_payloads(whole: bytes) -> list[str]:
    """The ``data`` payloads of the whole events in ``whole`` (multi-line data joined with ``\\n``)."""
    payloads: list[str] = []
    while whole:
        cuts = [(i, len(sep)) for sep in _SEPARATORS if (i := whole.find(sep)) >= 0]
        end, sep_len = min(cuts) if cuts else (len(whole), 0)
        event, whole = whole[:end], whole[end + sep_len :]
        lines = [line[5:].lstrip(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(lines).decode("utf-8", errors="replace"))
    return payloads


@dataclass(frozen=True, slots=True)
class SseChunk:
    """What :meth:`SseFramer.feed` releases: whole events and their payloads."""

    raw: bytes
    """Whole events, byte-exact as received (empty while an event is still incomplete)."""
    data: tuple[str, ...]
    """The ``data`` payloads of those events, in order (events without data lines are skipped)."""


@dataclass
class SseFramer:
    """Feed the chunks of a byte stream; get back whole events (to pass on) and their data payloads.

    Holds at most one incomplete event. ``flush()`` returns what is left when the stream ends
    (an unterminated last event, or a body that was not SSE at all).
    """

    _held: bytes = field(default=b"", repr=False)

    def feed(self, chunk: bytes) -> SseChunk:
        held = self._held + chunk
        cut = event_boundary(held)
        whole, self._held = held[:cut], held[cut:]
        return SseChunk(whole, tuple(_data_payloads(whole)))

    def flush(self) -> bytes:
        rest, self._held = self._held, b""
        return rest


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one answer (OpenAI ``usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        """The ``usage`` object of a chunk or body; None when absent or not an object."""
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            _token_count(usage.get("prompt_tokens")),
            _token_count(usage.get("completion_tokens")),
            _token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0,
        )


def _token_count(value: Any) -> int:
    """A usage count as an int: a non-negative integer (or an integral float) as is; anything else an engine
    may send (NaN, Infinity, a string, a list, a negative or fractional number, a bool) counts 0, so a
    malformed ``usage`` never fails the request it describes."""
    if type(value) is int:
        return value if value >= 0 else 0
    if type(value) is float and value.is_integer() and value >= 0:
        return int(value)
    return 0


@dataclass(frozen=True, slots=True)
class StreamPiece:
    """One parsed stream chunk (the first choice only: kvmesh serves ``n`` = 1)."""

    text: str
    """Completions ``choices[0].text`` or chat ``choices[0].delta.content``; "" when absent."""
    finish_reason: str | None
    usage: Usage | None
    id: str
    error: Any = None
    """The ``error`` object of an in-stream error event (vLLM's convention), else None."""


_DECODER = msgspec.json.Decoder()


def _loads(payload: str | bytes) -> Any:
    """JSON decode: msgspec (several times faster than ``json`` on an engine's chunk), and for what
    it refuses (NaN, integers beyond 64 bits, lone surrogate escapes, very deep nesting) the json
    module's answer or error, so callers see exactly ``json.loads``'s results."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(payload)


def parse_event(payload: str) -> StreamPiece | None:
    """Parse one ``data`` payload (a completions or chat chunk); None for ``[DONE]`` or non-JSON."""
    if payload.strip() == DONE:
        return None
    try:
        data = _loads(payload)
    except (ValueError, RecursionError):  # not JSON, an int past the digit limit, nested too deeply
        return None
    if not isinstance(data, dict):
        return None
    text, finish = _first_choice(data, "delta")
    return StreamPiece(text, finish, Usage.from_json(data.get("usage")), str(data.get("id", "")), data.get("error"))


def _first_choice(data: dict[str, Any], chat_key: str) -> tuple[str, str | None]:
    """Text and finish reason of ``choices[0]``: chat's ``<chat_key>.content`` or completions' ``text``."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", None
    choice = choices[0]
    part = choice.get(chat_key)
    text = (part.get("content") or "") if isinstance(part, dict) else (choice.get("text") or "")
    return text, choice.get("finish_reason")


class Completion(NamedTuple):
    """A non-streamed completions or chat answer: text, finish reason, usage, id ("" when absent)."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    id: str


def parse_completion(body: bytes) -> Completion:
    """Parse a non-streamed answer body; an empty :class:`Completion` when it is not a JSON object."""
    try:
        data = _loads(body)
    except (ValueError, RecursionError):  # not JSON (or UTF-8), an int past the digit limit, nested too deeply
        return Completion("", None, None, "")
    if not isinstance(data, dict):
        return Completion("", None, None, "")
    text, finish = _first_choice(data, "message")
    return Completion(text, finish, Usage.from_json(data.get("usage")), str(data.get("id", "")))
