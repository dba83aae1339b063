"""Priority bands and the flows inside them (GIE's ``registry``: ``PriorityBandConfig``, managed flow queues).

A :class:`Band` holds every flow of one priority; a :class:`FlowQueue` holds the waiting requests of
one ``(flow_id, priority)`` in its ordering policy's order. Bands are served in strict priority order
(highest first); inside a band the band's fairness policy picks the flow. Counters here are exact
(every push/pop/remove goes through these methods), so capacity checks are O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.flow_control.fairness.base import FairnessPolicy
from services.flow_control.queues.base import QueuedItem, QueueOrdering
from services.flow_control.types import NO_QUOTA, FlowQuota


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One priority band's settings (GIE ``PriorityBandConfig``; 0 = unlimited / inherit).

    Attributes:
        priority: the band's priority (higher first; negative = sheddable).
        name: human-readable name (metric label ``band``); defaults to ``str(priority)``.
        max_requests: requests that may wait in this band.
        max_bytes: bytes (request bodies) that may wait in this band.
        ttl_seconds: this band's queue TTL (the effective TTL is the minimum of global, band, request).
        fairness_policy: registered fairness policy name ("" = the controller's default).
        ordering_policy: registered ordering policy name ("" = the controller's default).
        max_saturation: this band dispatches only while the detector's ``saturation`` is below it
            (0 = until the pool is saturated). A value under 1 leaves headroom that only higher
            bands may use (e.g. batch at 0.8: interactive requests find free engine slots).
    """

    priority: int
    name: str = ""
    max_requests: int = 0
    max_bytes: int = 0
    ttl_seconds: float = 0.0
    fairness_policy: str = ""
    ordering_policy: str = ""
    max_saturation: float = 0.0

    @property
    def label(self) -> str:
        return self.name or str(self.priority)

    @property
    def sheddable(self) -> bool:
        """Negative priorities are sheddable (GIE/llm-d convention)."""
        return self.priority < 0


class TokenBucket:
    """A tenant's rate quota: ``rate`` requests/s sustained, ``burst`` at once (refilled lazily)."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def take(self, now: float, quota: FlowQuota) -> bool:
        """Refill to ``now`` (with the latest quota) and take one token; False when empty."""
        self.rate = quota.rate_per_second
        self.burst = float(quota.burst or max(1.0, self.rate))
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def full(self, now: float) -> bool:
        return self.tokens + max(0.0, now - self.at) * self.rate >= self.burst

    def retry_after(self) -> float:
        """Seconds until the bucket holds one token again."""
        return max(0.0, (1.0 - self.tokens) / self.rate) if self.rate > 0 else 0.0


class FlowQueue:
    """The waiting requests of one flow ``(flow_id, priority)`` plus its in-flight count and tenant quota."""

    __slots__ = ("bytes", "flow_id", "in_flight", "priority", "queue", "quota")

    def __init__(self, flow_id: str, priority: int, queue: QueueOrdering) -> None:
        self.flow_id = flow_id
        self.priority = priority
        self.queue = queue
        self.bytes = 0
        self.in_flight = 0
        self.quota: FlowQuota = NO_QUOTA

    def __len__(self) -> int:
        return len(self.queue)


class Band:
    """All flows of one priority; ``backlogged`` lists the flows with waiting requests, oldest first."""

    def __init__(self, config: BandConfig, fairness: FairnessPolicy, queue_factory: Callable[[], QueueOrdering]) -> None:
        self.config = config
        self.priority = config.priority
        self.fairness = fairness
        self.queue_factory = queue_factory
        self.flows: dict[str, FlowQueue] = {}
        self.backlogged: dict[str, FlowQueue] = {}
        self.queued = 0
        self.queued_bytes = 0
        self.in_flight = 0

    @property
    def label(self) -> str:
        return self.config.label

    def flow(self, flow_id: str) -> FlowQueue:
        """The flow ``flow_id`` of this band, created on first use."""
        flow = self.flows.get(flow_id)
        if flow is None:
            flow = self.flows[flow_id] = FlowQueue(flow_id, self.priority, self.queue_factory())
        return flow

    def push(self, flow: FlowQueue, item: QueuedItem) -> None:
        flow.queue.push(item)
        flow.bytes += item.request.byte_size
        self.queued += 1
        self.queued_bytes += item.request.byte_size
        if len(flow.queue) == 1:
            self.backlogged[flow.flow_id] = flow
            self.fairness.on_backlogged(self, flow)

    def _took(self, flow: FlowQueue, item: QueuedItem) -> None:
        flow.bytes -= item.request.byte_size
        self.queued -= 1
        self.queued_bytes -= item.request.byte_size
        if not flow.queue:
            self.backlogged.pop(flow.flow_id, None)
            self.fairness.on_idle(self, flow)

    def pop(self, flow: FlowQueue) -> QueuedItem:
        item = flow.queue.pop()
        self._took(flow, item)
        return item

    def remove(self, flow: FlowQueue, ticket_id: int) -> QueuedItem | None:
        item = flow.queue.remove(ticket_id)
        if item is not None:
            self._took(flow, item)
        return item

    def forget_if_idle(self, flow: FlowQueue) -> None:
        """Drop a flow with nothing queued or in flight (GIE's flow GC, done eagerly)."""
        if not flow.queue and flow.in_flight == 0 and self.flows.get(flow.flow_id) is flow:
            del self.flows[flow.flow_id]
            self.fairness.on_forget(self, flow)
