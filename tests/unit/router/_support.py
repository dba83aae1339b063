"""Shared set-up of the router's gRPC front-door tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from engine_simulator.app import EngineSimulator, build_service
from engine_simulator.config import SimulatorConfig
from kvmesh._proto.kvmesh.router.v1 import router_pb2_grpc
from kvmesh.interceptors import server_interceptors
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow
from services.router.servicer import InferenceServicer
from tests.unit.router.fakes import CATALOG, MODEL


@asynccontextmanager
async def inference_stub(config: RouterConfig, flow: RequestFlow) -> AsyncIterator[router_pb2_grpc.InferenceStub]:
    """The router's ``InferenceServicer`` over ``flow`` (catalog :data:`CATALOG`) on a real grpc.aio
    server with the shared interceptors, on 127.0.0.1 at a free port, and a stub on a loopback channel
    to it. The server stops (no grace) on exit; ``flow`` stays the caller's to close."""
    server = grpc.aio.server(interceptors=server_interceptors())
    router_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(config, flow, lambda: CATALOG), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield router_pb2_grpc.InferenceStub(channel)
    finally:
        await server.stop(0)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> EngineSimulator:
    """(fixture, imported by ``conftest.py``) A simulator core for :data:`MODEL` (``max_model_len`` 512, time scale 10,000, no etcd) served in-process by
    the tests that compare the router's gRPC answer with the engine's own HTTP answer."""
    config = SimulatorConfig(model=MODEL, max_model_len=512, time_scale=10000.0,
                             tokenizer_path=str(tmp_path_factory.mktemp("tok")), etcd_endpoints=[])
    return build_service(config)
