"""Outbound gRPC channels with tracing, and remote-status -> domain-error translation."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from kvmesh.errors import KvmeshError, from_grpc_status


def insecure_channel(target: str) -> grpc.aio.Channel:
    """An aio channel to ``host:port`` whose calls carry the W3C trace context in metadata."""
    return grpc.aio.insecure_channel(
        target,
        interceptors=aio_client_interceptors(),
        options=[("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )


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
    return from_grpc_status(err.code().name, err.details() or err.code().name)
