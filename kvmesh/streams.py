"""Server-side helpers for kvmesh's long-lived bidirectional gRPC streams (epp's ``PickMany``,
flow_control's ``AdmitMany``).

Each such stream is served by a session whose one writer task waits on an ``asyncio.Event``, writes
everything answered since in one message, and returns after a write once the session is closing.
:func:`stop_stream_writer` is how a session ends that task when the client's side ended (or the call
broke).
"""

from __future__ import annotations

import asyncio
import contextlib


async def stop_stream_writer(writer: asyncio.Task[None], wake: asyncio.Event, flush_seconds: float) -> None:
    """Let ``writer`` flush what is answered, then stop it.

    The caller has already marked its session closing (so ``writer`` returns after its next write);
    this wakes the writer and waits for it at most ``flush_seconds`` (the client may still be
    reading). A write that fails (the call is gone) or a client that stopped reading ends the wait
    early and quietly. ``writer`` is cancelled in every case, also when the caller is cancelled.
    """
    wake.set()
    try:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(writer), flush_seconds)
    finally:
        writer.cancel()
