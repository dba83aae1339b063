"""Process-wide logging set-up: one line per record, ``key=value`` context in the message."""

from __future__ import annotations

import logging
import sys

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
