"""The flow controller: priority bands, fairness across flows, pool saturation, TTLs, shedding, quotas.

The layering is GIE's (``pkg/epp/flowcontrol``): *whether* anything may be dispatched (the
in-flight limit AND the saturation detector), *which band* (strict priority, highest first),
*which flow* inside the band (the band's fairness policy) and *which request* of the flow (the
flow's ordering policy) are separate decisions. One event loop, no locks: every method runs to
completion without awaiting.

* ``enqueue(request)``: the request joins flow ``(flow_id, priority)`` of band ``priority``
  (bands not configured are created from the default band, as GIE's dynamic bands: at most
  ``max_dynamic_bands`` at once, idle ones removed after ``dynamic_band_idle_seconds``; past the cap
  the request joins the nearest existing band, see ``band()``). In order:
  no endpoint serves the model (fresh pool snapshot) -> ``REJECTED_NO_ENDPOINTS``; the tenant's
  rate quota is spent -> ``REJECTED_RATE_LIMITED``; it is dispatched at once when no request of
  its band or a higher one waits, the pool has room and its flow is under its concurrency quota;
  else a sheddable band (priority < 0) -> ``SHED``; else a full queue (global or band, in
  requests or bytes) -> ``REJECTED_CAPACITY``; else it waits.
* ``release(ticket)`` (the admission stream closed, for any reason): a dispatched ticket frees its
  slot and the next request is dispatched; a queued one leaves its queue (``EVICTED_CANCELLED``);
  anything else changes nothing. Every ticket moves ``QUEUED -> DISPATCHED | REJECTED -> RELEASED``
  once, so ``in_flight`` is exact.
* ``complete(ticket, served)``: the tokens the request actually used feed the fairness policy and
  the served-token window (shares, Jain's index).
* TTL: effective TTL = min(global ``queue_ttl_seconds``, band TTL, request TTL). ``expire_due()``
  pops every due request from a deadline heap (``EVICTED_TTL``; ``REJECTED_NO_ENDPOINTS`` when a
  fresh snapshot shows no endpoint for its model); it runs before every dispatch and in
  ``run_expiry()``, and a request found expired at dispatch is evicted instead: an expired request
  is never dispatched.
* ``update_pool(snapshot)``: new engine metrics for the :class:`SaturationDetector`; dispatches
  whatever the new room allows.
* Admission credits (:mod:`services.flow_control.credits`; ``admission_credits`` per client,
  band ``admission_credit_priority``): ``open_credits`` / ``enqueue_on_credit`` /
  ``credits_returned`` / ``close_credits``. Credits are lent only while a request of the lending
  band would be dispatched at once (nothing queued, room under ``max_in_flight`` and the
  detector's headroom, the band under its ``max_saturation``), at most half that free room in
  all; every credit lent counts as a request in flight for every other admission, so neither
  limit is exceeded; all are revoked as soon as the credits fill the free room or anything
  queues. A request spent on a credit is dispatched on arrival, whatever the state (the client
  already sent it to an engine): it is recorded exactly as any dispatch.

Parameters: ``max_in_flight`` >= 1 (requests), ``queue_ttl_seconds`` > 0 (clock seconds),
``max_queue_size`` >= 0 (requests; 0 means "never queue"), ``max_queue_bytes`` >= 0 (0 = no limit).
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvmesh.clock import Clock, SystemClock
from services.flow_control.bands import Band, BandConfig, FlowQueue, TokenBucket
from services.flow_control.credits import CreditAccount
from services.flow_control.fairness.window import ServedWindow
from services.flow_control.policies import (
    DEFAULT_FAIRNESS_POLICY,
    DEFAULT_ORDERING_POLICY,
    fairness_policy,
    ordering_factory,
)
from services.flow_control.queues.base import QueuedItem, QueueOrdering
from services.flow_control.saturation import PoolSnapshot, SaturationDetector, SaturationState
from services.flow_control.types import (
    DEFAULT_FLOW_ID,
    AdmissionDecision,
    AdmissionRequest,
    QueueOutcome,
    ServedTokens,
)

logger = logging.getLogger(__name__)

_MAX_BUCKETS = 10_000
"""Rate buckets kept before full ones (tenants idle long enough to refill) are forgotten."""


@dataclass(frozen=True, slots=True)
class ControllerLimits:
    """The controller's knobs (see the module docstring for meaning and ranges).

    Their defaults live once, in :class:`~services.flow_control.config.FlowControlConfig`
    (``FlowControlConfig.limits()`` builds this); the ones here only let tests name fewer.

    Attributes:
        bands: configured bands (others are created from ``default_band`` on first use).
        default_band: template of unconfigured bands (its ``priority`` is ignored).
        fairness_policy, ordering_policy: defaults of bands that name none.
        fairness_weights: flow id -> weight for ``least-attained-service-fairness-policy``.
        fairness_window_seconds: window of the served-token shares and Jain's index.
        max_dynamic_bands: bands created from ``default_band`` (priorities not configured) that may
            exist at once; configured bands never count. A request whose priority has no band
            once the cap is reached joins the nearest existing band (see :meth:`FlowController.band`).
        dynamic_band_idle_seconds: a dynamic band with nothing queued or in flight for this long
            (clock seconds) is removed, with its flows and metric label sets (GIE's
            ``PriorityBandGCTimeout``).
    """

    max_in_flight: int
    queue_ttl_seconds: float
    max_queue_size: int
    max_queue_bytes: int = 0
    bands: tuple[BandConfig, ...] = ()
    default_band: BandConfig = field(default_factory=lambda: BandConfig(0))
    fairness_policy: str = DEFAULT_FAIRNESS_POLICY
    ordering_policy: str = DEFAULT_ORDERING_POLICY
    fairness_weights: Mapping[str, float] = field(default_factory=dict)
    fairness_window_seconds: float = 10.0
    admission_credits: int = 4
    """Most credits lent to one client (an ``AdmitMany`` stream) at a time; 0 lends none. Only a
    client that asks is lent any."""
    admission_credit_priority: int = 0
    """The band whose requests credits are for."""
    max_dynamic_bands: int = 16
    dynamic_band_idle_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if not self.queue_ttl_seconds > 0:
            raise ValueError(f"queue_ttl_seconds must be > 0, got {self.queue_ttl_seconds}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if self.max_queue_bytes < 0:
            raise ValueError(f"max_queue_bytes must be >= 0, got {self.max_queue_bytes}")
        if self.admission_credits < 0:
            raise ValueError(f"admission_credits must be >= 0, got {self.admission_credits}")
        if self.max_dynamic_bands < 0:
            raise ValueError(f"max_dynamic_bands must be >= 0, got {self.max_dynamic_bands}")
        if not self.dynamic_band_idle_seconds > 0:
            raise ValueError(f"dynamic_band_idle_seconds must be > 0, got {self.dynamic_band_idle_seconds}")
        priorities = [b.priority for b in self.bands]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"duplicate band priority in {sorted(priorities)}")
        for band in (*self.bands, self.default_band):
            fairness_policy(band.fairness_policy or self.fairness_policy, self.fairness_weights)
            ordering_factory(band.ordering_policy or self.ordering_policy)
            if band.max_requests < 0 or band.max_bytes < 0 or band.ttl_seconds < 0:
                raise ValueError(f"band {band.label}: limits must be >= 0")


@dataclass(frozen=True, slots=True)
class BandStats:
    priority: int
    name: str
    queued: int
    queued_bytes: int
    in_flight: int
    flows: int


@dataclass(frozen=True, slots=True)
class FlowStats:
    flow_id: str
    priority: int
    queued: int
    in_flight: int
    oldest_wait_seconds: float
    served_tokens: int
    """Prompt + completion tokens of its requests that ended in the fairness window."""
    share: float
    """``served_tokens`` / all tokens served in the window."""


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """A snapshot: requests in flight and queued, the limit, lifetime totals, per band and flow.

    ``rejected_total`` counts every request that got a rejection (capacity, TTL, shed, quota,
    no endpoints, other); requests whose client left while queued are in neither total.
    """

    in_flight: int
    queued: int
    max_in_flight: int
    dispatched_total: int
    rejected_total: int
    queued_bytes: int = 0
    bands: tuple[BandStats, ...] = ()
    flows: tuple[FlowStats, ...] = ()
    saturation: SaturationState | None = None
    jain_index: float = 1.0
    fairness_window_seconds: float = 0.0
    credits_lent: int = 0
    """Admission credits lent and neither spent nor returned (each counts as a request in flight)."""
    dynamic_bands: int = 0
    """Bands created from the default band that exist now (at most ``max_dynamic_bands``, plus the
    bands of priority 0 and ``admission_credit_priority`` when not configured)."""


class ControllerObserver(Protocol):
    """Hooks for metrics and logging; called synchronously, must not block."""

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        """A request left the queue (or never entered it) with ``outcome``."""
        ...

    def on_state(self, queued: int, in_flight: int) -> None:
        """The number of queued or in-flight requests changed."""
        ...


class CreditObserver(Protocol):
    """Optional hook of an observer (looked up once; observers without it see no credit events)."""

    def on_credits(self, event: str, credits: int, reason: str = "") -> None:
        """``credits`` credits were ``lent``, ``spent``, ``returned`` (after a revoke),
        ``freed`` (their stream ended) or ``overdrawn`` (a request arrived on a credit its client
        did not hold; dispatched anyway); ``revoked`` counts revocations (``credits`` = 1) with
        the ``reason``: queued, saturated, max_in_flight."""
        ...


class BandObserver(Protocol):
    """Optional hooks of an observer for dynamic bands (looked up once)."""

    def on_band_mapped(self, priority: int, band: str) -> None:
        """A request of ``priority`` (no band, ``max_dynamic_bands`` reached) joined band ``band``."""
        ...

    def on_band_removed(self, band: str) -> None:
        """Idle dynamic band ``band`` was removed: forget its metric label sets."""
        ...


def _no_credit_events(event: str, credits: int, reason: str = "") -> None:
    pass


def _no_band_event(*args: object) -> None:
    pass


class NullObserver:
    """Observes nothing (the default)."""

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        pass

    def on_state(self, queued: int, in_flight: int) -> None:
        pass


class TicketState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REJECTED = "rejected"
    RELEASED = "released"


class Ticket:
    """One request's place in the controller; ``await ticket.wait()`` yields its :class:`AdmissionDecision`."""

    __slots__ = ("_decided", "band", "decision", "dispatched_at", "enqueued_at", "flow", "id", "item", "request", "state")

    def __init__(self, ticket_id: int, request: AdmissionRequest, enqueued_at: float) -> None:
        self.id = ticket_id
        self.request = request
        self.enqueued_at = enqueued_at
        self.state = TicketState.QUEUED
        self.decision: AdmissionDecision | None = None
        self.dispatched_at: float | None = None
        self._decided = asyncio.Event()
        self.band: Band | None = None
        self.flow: FlowQueue | None = None
        self.item: QueuedItem | None = None

    @property
    def decided(self) -> bool:
        return self.decision is not None

    async def wait(self) -> AdmissionDecision:
        """Wait until the request is dispatched or rejected (cancel-safe: just stop waiting)."""
        await self._decided.wait()
        assert self.decision is not None
        return self.decision

    def _decide(self, decision: AdmissionDecision, state: TicketState) -> None:
        self.decision = decision
        self.state = state
        self._decided.set()

    def __repr__(self) -> str:
        return f"Ticket(id={self.id}, state={self.state.value}, request_id={self.request.request_id!r})"


