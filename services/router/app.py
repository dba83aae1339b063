"""Wires the router together: catalog, clients, request flow, HTTP app and gRPC servicer -> one GrpcService.

The etcd :class:`~kvmesh.membership.EndpointWatcher` keeps the model catalog current (a
:class:`WatchedCatalog`, rebuilt on every membership change); the HTTP server
(:class:`kvmesh.http_server.HttpServer`) runs as a task of the same event loop, started in
``on_start`` (so HTTP is up before gRPC health says SERVING).

Shutdown (:class:`RouterService`): from SIGTERM on both front doors drain *together*, beside the
gRPC server's own graceful stop: ``/health`` says 503 "shutting down" at once, HTTP stops accepting,
the requests in flight on either door run on, and those still running ``_END_MARGIN_SECONDS``
before the shorter of the two graces (``shutdown_http_grace_seconds`` for HTTP, whole seconds as
uvicorn counts them; ``shutdown_grace_seconds`` for gRPC) are ended with "the server is shutting
down; retry the request": HTTP a 503 (unanswered) or the in-stream error event + ``[DONE]``, gRPC
``UNAVAILABLE`` (after the chunks a stream already sent). Before, the HTTP drain began only after
the gRPC grace, and a gRPC stream still running at its end was cut by the gRPC server:
``UNAVAILABLE`` "Cancelling all calls", which says nothing of a shutdown or a retry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from kvmesh._proto.kvmesh.router.v1 import router_pb2_grpc
from kvmesh.http_server import HttpServer
from kvmesh.membership import EndpointWatcher, etcd_health
from kvmesh.server import GrpcService, ServiceSpec
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog, ModelMemory
from services.router.clients import AdmissionClient, PickerClient
from services.router.config import RouterConfig
from services.router.http_app import RouterHttpApi
from services.router.metrics import record_dependency_check
from services.router.passthrough import Passthrough
from services.router.readiness import HealthCheck, ReadinessProbe, StartupDependency, served_around, watch_startup
from services.router.request_flow import RequestFlow, build_http_client, build_passthrough_client
from services.router.servicer import SERVICE_NAME, InferenceServicer

logger = logging.getLogger(__name__)

_END_MARGIN_SECONDS = 0.6
"""How long before uvicorn cancels what is left (``ceil(shutdown_http_grace_seconds)``) the streams
still running are ended with the in-stream error, so they finish on their own."""


@dataclass
class RouterService(GrpcService):
    """The router's :class:`GrpcService`: ``drain`` (both front doors' shutdown, see the module
    docstring) starts as soon as the service is asked to stop, beside the gRPC server's graceful
    stop (which :meth:`GrpcService.stop` awaits before its ``on_stop`` hooks), not after it."""

    drain: Callable[[], Awaitable[None]] | None = None
    _draining: asyncio.Future[None] | None = None

    def draining(self) -> asyncio.Future[None]:
        """The drain, started on the first call (the same future afterwards)."""
        if self._draining is None:
            drain = self.drain
            self._draining = asyncio.ensure_future(drain() if drain is not None else asyncio.sleep(0))
        return self._draining

    async def stop(self) -> None:
        self.draining()
        await super().stop()


class WatchedCatalog:
    """The current :class:`ModelCatalog`, rebuilt from the watcher's view on every change.

    Calling the object returns the catalog in force (the ``Callable[[], ModelCatalog]`` the request
    flow, the HTTP API and the servicer read); without a watcher it stays empty.
    """

    def __init__(self, watcher: EndpointWatcher | None, memory_seconds: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._watcher = watcher
        self._catalog = ModelCatalog()
        self._memory = ModelMemory(memory_seconds)
        self._clock = clock
        self._expires_at: float | None = None

    def __call__(self) -> ModelCatalog:
        if self._expires_at is not None and self._clock() >= self._expires_at:  # a departed name is forgotten
            self._catalog = self._memory.current(self._catalog, self._clock())
            self._expires_at = self._memory.next_expiry()
        return self._catalog

    def refresh(self, joined: dict[EndpointId, Endpoint] | None = None,
                left: dict[EndpointId, Endpoint] | None = None) -> None:
        """Rebuild from the watcher's snapshot (a :data:`~kvmesh.membership.MembershipListener`)."""
        if self._watcher is not None:
            built = ModelCatalog.from_endpoints(self._watcher.snapshot().values())
            self._catalog = self._memory.observe(built, self._clock())
            self._expires_at = self._memory.next_expiry()

    def endpoint_count(self) -> int:
        """Live endpoints across all models."""
        return sum(info.endpoints for info in self._catalog.models.values())


