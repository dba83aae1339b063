"""Domain errors and the one table that maps them to gRPC status codes and HTTP statuses.

Cores raise these and nothing else on purpose; the shared gRPC interceptor
(:mod:`kvmesh.interceptors`) and the router's HTTP layer translate them with
:data:`ERROR_TABLE`. This module imports no grpc so cores stay free of it.
"""

from __future__ import annotations

from dataclasses import dataclass


class KvmeshError(Exception):
    """Base of every domain error; ``str(err)`` is the client-facing message."""


QUOTED_CHARS = 200
"""Most characters of a caller's value an error message echoes (:func:`quoted`)."""


def quoted(value: str, limit: int = QUOTED_CHARS) -> str:
    """``value`` as an error message echoes it: whole up to ``limit`` characters, else its first
    ``limit`` and how many more (a 100,000-character model name must not make a 100 KB error body)."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value) - limit} more characters)"


class InvalidRequest(KvmeshError):
    """The caller sent something malformed or out of range."""


class NotFound(KvmeshError):
    """The named thing does not exist (a key, a model, an endpoint)."""


class UnknownModel(NotFound):
    """No endpoint serves the requested model."""


class UnknownEndpoint(NotFound):
    """An endpoint id that is not (or no longer) registered."""


class NoEndpointsAvailable(KvmeshError):
    """No live endpoint can take the request."""


class NotReady(KvmeshError):
    """The service has not finished starting (or is draining)."""


class Saturated(KvmeshError):
    """The pool is saturated; retry later.

    Admission rejections carry ``dropped_reason`` (the value of llm-d's
    ``x-llm-d-request-dropped-reason`` response header) and ``retry_after_seconds`` (flow_control's
    hint for ``Retry-After``; 0 = none).
    """

    dropped_reason = "rejected-saturated"

    def __init__(self, message: str = "", retry_after_seconds: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class QueueFull(Saturated):
    """The admission queue is at its capacity."""


class Shed(Saturated):
    """The request was shed to protect more important traffic (a sheddable band while the pool is saturated)."""

    dropped_reason = "rejected-shed"


class AdmissionTTLExpired(Saturated):
    """The request waited in flow_control's queue past its effective TTL (429, as llm-d)."""

    dropped_reason = "rejected-ttl-expired"


class RateLimited(Saturated):
    """The tenant's rate quota is spent."""

    dropped_reason = "rejected-rate-limited"


class Unauthenticated(KvmeshError):
    """A missing (where required), malformed or unknown API key."""


class QueueTTLExpired(KvmeshError):
    """The request waited longer than its queue TTL."""


class DependencyUnavailable(KvmeshError):
    """A service this one needs (another kvmesh service, an engine, etcd) could not be reached or
    failed; the caller may retry."""


class LeaseLost(KvmeshError):
    """The etcd lease backing a registration expired."""


@dataclass(frozen=True, slots=True)
class ErrorMapping:
    """How one error class is reported: gRPC status name, HTTP status, OpenAI error type."""

    grpc_status: str
    http_status: int
    openai_type: str


ERROR_TABLE: dict[type[KvmeshError], ErrorMapping] = {
    InvalidRequest: ErrorMapping("INVALID_ARGUMENT", 400, "invalid_request_error"),
    NotFound: ErrorMapping("NOT_FOUND", 404, "not_found_error"),
    UnknownModel: ErrorMapping("NOT_FOUND", 404, "not_found_error"),
    UnknownEndpoint: ErrorMapping("NOT_FOUND", 404, "not_found_error"),
    NoEndpointsAvailable: ErrorMapping("UNAVAILABLE", 503, "service_unavailable"),
    NotReady: ErrorMapping("UNAVAILABLE", 503, "service_unavailable"),
    Saturated: ErrorMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
    QueueFull: ErrorMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
    Shed: ErrorMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
    AdmissionTTLExpired: ErrorMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
    RateLimited: ErrorMapping("RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded"),
    Unauthenticated: ErrorMapping("UNAUTHENTICATED", 401, "invalid_request_error"),
    QueueTTLExpired: ErrorMapping("DEADLINE_EXCEEDED", 504, "timeout"),
    DependencyUnavailable: ErrorMapping("UNAVAILABLE", 503, "service_unavailable"),
    LeaseLost: ErrorMapping("FAILED_PRECONDITION", 500, "internal_error"),
}
INTERNAL = ErrorMapping("INTERNAL", 500, "internal_error")


def mapping_for(exc: BaseException) -> ErrorMapping:
    """The table row for ``exc`` (walking its MRO), or :data:`INTERNAL` for anything else."""
    for cls in type(exc).__mro__:
        row = ERROR_TABLE.get(cls)
        if row is not None:
            return row
    return INTERNAL


REMOTE_ERRORS: dict[str, type[KvmeshError]] = {
    "INVALID_ARGUMENT": InvalidRequest,
    "NOT_FOUND": NotFound,
    "UNAVAILABLE": NoEndpointsAvailable,
    "RESOURCE_EXHAUSTED": Saturated,
    "UNAUTHENTICATED": Unauthenticated,
}
"""The table read backwards: a remote gRPC status name -> the domain error a client re-raises.

Each row is the first :data:`ERROR_TABLE` class with that status, so the error keeps its status
and HTTP answer across a hop; a kvmesh server also names its exact class in a trailer, which
:func:`error_class_named` reads first (``QueueFull`` stays ``QueueFull``). Statuses not
listed become a plain :class:`KvmeshError` (``INTERNAL``). ``DEADLINE_EXCEEDED`` is left out on
purpose: it says "this call took too long", which only the caller can name, so callers pass it
as a per-call override (:func:`kvmesh.channels.to_domain_error`): the router's admission call
reads it as :class:`QueueTTLExpired`, its Pick call as :class:`NoEndpointsAvailable`.
"""


def error_class_named(name: str, status_name: str) -> type[KvmeshError] | None:
    """The :data:`ERROR_TABLE` class called ``name`` whose gRPC status is ``status_name``, else None.

    A kvmesh server names its domain error's class in a trailer (``kvmesh-error-class``, see
    :mod:`kvmesh.interceptors`); the client rebuilds that very class, so the kind survives a hop
    (epp's :class:`UnknownModel` stays an ``UnknownModel`` at the router, not the table's first
    ``NOT_FOUND`` row). The status must agree, so a trailer can never change an answer's class of status.
    """
    for cls, row in ERROR_TABLE.items():
        if cls.__name__ == name and row.grpc_status == status_name:
            return cls
    return None


def from_grpc_status(status_name: str, message: str) -> KvmeshError:
    """Rebuild a domain error from a remote gRPC status through :data:`REMOTE_ERRORS`
    (``KvmeshError``, i.e. ``INTERNAL``, when unmapped)."""
    return REMOTE_ERRORS.get(status_name, KvmeshError)(message)
