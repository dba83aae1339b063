"""Readiness behind ``GET /health``: the router's dependencies, checked cheaply (no I/O of its own).

Ready means all of:

| check | how | failing value |
| --- | --- | --- |
| ``flow_control`` | grpc.health.v1 ``Check("")`` within ``health_check_timeout_seconds`` | its status or the failed call's code: ``NOT_SERVING``, ``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` |
| ``epp`` | same | same |
| ``endpoints`` | at least one live endpoint (etcd) serves a model | ``0`` |
| ``etcd`` (with etcd configured) | :func:`kvmesh.membership.etcd_health`: this process's etcd clients, no I/O | ``UNAVAILABLE``: always degraded, never unready (the last known membership serves) |

A dependency with a degraded mode (``degradable``: flow_control and epp when their failure mode
is ``open``, see ``docs/degraded-modes.md``) that is *unreachable* (``UNAVAILABLE``,
``NOT_CONNECTED``) does not make the router unready: the answer is 200 with ``"status": "degraded"``
and ``"degraded": [names]``, since requests are still served (a readiness probe that failed here
would turn one dead dependency into an outage of every router). A hung one (``DEADLINE_EXCEEDED``)
is degraded too when requests are still served past its timeout (``hang_tolerant``: epp, whose
Pick falls back to the local pick after ``pick_timeout_seconds``), and fails readiness otherwise
(flow_control: a hung admission answers 504); one that says ``NOT_SERVING`` fails readiness.

Both gRPC checks run concurrently; one result is reused for ``health_cache_seconds`` (1 s by
default), and concurrent probes share one in-flight check, so a load balancer probing often costs
at most one pair of health RPCs per second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

SERVING = "SERVING"
UNREACHABLE = frozenset({"UNAVAILABLE", "NOT_CONNECTED"})
HUNG = "DEADLINE_EXCEEDED"
"""Check results that mean "cannot be reached" (as opposed to hung or not serving)."""

HealthCheck = Callable[[float], Awaitable[str]]
"""``check(timeout_seconds) -> status name`` (``"SERVING"`` when healthy); must not raise."""


@dataclass(frozen=True, slots=True)
class Readiness:
    """One evaluation: dependency name -> status name, and the live endpoint count."""

    dependencies: dict[str, str]
    endpoints: int
    degradable: frozenset[str] = frozenset()
    hang_tolerant: frozenset[str] = frozenset()

    @property
    def degraded(self) -> list[str]:
        """Failing dependencies the router serves without (their degraded mode is on): unreachable, or
        hung for those in ``hang_tolerant``."""
        return [name for name, status in self.dependencies.items()
                if name in self.degradable and (status in UNREACHABLE or (status == HUNG and name in self.hang_tolerant))]

    @property
    def failing(self) -> list[str]:
        """Names of what is not ready (dependencies first, then ``endpoints``)."""
        degraded = self.degraded
        bad = [name for name, status in self.dependencies.items() if status != SERVING and name not in degraded]
        if self.endpoints <= 0:
            bad.append("endpoints")
        return bad

    @property
    def ready(self) -> bool:
        return not self.failing

    def body(self) -> dict[str, object]:
        """The /health JSON: ``{"status": "ok"|"unavailable", "endpoints", "dependencies"}`` plus, when
        not ready, an OpenAI ``error`` naming what fails (type ``service_unavailable``, code 503)."""
        out: dict[str, object] = {
            "status": ("degraded" if self.degraded else "ok") if self.ready else "unavailable",
            "endpoints": self.endpoints,
            "dependencies": dict(self.dependencies),
        }
        if self.degraded:
            out["degraded"] = self.degraded
        if not self.ready:
            reasons = [
                "no live endpoint serves any model" if name == "endpoints" else f"{name} is {self.dependencies[name]}"
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
    ) -> None:
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

    async def readiness(self) -> Readiness:
        if self._last is not None and self._clock() - self._last_at < self._cache:
            return self._last
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
        statuses = await asyncio.gather(*(self._checks[n](self._timeout) for n in names))
        result = Readiness(dict(zip(names, statuses, strict=True)), self._endpoints(), self._degradable,
                           self._hang_tolerant)
        self._last, self._last_at = result, self._clock()
        return result
