"""The fairness-policy contract (GIE ``pkg/epp/framework/interface/flowcontrol.FairnessPolicy``).

One policy instance per band (its state is the band's). The band calls the hooks as flows gain
and lose waiting requests; the controller calls :meth:`pick` for each dispatch, and reports what
was dispatched and, when the request ends, what it actually used (prompt and completion tokens).
``eligible(flow)`` is False for a flow at its tenant's concurrency quota: a policy skips it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.flow_control.bands import Band, FlowQueue
    from services.flow_control.queues.base import QueuedItem


class FairnessPolicy:
    """Base with no-op hooks; subclasses implement :meth:`pick`."""

    type_name = ""

    def on_backlogged(self, band: Band, flow: FlowQueue) -> None:
        """``flow`` went from no waiting request to one."""

    def on_idle(self, band: Band, flow: FlowQueue) -> None:
        """``flow`` has no waiting request any more."""

    def on_forget(self, band: Band, flow: FlowQueue) -> None:
        """``flow`` was dropped (nothing queued or in flight)."""

    def pick(self, band: Band, eligible: Callable[[FlowQueue], bool]) -> FlowQueue | None:
        """The backlogged, eligible flow to serve next, or None."""
        raise NotImplementedError

    def on_dispatch(self, band: Band, flow: FlowQueue, item: QueuedItem) -> None:
        """``item`` of ``flow`` was dispatched."""

    def on_served(self, band: Band, flow_id: str, item: QueuedItem, prompt_tokens: int, completion_tokens: int) -> None:
        """A dispatched request of ``flow_id`` ended having used these tokens."""