def startup_dependencies(config: RouterConfig, flow_control_check: HealthCheck,
                         epp_check: HealthCheck) -> list[StartupDependency]:
    """flow_control and epp as :func:`~services.router.readiness.watch_startup` checks them, each with what
    requests get while it does not answer in this configuration (``docs/degraded-modes.md``)."""
    if config.flow_control_failure_mode == "open" and config.degraded_max_in_flight > 0:
        admission = (f"requests are admitted locally (fail-open, at most {config.degraded_max_in_flight} at once, "
                     "then 503); /health says degraded")
    else:
        admission = "requests are refused with 503 (flow_control_failure_mode closed or degraded_max_in_flight 0) " \
                    "and /health says 503"
    if config.epp_failure_mode == "open":
        pick = "requests are picked locally (least-request over the router's own endpoint view); /health says degraded"
    else:
        pick = "requests are refused with 503 (epp_failure_mode closed) and /health says 503"
    return [
        StartupDependency("flow_control", config.flow_control_address, "flow_control_address", admission,
                          flow_control_check),
        StartupDependency("epp", config.epp_address, "epp_address", pick, epp_check),
    ]


def build_service(config: RouterConfig) -> GrpcService:
    """The router as a GrpcService: catalog watcher, clients, flow, HTTP app and servicer."""
    watcher = EndpointWatcher(config.etcd_endpoints) if config.etcd_endpoints else None
    catalog = WatchedCatalog(watcher, config.model_memory_seconds)
    admission = AdmissionClient(
        config.flow_control_address, config.admission_timeout_seconds, config.admission_close_timeout_seconds,
        multiplexed=config.admission_stream == "multiplexed", credits=config.admission_credits,
        credit_flush_seconds=config.admission_credit_flush_seconds,
    )
    picker = PickerClient(config.epp_address, config.pick_timeout_seconds,
                          multiplexed=config.pick_transport == "multiplexed", max_endpoints=config.max_fallback_attempts,
                          completed_flush_seconds=config.epp_completed_flush_seconds)
    http_client = build_http_client(config)
    flow = RequestFlow(config, catalog, admission, picker, http_client,
                       endpoints=lambda model: watcher.snapshot().values() if watcher is not None else ())
    def dependency_checked(name: str, status: str) -> None:
        """A grpc.health.v1 check's result (``/health`` or the start-up watch): the metric, the breaker."""
        if name in ("flow_control", "epp"):
            record_dependency_check(name, status)
        flow.dependency_checked(name, status)

    def refused_live() -> list[str]:
        """Registered endpoints whose last connect was refused (a killed engine, its lease still alive)."""
        live = watcher.snapshot() if watcher is not None else {}
        return sorted(endpoint_id for endpoint_id in flow.refused_endpoints() if endpoint_id in live)

    def live_endpoints() -> int:
        return max(0, catalog.endpoint_count() - len(refused_live()))

    readiness = ReadinessProbe(
        {"flow_control": admission.health, "epp": picker.health,
         # etcd unreachable: served from the last known membership, so "degraded", never unready
         **({"etcd": etcd_health} if config.etcd_endpoints else {})},
        live_endpoints,
        config.health_check_timeout_seconds,
        config.health_cache_seconds,
        time.monotonic,
        # one rule: a failure this config serves around is "degraded" (200), any other is 503
        *served_around(flow_control_failure_mode=config.flow_control_failure_mode,
                       degraded_max_in_flight=config.degraded_max_in_flight,
                       epp_failure_mode=config.epp_failure_mode, etcd=bool(config.etcd_endpoints),
                       breaker=config.dependency_breaker_cool_down_seconds > 0),
        breakers_open=flow.open_breakers,
        on_checked=dependency_checked,
        unreachable_endpoints=refused_live,
        refresh=flow.recheck_refused,
    )
    passthrough_http = build_passthrough_client(config)  # /tokenize, /detokenize: off the hot path
    passthrough = Passthrough(config, passthrough_http,
                              lambda model: watcher.snapshot().values() if watcher is not None else (), flow.local_picker,
                              flow.await_engine)
    api = RouterHttpApi(config, flow, catalog, readiness, passthrough)
    http_server = HttpServer(api.app(), config.host, config.http_port, config.shutdown_http_grace_seconds,
                             name="router-http", http=config.http_parser,
                             header_timeout_seconds=config.request_header_timeout_seconds)
    servicer = InferenceServicer(config, flow, catalog)

    def add_servicers(server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_InferenceServicer_to_server(servicer, server)

    async def start_clients() -> None:
        await admission.connect()
        await picker.connect()

    startup_watch: list[asyncio.Task[None]] = []

    async def watch_dependencies() -> None:
        """flow_control and epp checked beside the start, never delaying it (``readiness.watch_startup``)."""
        startup_watch.append(asyncio.create_task(watch_startup(
            startup_dependencies(config, admission.health, picker.health), config.health_check_timeout_seconds,
            dependency_checked), name="router-startup-dependency-watch"))

    async def stop_watch() -> None:
        for task in startup_watch:
            task.cancel()

    def on_membership(joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        flow.forget_refused([*joined, *left])  # registered again (restarted) or gone: an old refusal says nothing
        if watcher is not None and left:  # an endpoint gone (not just re-labelled): requests hung on it end
            live = watcher.snapshot()
            gone = [endpoint_id for endpoint_id in left if endpoint_id not in live]
            if gone and (waiting := flow.endpoints_left(gone)):  # cut only if its /health does not answer
                logger.warning("endpoint left with requests waiting on it endpoints=%s waiting=%d", gone, waiting)

    async def drain() -> None:
        """Both front doors at once (module docstring): stop HTTP, let the requests of either door
        finish; what still runs near the end of the shorter grace ends with "shutting down"
        instead of being cut by uvicorn's or the gRPC server's cancel."""
        readiness.stop()  # /health 503 "shutting down" from now on (kept-alive probes still get an answer)
        stopping = asyncio.ensure_future(http_server.stop())
        loop = asyncio.get_running_loop()
        http_grace = config.shutdown_http_grace_seconds
        end_in = max(0.0, min(http_grace, math.ceil(http_grace) - _END_MARGIN_SECONDS,
                              config.shutdown_grace_seconds - _END_MARGIN_SECONDS))
        end_at = loop.time() + end_in
        done, _ = await asyncio.wait([stopping], timeout=end_in)
        idle = await servicer.wait_idle(end_at - loop.time())
        if not done or not idle:
            ended, drained = flow.end_all(), servicer.drain()
            if ended or drained:
                logger.info("shutting down: ended %d request(s) still on an engine and %d other gRPC call(s)",
                            ended, drained)
        await stopping

    async def stop_http() -> None:
        """After the gRPC server stopped: the drain's end, then the hung-engine reaper."""
        await service.draining()
        await flow.aclose()

    async def start_watcher() -> None:
        if watcher is not None:
            watcher.add_listener(catalog.refresh)
            watcher.add_listener(on_membership)
            await watcher.start()
            catalog.refresh()
            logger.info("router models=%s", catalog().names())

    async def start_http() -> None:
        await http_server.start()
        service.extra_ports["http"] = http_server.port  # reported in the ports file with grpc and metrics
        logger.info("router http listening address=%s:%d", config.host, http_server.port)

    async def close_clients() -> None:
        if watcher is not None:
            await watcher.stop()
        await http_client.aclose()
        await passthrough_http.aclose()
        await admission.close()
        await picker.close()

    service = RouterService(
        config,
        ServiceSpec(
            name="router",
            service_names=[SERVICE_NAME],
            add_servicers=add_servicers,
            on_start=[start_clients, watch_dependencies, start_watcher, start_http],
            on_stop=[stop_watch, stop_http, close_clients],
            # one bound for both front doors: a CompletionRequest as large as the largest HTTP body is served
            # (grpcio's own 4 MiB default refused prompts the HTTP front door takes); beyond it RESOURCE_EXHAUSTED
            max_receive_message_bytes=config.max_request_body_bytes,
        ),
        drain=drain,
    )
    return service
