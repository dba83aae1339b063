"""The simulator process: wires config, tokenizer, core, publisher, HTTP and etcd; handles signals.

Start order: tokenizer -> engine core and loop -> KV-event publisher -> HTTP (uvicorn on
``--host:--port``) -> etcd registration (``Endpoint`` under ``endpoint_key``) once HTTP listens.
On SIGTERM/SIGINT: revoke the etcd lease first (routers stop picking the engine at once), stop
HTTP (running requests get ``shutdown_grace_seconds``), abort what is left, close the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator

import uvicorn

from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.latency_model import get_profile
from engine_simulator.metrics import EngineMetrics
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import make_publisher
from engine_simulator.rendering import Renderer
from engine_simulator.scheduler import EngineCore, SchedulerConfig
from engine_simulator.server import ServerState, build_app
from engine_simulator.tokenizer import ensure_tokenizer, load_tokenizer
from kvmesh.clock import ScaledClock
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId, EndpointRole

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the process handles signals in one place)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def cache_config_info(config: SimulatorConfig) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (vLLM 0.32's set, with this engine's values)."""
    tokens = (config.num_gpu_blocks - 1) * config.block_size_tokens
    return {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size_tokens),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size_tokens),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": "0.9",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_gpu_blocks_override": str(config.num_gpu_blocks),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256_cbor",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


async def run(config: SimulatorConfig) -> None:
    """Run until SIGTERM/SIGINT."""
    tok_dir = ensure_tokenizer(config.tokenizer_path or None)
    renderer = Renderer(load_tokenizer(str(tok_dir)))
    endpoint_id = f"{config.host}:{config.port}"
    cache = PrefixCache(config.num_gpu_blocks, config.block_size_tokens, config.enable_prefix_caching)
    core = EngineCore(
        SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, renderer.vocab_size
        ),
        cache,
    )
    metrics = EngineMetrics(config.model, cache_config_info(config), config.max_model_len)
    publisher = make_publisher(config.events_endpoint, endpoint_id, config.model)
    engine = AsyncEngine(
        core, get_profile(config.latency_profile), ScaledClock(config.time_scale), publisher, metrics
    )
    engine.start()
    state = ServerState(engine, renderer, config.model, config.max_model_len, str(tok_dir), int(time.time()))
    server = _Server(
        uvicorn.Config(
            build_app(state),
            host=config.host,
            port=config.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=int(config.shutdown_grace_seconds),
            access_log=False,
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_task = asyncio.create_task(server.serve(), name="http")
    while not server.started and not server_task.done():
        await asyncio.sleep(0.02)
    registration: LeaseRegistration | None = None
    if server.started:
        logger.info(
            "engine simulator listening url=http://%s model=%s block_size=%d num_gpu_blocks=%d "
            "events=%s time_scale=%s",
            endpoint_id,
            config.model,
            config.block_size_tokens,
            config.num_gpu_blocks,
            config.events_endpoint or "off",
            config.time_scale,
        )
        if config.etcd_endpoints:
            ep = Endpoint(
                id=EndpointId(endpoint_id),
                url=f"http://{endpoint_id}",
                model=config.model,
                block_size_tokens=config.block_size_tokens,
                events_endpoint=config.events_endpoint,
                role=EndpointRole(config.role),
                labels={"engine": "simulator", "max_model_len": str(config.max_model_len)},
            )
            registration = LeaseRegistration(
                config.etcd_endpoints, endpoint_key(ep), ep.to_json(), config.lease_ttl_seconds
            )
            await registration.start()
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({stop_task, server_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
    logger.info("shutting down")
    if registration is not None:
        await registration.stop()
    server.should_exit = True
    with contextlib.suppress(Exception):
        await server_task
    await engine.stop()
    publisher.shutdown()
    logger.info("stopped")
