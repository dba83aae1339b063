"""Served tokens per flow over a sliding window: each flow's share and Jain's fairness index.

Jain's index (R. Jain, D. Chiu, W. Hawe, "A Quantitative Measure of Fairness and Discrimination
for Resource Allocation in Shared Computer Systems", DEC-TR-301, 1984) over the flows served in the
window: ``J = (sum x_i)^2 / (n * sum x_i^2)``, 1.0 when every flow got the same tokens, ``1/n`` when
one flow got everything. ``x_i`` are the prompt + completion tokens of the requests of flow ``i``
that ended in the window. Recording and reading are O(1) amortized (a deque of events, running sums).
"""

from __future__ import annotations

from collections import deque


class ServedWindow:
    """Tokens served per flow during the last ``window_seconds`` (clock seconds supplied by the caller)."""

    def __init__(self, window_seconds: float = 10.0) -> None:
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds}")
        self.window_seconds = window_seconds
        self._events: deque[tuple[float, str, int]] = deque()
        self._totals: dict[str, int] = {}

    def record(self, now: float, flow_id: str, tokens: int) -> None:
        if tokens <= 0:
            return
        self._expire(now)
        self._events.append((now, flow_id, tokens))
        self._totals[flow_id] = self._totals.get(flow_id, 0) + tokens

    def _expire(self, now: float) -> None:
        horizon = now - self.window_seconds
        events, totals = self._events, self._totals
        while events and events[0][0] <= horizon:
            _, flow_id, tokens = events.popleft()
            left = totals[flow_id] - tokens
            if left:
                totals[flow_id] = left
            else:
                del totals[flow_id]

    def totals(self, now: float) -> dict[str, int]:
        """Flow id -> tokens served in the window."""
        self._expire(now)
        return dict(self._totals)

    def shares(self, now: float) -> dict[str, float]:
        """Flow id -> fraction of the window's served tokens (sums to 1; empty when nothing was served)."""
        totals = self.totals(now)
        whole = sum(totals.values())
        return {f: t / whole for f, t in totals.items()} if whole else {}

    def jain_index(self, now: float) -> float:
        """Jain's index over the flows served in the window (1.0 when none or one was served)."""
        return jain_index(list(self.totals(now).values()))


def jain_index(values: list[float] | list[int]) -> float:
    """``(sum x)^2 / (n * sum x^2)`` over ``values``; 1.0 for an empty or all-zero list."""
    n = len(values)
    squares = sum(v * v for v in values)
    if n == 0 or squares == 0:
        return 1.0
    return float(sum(values)) ** 2 / (n * squares)
