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

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2_grpc
from kvmesh.membership import EndpointWatcher
from kvmesh.server import GrpcService, ServiceSpec
from services.epp.config import EppConfig
from services.epp.datastore import Datastore
from services.epp.framework.interfaces import PluginHandle
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.kv_indexer_client import GrpcPrefixIndex
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.scheduler import Scheduler
from services.epp.scraper import MetricsScraper
from services.epp.servicer import SERVICE_NAME, EndpointPickerServicer
from services.epp.tokenize_client import EngineTokenizer

logger = logging.getLogger(__name__)


def build_service(config: EppConfig) -> GrpcService:
    """Build the whole service.

    Raises:
        ConfigError: the scheduling config is unknown or invalid (the message says which entry and why).
    """
    source, data = resolve_scheduling_config(config.scheduling_config)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
    prefix_index = (
        GrpcPrefixIndex(config.kv_indexer_address, config.kv_indexer_timeout_seconds)
        if config.kv_indexer_address
        else None
    )
    handle = PluginHandle(
        rng=random.Random(config.random_seed),
        prefix_index=prefix_index,
        tokenizer=EngineTokenizer(
            http, config.tokenize_timeout_seconds, config.tokenize_cache_entries,
            max_prompt_chars=config.tokenize_max_prompt_chars,
            max_concurrency_per_endpoint=config.tokenize_max_concurrency_per_endpoint,
            max_attempts=config.tokenize_max_attempts,
        ),
    )
    profile = build_profile(data, default_registry(), handle, source=source)
    datastore = Datastore()
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
    scraper = MetricsScraper(datastore, config.metrics_scrape_interval_seconds, config.metrics_scrape_timeout_seconds)
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

    spec = ServiceSpec(
        name="epp",
        service_names=[SERVICE_NAME],
        add_servicers=add_servicers,
        on_start=[start_watcher],
        background=[scraper.run],
        on_stop=[stop_clients],
    )
    return GrpcService(config, spec)
