"""The simulator process: ``build_service(config)`` wires tokenizer, core and HTTP API; ``run()`` serves.

``build_service`` does the synchronous part (tokenizer files built if missing and loaded, prefix
cache, scheduler core, metrics, latency profile, the HTTP routes) and opens nothing.
:meth:`EngineSimulator.run` then starts in order: KV-event publisher -> engine loop -> HTTP
(:class:`kvmesh.http_server.HttpServer` on ``--host:--port``) -> etcd registration (``Endpoint``
under ``endpoint_key``) once HTTP listens. The lease is kept alive from its own thread and event loop
(:class:`kvmesh.lease_thread.ThreadedLeaseRegistration`), so a busy engine loop (a long prompt being
encoded) never costs the engine its registration. On SIGTERM/SIGINT: revoke the etcd lease first (routers
stop picking the engine at once), stop HTTP (running requests get ``shutdown_grace_seconds``), abort
what is left, close the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid

from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.latency_model import LatencyModel, get_profile
from engine_simulator.metrics import EngineMetrics
from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import EventPublisher, make_publisher
from engine_simulator.rendering import Renderer
from engine_simulator.scheduler import EngineCore, LoraAdapter, SchedulerConfig
from engine_simulator.server import EngineHttpApi, ServerState
from engine_simulator.sglang import SGLangEventPublisher, SGLangHttpApi, SGLangMetrics
from engine_simulator.sglang import server_args as sglang_server_args
from engine_simulator.tokenizer import ensure_tokenizer, load_chat_template, load_tokenizer
from kvmesh.clock import ScaledClock
from kvmesh.http_server import HttpServer, bind_tcp
from kvmesh.kv_events import make_topic
from kvmesh.lease_thread import ThreadedLeaseRegistration
from kvmesh.membership import endpoint_key
from kvmesh.server import write_ports_file
from kvmesh.types import KV_STORES_LABEL, LORA_ADAPTERS_LABEL, Endpoint, EndpointId

logger = logging.getLogger(__name__)


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


class EngineSimulator:
    """One simulated engine, built and not yet serving; ``await run()`` serves until SIGTERM/SIGINT.

    Args:
        config: the process config.
        renderer: the loaded tokenizer and chat template.
        tokenizer_dir: directory of ``tokenizer.json`` (the ``root`` of ``GET /v1/models``).
    """

    def __init__(self, config: SimulatorConfig, renderer: Renderer, tokenizer_dir: str) -> None:
        self.config = config
        self.endpoint_id = f"{config.host}:{config.port}"
        """``host:port`` the engine serves on; with ``--port 0`` the bound port, known once :meth:`run` binds."""
        self.replay_endpoint = ""
        """The bound replay endpoint (a ``tcp://host:*`` flag resolved to its port), known once :meth:`run` binds."""
        self.instance_id = uuid.uuid4().hex
        """This process's incarnation: a restart on the same address registers a new one."""
        self.latency: LatencyModel = get_profile(config.latency_profile)
        self.offload = offload_manager(config)
        """The offload connector (``--offload``), None when off."""
        cache = PrefixCache(config.num_gpu_blocks, config.block_size_tokens, config.enable_prefix_caching,
                            offload=self.offload)
        self.core = EngineCore(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, renderer.vocab_size,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
                scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
                sampled_token_ids=renderer.printable_token_ids(),
            ),
            cache,
        )
        self.lora_adapters = {
            name: LoraAdapter(name, i + 1, f"/adapters/{name}")
            for i, name in enumerate(n.strip() for n in config.lora_adapters.split(",") if n.strip())
        }
        """Served LoRA adapters (``--lora-adapters``), ``lora_int_id`` from 1 in the given order."""
        self.metrics: EngineMetrics
        if config.personality == "sglang":
            self.metrics = SGLangMetrics(config.model, cache_config_info(config), config.max_model_len,
                                         config.block_size_tokens, config.num_gpu_blocks)
        else:
            self.metrics = EngineMetrics(config.model, cache_config_info(config), config.max_model_len)
        if self.offload is not None:
            self.metrics.attach_offload(self.offload)
        self.renderer = renderer
        self.tokenizer_dir = tokenizer_dir

    def endpoint(self) -> Endpoint:
        """The etcd registration of this engine."""
        config = self.config
        return Endpoint(
            id=EndpointId(self.endpoint_id),
            url=f"http://{self.endpoint_id}",
            model=config.model,
            block_size_tokens=config.block_size_tokens,
            events_endpoint=config.events_endpoint,
            role=config.role,
            labels={
                "engine": "simulator" if config.personality == "vllm" else f"simulator-{config.personality}",
                "max_model_len": str(config.max_model_len),
                "tokenizer": self.tokenizer_dir,  # epp tokenizes in-process from these files
                **({LORA_ADAPTERS_LABEL: ",".join(self.lora_adapters)} if self.lora_adapters else {}),
                **({KV_STORES_LABEL: self._kv_stores()} if config.offload == OffloadMode.CPU_KV_STORE else {}),
            },
            instance_id=self.instance_id,
            replay_endpoint=self.replay_endpoint or config.events_replay_endpoint,
            hash_algo="sha256_cbor",
        )

    def _kv_stores(self) -> str:
        return ",".join(a.strip() for a in self.config.kv_stores.split(",") if a.strip())

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or until HTTP ends on its own), then shut down in order."""
        config = self.config
        sock = bind_tcp(config.host, config.port)  # bound first: the endpoint id (topic, etcd key) names the port
        self.endpoint_id = f"{config.host}:{sock.getsockname()[1]}"
        publisher: EventPublisher
        if config.personality == "sglang" and config.events_endpoint:
            publisher = SGLangEventPublisher(
                config.events_endpoint, make_topic(self.endpoint_id, config.model),
                replay_endpoint=self.replay_endpoint or config.events_replay_endpoint, buffer_steps=config.events_buffer_steps,
            )
        else:
            publisher = make_publisher(
                config.events_endpoint, self.endpoint_id, config.model, config.events_replay_endpoint,
                config.events_buffer_steps,
            )
        self.replay_endpoint = getattr(publisher, "replay_endpoint", "")
        engine = AsyncEngine(self.core, self.latency, ScaledClock(config.time_scale), publisher, self.metrics)
        engine.start()
        uploader = None
        if self.offload is not None and self.offload.config.uses_kv_store:
            from engine_simulator.offload_client import KVStoreUploader  # gRPC only when kv_store is used

            uploader = KVStoreUploader(self.offload, self._kv_stores().split(",")[0], config.offload_put_value_bytes,
                                       clock=engine.clock, wake=engine.wake)
            uploader.start()
        state = ServerState(engine, self.renderer, config.model, config.max_model_len, self.tokenizer_dir,
                            int(time.time()), metrics_delay_seconds=config.fault_metrics_delay_seconds,
                            lora_adapters=self.lora_adapters, api_key=config.api_key.get_secret_value(), runner=config.runner)
        api = EngineHttpApi(state)
        if config.personality == "sglang":
            api = SGLangHttpApi(state, sglang_server_args(
                model=config.model, model_path=self.tokenizer_dir, host=config.host, port=int(self.endpoint_id.rsplit(":", 1)[1]),
                page_size=config.block_size_tokens, num_pages=config.num_gpu_blocks,
                max_running_requests=config.max_num_seqs, chunked_prefill_size=config.max_num_batched_tokens,
                context_length=config.max_model_len, kv_events_endpoint=config.events_endpoint,
                lora_paths=list(self.lora_adapters),
            ))
        http = HttpServer(api.app(), config.host, config.port, config.shutdown_grace_seconds,
                          log_level="warning", sock=sock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        registration: ThreadedLeaseRegistration | None = None
        try:
            await http.start()
            write_ports_file(config.ports_file, {"http": http.port})
            logger.info(
                "engine simulator listening url=http://%s model=%s block_size=%d num_gpu_blocks=%d "
                "events=%s time_scale=%s max_num_batched_tokens=%d long_prefill_token_threshold=%d%s "
                "scheduler_reserve_full_isl=%s",
                self.endpoint_id,
                config.model,
                config.block_size_tokens,
                config.num_gpu_blocks,
                config.events_endpoint or "off",
                config.time_scale,
                config.max_num_batched_tokens,
                config.long_prefill_token_threshold,
                " (adaptive)" if config.long_prefill_token_threshold_adaptive else "",
                config.scheduler_reserve_full_isl,
            )
            if config.etcd_endpoints:
                ep = self.endpoint()
                registration = ThreadedLeaseRegistration(
                    config.etcd_endpoints, endpoint_key(ep), ep.to_json(), config.lease_ttl_seconds
                )
                await registration.start()
            stop_task = asyncio.create_task(stop.wait())
            http_task = asyncio.create_task(http.wait())
            await asyncio.wait({stop_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
            stop_task.cancel()
            http_task.cancel()
        finally:
            logger.info("shutting down")
            if registration is not None:
                await registration.stop()
            with contextlib.suppress(Exception):
                await http.stop()
            await engine.stop()
            if uploader is not None:
                await uploader.stop()
            publisher.shutdown()
            logger.info("stopped")


def offload_manager(config: SimulatorConfig) -> OffloadManager | None:
    """The offload connector ``--offload`` and the ``--offload-*`` flags describe; None for ``off``."""
    mode = OffloadMode(config.offload)
    if mode == OffloadMode.OFF:
        return None
    return OffloadManager(
        OffloadConfig(
            mode=mode,
            cpu_capacity_blocks=config.offload_cpu_blocks,
            bytes_per_block=config.offload_bytes_per_block or config.block_size_tokens * 131_072,
            pcie_bandwidth=config.offload_pcie_bandwidth,
            nvme_bandwidth=config.offload_nvme_bandwidth,
            network_bandwidth=config.offload_network_bandwidth,
            max_remote_blocks=config.offload_max_remote_blocks,
        ),
        config.block_size_tokens,
        config.model,
    )


def build_service(config: SimulatorConfig) -> EngineSimulator:
    """The simulator, built and not serving (the tokenizer files are written first when missing).

    Raises:
        KeyError: ``latency_profile`` names no known profile.
        OSError: the tokenizer directory cannot be created or read.
    """
    tokenizer_dir = ensure_tokenizer(config.tokenizer_path or None)
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)), load_chat_template(tokenizer_dir))
    return EngineSimulator(config, renderer, str(tokenizer_dir))
