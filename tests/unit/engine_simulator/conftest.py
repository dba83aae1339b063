"""The simulator's HTTP API in process, shared by its HTTP tests: ``sim`` (a model ``tiny`` with a
512-token context, model time 10,000x wall time, no etcd) and ``client`` (an httpx client on its ASGI
app, a running engine behind it). A test module may define its own ``sim``/``client`` instead."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from engine_simulator.app import EngineSimulator, build_service
from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.server import EngineHttpApi, ServerState
from kvmesh.clock import ScaledClock

MODEL = "tiny"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> EngineSimulator:
    config = SimulatorConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, time_scale=10000.0,
                             tokenizer_path=str(tmp_path_factory.mktemp("tok")), etcd_endpoints=[])
    return build_service(config)


@pytest.fixture
async def client(sim: EngineSimulator) -> AsyncIterator[httpx.AsyncClient]:
    clock = ScaledClock(sim.config.time_scale)
    engine = AsyncEngine(sim.core, sim.latency, clock, NullEventPublisher(), sim.metrics)
    engine.start()
    api = EngineHttpApi(ServerState(engine, sim.renderer, MODEL, MAX_MODEL_LEN, sim.tokenizer_dir, 1700000000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app()), base_url="http://sim") as c:
        yield c
    await engine.stop()
