"""Readiness behind ``GET /health``: the router's dependencies, checked cheaply (no I/O of its own).

Ready means all of:

| check | how | failing value |
| --- | --- | --- |
| ``flow_control`` | grpc.health.v1 ``Check("")`` within ``health_check_timeout_seconds`` | its status or the failed call's code: ``NOT_SERVING``, ``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` |
| ``epp`` | same | same |
| ``endpoints`` | at least one live endpoint (etcd) serves a model, not counting those whose last connect was refused (a killed engine whose lease lives on: ``unreachable_endpoints``, listed in the body; degraded while others remain) | ``0`` |
| ``etcd`` (with etcd configured) | :func:`kvmesh.membership.etcd_health`: this process's etcd clients, no I/O | ``UNAVAILABLE``: always degraded, never unready (the last known membership serves) |
| ``shutting_down`` | :meth:`ReadinessProbe.stop` was called (the router's ``on_stop``) | always unready from then on |

One rule for every dependency: a failure the router *serves around* (a documented degraded mode
that is on in this configuration, ``docs/degraded-modes.md``) leaves the router ready: the answer is
200 with ``"status": "degraded"`` and ``"degraded": [names]`` (a readiness probe that failed here
would turn one failing dependency into an outage of every router, while requests are still served).
Only a state in which requests are *not* served is 503: a dependency failure without a degraded mode
in this configuration, no live endpoint for any model, or the router shutting down.
:func:`served_around` derives, from the router's config, which failures are served around:

| dependency | unreachable (``UNAVAILABLE``, ``NOT_CONNECTED``) | hung (``DEADLINE_EXCEEDED``) |
| --- | --- | --- |
| ``etcd`` | served (last known membership) | served |
| ``epp`` (``epp_failure_mode: open``) | served (local least-request pick) | served (local pick after ``pick_timeout_seconds``; then, the breaker open, at once) |
| ``epp`` (``closed``) | 503 | 503 |
| ``flow_control`` (``open``, ``degraded_max_in_flight`` > 0) | served (local admission, up to the cap) | served with the dependency breaker on (``dependency_breaker_cool_down_seconds`` > 0, default): the requests waiting when it hung get 504 at ``admission_timeout_seconds``, then the breaker opens and requests are admitted locally (one probe at a time still asks flow_control); with the breaker off **not** served (each request waits and gets 504) |
| ``flow_control`` (``closed``, or a cap of 0) | 503 | 503 |

A served-around dependency whose breaker is open (:attr:`Readiness.breakers_open`: a call timed
out, no probe answered since) and whose check does not say ``SERVING`` is listed as degraded too (a
breaker still open while the check already says ``SERVING`` closes on the next request's probe).
``NOT_SERVING`` (a dependency starting or draining) and ``UNIMPLEMENTED`` are never served around.
kv_indexer is not checked here: epp serves around it (prefix scores unknown).

The endpoint count is read on every call (no I/O: a refused connect counts at once); the refused
endpoints' own ``GET /health`` (``refresh``, the request flow's :meth:`recheck_refused`) runs beside the
gRPC checks, so an engine back on its address counts again at the next evaluation.

Both gRPC checks run concurrently; one result is reused for ``health_cache_seconds`` (1 s by
default), and concurrent probes share one in-flight check, so a load balancer probing often costs
at most one pair of health RPCs per second.

At start-up (:func:`watch_startup`, run beside the router's start, never delaying it) flow_control and
epp are checked the same way: one that has not answered ``SERVING`` within
:data:`STARTUP_GRACE_SECONDS` gets one WARNING naming its address, the config field, flag and env var
that set it, and what requests get meanwhile (its degraded mode); it is then checked every
:data:`STARTUP_RETRY_SECONDS` until it answers (one INFO line then). Every check, at start-up and
behind ``/health``, sets ``kvmesh_router_dependency_up{dependency}`` (1 ``SERVING``, else 0). Before,
a router started with the default addresses and nothing listening there said nothing at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)

SERVING = "SERVING"
UNREACHABLE = frozenset({"UNAVAILABLE", "NOT_CONNECTED"})
HUNG = "DEADLINE_EXCEEDED"
"""Check results that mean "cannot be reached" (as opposed to hung or not serving)."""

SHUTTING_DOWN = "shutting_down"
"""The pseudo-dependency that fails readiness while the router stops (:meth:`ReadinessProbe.stop`)."""

HealthCheck = Callable[[float], Awaitable[str]]
"""``check(timeout_seconds) -> status name`` (``"SERVING"`` when healthy); must not raise."""


def served_around(*, flow_control_failure_mode: str, degraded_max_in_flight: int, epp_failure_mode: str,
                  etcd: bool, breaker: bool = False) -> tuple[frozenset[str], frozenset[str]]:
    """The router config's degraded modes as ``(degradable, hang_tolerant)`` for :class:`ReadinessProbe`:
    dependencies whose *unreachable* failure is served around, and those whose *hung* failure is too
    (the table in this module's docstring; ``services.router.config.RouterConfig`` fields). ``breaker``:
    the dependency circuit breaker is on (``dependency_breaker_cool_down_seconds`` > 0), so a hung
    flow_control costs one ``admission_timeout_seconds`` wait and is then served around (fail-open)."""
    degradable = {"etcd"} if etcd else set()
    hang_tolerant = {"etcd"} if etcd else set()
    if epp_failure_mode == "open":
        degradable.add("epp")
        hang_tolerant.add("epp")  # each pick falls back to the local pick after pick_timeout_seconds
    if flow_control_failure_mode == "open" and degraded_max_in_flight > 0:
        degradable.add("flow_control")  # hung: 504 at admission_timeout_seconds, then (breaker) served locally
        if breaker:
            hang_tolerant.add("flow_control")
    return frozenset(degradable), frozenset(hang_tolerant)


@dataclass(frozen=True, slots=True)
class Readiness:
    """One evaluation: dependency name -> status name, and the live endpoint count."""

    dependencies: dict[str, str]
    endpoints: int
    degradable: frozenset[str] = frozenset()
    hang_tolerant: frozenset[str] = frozenset()
    stopping: bool = False
    breakers_open: frozenset[str] = frozenset()
    """Dependencies whose circuit breaker is open (a call timed out): served around, so degraded."""
    unreachable_endpoints: tuple[str, ...] = ()
    """Registered endpoints left out of ``endpoints``: their last connect was refused (a dead engine)."""

    @property
    def degraded(self) -> list[str]:
        """Failing dependencies the router serves without (their degraded mode is on): unreachable, or
        hung for those in ``hang_tolerant``, or with their breaker open."""
        names = [name for name, status in self.dependencies.items()
                 if name in self.degradable and (status in UNREACHABLE or (status == HUNG and name in self.hang_tolerant)
                                                 or (status != SERVING and name in self.breakers_open))]
        if self.unreachable_endpoints and self.endpoints > 0:  # some engines refuse, the others serve
            names.append("endpoints")
        return names

    @property
    def failing(self) -> list[str]:
        """Names of what is not ready (dependencies first, then ``endpoints``)."""
        degraded = self.degraded
        bad = [name for name, status in self.dependencies.items() if status != SERVING and name not in degraded]
        if self.endpoints <= 0:
            bad.append("endpoints")
        if self.stopping:
            bad.append(SHUTTING_DOWN)
        return bad

    @property
    def ready(self) -> bool:
        return not self.failing

    def body(self) -> dict[str, object]:
        """The /health JSON: ``{"status": "ok"|"degraded"|"unavailable", "endpoints", "dependencies"}``,
        ``"degraded": [names]`` when some failure is served around, and, when not ready, an OpenAI
        ``error`` naming what fails (type ``service_unavailable``, code 503)."""
        out: dict[str, object] = {
            "status": ("degraded" if self.degraded else "ok") if self.ready else "unavailable",
            "endpoints": self.endpoints,
            "dependencies": dict(self.dependencies),
        }
        if self.degraded:
            out["degraded"] = self.degraded
        if self.unreachable_endpoints:
            out["unreachable_endpoints"] = list(self.unreachable_endpoints)
        if not self.ready:
            reasons = [
                ("no live endpoint serves any model" + (
                    f" (registered but refusing connections: {', '.join(self.unreachable_endpoints)})"
                    if self.unreachable_endpoints else ""))
                if name == "endpoints"
                else "the router is shutting down" if name == SHUTTING_DOWN
                else f"{name} is {self.dependencies[name]}"
                for name in self.failing
            ]
            out["error"] = {"message": "not ready: " + "; ".join(reasons), "type": "service_unavailable", "param": None, "code": 503}
        return out


class ReadinessProbe:
    """Evaluates :class:`Readiness` at most once per ``cache_seconds``."""

    def __init__(
        self,
        checks: dict[str, HealthCheck],
        endpoints: Callable[[], int],
        timeout_seconds: float,
        cache_seconds: float,
        clock: Callable[[], float],
        degradable: frozenset[str] = frozenset(),
        hang_tolerant: frozenset[str] = frozenset(),
        breakers_open: Callable[[], Iterable[str]] = lambda: (),
        on_checked: Callable[[str, str], None] = lambda name, status: None,
        unreachable_endpoints: Callable[[], Iterable[str]] = lambda: (),
        refresh: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """``endpoints``: the live endpoint count, ``unreachable_endpoints``: the registered ones it leaves
        out (refused connects), both read on every call; ``refresh(timeout)`` runs beside the checks of
        each evaluation (re-checks those endpoints)."""
        self._unreachable = unreachable_endpoints
        self._refresh = refresh
        self._on_checked = on_checked
        self._breakers_open = breakers_open
        self._degradable = degradable
        self._hang_tolerant = hang_tolerant
        self._checks = checks
        self._endpoints = endpoints
        self._timeout = timeout_seconds
        self._cache = cache_seconds
        self._clock = clock
        self._last: Readiness | None = None
        self._last_at = 0.0
        self._pending: asyncio.Future[Readiness] | None = None
        self._stopping = False

    def stop(self) -> None:
        """The router is shutting down: every later evaluation is not ready (a load balancer stops
        sending it requests while the running ones finish)."""
        self._stopping = True

    async def readiness(self) -> Readiness:
        if self._stopping:
            last = self._last
            return Readiness(dict(last.dependencies) if last else {}, last.endpoints if last else self._endpoints(),
                             self._degradable, self._hang_tolerant, stopping=True)
        if self._last is not None and self._clock() - self._last_at < self._cache:
            last = self._last
            endpoints, unreachable = self._endpoints(), tuple(self._unreachable())
            if (endpoints, unreachable) != (last.endpoints, last.unreachable_endpoints):  # cheap, read now
                return replace(last, endpoints=endpoints, unreachable_endpoints=unreachable)
            return last
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._evaluate())
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None

    async def _evaluate(self) -> Readiness:
        names = list(self._checks)
        checks = asyncio.gather(*(self._checks[n](self._timeout) for n in names))
        refresh = self._refresh(self._timeout) if self._refresh is not None else asyncio.sleep(0)
        statuses, _ = await asyncio.gather(checks, refresh)
        for name, status in zip(names, statuses, strict=True):
            self._on_checked(name, status)
        result = Readiness(dict(zip(names, statuses, strict=True)), self._endpoints(), self._degradable,
                           self._hang_tolerant, breakers_open=frozenset(self._breakers_open()),
                           unreachable_endpoints=tuple(self._unreachable()))
        self._last, self._last_at = result, self._clock()
        return result


STARTUP_GRACE_SECONDS = 2.0
"""How long after start-up a dependency may take to answer ``SERVING`` before the WARNING (it may be starting
beside the router, as ``kvmesh up`` and compose start them)."""
STARTUP_RETRY_SECONDS = 2.0
"""Checks of a dependency that has not answered yet: every 0.25 s within the grace, then this often."""


@dataclass(frozen=True, slots=True)
class StartupDependency:
    """A dependency :func:`watch_startup` checks: its ``name`` (``flow_control``, ``epp``), the ``address`` the
    router dials, the config ``field`` that sets it (``flow_control_address``; flag and ``KVMESH_ROUTER_*`` env
    var derived from it), what requests get while it does not answer (``meanwhile``, a phrase) and its check."""

    name: str
    address: str
    field: str
    meanwhile: str
    check: HealthCheck


def unanswered_warning(dep: StartupDependency, status: str, waited_seconds: float) -> str:
    """The one WARNING line for a dependency that did not answer at start-up."""
    from services.router.config import RouterConfig  # the env prefix from the one place that sets it

    env = f"{RouterConfig.model_config.get('env_prefix', '')}{dep.field}".upper()
    return (f"{dep.name} at {dep.address} did not answer within {waited_seconds:.1f}s of start-up ({status}): "
            f"set {dep.field} (--{dep.field.replace('_', '-')}, env {env}) to where "
            f"{dep.name} listens; until it answers {dep.meanwhile} (docs/degraded-modes.md)")


async def watch_startup(
    deps: Iterable[StartupDependency],
    timeout_seconds: float,
    on_checked: Callable[[str, str], None],
    *,
    grace_seconds: float = STARTUP_GRACE_SECONDS,
    retry_seconds: float = STARTUP_RETRY_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Check each dependency until it answers ``SERVING`` (module docstring); ``on_checked(name, status)`` after
    every check (the metric). Returns once all answered; meant to run as a task the router cancels at stop."""

    async def watch(dep: StartupDependency) -> None:
        started = clock()
        warned = False
        while True:
            status = await dep.check(timeout_seconds)
            on_checked(dep.name, status)
            waited = clock() - started
            if status == SERVING:
                if warned:
                    logger.info("%s at %s answers now (%.1fs after start-up)", dep.name, dep.address, waited)
                return
            if not warned and waited >= grace_seconds:
                logger.warning(unanswered_warning(dep, status, waited))
                warned = True
            await sleep(retry_seconds if warned else min(0.25, grace_seconds))

    await asyncio.gather(*(watch(dep) for dep in deps))
