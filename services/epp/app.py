"""Wires epp together: config -> datastore, watcher, scraper, plugins, scheduler -> a GrpcService.

Everything is built synchronously (so a bad scheduling config stops the process before it serves,
with the loader's message); connections open inside the event loop (httpx on first use, the
kv_indexer channel on first call, the etcd watch in ``on_start``).
"""

from __future__ import annotations

import logging
import random

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2_grpc
from kvmesh.listen import ListenError
from kvmesh.membership import EndpointWatcher
from kvmesh.server import GrpcService, ServiceSpec
from services.epp.config import EppConfig
from services.epp.datastore import Datastore
from services.epp.ext_proc import SERVICE_NAME as EXT_PROC_SERVICE_NAME
from services.epp.ext_proc import ExternalProcessorServicer, ExtProcSettings
from services.epp.framework.interfaces import PluginHandle, Tokenizer
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.kv_indexer_client import GrpcPrefixIndex, ReplicaPrefixIndex
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.scheduler import Scheduler
from services.epp.scraper import MetricsScraper
from services.epp.servicer import SERVICE_NAME, EndpointPickerServicer
from services.epp.tokenization.in_process import InProcessTokenizer
from services.epp.tokenize_client import EngineTokenizer

logger = logging.getLogger(__name__)


def build_service(config: EppConfig) -> GrpcService:
    """Build the whole service.

    Raises:
        ConfigError: the scheduling config is unknown or invalid (the message says which entry and why).
    """
    source, data = resolve_scheduling_config(config.scheduling_config)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
    prefix_index: GrpcPrefixIndex | ReplicaPrefixIndex | None = None
    if config.kv_indexer_address and config.prefix_index_mode == "replica":
        prefix_index = ReplicaPrefixIndex(
            config.kv_indexer_address, config.kv_indexer_timeout_seconds, config.kv_indexer_watch_stale_seconds
        )
    elif config.kv_indexer_address:
        prefix_index = GrpcPrefixIndex(config.kv_indexer_address, config.kv_indexer_timeout_seconds)
    engine_tokenizer = EngineTokenizer(
        http, config.tokenize_timeout_seconds, config.tokenize_cache_entries,
        max_prompt_chars=config.tokenize_max_prompt_chars,
        max_concurrency_per_endpoint=config.tokenize_max_concurrency_per_endpoint,
        max_attempts=config.tokenize_max_attempts, engine_key=config.engine_key_for,
    )
    tokenizer: Tokenizer = (
        InProcessTokenizer(config.tokenizer_paths, engine_tokenizer, config.tokenize_max_prompt_chars,
                           config.tokenize_cache_max_tokens)
        if config.tokenize_in_process else engine_tokenizer
    )
    handle = PluginHandle(
        rng=random.Random(config.random_seed),
        prefix_index=prefix_index,
        tokenizer=tokenizer,
    )
    profile = build_profile(data, default_registry(), handle, source=source)
    datastore = Datastore(routed_half_life_seconds=config.routed_half_life_seconds)
    live_filter = LiveEndpointFilter(
        "live-endpoints",
        LiveEndpointFilterParams(
            max_metrics_age_seconds=config.max_metrics_age_seconds,
            max_consecutive_scrape_failures=config.max_consecutive_scrape_failures,
        ),
    )
    scheduler = Scheduler(datastore, profile, live_filter)
    watcher = EndpointWatcher(config.etcd_endpoints)
    watcher.add_listener(datastore.apply_membership)
    scraper = MetricsScraper(datastore, config.metrics_scrape_interval_seconds, config.metrics_scrape_timeout_seconds,
                             idle_interval_seconds=min(config.metrics_idle_scrape_interval_seconds,
                                                       config.max_metrics_age_seconds / 2))
    logger.info(
        "scheduling config=%s profile=%s filters=%s scorers=%s picker=%s",
        source, profile.name, [f.name for f in profile.filters],
        {w.scorer.name: w.weight for w in profile.scorers}, profile.picker.name,
    )

    async def start_watcher() -> None:
        await watcher.start()
        datastore.set_endpoints(watcher.snapshot())

    async def stop_clients() -> None:
        await watcher.stop()
        await http.aclose()
        if prefix_index is not None:
            await prefix_index.close()

    def add_servicers(server: grpc.aio.Server) -> None:
        epp_pb2_grpc.add_EndpointPickerServicer_to_server(EndpointPickerServicer(scheduler), server)

    # GIE's endpoint-picker protocol (Envoy ext_proc) on its own port, as GIE serves it (9002), with
    # its own gRPC health (GIE's names: the ext_proc service, liveness, readiness) so Envoy's
    # health checks of the ext_proc cluster follow epp's drain.
    ext_proc = ExternalProcessorServicer(
        scheduler,
        ExtProcSettings(
            destination_endpoints=config.ext_proc_destination_endpoints,
            max_body_bytes=config.ext_proc_max_body_bytes,
            header_key=config.ext_proc_destination_header,
            metadata_namespace=config.ext_proc_metadata_namespace,
        ),
        rng=random.Random(config.random_seed),
    )
    ext_proc_servers: list[tuple[grpc.aio.Server, health.aio.HealthServicer]] = []
    ext_proc_names = ("", EXT_PROC_SERVICE_NAME, "liveness", "readiness")

    async def start_ext_proc() -> None:
        # No server interceptors: Envoy opens one ext_proc stream per HTTP request, and the standard chain
        # (a span per RPC, the error table, the tolerant decoder) cost ~0.3 ms of epp CPU per request
        # (docs/BENCHMARKS.md §3, wave 10); the servicer answers every failure itself and opens the
        # request's epp.Pick span (services/epp/ext_proc.py).
        ext_proc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ext_proc_health = health.aio.HealthServicer()
        ext_proc_servers.append((ext_proc_server, ext_proc_health))
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(ext_proc, ext_proc_server)
        health_pb2_grpc.add_HealthServicer_to_server(ext_proc_health, ext_proc_server)
        try:
            port = ext_proc_server.add_insecure_port(f"{config.host}:{config.ext_proc_port}")
        except RuntimeError:  # grpcio: "Failed to bind to address" (kvmesh.server.main prints one line)
            port = 0
        if port == 0:
            raise ListenError.probe("ext-proc", config.host, config.ext_proc_port, "gRPC could not bind the address")
        await ext_proc_server.start()
        for name in ext_proc_names:
            await ext_proc_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        service.extra_ports["ext_proc"] = port
        logger.info("ext_proc (GIE endpoint-picker protocol) serving on %s:%d", config.host, port)

    async def stop_ext_proc() -> None:
        for ext_proc_server, ext_proc_health in ext_proc_servers:
            await ext_proc_health.enter_graceful_shutdown()
            await ext_proc_server.stop(config.shutdown_grace_seconds)

    spec = ServiceSpec(
        name="epp",
        service_names=[SERVICE_NAME],
        add_servicers=add_servicers,
        on_start=[start_watcher, start_ext_proc],
        background=[scraper.run, *([prefix_index.run] if isinstance(prefix_index, ReplicaPrefixIndex) else [])],
        on_stop=[stop_ext_proc, stop_clients],
    )
    service = GrpcService(config, spec)
    return service
