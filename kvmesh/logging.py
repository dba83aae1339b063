"""Process-wide logging set-up: one line per record, ``key=value`` context in the message."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

_FORMAT = "%(asctime)s %(levelname)s [%(service)s] %(name)s: %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


def setup_logging(service: str, level: str = "INFO") -> None:
    """Log to stderr with the service name on every line; safe to call more than once."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_ServiceFilter(service))
    root.addHandler(handler)
    root.setLevel(level)
    # Quiet chatty libraries at INFO.
    for name in ("httpx", "httpcore", "uvicorn.access", "aetcd"):
        logging.getLogger(name).setLevel(logging.WARNING)


SUPPRESSED_LINES = " (+{more} more {kind} lines suppressed in the last {interval:.0f}s)"
"""The default suffix of a :class:`RateLimitedLog` line after suppressed ones (``str.format`` fields: ``more``,
``kind``, ``interval``)."""


class RateLimitedLog:
    """Rate-limited log lines per kind: the first at once, then at most one per ``interval_seconds``,
    which says how many lines of that kind were suppressed since the last one. The one rate limiter of
    kvmesh's warning lines (etcd's :class:`kvmesh.membership.EtcdState`, the router's degraded modes,
    epp's kv_indexer and prefix-match warnings, kv_indexer's dropped events).

    Args:
        logger: where lines go.
        interval_seconds: minimum seconds between two lines of one kind.
        clock: monotonic seconds (injectable for tests).
        suffix: appended to a line that follows suppressed ones; ``str.format`` fields ``more`` (count),
            ``kind`` and ``interval`` (seconds).
        thread_safe: True guards the state with a lock, for callers on several threads (the decision is
            taken under the lock, the line written outside it); False (default) for one event loop.
        forget_after_seconds: a kind with lines suppressed and none written for this long is forgotten
            with its count (default: 10 intervals); a kind with none suppressed is forgotten once its
            interval passed (nothing is lost: its next line would go out at once anyway). So kinds
            named after something that comes and goes (``duplicate <endpoint>``) do not pile up; the
            state is swept at most once per interval, amortized over the calls.
    """

    def __init__(self, logger: logging.Logger, interval_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, suffix: str = SUPPRESSED_LINES,
                 thread_safe: bool = False, forget_after_seconds: float | None = None) -> None:
        self._logger = logger
        self._interval = interval_seconds
        self._forget_after = 10 * interval_seconds if forget_after_seconds is None else forget_after_seconds
        self._swept: float | None = None
        self._clock = clock
        self._suffix = suffix
        self._lock: threading.Lock | contextlib.nullcontext[None] = (
            threading.Lock() if thread_safe else contextlib.nullcontext())
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` at ``level`` unless a line of ``kind`` went out within the interval
        (then only counted). Returns whether a line was written."""
        with self._lock:
            now = self._clock()
            if self._swept is None or now - self._swept >= self._interval:
                self._sweep(now)
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] += 1
                return False
            self._last[kind] = now
            more = self._suppressed.pop(kind, 0)
        suffix = self._suffix.format(more=more, kind=kind, interval=self._interval) if more else ""
        self._logger.log(level, message + suffix, *args)
        return True

    def _sweep(self, now: float) -> None:
        """Forget kinds past their interval with nothing suppressed, and any past ``forget_after``
        (under the lock)."""
        self._swept = now
        if not self._last:
            return
        suppressed = self._suppressed
        stale = [
            kind for kind, last in self._last.items()
            if now - last >= self._interval and (now - last >= self._forget_after or not suppressed.get(kind))
        ]
        for kind in stale:
            del self._last[kind]
            suppressed.pop(kind, None)

    def kinds(self) -> int:
        """Kinds remembered now (a line written within the interval, or lines suppressed since)."""
        with self._lock:
            return len(self._last)

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, kind, message, *args)

    def suppressed(self, kind: str) -> int:
        """Lines of ``kind`` suppressed since its last line."""
        with self._lock:
            return self._suppressed[kind]

    def reset(self) -> None:
        """Forget every kind: the next line of each goes out at once, with no count (a new outage)."""
        with self._lock:
            self._last.clear()
            self._suppressed.clear()
