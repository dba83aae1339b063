"""Process-wide logging set-up: one line per record, ``key=value`` context in the message."""

from __future__ import annotations

import logging
import sys
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


class RateLimitedLog:
    """Rate-limited log lines per kind: the first at once, then at most one per ``interval_seconds``,
    which says how many lines of that kind were suppressed since the last one (the convention of
    :class:`kvmesh.membership.EtcdState`'s etcd warnings). Not thread-safe: one event loop.

    Args:
        logger: where lines go.
        interval_seconds: minimum seconds between two lines of one kind.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, logger: logging.Logger, interval_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval_seconds
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` at ``level`` unless a line of ``kind`` went out within the interval
        (then only counted). Returns whether a line was written."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] += 1
            return False
        self._last[kind] = now
        more = self._suppressed.pop(kind, 0)
        suffix = f" (+{more} more {kind} lines suppressed in the last {self._interval:.0f}s)" if more else ""
        self._logger.log(level, message + suffix, *args)
        return True

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, kind, message, *args)

    def suppressed(self, kind: str) -> int:
        """Lines of ``kind`` suppressed since its last line."""
        return self._suppressed[kind]
