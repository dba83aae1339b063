"""Outbound gRPC channels with tracing, and remote-status -> domain-error translation."""

from __future__ import annotations

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


def to_domain_error(err: grpc.aio.AioRpcError) -> KvmeshError:
    """Turn a failed call's status into the matching domain error (for re-raising at the edge)."""
    return from_grpc_status(err.code().name, err.details() or err.code().name)