class FlowController:
    """Bands, flows, fairness, saturation, TTLs and shedding (see the module docstring).

    Args:
        limits: the knobs.
        clock: injected time (``ManualClock`` in tests).
        queue_factory: overrides the ordering policy of every flow queue (tests).
        observer: metrics/logging hooks.
        detector: the pool saturation detector; None = no pool signal (the in-flight limit alone).
    """

    def __init__(
        self,
        limits: ControllerLimits,
        clock: Clock | None = None,
        queue_factory: Callable[[], QueueOrdering] | None = None,
        observer: ControllerObserver | None = None,
        detector: SaturationDetector | None = None,
    ) -> None:
        self.limits = limits
        self._clock = clock or SystemClock()
        self._queue_factory = queue_factory
        self._observer = observer or NullObserver()
        self.detector = detector
        self._ids = itertools.count(1)
        self._bands: dict[int, Band] = {}
        self._order: list[Band] = []  # highest priority first
        for config in limits.bands:
            self._add_band(config)
        self._waiting: dict[int, Ticket] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline, ticket id); lazy removal
        self._queued = 0
        self._queued_bytes = 0
        self._in_flight = 0
        self._dispatched_total = 0
        self._rejected_total = 0
        self._window = ServedWindow(limits.fairness_window_seconds)
        self._tenant_in_flight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._wake = asyncio.Event()
        self.activity = asyncio.Event()
        """Set whenever a request is queued or dispatched: the pool poller's idle wait ends on it
        (cleared by that waiter; no polling of :attr:`busy` while idle, issue 10's idle cost)."""
        self._accounts: list[CreditAccount] = []
        self._credits_lent = 0
        self._on_credits: Callable[..., None] = getattr(self._observer, "on_credits", _no_credit_events)
        self._on_band_mapped: Callable[[int, str], None] = getattr(self._observer, "on_band_mapped", _no_band_event)
        self._on_band_removed: Callable[[str], None] = getattr(self._observer, "on_band_removed", _no_band_event)
        self._dynamic: dict[int, float] = {}
        """Priority of each dynamic band -> clock time it last had a request (enqueued or released)."""
        self._reserved = frozenset({0, limits.admission_credit_priority})
        """Priorities whose dynamic band never counts against the cap (0: requests that name none;
        the credits' band), so junk priorities cannot push the default traffic into another band."""

    # -- bands ------------------------------------------------------------------------------------

    def _add_band(self, config: BandConfig) -> Band:
        limits = self.limits
        factory = self._queue_factory or ordering_factory(config.ordering_policy or limits.ordering_policy)
        policy = fairness_policy(config.fairness_policy or limits.fairness_policy, limits.fairness_weights)
        band = Band(config, policy, factory)
        self._bands[config.priority] = band
        self._order = sorted(self._bands.values(), key=lambda b: -b.priority)
        return band

    def band(self, priority: int) -> Band:
        """The band of ``priority``: configured, or created from the default band on first use
        (GIE's dynamic bands) while fewer than ``max_dynamic_bands`` dynamic bands exist (the bands
        of priority 0 and ``admission_credit_priority`` are always created and never count).

        Past the cap (after removing dynamic bands idle for ``dynamic_band_idle_seconds``), the
        request joins the nearest existing band that does not raise it: the highest band with
        priority <= ``priority`` and the same sheddability (priority < 0); if there is none,
        the lowest band of that sheddability; failing that, the lowest band. GIE provisions every
        unknown priority (no cap); the cap bounds the state and metric labels a client can create,
        and rounding down means a made-up priority never outranks a real one.
        Callers that join the band must :meth:`_touch` it.
        """
        band = self._bands.get(priority)
        if band is not None:
            return band
        if priority not in self._reserved and self._counted_bands() >= self.limits.max_dynamic_bands:
            self.collect_idle_bands()
        if priority in self._reserved or self._counted_bands() < self.limits.max_dynamic_bands or not self._order:
            template = self.limits.default_band
            band = self._add_band(BandConfig(
                priority, str(priority), template.max_requests, template.max_bytes, template.ttl_seconds,
                template.fairness_policy, template.ordering_policy, template.max_saturation,
            ))
            self._dynamic[priority] = self._clock.now()
            return band
        band = self._nearest_band(priority)
        self._on_band_mapped(priority, band.label)
        return band

    def _counted_bands(self) -> int:
        return sum(1 for p in self._dynamic if p not in self._reserved)

    def _nearest_band(self, priority: int) -> Band:
        sheddable = priority < 0
        same = [b for b in self._order if b.config.sheddable == sheddable] or self._order  # highest first
        for band in same:
            if band.priority <= priority:
                return band
        return same[-1]

    def _touch(self, band: Band, now: float) -> None:
        if band.priority in self._dynamic:
            self._dynamic[band.priority] = now

    def collect_idle_bands(self) -> int:
        """Remove every dynamic band with nothing queued or in flight whose last request came
        ``dynamic_band_idle_seconds`` ago or more (its flows, fairness state and metric label sets go
        with it; a later request of that priority creates it afresh). Returns how many.

        Runs when a new priority finds the cap reached and at each :meth:`stats` (every scrape).
        Configured bands are never removed."""
        if not self._dynamic:
            return 0
        now = self._clock.now()
        idle = self.limits.dynamic_band_idle_seconds
        gone = [p for p, at in self._dynamic.items()
                if now - at >= idle and not self._bands[p].queued and not self._bands[p].in_flight]
        for priority in gone:
            del self._dynamic[priority]
            band = self._bands.pop(priority)
            self._on_band_removed(band.label)
        if gone:
            self._order = sorted(self._bands.values(), key=lambda b: -b.priority)
        return len(gone)

    def band_label(self, priority: int) -> str:
        """The ``band`` metric label of ``priority`` (a request's priority is its band's once it has joined one)."""
        band = self._bands.get(priority)
        return band.label if band is not None else str(priority)

    # -- the contract ---------------------------------------------------------------------------

    def enqueue(self, request: AdmissionRequest) -> Ticket:
        """Admit, queue or reject ``request``; the returned ticket is decided or queued.

        The caller must call :meth:`release` with the ticket when the request's stream closes.
        """
        now = self._clock.now()
        if not request.flow_id:
            request = _with_flow(request, DEFAULT_FLOW_ID)
        self.expire_due()
        band = self.band(request.priority)
        if band.priority != request.priority:  # mapped past max_dynamic_bands: served (and labelled) as its band
            request = replace(request, priority=band.priority)
        self._touch(band, now)
        ticket = Ticket(next(self._ids), request, now)
        flow = band.flow(request.flow_id)
        flow.quota = request.quota
        ticket.band, ticket.flow = band, flow
        if self.detector is not None and self.detector.has_endpoints(request.model, now) is False:
            self._reject(ticket, QueueOutcome.REJECTED_NO_ENDPOINTS, f"no endpoint serves model {request.model!r}", now)
        elif (bucket := self._take_rate_token(request, now)) is not None:
            self._reject(ticket, QueueOutcome.REJECTED_RATE_LIMITED,
                         f"flow {request.flow_id!r} is over its rate quota ({request.quota.rate_per_second:g} requests/s)",
                         now, bucket.retry_after())
        elif (not self._waiting_at_or_above(band.priority) and self._eligible(flow) and self._has_capacity(now)
              and self._band_has_room(band, now)):
            ticket.item = QueuedItem(ticket.id, request, now, now + self._ttl(band, request))
            self._dispatch(ticket, now)
        elif band.config.sheddable:
            self._reject(ticket, QueueOutcome.SHED, self._shed_reason(band, now), now)
        elif (full := self._capacity_exceeded(band, request)) is not None:
            self._reject(ticket, QueueOutcome.REJECTED_CAPACITY, full, now)
        else:
            item = QueuedItem(ticket.id, request, now, now + self._ttl(band, request))
            ticket.item = item
            band.push(flow, item)
            self._queued += 1
            self.activity.set()
            self._queued_bytes += request.byte_size
            self._waiting[ticket.id] = ticket
            heapq.heappush(self._deadlines, (item.deadline, ticket.id))
            self._wake.set()
            if self._in_flight < self.limits.max_in_flight:
                self._dispatch_ready()  # room, but something older waits (e.g. behind a concurrency quota)
        if ticket.state is not TicketState.DISPATCHED:
            band.forget_if_idle(flow)
        self._publish_state()
        return ticket

    def release(self, ticket: Ticket) -> bool:
        """Close ``ticket`` (its stream ended); idempotent.

        Returns:
            ``True`` when this call freed an in-flight slot, ``False`` otherwise (the ticket was
            queued, rejected or already released).
        """
        freed = False
        band, flow = ticket.band, ticket.flow
        if ticket.state is TicketState.DISPATCHED:
            self._in_flight -= 1
            assert self._in_flight >= 0, "in-flight count went negative"
            if self.detector is not None and ticket.dispatched_at is not None:
                self.detector.note_done(ticket.dispatched_at, self._clock.now())
            if band is not None and flow is not None:
                band.in_flight -= 1
                flow.in_flight -= 1
                self._tenant_gone(flow.flow_id)
            freed = True
        elif ticket.state is TicketState.QUEUED:
            self._unqueue(ticket)
            now = self._clock.now()
            waited = now - ticket.enqueued_at
            ticket._decide(
                AdmissionDecision(QueueOutcome.EVICTED_CANCELLED, "client closed the stream while queued", waited),
                TicketState.RELEASED,
            )
            self._observer.on_outcome(ticket.request, QueueOutcome.EVICTED_CANCELLED, waited)
        ticket.state = TicketState.RELEASED
        if band is not None and flow is not None:
            band.forget_if_idle(flow)
            self._touch(band, self._clock.now())
        if freed:
            self._dispatch_ready()
        self._publish_state()
        return freed

    def complete(self, ticket: Ticket, served: ServedTokens) -> None:
        """The dispatched request of ``ticket`` ended having used ``served`` tokens (fairness accounting)."""
        if ticket.decision is None or ticket.decision.outcome is not QueueOutcome.DISPATCHED or ticket.item is None:
            return
        now = self._clock.now()
        prompt = served.prompt_tokens or ticket.request.prompt_tokens
        self._window.record(now, ticket.request.flow_id, prompt + served.completion_tokens)
        if ticket.band is not None:
            ticket.band.fairness.on_served(
                ticket.band, ticket.request.flow_id, ticket.item, served.prompt_tokens, served.completion_tokens
            )

    def update_pool(self, snapshot: PoolSnapshot) -> None:
        """New engine metrics: update the detector, dispatch what the new room allows, lend or
        revoke admission credits."""
        if self.detector is None:
            return
        self.detector.update(snapshot)
        if self._queued:
            self._dispatch_ready()
            self._publish_state()
        else:
            self._settle_credits()

    def refresh(self) -> None:
        """Dispatch what the current state allows (after a failed poll: stale metrics fail open)."""
        if self._queued:
            self._dispatch_ready()
            self._publish_state()
        else:
            self._settle_credits()

    # -- admission credits (services/flow_control/credits.py) ----------------------------------

    def open_credits(self, want: int, notify: Callable[[], None]) -> CreditAccount:
        """A client asks to be lent up to ``want`` credits (capped by ``admission_credits``);
        ``notify()`` is called (synchronously) whenever the account has an update to send.
        The caller must :meth:`close_credits` when the client's stream ends."""
        account = CreditAccount(min(max(want, 0), self.limits.admission_credits),
                                self.limits.admission_credit_priority, notify)
        self._accounts.append(account)
        self._settle_credits()
        return account

    def want_credits(self, account: CreditAccount, want: int) -> None:
        """The client changed how many credits it wants (credits already lent stay lent)."""
        account.want = min(max(want, 0), self.limits.admission_credits)
        self._settle_credits()

    def enqueue_on_credit(self, request: AdmissionRequest, account: CreditAccount | None) -> Ticket:
        """A request its client already dispatched on a credit of ``account``: recorded as
        dispatched on arrival (in flight, band, flow and tenant counts, fairness, the detector),
        whatever the state, since it is already on its way to an engine. A request whose client
        held no credit (a client bug) is dispatched all the same and counted ``overdrawn``.
        The caller must :meth:`release` the ticket, as any other."""
        now = self._clock.now()
        if not request.flow_id:
            request = _with_flow(request, DEFAULT_FLOW_ID)
        band = self.band(request.priority)
        if band.priority != request.priority:
            request = replace(request, priority=band.priority)
        self._touch(band, now)
        ticket = Ticket(next(self._ids), request, now)
        flow = band.flow(request.flow_id)
        flow.quota = request.quota
        ticket.band, ticket.flow = band, flow
        ticket.item = QueuedItem(ticket.id, request, now, now + self._ttl(band, request))
        if not self._take_credit(account):
            self._on_credits("overdrawn", 1)
            logger.debug("request on a credit its client did not hold request_id=%s", request.request_id)
        self._dispatch(ticket, now)
        self._publish_state()
        return ticket

    def spend_credit(self, account: CreditAccount | None) -> None:
        """A credit of ``account`` was spent on an entry that could not be admitted (malformed):
        the credit is gone, nothing is dispatched."""
        if self._take_credit(account):
            self._publish_state()

    def _take_credit(self, account: CreditAccount | None) -> bool:
        if account is None or account.held <= 0:
            return False
        account.lent -= 1
        self._credits_lent -= 1
        self._on_credits("spent", 1)
        return True

    def credits_returned(self, account: CreditAccount, credits: int) -> None:
        """The client answered a revoke: it dropped ``credits`` unspent credits."""
        freed = account._returned(credits)
        self._credits_lent -= freed
        if freed:
            self._on_credits("returned", freed)
        if self._queued:
            self._dispatch_ready()
        self._publish_state()

    def close_credits(self, account: CreditAccount) -> None:
        """The client's stream ended: every credit it was lent is free again (idempotent)."""
        if account.closed:
            return
        account.closed = True
        self._accounts.remove(account)
        freed, account.lent, account.unsent = account.lent, 0, 0
        self._credits_lent -= freed
        if freed:
            self._on_credits("freed", freed)
        if self._queued:
            self._dispatch_ready()
        self._publish_state()

    @property
    def credits_lent(self) -> int:
        """Credits lent and neither spent nor returned, all clients."""
        return self._credits_lent

    def expire_due(self) -> int:
        """Evict every queued request whose effective TTL ran out; returns how many."""
        now = self._clock.now()
        deadlines = self._deadlines
        expired = 0
        while deadlines and deadlines[0][0] <= now:
            _, ticket_id = heapq.heappop(deadlines)
            ticket = self._waiting.get(ticket_id)
            if ticket is None:
                continue  # dispatched or cancelled meanwhile
            self._unqueue(ticket)
            self._evict_expired(ticket, now)
            expired += 1
        if expired:
            self._publish_state()
        return expired

    def next_expiry(self) -> float | None:
        """Clock time of the next TTL eviction, ``None`` when nothing waits."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][1] not in self._waiting:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    async def run_expiry(self) -> None:
        """Background loop: evict requests at their TTL deadline, on the injected clock. Cancel to stop."""
        while True:
            self.expire_due()
            deadline = self.next_expiry()
            if deadline is None:
                self._wake.clear()
                await self._wake.wait()
            else:
                self._wake.clear()
                sleep = asyncio.ensure_future(self._clock.sleep(max(deadline - self._clock.now(), 0.001)))
                woken = asyncio.ensure_future(self._wake.wait())
                try:  # an arrival with an earlier deadline (a short request TTL) wakes the loop
                    await asyncio.wait({sleep, woken}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleep.cancel()
                    woken.cancel()

    @property
    def busy(self) -> bool:
        """Whether any request is queued or in flight (O(1))."""
        return self._in_flight > 0 or self._queued > 0

    def saturation(self) -> SaturationState | None:
        return self.detector.state(self._clock.now()) if self.detector is not None else None

    def stats(self) -> ControllerStats:
        """A snapshot (removes idle dynamic bands first: :meth:`collect_idle_bands`)."""
        self.collect_idle_bands()
        now = self._clock.now()
        totals = self._window.totals(now)
        whole = sum(totals.values())
        bands = tuple(
            BandStats(b.priority, b.label, b.queued, b.queued_bytes, b.in_flight, len(b.flows)) for b in self._order
        )
        flows = []
        for band in self._order:
            for flow in band.flows.values():
                head = flow.queue.peek()
                served = totals.get(flow.flow_id, 0)
                flows.append(FlowStats(
                    flow.flow_id, band.priority, len(flow.queue), flow.in_flight,
                    now - head.enqueued_at if head is not None else 0.0, served, served / whole if whole else 0.0,
                ))
        return ControllerStats(
            in_flight=self._in_flight,
            queued=self._queued,
            max_in_flight=self.limits.max_in_flight,
            dispatched_total=self._dispatched_total,
            rejected_total=self._rejected_total,
            queued_bytes=self._queued_bytes,
            bands=bands,
            flows=tuple(flows),
            saturation=self.saturation(),
            jain_index=self._window.jain_index(now),
            fairness_window_seconds=self._window.window_seconds,
            credits_lent=self._credits_lent,
            dynamic_bands=len(self._dynamic),
        )

    # -- decisions ------------------------------------------------------------------------------

    def _has_capacity(self, now: float) -> bool:
        """Whether one more request may be dispatched now: under ``max_in_flight`` and the pool has
        room, every credit lent counting as a request in flight."""
        lent = self._credits_lent
        if self._in_flight + lent >= self.limits.max_in_flight:
            return False
        if self.detector is None:
            return True
        state = self.detector.state(now)
        return not state.saturated and state.headroom > lent  # headroom is inf when stale (fail open)

    def _credit_room(self, now: float) -> tuple[int, str]:
        """The free room credits are judged against, and what limits it: the requests that could
        still be dispatched now, lent credits not counted (``max_in_flight`` and the detector's
        headroom; 0 while anything waits, the pool is saturated or the lending band is over its
        ``max_saturation``)."""
        if self._queued:
            return 0, "queued"
        limits = self.limits
        room, reason = limits.max_in_flight - self._in_flight, "max_in_flight"
        if self.detector is not None:
            state = self.detector.state(now)
            if not state.stale:  # stale metrics fail open: max_in_flight alone, as for any dispatch
                band = self._bands.get(limits.admission_credit_priority)
                limit = (band.config if band is not None else limits.default_band).max_saturation
                if state.saturated or (limit > 0 and state.saturation >= limit):
                    return 0, "saturated"
                if state.headroom < room:
                    room, reason = int(state.headroom), "saturated"
        return max(room, 0), reason

    def _settle_credits(self) -> None:
        """Revoke every account as soon as the credits lent could stand in an arrival's way (they
        fill the free room: something queued, the pool saturated, or the room shrank); else lend
        up to half the free room in all, topping each account up once it holds half its ``want``
        or less (one grant per half: fewer messages than one per request).

        Half: an arrival that would be dispatched without credits finds room with them too, so no
        request is queued or shed because of idle credits (except for the one round trip between a
        sudden drop of the room, e.g. a new pool sample, and the revoke's answer)."""
        if not self._accounts:
            return
        room, reason = self._credit_room(self._clock.now())
        if self._credits_lent and self._credits_lent >= room:
            dropped = 0
            for account in self._accounts:
                revoking = account.revoking
                dropped += account._revoke()
                if account.revoking and not revoking:
                    self._on_credits("revoked", 1, reason)
            self._credits_lent -= dropped
            if dropped and self._queued:  # grants never sent are room again at once
                self._dispatch_ready()
                self._observer.on_state(self._queued, self._in_flight)
            return
        free = room // 2 - self._credits_lent
        for account in self._accounts:
            if free <= 0:
                break
            if account.revoking or account.lent > account.want // 2:
                continue
            grant = min(account.want - account.lent, free)
            if grant > 0:
                account._grant(grant)
                self._credits_lent += grant
                free -= grant
                self._on_credits("lent", grant)

    def _band_has_room(self, band: Band, now: float) -> bool:
        """A band with ``max_saturation`` dispatches only while the pool's saturation is below it (fails open when stale)."""
        limit = band.config.max_saturation
        if limit <= 0 or self.detector is None:
            return True
        state = self.detector.state(now)
        return state.stale or state.saturation < limit

    def _waiting_at_or_above(self, priority: int) -> bool:
        for band in self._order:
            if band.priority < priority:
                return False
            if band.queued:
                return True
        return False

    def _ttl(self, band: Band, request: AdmissionRequest) -> float:
        ttl = self.limits.queue_ttl_seconds
        if band.config.ttl_seconds > 0:
            ttl = min(ttl, band.config.ttl_seconds)
        if request.ttl_seconds > 0:
            ttl = min(ttl, request.ttl_seconds)
        return ttl

    def _capacity_exceeded(self, band: Band, request: AdmissionRequest) -> str | None:
        limits, config = self.limits, band.config
        size = request.byte_size
        if self._queued >= limits.max_queue_size:
            return (f"queue full: {self._queued} requests waiting (max_queue_size={limits.max_queue_size}),"
                    f" {self._in_flight} in flight (max_in_flight={limits.max_in_flight})")
        if limits.max_queue_bytes and self._queued_bytes + size > limits.max_queue_bytes:
            return f"queue full: {self._queued_bytes} + {size} bytes waiting > max_queue_bytes={limits.max_queue_bytes}"
        if config.max_requests and band.queued >= config.max_requests:
            return f"band {band.label} full: {band.queued} requests waiting (max_requests={config.max_requests})"
        if config.max_bytes and band.queued_bytes + size > config.max_bytes:
            return f"band {band.label} full: {band.queued_bytes} + {size} bytes waiting > max_bytes={config.max_bytes}"
        return None

    def _shed_reason(self, band: Band, now: float) -> str:
        if self._in_flight >= self.limits.max_in_flight:
            why = f"{self._in_flight} in flight (max_in_flight={self.limits.max_in_flight})"
        elif self.detector is not None and (state := self.detector.state(now)).saturated:
            why = f"pool saturated (saturation={state.saturation:.2f})"
        else:
            why = "requests of higher or equal priority are waiting"
        return f"shed: band {band.label} is sheddable and {why}"

    def _select(self) -> tuple[Band, FlowQueue] | None:
        """Strict band order, then the band's fairness policy over flows under their concurrency quota."""
        now = self._clock.now()
        for band in self._order:
            if band.queued and self._band_has_room(band, now):
                flow = band.fairness.pick(band, self._eligible)
                if flow is not None:
                    return band, flow
        return None

    def _eligible(self, flow: FlowQueue) -> bool:
        """False while the flow's tenant (fairness id, all bands) is at its concurrency quota."""
        limit = flow.quota.max_concurrency
        return limit <= 0 or self._tenant_in_flight.get(flow.flow_id, 0) < limit

    def _take_rate_token(self, request: AdmissionRequest, now: float) -> TokenBucket | None:
        """None when the request may pass the tenant's rate quota, else the (empty) bucket."""
        quota = request.quota
        if quota.rate_per_second <= 0:
            return None
        bucket = self._buckets.get(request.flow_id)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:  # forget tenants whose bucket refilled
                for flow_id in [f for f, b in self._buckets.items() if b.full(now)]:
                    del self._buckets[flow_id]
            bucket = self._buckets[request.flow_id] = TokenBucket(quota.rate_per_second, 0.0, now)
            bucket.tokens = float(quota.burst or max(1.0, quota.rate_per_second))
        return None if bucket.take(now, quota) else bucket

    def _tenant_gone(self, flow_id: str) -> None:
        left = self._tenant_in_flight.get(flow_id, 0) - 1
        if left > 0:
            self._tenant_in_flight[flow_id] = left
        else:
            self._tenant_in_flight.pop(flow_id, None)

    # -- internals ------------------------------------------------------------------------------

    def _unqueue(self, ticket: Ticket) -> None:
        self._waiting.pop(ticket.id, None)
        self._compact_deadlines()
        if ticket.band is not None and ticket.flow is not None:
            ticket.band.remove(ticket.flow, ticket.id)
        self._queued -= 1
        self._queued_bytes -= ticket.request.byte_size

    def _compact_deadlines(self) -> None:
        """Drop the heap entries of requests no longer waiting once they outnumber the live ones (amortized O(1))."""
        if len(self._deadlines) > 2 * len(self._waiting) + 1024:
            self._deadlines = [e for e in self._deadlines if e[1] in self._waiting]
            heapq.heapify(self._deadlines)

    def _evict_expired(self, ticket: Ticket, now: float) -> None:
        """TTL eviction, or ``REJECTED_NO_ENDPOINTS`` when a fresh snapshot shows no endpoint for the model."""
        if self.detector is not None and self.detector.has_endpoints(ticket.request.model, now) is False:
            self._reject(ticket, QueueOutcome.REJECTED_NO_ENDPOINTS,
                         f"no endpoint serves model {ticket.request.model!r} (waited {now - ticket.enqueued_at:.3f} s)", now)
        else:
            ttl = ticket.item.deadline - ticket.enqueued_at if ticket.item is not None else self.limits.queue_ttl_seconds
            reason = (f"waited {now - ticket.enqueued_at:.3f} s in the queue (effective TTL {ttl:g} s;"
                      f" queue_ttl_seconds={self.limits.queue_ttl_seconds:g})")
            self._reject(ticket, QueueOutcome.EVICTED_TTL, reason, now)
        if ticket.band is not None and ticket.flow is not None:
            ticket.band.forget_if_idle(ticket.flow)

    def _dispatch_ready(self) -> None:
        self.expire_due()
        now = self._clock.now()
        while self._queued and self._has_capacity(now):
            chosen = self._select()
            if chosen is None:
                break
            band, flow = chosen
            item = band.pop(flow)
            ticket = self._waiting.pop(item.ticket_id)
            self._compact_deadlines()
            self._queued -= 1
            self._queued_bytes -= item.request.byte_size
            if item.deadline <= now or (  # TTL re-checked at dispatch; an emptied pool answers at once
                self.detector is not None and self.detector.has_endpoints(item.request.model, now) is False
            ):
                self._evict_expired(ticket, now)
                continue
            self._dispatch(ticket, now)

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        self._in_flight += 1
        self.activity.set()
        self._dispatched_total += 1
        band, flow = ticket.band, ticket.flow
        if band is not None and flow is not None:
            band.in_flight += 1
            flow.in_flight += 1
            self._tenant_in_flight[flow.flow_id] = self._tenant_in_flight.get(flow.flow_id, 0) + 1
            if ticket.item is not None:
                band.fairness.on_dispatch(band, flow, ticket.item)
        if self.detector is not None:
            self.detector.note_dispatch(now)
        ticket.dispatched_at = now
        waited = now - ticket.enqueued_at
        ticket._decide(AdmissionDecision(QueueOutcome.DISPATCHED, "", waited), TicketState.DISPATCHED)
        self._observer.on_outcome(ticket.request, QueueOutcome.DISPATCHED, waited)

    def _reject(self, ticket: Ticket, outcome: QueueOutcome, reason: str, now: float, retry_after: float = 0.0) -> None:
        self._rejected_total += 1
        waited = now - ticket.enqueued_at
        ticket._decide(AdmissionDecision(outcome, reason, waited, retry_after), TicketState.REJECTED)
        self._observer.on_outcome(ticket.request, outcome, waited)
        logger.debug("rejected request_id=%s outcome=%s reason=%s", ticket.request.request_id, outcome.value, reason)

    def _publish_state(self) -> None:
        self._observer.on_state(self._queued, self._in_flight)
        if self._accounts:
            self._settle_credits()


def _with_flow(request: AdmissionRequest, flow_id: str) -> AdmissionRequest:
    return replace(request, flow_id=flow_id)
