"""Domain error -> HTTP status, headers and an OpenAI-style error body (pure; the one table is kvmesh.errors).

Body shape, as OpenAI and vLLM send it::

    {"error": {"message": str, "type": str, "param": str | None, "code": int}}

``type`` comes from :data:`kvmesh.errors.ERROR_TABLE` (an error class may name its own
``openai_type`` and ``param``, to word an answer as the engine would); ``code`` is the HTTP status (vLLM's
convention). Rate-limit answers (429) and unavailable ones (503: a dependency down, nothing live) carry ``retry-after``. :class:`RequestTooLarge` (an
``InvalidRequest``, so INVALID_ARGUMENT over gRPC) is a 413, :class:`HeadersTooLarge` a 431,
:class:`UnsupportedMediaType` a 415. Anything outside the table is a
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

_PARAM = re.compile(r"^'([A-Za-z_][A-Za-z0-9_.\[\]-]*)'")


class RequestTooLarge(InvalidRequest):
    """The request body exceeds ``max_request_body_bytes`` (HTTP 413)."""


class HeadersTooLarge(InvalidRequest):
    """The client's headers the router would pass on exceed its bound (HTTP 431, RFC 6585)."""


class UnsupportedMediaType(InvalidRequest):
    """A request body in an encoding (``content-encoding``) the router does not decode (HTTP 415)."""


class RequestTimedOut(InvalidRequest):
    """The request body did not arrive within ``request_body_timeout_seconds`` (HTTP 408, connection closed)."""


_STATUS_OVERRIDES: dict[type[KvmeshError], int] = {RequestTooLarge: 413, HeadersTooLarge: 431, UnsupportedMediaType: 415,
                                                    RequestTimedOut: 408}


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


MAX_ENGINE_ERROR_BYTES = 64 * 1024
"""The most of an engine's error body the router reads (the rest is dropped with the connection)."""
MAX_ENGINE_MESSAGE_CHARS = 1024
"""The longest engine error message passed on (longer ones are cut, ending ``... (truncated)``)."""
_TAG = re.compile(r"<[^>]*>")
_SPACE = re.compile(r"\s+")
_ENGINE_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                       405: "invalid_request_error", 429: "rate_limit_exceeded", 502: "upstream_error",
                       503: "service_unavailable"}


def _bounded(text: str, limit: int = MAX_ENGINE_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "... (truncated)"


def body_snippet(body: bytes, limit: int = 200) -> str:
    """A short printable excerpt of a non-JSON error body (HTML tags dropped, whitespace collapsed)."""
    text = _TAG.sub(" ", body[: limit * 8].decode("utf-8", "replace"))
    text = "".join(c if c.isprintable() else " " for c in text)
    return _bounded(_SPACE.sub(" ", text).strip(), limit)


def engine_error_status(status: int) -> int:
    """The status the client gets for an engine's error status: a 4xx/5xx kept (vLLM's own), anything
    else (an engine answering outside HTTP's error range) 502."""
    return status if 400 <= status <= 599 else 502


def normalize_engine_error(status: int, payload: bytes, fallback: str, truncated: bool = False) -> dict[str, dict[str, object]] | None:
    """The OpenAI error body for an engine's error answer, or None when ``payload`` already is one to pass unchanged.

    Passed unchanged: a JSON ``{"error": {"message": str, "type": str, "param": str | null, ...}}`` (vLLM 0.32's
    ``ErrorResponse``) whose message is at most :data:`MAX_ENGINE_MESSAGE_CHARS`, read whole and with a
    status kept as is. Anything else (plain text, HTML, JSON without ``error`` such as FastAPI's
    ``{"detail": ...}``, an ``error`` that is a string or a malformed object, an oversized message or
    body) is rewritten: ``message`` the engine's own (:func:`engine_error_message`) else ``fallback``,
    cut to :data:`MAX_ENGINE_MESSAGE_CHARS`; ``type`` the engine's when a short string, else by status
    (``invalid_request_error`` for 4xx, ``internal_error`` for 5xx, 401/403/404/429/502/503 their own);
    ``param`` the engine's when a string; ``code`` the client's status (:func:`engine_error_status`).
    """
    client_status = engine_error_status(status)
    inner: object = None
    try:
        data = json.loads(payload) if not truncated else None
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
    if (isinstance(inner, dict) and isinstance(inner.get("message"), str) and isinstance(inner.get("type"), str)
            and isinstance(inner.get("param"), str | None) and len(inner["message"]) <= MAX_ENGINE_MESSAGE_CHARS
            and client_status == status):
        return None
    message = engine_error_message(payload) if not truncated else ""
    message = _bounded(message or fallback)
    etype = inner.get("type") if isinstance(inner, dict) else None
    if not (isinstance(etype, str) and 0 < len(etype) <= 64):
        etype = _ENGINE_ERROR_TYPES.get(client_status, "invalid_request_error" if client_status < 500 else "internal_error")
    param = inner.get("param") if isinstance(inner, dict) else None
    return error_body(message, etype, client_status, param[:200] if isinstance(param, str) else None)


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
    ``engine answered HTTP <status>: <excerpt>`` (:func:`body_snippet`); at most
    :data:`MAX_ENGINE_MESSAGE_CHARS` characters (gRPC carries it in a trailer).
    """
    message = engine_error_message(body) or f"engine answered HTTP {status}" + (
        f": {snippet}" if (snippet := body_snippet(body)) else "")
    cls = _STATUS_ERRORS.get(status) or (EngineRejected if 400 <= status < 500 else EngineUnavailable)
    return cls(_bounded(message))


def error_from_stream_event(error: object) -> KvmeshError:
    """The domain error for an in-stream error event (``data: {"error": {"message", "type", "code"}}``):
    vLLM 0.32 answers a streamed request whose sampling parameters it refuses (``logprobs`` over its
    limit, a token id outside the vocabulary) with 200 and this event; ``code`` is the HTTP status it
    stands for (500 when absent), mapped as :func:`error_from_engine` does."""
    inner = error if isinstance(error, dict) else {"message": str(error)}
    code = inner.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return error_from_engine(status, json.dumps({"error": inner}).encode())
