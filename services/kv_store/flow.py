"""Flow control shared by kv_store's two data paths (gRPC and ``lm://``): a FIFO byte budget for
values in flight and store operations that outlive a cancelled caller. No gRPC, no I/O.

**ByteBudget.** Both listeners charge the bytes they buffer for puts in flight to one
:class:`ByteBudget` of ``max_inflight_put_bytes``, as the bytes arrive (never what a header
announces: a client that announces 1 GiB and sends nothing holds nothing). Waiters are served in
arrival order (FIFO), so a large value is not starved by a stream of small ones; a wait can be
bounded (``timeout``), which also breaks the deadlock of two large puts each holding part of the
budget and waiting for the rest.

**Detached.** A store operation moves values down the tiers (a put's victims, a promotion's
victims); cancelling it half way would release a victim no slower tier took yet. A caller that
can be cancelled (a gRPC deadline, a client that hangs up) runs it through :meth:`Detached.run`:
the caller is cancelled as asked, the operation runs to its end in its own task (kept referenced
until done), and an error it raises after its caller left is logged, never lost as "exception was
never retrieved".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmesh.errors import KvmeshError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ByteBudget:
    """A FIFO async byte semaphore: ``acquire(n)`` waits until ``n`` more bytes fit under ``limit``.

    A request larger than ``limit`` is clamped to ``limit`` (it waits for an idle budget). Waiters
    are granted strictly in arrival order: a small request never overtakes a large one queued
    before it.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"budget limit must be positive, got {limit}")
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests queued for bytes."""
        return sum(1 for _, fut in self._waiters if not fut.done())

    def try_acquire(self, size: int) -> bool:
        """Take ``size`` bytes now if they fit and nobody is queued; False otherwise (nothing taken)."""
        size = min(size, self.limit)
        if self._waiters or self.in_use + size > self.limit:
            return False
        self.in_use += size
        return True

    async def acquire(self, size: int, timeout: float | None = None) -> None:
        """Wait (FIFO) until ``size`` bytes fit, then take them.

        Raises:
            TimeoutError: not granted within ``timeout`` seconds (nothing taken).
        """
        size = min(size, self.limit)
        if self.try_acquire(size):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted as the wait ended: give the bytes back
                self.release_now(size)
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()  # it may have blocked the head of the queue
            raise

    def release_now(self, size: int) -> None:
        """Give back ``size`` bytes (as clamped when taken) and wake the waiters that now fit, in order."""
        self.in_use -= min(size, self.limit)
        self._wake()

    async def release(self, size: int) -> None:
        """:meth:`release_now`, awaitable (the former API)."""
        self.release_now(size)

    def _wake(self) -> None:
        while self._waiters:
            size, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.in_use + size > self.limit:
                return
            self._waiters.popleft()
            self.in_use += size
            fut.set_result(None)


class Detached:
    """Runs store operations to their end even when the awaiting caller is cancelled (module docstring).

    Args:
        name: for log lines (``"grpc"``, ``"lm://"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def pending(self) -> int:
        """Operations still running (their callers may have gone)."""
        return len(self._tasks)

    async def run(self, operation: Coroutine[Any, Any, T]) -> T:
        """Await ``operation`` in its own task; cancelling the caller leaves the task running.

        Returns what the operation returns and raises what it raises. Raises
        ``asyncio.CancelledError`` when the caller is cancelled (the operation carries on).
        """
        task = asyncio.get_running_loop().create_task(operation)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._orphaned)  # its result now has no reader: retrieve and log it
            raise

    def _orphaned(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, KvmeshError):
            log.info("%s: a store operation whose caller was cancelled ended with: %s", self.name, exc)
        else:
            log.error("%s: a store operation whose caller was cancelled failed", self.name, exc_info=exc)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the operations in flight; returns how many are still running."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        return len(self._tasks)
