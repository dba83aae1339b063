"""The queue contract: one ordering of waiting requests, with O(1) removal by ticket id.

An ordering only decides *which* waiting request of one flow comes next (GIE's
``OrderingPolicy``). *Whether* anything may be dispatched (in-flight limit, saturation) and
*which flow* to draw from (strict band order, then a fairness policy) are the controller's
decisions, so new orderings are one file here, registered by name in
:mod:`services.flow_control.policies`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from services.flow_control.types import AdmissionRequest


@dataclass(frozen=True, slots=True)
class QueuedItem:
    """A request waiting for a slot.

    Attributes:
        ticket_id: the controller's unique id of the request.
        request: what the router sent (flow_id and priority are kept for bands and fairness).
        enqueued_at: clock seconds at arrival.
        deadline: clock seconds of its TTL expiry (arrival + the effective TTL).
    """

    ticket_id: int
    request: AdmissionRequest
    enqueued_at: float
    deadline: float = float("inf")


class QueueOrdering(Protocol):
    """A queue of :class:`QueuedItem`; every method is O(1) or O(log n) in real orderings."""

    type_name: str
    """Kebab-case name of the ordering (``"fcfs"``)."""

    def push(self, item: QueuedItem) -> None:
        """Add ``item``; its ``ticket_id`` is not already queued."""
        ...

    def peek(self) -> QueuedItem | None:
        """The item to dispatch next, or ``None`` when empty (does not remove it)."""
        ...

    def pop(self) -> QueuedItem:
        """Remove and return :meth:`peek`'s item. Raises ``IndexError`` when empty."""
        ...

    def remove(self, ticket_id: int) -> QueuedItem | None:
        """Remove the item with ``ticket_id`` (cancelled or expired); ``None`` when absent."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[QueuedItem]:
        """Items in dispatch order."""
        ...
