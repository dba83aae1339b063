"""The sidecar process: poll the engine's /health, keep its etcd key alive only while it answers.

Loop (every ``health_interval_seconds``): ``GET <engine_url><health_path>`` with
``health_timeout_seconds``; a 200 is a success, anything else (status, refused connection,
timeout) a failure; a timeout is an *unresponsive* failure, which deregisters only after
``unresponsive_grace_seconds`` (a busy engine keeps its registration; the lease itself is refreshed
by this process, whatever the engine's loop does). :class:`HealthTracker` turns the results into actions: REGISTER grants a
lease and puts :func:`build_endpoint`'s JSON under ``endpoint_key`` (a new
:class:`kvmesh.membership.LeaseRegistration` each time, so a recovered engine reappears as a
fresh join); DEREGISTER revokes the lease (watchers see the leave at once; kv_indexer purges the
endpoint's blocks). On SIGTERM/SIGINT the lease is revoked before exit. If the sidecar itself
dies, the lease expires after ``lease_ttl_seconds``.

``build_service(config)`` builds the :class:`Sidecar` (nothing opens); :meth:`Sidecar.run` serves
its ``/metrics`` and polls until SIGTERM/SIGINT.

``max_model_len`` 0 is asked from the engine's ``GET /v1/models`` before each registration
(vLLM reports it there), so the router's context check matches the engine's. When it cannot be
read (a 401 from an engine started with ``--api-key`` and no ``--engine-api-key`` here, the model
not listed, no answer) the engine is **not** registered: one ERROR line naming the cause,
``kvmesh_registration_sidecar_transitions_total{action="refused"}``, and the next good poll tries
again. ``--engine-api-key`` is sent as ``Authorization: Bearer`` on every probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid

import httpx

from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.metrics import MetricsServer, start_metrics_server
from services.registration_sidecar import metrics
from services.registration_sidecar.config import SidecarConfig
from services.registration_sidecar.health import (
    Action,
    HealthTracker,
    build_endpoint,
    engine_identity_from_metrics,
    max_model_len_or_reason,
)

logger = logging.getLogger(__name__)


class Sidecar:
    """Health poller + etcd registration for one engine.

    ``await poll()`` runs the loop until :meth:`stop`; ``await run()`` is the whole process
    (``/metrics`` server, signal handlers, then ``poll()``).
    """

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.tracker = HealthTracker(config.failure_threshold, config.success_threshold,
                                     config.unresponsive_grace_seconds)
        self.registration: LeaseRegistration | None = None
        self._stop = asyncio.Event()
        key = config.engine_api_key.get_secret_value() if config.engine_api_key is not None else ""
        self._client = httpx.AsyncClient(timeout=config.health_timeout_seconds,
                                         headers={"authorization": f"Bearer {key}"} if key else None)

    def stop(self) -> None:
        self._stop.set()

    async def _healthy(self) -> tuple[bool, bool]:
        """(healthy, unresponsive): unresponsive when the poll timed out after the connection was accepted."""
        url = self.config.engine_url.rstrip("/") + self.config.health_path
        try:
            reply = await self._client.get(url)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
            logger.debug("health poll timed out url=%s error=%r", url, exc)
            return False, True
        except httpx.HTTPError as exc:
            logger.debug("health poll failed url=%s error=%r", url, exc)
            return False, False
        return reply.status_code == 200, False

    async def _max_model_len(self) -> int | str:
        """The configured or probed context length, or why the probe failed (a message)."""
        if self.config.max_model_len:
            return self.config.max_model_len
        try:
            reply = await self._client.get(self.config.engine_url.rstrip("/") + "/v1/models")
            body = reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            return f"GET /v1/models failed: {exc!r}"
        return max_model_len_or_reason(reply.status_code, body, self.config.model)

    async def _identity(self) -> tuple[str, str]:
        """The engine's incarnation and hash algorithm from its /metrics; a fresh id when unreadable
        (each registration after the engine was down is then a new incarnation)."""
        try:
            reply = await self._client.get(self.config.engine_url.rstrip("/") + "/metrics")
            instance_id, hash_algo = engine_identity_from_metrics(reply.text) if reply.status_code == 200 else ("", "")
        except httpx.HTTPError as exc:
            logger.warning("could not read the engine's /metrics for its incarnation error=%r", exc)
            instance_id, hash_algo = "", ""
        return instance_id or f"reg-{uuid.uuid4().hex[:12]}", hash_algo

    async def _register(self) -> None:
        cfg = self.config
        max_model_len = await self._max_model_len()
        if isinstance(max_model_len, str):  # never registered without its context length, silently
            self.tracker.registered = False
            self.tracker.successes = 0
            metrics.TRANSITIONS.labels("refused").inc()
            logger.error("engine not registered endpoint=%s: cannot read max_model_len: %s", cfg.endpoint_id, max_model_len)
            return
        instance_id, hash_algo = await self._identity()
        ep = build_endpoint(cfg.endpoint_id, cfg.engine_url, cfg.model, cfg.block_size_tokens,
                            cfg.events_endpoint, cfg.role, cfg.engine_label, max_model_len,
                            instance_id=instance_id, replay_endpoint=cfg.replay_endpoint, hash_algo=hash_algo)
        self.registration = LeaseRegistration(cfg.etcd_endpoints, endpoint_key(ep), ep.to_json(),
                                              cfg.lease_ttl_seconds)
        await self.registration.start()
        metrics.REGISTERED.set(1)
        metrics.TRANSITIONS.labels("register").inc()
        logger.info("engine healthy: registered endpoint=%s model=%s labels=%s", ep.id, ep.model, ep.labels)

    async def _deregister(self, why: str) -> None:
        if self.registration is not None:
            await self.registration.stop()
            self.registration = None
        metrics.REGISTERED.set(0)
        metrics.TRANSITIONS.labels("deregister").inc()
        logger.warning("engine %s: deregistered endpoint=%s", why, self.config.endpoint_id)

    async def poll(self) -> None:
        """Poll until :meth:`stop`; deregister on the way out."""
        metrics.REGISTERED.set(0)
        try:
            while not self._stop.is_set():
                healthy, unresponsive = await self._healthy()
                metrics.HEALTH_CHECKS.labels("ok" if healthy else "timeout" if unresponsive else "failed").inc()
                action = self.tracker.observe(healthy, unresponsive=unresponsive, now=time.monotonic())
                if action is Action.REGISTER:
                    await self._register()
                elif action is Action.DEREGISTER:
                    await self._deregister(f"unhealthy ({self.tracker.failures} failed polls"
                                           f"{', unresponsive past the grace' if unresponsive else ''})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.health_interval_seconds)
        finally:
            if self.registration is not None:
                await self._deregister("sidecar stopping")
            await self._client.aclose()

    async def run(self) -> None:
        """Serve ``/metrics`` and poll until SIGTERM/SIGINT."""
        config = self.config
        server: MetricsServer = start_metrics_server(config.host, config.metrics_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        logger.info("registration sidecar watching engine=%s model=%s interval=%.2fs failure_threshold=%d",
                    config.engine_url, config.model, config.health_interval_seconds, config.failure_threshold)
        try:
            await self.poll()
        finally:
            server.stop()
        logger.info("stopped")


def build_service(config: SidecarConfig) -> Sidecar:
    """The sidecar for ``config``, built and not polling.

    Raises:
        SystemExit: ``etcd_endpoints`` is empty (the sidecar exists to register in etcd).
    """
    if not config.etcd_endpoints:
        raise SystemExit("--etcd-endpoints is required (the sidecar exists to register in etcd)")
    return Sidecar(config)
