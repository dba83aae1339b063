"""The router's degraded modes when flow_control or epp cannot be reached (pure: no I/O, no gRPC).

See ``docs/degraded-modes.md`` for every dependency's mode. The two the router itself carries:

* **flow_control unreachable** (the admission call fails: refused connection, reset, the stream
  ended without a decision): the request is admitted *locally* while the router's own
  degraded-admitted in-flight count is below ``degraded_max_in_flight`` (fail-open with a cap,
  like Envoy's ``failure_mode_allow`` for ext_authz/ext_proc, bounded so a dead flow_control does
  not turn into unbounded load on the engines); past the cap, 503 with ``retry-after``. With
  ``flow_control_failure_mode = "closed"`` every such request is the 503. A *hung* flow_control
  (no answer) is not this mode: that request waits for the admission timeout (504), since queueing
  is flow_control's job and one call's silence looks like a long queue; :class:`DependencyBreaker`
  then tells the two apart by whether flow_control answers anything else (other decisions, a health
  check), and only a silent one sends the next requests here.
* **epp unreachable** (``Pick`` fails with ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``UNKNOWN`` or
  ``INTERNAL``): :class:`LocalPicker` orders the model's live endpoints from the router's own etcd
  membership view by the router's own in-flight requests per endpoint (least first; ties by
  rotation), the least-request policy Envoy uses without an external picker. epp's ``NOT_FOUND``
  (unknown model) and an empty answer (no candidate) are answers, not failures: they are kept.

Both are counted in ``kvmesh_router_degraded_total{dependency, action}`` and logged (the first
time a dependency is found unreachable, and then at most once per ``log_interval_seconds``).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable

from kvmesh import errors
from kvmesh.logging import RateLimitedLog
from kvmesh.types import Endpoint, EndpointRole

logger = logging.getLogger(__name__)


class FlowControlUnreachable(errors.NotReady):
    """flow_control could not be reached or failed the admission call without a decision (503 when
    not admitted locally)."""


class FlowControlHung(FlowControlUnreachable):
    """An admission call got no decision for ``admission_liveness_check_seconds`` and flow_control showed no
    sign of life meanwhile (no call answered, its health check unanswered): the call is given up and the
    request takes the unreachable path (local admission)."""


class AdmissionTimedOut(errors.QueueTTLExpired):
    """flow_control gave no decision within ``admission_timeout_seconds`` (hung, or far behind): 504,
    logged (rate-limited) and counted as ``kvmesh_router_degraded_total{dependency="flow_control",
    action="timed_out"}``."""


class PickerUnreachable(errors.NoEndpointsAvailable):
    """epp could not be reached or failed the Pick call (503 when no local pick is possible)."""


class PickerTimedOut(PickerUnreachable):
    """The Pick call passed its deadline (the router's ``pick_timeout``, or the ``PickMany`` entry's own):
    handled as :class:`PickerUnreachable`, but epp had the pick and may have counted it (its deadline
    starts later, and a cancel does nothing once the answer is on the wire), so the request flow tells
    epp how the request ended, as for a pick epp answered."""


class LocalAdmission:
    """Counts requests admitted without flow_control; admits while under ``max_in_flight``.

    Args:
        max_in_flight: most requests admitted this way at once (0 with ``fail_open`` False: none).
        fail_open: False turns every unreachable-flow_control request into a 503.
    """

    def __init__(self, max_in_flight: int, fail_open: bool = True) -> None:
        self.max_in_flight = max_in_flight
        self.fail_open = fail_open
        self.in_flight = 0

    def try_admit(self) -> bool:
        """Take a local slot (True) or refuse (False: the cap is reached, or fail-closed)."""
        if not self.fail_open or self.in_flight >= self.max_in_flight:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        """Give a slot taken by :meth:`try_admit` back."""
        self.in_flight = max(0, self.in_flight - 1)


class LocalPicker:
    """Least-request ordering of live endpoints by the router's own in-flight count per endpoint.

    ``note_start(id)`` / ``note_end(id)`` are called for every request the router forwards (not
    only degraded ones), so the counts are current when epp disappears.
    """

    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()
        self._rotation = itertools.count()

    def note_start(self, endpoint_id: str) -> None:
        self._in_flight[endpoint_id] += 1

    def note_end(self, endpoint_id: str) -> None:
        self._in_flight[endpoint_id] -= 1
        if self._in_flight[endpoint_id] <= 0:
            del self._in_flight[endpoint_id]

    def in_flight(self, endpoint_id: str) -> int:
        return self._in_flight.get(endpoint_id, 0)

    def order(self, endpoints: Iterable[Endpoint], exclude: Iterable[str] = ()) -> list[Endpoint]:
        """``endpoints`` minus ``exclude``, least in-flight first; equal loads rotate request by request.

        Prefill-only endpoints (``role == "prefill"``) are left out: they cannot answer alone.
        """
        skip = set(exclude)
        live = sorted(
            (ep for ep in endpoints if ep.id not in skip and ep.role is not EndpointRole.PREFILL),
            key=lambda ep: ep.id,
        )
        if not live:
            return []
        shift = next(self._rotation) % len(live)
        rotated = live[shift:] + live[:shift]
        return sorted(rotated, key=lambda ep: self._in_flight.get(ep.id, 0))  # stable: rotation breaks ties


class DegradedLog:
    """Rate-limited warning lines for degraded decisions (first one at once, then one per interval per
    ``(dependency, cause)``): :class:`kvmesh.logging.RateLimitedLog` with the ``degraded mode
    dependency=<dependency>`` prefix."""

    def __init__(self, clock: Callable[[], float], log_interval_seconds: float = 10.0) -> None:
        self._log = RateLimitedLog(logger, log_interval_seconds, clock, suffix=" (+{more} more since the last line)")

    def warn(self, dependency: str, message: str, *args: object, cause: str = "") -> None:
        """One warning line, unless one for the same ``(dependency, cause)`` went out within the interval
        (then counted, and the count shown on the next line)."""
        self._log.warning(f"{dependency}/{cause}", "degraded mode dependency=%s " + message, dependency, *args)


class DependencyBreaker:
    """A circuit breaker for one per-request dependency (``"epp"`` Pick, ``"flow_control"`` admission).

    Closed: every request calls the dependency. A call that **timed out while the dependency was
    unresponsive** (a hung dependency: the connection is open but nothing comes back) opens it: for
    ``cool_down_seconds`` :meth:`admit` answers ``"skip"`` (the request takes the path it takes when
    the dependency is unreachable: the local pick, local admission); once the cool-down has passed
    (half-open) **one probe at a time** is let through (``"probe"``), the other requests still skip.
    The probe's answer (any answer, a rejection too) closes the breaker at once; its timeout renews
    the cool-down; any other failure (refused, reset: fast) or abandonment just ends the probe (the
    next request probes). An answer to a call made before the opening (the dependency woke up)
    closes it too; a health check that says ``SERVING`` ends the cool-down early (:meth:`seen_serving`).
    ``cool_down_seconds`` 0: never opens.

    A timeout alone is not a hang: a **busy** dependency answers other calls (flow_control queues a
    request for as long as its band's TTL allows, which may exceed the router's wait; epp's picks slow
    down under load). The request flow reports a timeout with :meth:`timed_out` only when the
    dependency showed no sign of life during the wait (:meth:`heard_since`: no call answered since
    the timed-out call was sent, nor a liveness check, :meth:`heard`), else with :meth:`busy`, which
    never opens it. Pure: no I/O; the request flow reports outcomes (:meth:`answered`,
    :meth:`timed_out`, :meth:`busy`, :meth:`failed`); ``on_change(open)`` is called on each
    transition (metrics, log).
    """

    def __init__(self, name: str, cool_down_seconds: float, clock: Callable[[], float],
                 on_change: Callable[[bool], None] = lambda is_open: None) -> None:
        self.name = name
        self.cool_down_seconds = cool_down_seconds
        self._clock = clock
        self._on_change = on_change
        self._open_until: float | None = None
        self._probing = False
        self._heard_at = float("-inf")

    def is_open(self) -> bool:
        """Whether requests skip the dependency (open or half-open: not every request calls it)."""
        return self._open_until is not None

    def admit(self) -> str:
        """``"call"`` (closed), ``"probe"`` (half-open and no probe in flight: this request is the
        probe; report its outcome with ``probe=True``) or ``"skip"`` (do not call)."""
        if self._open_until is None:
            return "call"
        if self._probing or self._clock() < self._open_until:
            return "skip"
        self._probing = True
        return "probe"

    def answered(self, probe: bool) -> None:
        """The dependency answered (any answer, a rejection too): closes the breaker."""
        self.heard()
        if probe:
            self._probing = False
        if self._open_until is not None:
            self._set(None)

    def heard(self) -> None:
        """The dependency showed a sign of life now (a call answered, a liveness check answered)."""
        self._heard_at = self._clock()

    def heard_since(self, since: float) -> bool:
        """Whether the dependency showed a sign of life at or after ``since`` (this breaker's clock)."""
        return self._heard_at >= since

    def busy(self, probe: bool) -> None:
        """The call passed its deadline, but the dependency is answering (:meth:`heard_since`): it is
        busy (a long queue, slow picks), not hung. Never opens; a probe's ends, closing the breaker
        (the dependency is responsive)."""
        if probe:
            self._probing = False
            if self._open_until is not None:
                self._set(None)

    def timed_out(self, probe: bool) -> None:
        """The call passed its deadline and the dependency showed no sign of life meanwhile (hung):
        opens the breaker, or renews its cool-down."""
        if probe:
            self._probing = False
        if self.cool_down_seconds > 0:
            self._set(self._clock() + self.cool_down_seconds)

    def failed(self, probe: bool) -> None:
        """The call failed fast (unreachable) or was abandoned: a probe ends; the state is kept."""
        if probe:
            self._probing = False

    abandoned = failed

    def seen_serving(self) -> None:
        """A health check of the dependency said ``SERVING``: the cool-down ends now (the next request
        is the probe; its answer, not the check, closes the breaker)."""
        if self._open_until is not None:
            self._open_until = min(self._open_until, self._clock())

    def _set(self, until: float | None) -> None:
        was_open = self._open_until is not None
        self._open_until = until
        if was_open != (until is not None):
            self._on_change(until is not None)
