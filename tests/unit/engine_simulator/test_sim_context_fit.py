"""The simulator never advertises a context its KV cache cannot hold (found by a new user: a chat
without ``max_tokens`` on ``kvmesh up``'s 2,048-block engines was refused, "needs 2048 KV blocks but the
engine has only 2047").

vLLM 0.32 defaults a chat's ``max_tokens`` to the room left in the context (``get_max_tokens``) and
refuses at start-up a ``max_model_len`` its KV cache cannot hold, so a request without ``max_tokens``
always fits. The simulator's default ``max_model_len`` is therefore cut to ``(num_gpu_blocks - 1) *
block_size_tokens`` (the null block excluded); an explicit value is kept.
"""

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


@pytest.mark.parametrize(
    ("blocks", "block_size", "explicit", "expected"),
    [
        (2048, 64, None, 2047 * 64),  # kvmesh up's default engines: 131,008, not 131,072
        (512, 64, None, 511 * 64),
        (9, 16, None, 8 * 16),
        (4096, 64, None, 131072),  # the cache holds the default context: unchanged
        (512, 64, 100_000, 100_000),  # explicit: kept, as vLLM with --num-gpu-blocks-override
    ],
)
def test_default_context_fits_the_kv_cache(blocks: int, block_size: int, explicit: int | None, expected: int) -> None:
    extra = {"max_model_len": explicit} if explicit is not None else {}
    config = SimulatorConfig(num_gpu_blocks=blocks, block_size_tokens=block_size, etcd_endpoints=[], **extra)
    assert config.max_model_len == expected


@pytest.fixture
async def small(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    config = SimulatorConfig(model=MODEL, num_gpu_blocks=9, block_size_tokens=16, time_scale=10000.0,
                             tokenizer_path=str(tmp_path_factory.mktemp("tok")), etcd_endpoints=[])
    sim: EngineSimulator = build_service(config)
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    api = EngineHttpApi(ServerState(engine, sim.renderer, MODEL, config.max_model_len, sim.tokenizer_dir, 1700000000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app()), base_url="http://sim") as client:
        yield client
    await engine.stop()


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_without_max_tokens_is_served(small: httpx.AsyncClient, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "stream": stream}
    reply = await small.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    models = (await small.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 8 * 16


async def test_responses_without_max_output_tokens_is_served(small: httpx.AsyncClient) -> None:
    reply = await small.post("/v1/responses", json={"model": MODEL, "input": "hi there"})
    assert reply.status_code == 200, reply.text
