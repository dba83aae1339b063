"""Domain error -> HTTP status, headers and an OpenAI-style error body (pure; the one table is kvmesh.errors).

Body shape, as OpenAI and vLLM send it::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

``type`` comes from :data:`kvmesh.errors.ERROR_TABLE`; ``code`` is the HTTP status (vLLM's
convention). Rate-limit answers (429) and unavailable ones (503: a dependency down, nothing live) carry ``retry-after``. :class:`RequestTooLarge` (an
``InvalidRequest``, so INVALID_ARGUMENT over gRPC) is a 413. Anything outside the table is a
500 with a generic message (the caller logs the traceback). Bodies are rendered with
:func:`render_json` (ASCII-escaped, so a string from the request can never break the encoding).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvmesh.errors import (
    INTERNAL,
    InvalidRequest,
    KvmeshError,
    NoEndpointsAvailable,
    QueueTTLExpired,
    Saturated,
    UnknownModel,
    mapping_for,
)

_PARAM = re.compile(r"^'([a-z_]+)'")


class RequestTooLarge(InvalidRequest):
    """The request body exceeds ``max_request_body_bytes`` (HTTP 413)."""


_STATUS_OVERRIDES: dict[type[KvmeshError], int] = {RequestTooLarge: 413}


def render_json(body: object) -> bytes:
    """JSON bytes for a response: ASCII-escaped (lone surrogates and any other text stay encodable)."""
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True, slots=True)
class HttpError:
    """What the HTTP layer sends for an error."""

    status: int
    body: dict[str, dict[str, object]]
    headers: dict[str, str]


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def http_error(exc: BaseException, retry_after_seconds: int = 1) -> HttpError:
    """Translate ``exc`` through the error table.

    ``param`` is the field a validation message starts with (``"'max_tokens' must ..."``), else None.
    """
    row = mapping_for(exc)
    if row is INTERNAL or not isinstance(exc, KvmeshError):
        return HttpError(INTERNAL.http_status, error_body("internal error", INTERNAL.openai_type, 500), {})
    message = str(exc) or type(exc).__name__
    match = _PARAM.match(message)
    status = _STATUS_OVERRIDES.get(type(exc), row.http_status)
    headers = {"retry-after": str(retry_after_seconds)} if status in (429, 503) else {}
    return HttpError(status, error_body(message, row.openai_type, status, match and match.group(1)), headers)


_STATUS_ERRORS: dict[int, type[KvmeshError]] = {
    400: InvalidRequest,
    404: UnknownModel,
    429: Saturated,
    503: NoEndpointsAvailable,
    504: QueueTTLExpired,
}


def error_from_engine(status: int, body: bytes) -> KvmeshError:
    """The domain error for an engine's error answer (for the gRPC front door; HTTP passes it through).

    The message is the body's ``error.message`` (OpenAI) or ``message`` (vLLM's older shape) when present.
    """
    message = ""
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            inner = data.get("error")
            if isinstance(inner, dict):
                message = str(inner.get("message") or "")
            elif isinstance(data.get("message"), str):
                message = data["message"]
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    cls = _STATUS_ERRORS.get(status, KvmeshError)
    return cls(message or f"engine answered HTTP {status}")
