"""Admission credits (issue 10): pre-admitted slots flow_control lends to one admission stream.

A client (the router's ``AdmitMany`` stream) that asks for credits is lent up to ``want`` of them
while a request of the lending band would be dispatched at once anyway: nothing is queued, the
pool has room and the band is under its ``max_saturation``; at most half the free room
(``max_in_flight`` and the saturation detector's headroom) is lent in all, and every credit lent
counts as a request in flight for every other admission. The client
dispatches a request on a credit without waiting for a decision and still sends its Enqueue
(marked as spent on a credit), so in-flight counts, per-flow and tenant usage, fairness and the
Complete stay exact. When lending stops being safe (something queued, the pool saturated, the
free room shrank to what is lent) every account is revoked: the client drops its unspent credits
and says how many (``returned``); until that answer arrives the credits still count as lent,
since an Enqueue spent on one may be on its way.

:class:`CreditAccount` is one client's ledger, without I/O: the controller
(:meth:`~services.flow_control.controller.FlowController.open_credits` and the methods beside it)
changes it, the transport (the servicer) takes the pending :class:`CreditUpdate` with
:meth:`CreditAccount.take_update` when ``notify`` says there is one, and sends it.

Invariant: ``lent`` = credits granted (sent or not) - Enqueues received on a credit - credits
returned; it is exactly what the client holds plus what is on the wire either way. After a revoke
and its return, ``lent`` is 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CreditUpdate:
    """What the client is told: ``grant`` credits more, or ``revoke`` (drop every credit held and
    answer with the count dropped); credits are for requests of band ``priority``."""

    grant: int
    revoke: bool
    priority: int


class CreditAccount:
    """One client's credits as flow_control sees them.

    Attributes:
        want: the most credits the client may hold (its request capped by ``admission_credits``).
        lent: credits granted and neither spent nor returned (unsent ones included).
        unsent: granted credits the transport has not taken yet (dropped, not revoked, on a revoke).
        revoking: a revoke was decided (sent or not) and the client's return has not arrived;
            nothing is granted meanwhile.
        closed: the stream ended (its credits were freed).
    """

    __slots__ = ("_notify", "_revoke_unsent", "closed", "lent", "priority", "revoking", "unsent", "want")

    def __init__(self, want: int, priority: int, notify: Callable[[], None]) -> None:
        self.want = want
        self.priority = priority
        self.lent = 0
        self.unsent = 0
        self.revoking = False
        self.closed = False
        self._revoke_unsent = False
        self._notify = notify

    @property
    def held(self) -> int:
        """Credits the client may have received and not spent: ``lent - unsent``."""
        return self.lent - self.unsent

    def take_update(self) -> CreditUpdate | None:
        """The change the client has not been told yet (None: none); the caller must send it."""
        if self._revoke_unsent:
            self._revoke_unsent = False
            return CreditUpdate(0, True, self.priority)
        if self.unsent:
            grant, self.unsent = self.unsent, 0
            return CreditUpdate(grant, False, self.priority)
        return None

    # -- the controller's side ------------------------------------------------------------------

    def _grant(self, credits: int) -> None:
        self.lent += credits
        self.unsent += credits
        self._notify()

    def _revoke(self) -> int:
        """Drop the unsent grant and, when the client may hold credits, ask for them back; returns
        the credits freed at once (the unsent ones)."""
        dropped, self.unsent = self.unsent, 0
        self.lent -= dropped
        if self.lent > 0 and not self.revoking:
            self.revoking = True
            self._revoke_unsent = True
            self._notify()
        return dropped

    def _returned(self, credits: int) -> int:
        """The client's answer to a revoke; returns the credits freed (at most ``lent``)."""
        freed = max(0, min(credits, self.lent - self.unsent))
        self.lent -= freed
        if not self._revoke_unsent:  # an answer to a revoke not yet sent cannot be the answer to it
            self.revoking = False
        return freed

    def __repr__(self) -> str:
        return f"CreditAccount(want={self.want}, lent={self.lent}, unsent={self.unsent}, revoking={self.revoking})"
