"""Domain error -> HTTP status, headers and an OpenAI-style error body (pure; the one table is kvmesh.errors).

Body shape, as OpenAI and vLLM send it::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

``type`` comes from :data:`kvmesh.errors.ERROR_TABLE` (an error class may name its own
``openai_type`` and ``param``, to word an answer as the engine would); ``code`` is the HTTP status (vLLM's
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
    NotFound,
    QueueTTLExpired,
    Saturated,
    Unauthenticated,
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
    # an error may name the engine's own type/param (vLLM's wording, e.g. a stored response not found)
    error_type = getattr(exc, "openai_type", None) or row.openai_type
    param = getattr(exc, "param", None) or (match and match.group(1))
    return HttpError(status, error_body(message, error_type, status, param), headers)


class EngineRejected(InvalidRequest):
    """The engine refused the request as invalid (HTTP 400, 405, 409, 413, 422...): ``INVALID_ARGUMENT``."""


class EngineNotFound(NotFound):
    """The engine answered 404 (a route it does not serve, a stored response it does not hold): ``NOT_FOUND``."""


class EngineUnauthenticated(Unauthenticated):
    """The engine refused kvmesh's (or the client's) credentials (HTTP 401/403): ``UNAUTHENTICATED``."""


class EngineUnavailable(NoEndpointsAvailable):
    """The engine answered 500/502/503 (overloaded, not ready, failed): ``UNAVAILABLE`` (retryable)."""


_STATUS_ERRORS: dict[int, type[KvmeshError]] = {
    401: EngineUnauthenticated,
    403: EngineUnauthenticated,
    404: EngineNotFound,
    408: QueueTTLExpired,
    429: Saturated,
    504: QueueTTLExpired,
}


def engine_error_message(body: bytes) -> str:
    """The message of an engine's error body: ``error.message`` (OpenAI / vLLM 0.32), ``error`` as a
    string (vLLM's ``--api-key`` 401: ``{"error": "Unauthorized"}``), ``message`` (vLLM's older
    ``ErrorResponse``) or FastAPI's ``detail``; "" when the body is none of these."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (or UTF-8), an int past the digit limit, nested too deeply
        return ""
    if not isinstance(data, dict):
        return ""
    inner = data.get("error")
    if isinstance(inner, dict):
        return str(inner.get("message") or "")
    for key in ("error", "message", "detail"):
        if isinstance(data.get(key), str):
            return str(data[key])
    return ""


def error_from_engine(status: int, body: bytes) -> KvmeshError:
    """The domain error for an engine's error answer (the gRPC front door; HTTP passes the answer itself).

    Status -> class: 401/403 ``EngineUnauthenticated`` (UNAUTHENTICATED), 404 ``EngineNotFound``
    (NOT_FOUND), 408/504 ``QueueTTLExpired`` (DEADLINE_EXCEEDED), 429 ``Saturated`` (RESOURCE_EXHAUSTED),
    any other 4xx ``EngineRejected`` (INVALID_ARGUMENT), 5xx ``EngineUnavailable`` (UNAVAILABLE). The
    message is the engine's own (:func:`engine_error_message`), never empty: a body without one gives
    ``engine answered HTTP <status>``.
    """
    message = engine_error_message(body)
    cls = _STATUS_ERRORS.get(status) or (EngineRejected if 400 <= status < 500 else EngineUnavailable)
    return cls(message or f"engine answered HTTP {status}")


def error_from_stream_event(error: object) -> KvmeshError:
    """The domain error for an in-stream error event (``data: {"error": {"message", "type", "code"}}``):
    vLLM 0.32 answers a streamed request whose sampling parameters it refuses (``logprobs`` over its
    limit, a token id outside the vocabulary) with 200 and this event; ``code`` is the HTTP status it
    stands for (500 when absent), mapped as :func:`error_from_engine` does."""
    inner = error if isinstance(error, dict) else {"message": str(error)}
    code = inner.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return error_from_engine(status, json.dumps({"error": inner}).encode())
