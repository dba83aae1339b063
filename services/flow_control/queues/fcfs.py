"""First come, first served: dispatch in arrival order.

An insertion-ordered dict keyed by ticket id gives O(1) push, pop of the oldest and removal
of a cancelled request from the middle (GIE's ``listqueue`` does the same with a linked list).
"""

from __future__ import annotations

from collections.abc import Iterator

from services.flow_control.queues.base import QueuedItem

TYPE_NAME = "fcfs-ordering-policy"


class FcfsQueue:
    """FCFS :class:`~services.flow_control.queues.base.QueueOrdering`."""

    type_name = TYPE_NAME

    def __init__(self) -> None:
        self._items: dict[int, QueuedItem] = {}

    def push(self, item: QueuedItem) -> None:
        if item.ticket_id in self._items:
            raise ValueError(f"ticket {item.ticket_id} is already queued")
        self._items[item.ticket_id] = item

    def peek(self) -> QueuedItem | None:
        return next(iter(self._items.values()), None)

    def pop(self) -> QueuedItem:
        if not self._items:
            raise IndexError("pop from an empty queue")
        ticket_id = next(iter(self._items))
        return self._items.pop(ticket_id)

    def remove(self, ticket_id: int) -> QueuedItem | None:
        return self._items.pop(ticket_id, None)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedItem]:
        return iter(list(self._items.values()))
