"""kvmesh.logging.RateLimitedLog, the one rate limiter of kvmesh's warning lines: custom suffixes, reset, and
thread-safe use (EtcdState is fed from engines' lease threads). The basic first-at-once / one-per-interval
case is in tests/unit/kv_indexer/test_malformed_events.py."""

from __future__ import annotations

import logging
import threading

import pytest

from kvmesh.logging import RateLimitedLog


def test_custom_suffix_and_reset(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t.rl.suffix"), 10.0, lambda: now[0],
                         suffix=" (+{more} more {kind} failures in the last {interval:.0f}s)")
    caplog.set_level(logging.WARNING, logger="t.rl.suffix")
    log.warning("watch", "first")
    log.warning("watch", "dropped")
    log.warning("watch", "dropped")
    now[0] = 10.0
    log.warning("watch", "second")
    log.warning("watch", "dropped")
    log.reset()  # a new outage: the next line goes out at once, without the old count
    assert log.suppressed("watch") == 0
    log.warning("watch", "after reset")
    assert [r.getMessage() for r in caplog.records] == [
        "first", "second (+2 more watch failures in the last 10s)", "after reset",
    ]


def test_thread_safe_counts_every_line_once(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("t.rl.threads"), 3600.0, thread_safe=True)
    caplog.set_level(logging.WARNING, logger="t.rl.threads")
    barrier = threading.Barrier(8)
    written: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait()
        mine = [log.warning("k", "line") for _ in range(500)]
        with lock:
            written.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert len(written) == 4000
    assert written.count(True) == 1 and len(caplog.records) == 1
    assert log.suppressed("k") == 3999  # no lost update between the threads
