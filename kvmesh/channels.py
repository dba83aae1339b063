"""Outbound gRPC channels with tracing, and remote-status -> domain-error translation."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from opentelemetry import propagate
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from kvmesh.errors import KvmeshError, error_class_named, from_grpc_status

ERROR_CLASS_TRAILER = "kvmesh-error-class"
"""Trailing-metadata key a kvmesh server sets on every status it answers for a domain error."""

RECONNECT_BACKOFF_MS = (100, 1000)
"""Initial and largest reconnect backoff of kvmesh channels (gRPC's defaults, 1 s growing to 120 s,
would keep a client away from a restarted dependency for up to two minutes)."""

CONNECT_TIMEOUT_MS = 1000
"""How long one connection attempt may take (TCP + HTTP/2 SETTINGS). gRPC C-core reads it from
``grpc.min_reconnect_backoff_ms`` (``subchannel.cc``: an attempt's deadline is the later of the current
backoff and that value), so it is set apart from the backoff: at 100 ms (the backoff) a peer whose
handshake took longer (a loaded or remote process) failed every attempt with "connection attempt timed
out before receiving SETTINGS frame". A refused connection still fails at once and is retried after the
backoff; only a peer that accepts and stays silent (SIGSTOPped) now costs up to this long per attempt."""


def insecure_channel(target: str, *, client_spans: bool = True) -> grpc.aio.Channel:
    """An aio channel to ``host:port`` whose calls carry the W3C trace context in metadata.

    ``client_spans=False``: no client interceptors (no CLIENT span per call; the caller puts the
    trace context in each call's metadata itself, :func:`trace_metadata`). On a hot path that saves
    the interceptor's per-call task and, for streams, its request queue (``bench/grpc_hop.py``).

    Reconnects within :data:`RECONNECT_BACKOFF_MS` (a restarted dependency is used again within a second);
    one connection attempt may take :data:`CONNECT_TIMEOUT_MS`.
    """
    return grpc.aio.insecure_channel(
        target,
        interceptors=aio_client_interceptors() if client_spans else None,
        options=[
            ("grpc.enable_retries", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),  # the connect deadline (see CONNECT_TIMEOUT_MS)
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ],
    )


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's W3C ``traceparent``/``tracestate`` as gRPC call metadata (empty without a span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def answered(err: grpc.aio.AioRpcError) -> bool:
    """Whether a kvmesh service itself answered this status (a domain error: the
    :data:`ERROR_CLASS_TRAILER` trailer is present), as opposed to the call failing on the way
    (unreachable, reset, crashed, or an unhandled bug answered as ``INTERNAL``)."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:
        return False
    return any(key == ERROR_CLASS_TRAILER for key, _ in trailers)


def to_domain_error(
    err: grpc.aio.AioRpcError,
    overrides: Mapping[grpc.StatusCode, type[KvmeshError]] | None = None,
    remote: str = "",
) -> KvmeshError:
    """Turn a failed call's status into the matching domain error (for re-raising at the edge).

    The table in :mod:`kvmesh.errors` (:func:`~kvmesh.errors.from_grpc_status`) decides, unless the
    call passes ``overrides``: statuses that mean something else from this particular remote (e.g.
    ``UNAVAILABLE`` from flow_control is "not ready", not "no endpoints").

    Args:
        err: the failed call.
        overrides: status code -> domain error class, consulted before the table.
        remote: names the remote in an overridden error's message (``"<remote>: <details>"``).
    """
    if overrides is not None:
        error_cls = overrides.get(err.code())
        if error_cls is not None:
            return error_cls(f"{remote}: {err.details()}" if remote else str(err.details()))
    named = _answered_class(err)
    if named is not None:
        return named(err.details() or err.code().name)
    return from_grpc_status(err.code().name, err.details() or err.code().name)


def _answered_class(err: grpc.aio.AioRpcError) -> type[KvmeshError] | None:
    """The domain error class the remote named in its :data:`ERROR_CLASS_TRAILER` (None when absent or unknown)."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:
        return None
    for key, value in trailers:
        if key == ERROR_CLASS_TRAILER:
            return error_class_named(str(value), err.code().name)
    return None
