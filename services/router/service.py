"""Wiring: the router's clients, request flow, HTTP app and gRPC servicer inside one GrpcService.

The etcd :class:`~kvmesh.membership.EndpointWatcher` keeps the model catalog current; the HTTP
server (uvicorn) runs as a task of the same event loop, started in ``on_start`` (so HTTP is up
before gRPC health says SERVING) and stopped gracefully in ``on_stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Generator

import grpc
import uvicorn

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.membership import EndpointWatcher
from kvmesh.server import GrpcService, ServiceSpec
from services.router.catalog import ModelCatalog
from services.router.clients import AdmissionClient, PickerClient
from services.router.config import RouterConfig
from services.router.http_app import RouterHttpApi
from services.router.readiness import ReadinessProbe
from services.router.request_flow import RequestFlow, build_http_client
from services.router.servicer import InferenceServicer

logger = logging.getLogger(__name__)

INFERENCE_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: GrpcService owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` as a task of the running loop."""

    def __init__(self, app: object, host: str, port: int, grace_seconds: float) -> None:
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_config=None, access_log=False)
        self._server = _EmbeddedUvicorn(config)
        self._grace = grace_seconds
        self._task: asyncio.Task[None] | None = None
        self.port = port

    async def start(self, timeout_seconds: float = 10.0) -> None:
        """Start serving; returns once the socket is bound.

        Raises:
            OSError: when uvicorn could not bind within ``timeout_seconds``.
        """
        self._task = asyncio.create_task(self._server.serve(), name="router-http")
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                raise OSError(f"router HTTP server could not start on port {self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self._grace + 1.0)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 2.0)
        self._task = None


def build_service(config: RouterConfig) -> GrpcService:
    """The router as a GrpcService: catalog watcher, clients, flow, HTTP app and servicer."""
    watcher = EndpointWatcher(config.etcd_endpoints) if config.etcd_endpoints else None
    catalog_state = {"catalog": ModelCatalog()}

    def catalog() -> ModelCatalog:
        return catalog_state["catalog"]

    def refresh(joined: object = None, left: object = None) -> None:
        if watcher is not None:
            catalog_state["catalog"] = ModelCatalog.from_endpoints(watcher.snapshot().values())

    admission = AdmissionClient(
        config.flow_control_address, config.admission_timeout_seconds, config.admission_close_timeout_seconds
    )
    picker = PickerClient(config.epp_address, config.pick_timeout_seconds)
    http_client = build_http_client(config)
    flow = RequestFlow(config, catalog, admission, picker, http_client)

    def endpoint_count() -> int:
        return sum(info.endpoints for info in catalog().models.values())

    readiness = ReadinessProbe(
        {"flow_control": admission.health, "epp": picker.health},
        endpoint_count,
        config.health_check_timeout_seconds,
        config.health_cache_seconds,
        time.monotonic,
    )
    api = RouterHttpApi(config, flow, catalog, readiness)
    http_server = HttpServer(api.app(), config.host, config.http_port, config.shutdown_http_grace_seconds)
    servicer = InferenceServicer(config, flow, catalog)

    def add_servicers(server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_InferenceServicer_to_server(servicer, server)

    async def start_clients() -> None:
        await admission.connect()
        await picker.connect()

    async def start_watcher() -> None:
        if watcher is not None:
            watcher.add_listener(refresh)
            await watcher.start()
            refresh()
            logger.info("router models=%s", catalog().names())

    async def start_http() -> None:
        await http_server.start()
        logger.info("router http listening address=%s:%d", config.host, http_server.port)

    async def stop_http() -> None:
        await http_server.stop()

    async def close_clients() -> None:
        if watcher is not None:
            await watcher.stop()
        await http_client.aclose()
        await admission.close()
        await picker.close()

    return GrpcService(
        config,
        ServiceSpec(
            name="router",
            service_names=[INFERENCE_SERVICE],
            add_servicers=add_servicers,
            on_start=[start_clients, start_watcher, start_http],
            on_stop=[stop_http, close_clients],
        ),
    )
