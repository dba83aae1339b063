"""Deadline orderings: the waiting request with the smallest key is dispatched first.

A binary heap of ``(key, arrival, ticket_id)`` with lazy removal: ``remove`` drops the item from
the live map and its heap entry is skipped when it surfaces, so push, pop and remove are
O(log n) amortized (GIE's ``maxminheap`` queue plays this role for its EDF policy).

* ``edf-ordering-policy`` (earliest deadline first): key = the request's TTL deadline
  (arrival + min(global, band, request TTL)), so the request closest to expiry goes first.
* ``slo-deadline-ordering-policy``: key = arrival + the request's TTFT objective
  (``x-slo-ttft-ms``, as GIE's ``slo_deadline.go``); requests without one use their TTL deadline,
  so they sort behind every request that states a tighter objective.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from services.flow_control.queues.base import QueuedItem

EDF_TYPE_NAME = "edf-ordering-policy"
SLO_DEADLINE_TYPE_NAME = "slo-deadline-ordering-policy"


def ttl_deadline(item: QueuedItem) -> float:
    """The EDF key: clock seconds at which the item's queue TTL runs out."""
    return item.deadline


def slo_deadline(item: QueuedItem) -> float:
    """The SLO key: arrival + TTFT objective, or the TTL deadline when the request states none."""
    slo = item.request.ttft_slo_seconds
    return item.enqueued_at + slo if slo > 0 else item.deadline


class DeadlineQueue:
    """A :class:`~services.flow_control.queues.base.QueueOrdering` by ``key(item)``, ties by arrival."""

    def __init__(self, key: Callable[[QueuedItem], float], type_name: str) -> None:
        self.type_name = type_name
        self._key = key
        self._heap: list[tuple[float, float, int]] = []
        self._items: dict[int, QueuedItem] = {}

    def push(self, item: QueuedItem) -> None:
        if item.ticket_id in self._items:
            raise ValueError(f"ticket {item.ticket_id} is already queued")
        self._items[item.ticket_id] = item
        heapq.heappush(self._heap, (self._key(item), item.enqueued_at, item.ticket_id))

    def _clean(self) -> None:
        heap, items = self._heap, self._items
        while heap and heap[0][2] not in items:
            heapq.heappop(heap)

    def peek(self) -> QueuedItem | None:
        self._clean()
        return self._items[self._heap[0][2]] if self._heap else None

    def pop(self) -> QueuedItem:
        self._clean()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        _, _, ticket_id = heapq.heappop(self._heap)
        return self._items.pop(ticket_id)

    def remove(self, ticket_id: int) -> QueuedItem | None:
        item = self._items.pop(ticket_id, None)
        if item is not None and len(self._heap) > 2 * len(self._items) + 64:
            self._heap = [e for e in self._heap if e[2] in self._items]  # bound the dead entries
            heapq.heapify(self._heap)
        return item

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedItem]:
        return iter(sorted(self._items.values(), key=lambda i: (self._key(i), i.enqueued_at, i.ticket_id)))


def EdfQueue() -> DeadlineQueue:
    return DeadlineQueue(ttl_deadline, EDF_TYPE_NAME)


def SloDeadlineQueue() -> DeadlineQueue:
    return DeadlineQueue(slo_deadline, SLO_DEADLINE_TYPE_NAME)
