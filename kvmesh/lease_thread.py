"""A lease registration kept alive on its own thread and event loop, independent of the owner's loop.

An engine's event loop can be busy for seconds (a long prompt encoded, a large reply rendered); a
keepalive task on that loop then misses its refreshes and the engine's etcd key expires although the
engine is fine (issue 14: both engines purged by one 2 MB prompt). :class:`ThreadedLeaseRegistration`
runs a :class:`kvmesh.membership.LeaseRegistration` on a dedicated daemon thread with its own asyncio
loop, so refreshes happen whatever the owner's loop does; only a process that is really gone (or
frozen) loses its key, after the lease TTL. The owner awaits ``start``/``update``/``stop`` from its
own loop as with the plain registration.

The owner process must not use ``grpc.aio`` on its own loop at the same time (the simulator serves
HTTP only); one loop per thread is what grpc's asyncio support expects.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmesh.membership import LeaseRegistration

T = TypeVar("T")


class ThreadedLeaseRegistration:
    """``key = value`` under an etcd lease, refreshed every TTL/3 from a dedicated thread.

    Args: as :class:`~kvmesh.membership.LeaseRegistration` (``ttl_seconds`` in seconds).
    """

    def __init__(
        self,
        etcd_endpoints: list[str],
        key: str,
        value: str,
        ttl_seconds: int = 10,
        first_attempt_timeout_seconds: float = 5.0,
    ) -> None:
        self.key = key
        self.ttl_seconds = ttl_seconds
        self._inner = LeaseRegistration(etcd_endpoints, key, value, ttl_seconds, first_attempt_timeout_seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def registered(self) -> bool:
        return self._inner.registered

    def _serve(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def start(self) -> None:
        """Start the thread, then register (returns as :meth:`LeaseRegistration.start` does)."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name=f"lease:{self.key}", daemon=True)
        self._thread.start()
        ready.wait()
        await self._call(self._inner.start())

    async def update(self, value: str) -> None:
        """Change the registered value (same lease)."""
        await self._call(self._inner.update(value))

    async def stop(self) -> None:
        """Revoke the lease (the key disappears at once) and end the thread."""
        if self._loop is None or self._thread is None:
            return
        try:
            await self._call(self._inner.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join, 5.0)
            self._loop = None
            self._thread = None
