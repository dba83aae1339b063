"""Wires kv_store together: config -> tiers, store, metrics, servicer -> a GrpcService.

Tier order (fastest first): ``cpu``; ``disk`` when ``disk_path`` is set; ``sharedfs`` when
``shared_path`` is set; ``mooncake`` when ``mooncake_master`` is set. The Mooncake client is
Mooncake's own binding (``mooncake.store``, from ``make mooncake-venv``), set up lazily: while the
master cannot be reached the tier is unavailable (a degraded mode with a metric) and setup is
retried at most every ``MOONCAKE_RETRY_S`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvmesh.kv_events import KVEvent
from kvmesh.membership import LeaseRegistration, kv_source_key
from kvmesh.server import GrpcService, ServiceSpec
from kvmesh.types import KV_SOURCE_LABEL, SHARED_DOMAINS_LABEL, Endpoint, EndpointId
from services.kv_store.config import KvStoreConfig
from services.kv_store.errors import TierUnavailable
from services.kv_store.events import StoreEventPublisher
from services.kv_store.lmcache_server import LmcacheServer, register_lmcache_metrics
from services.kv_store.metrics import register_metrics
from services.kv_store.servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from services.kv_store.store import BlockStore
from services.kv_store.tiers.base import StoreTier
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import NOT_A_DIRECTORY, DiskTier, SharedFsTier, check_tier_root
from services.kv_store.tiers.mooncake import MooncakeTier

log = logging.getLogger(__name__)
MOONCAKE_RETRY_S = 5.0
SUBSCRIBER_WAIT_S = 5.0
"""How long the event publisher waits for kv_indexer's subscription before its first batch."""


class LazyMooncakeClient:
    """``MooncakeDistributedStore`` set up on first use; raises RuntimeError while the cluster is unreachable."""

    def __init__(self, config: KvStoreConfig) -> None:
        self._config = config
        self._client: Any = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                raise RuntimeError(f"mooncake master {self._config.mooncake_master} unreachable (retrying)")
            self._next_try = now + MOONCAKE_RETRY_S
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as exc:
                raise RuntimeError(f"the mooncake client is not installed (make mooncake-venv): {exc}") from exc
            c = self._config
            client = MooncakeDistributedStore()
            code = client.setup(
                c.mooncake_local_hostname,
                c.mooncake_metadata,
                c.mooncake_segment_bytes,
                c.mooncake_buffer_bytes,
                "tcp",
                "",
                c.mooncake_master,
            )
            if code != 0:
                raise RuntimeError(f"mooncake setup against {c.mooncake_master} returned {code}")
            log.info("mooncake client set up against %s", c.mooncake_master)
            self._client = client
            return client

    def upsert_parts(self, key: str, *parts: bytes) -> int:
        return int(self._get().upsert_parts(key, *parts))

    def get(self, key: str) -> bytes:
        return bytes(self._get().get(key))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return list(self._get().batch_is_exist(keys))

    def remove(self, key: str, force: bool = False) -> int:
        return int(self._get().remove(key, force))


def disk_tier_root(config: KvStoreConfig) -> Path:
    """``<disk_path>/<instance_id or 'default'>``: the disk tier's own directory."""
    instance = (config.instance_id or "default").replace("/", "_").replace(":", "_")
    return Path(config.disk_path) / instance


def check_tier_paths(config: KvStoreConfig) -> None:
    """Check the file tiers before anything starts (:func:`check_tier_root`).

    ``--disk-path`` (a local disk: a wrong path is a configuration error) is created when missing
    (its parent must exist), and so is the instance's directory in it; it must be a directory this
    process can write (a write probe: a read-only mount is caught here, not at the first demotion),
    else kv_store refuses to start. ``--shared-path`` that is a file is refused the same way. A
    shared path that is missing (a mount point is never created), fails its guard
    (``--shared-require-mount``: not a mount point; ``--shared-marker``: the marker file absent;
    both mean the filesystem is not mounted there) or is not writable is a **degraded start**
    (issue 8: the shared path missing or read-only, the service stays up): one ERROR line naming the
    option, the path and why, and the tier stays configured, so values reach it once the filesystem
    is mounted or writable again; until then each demotion to it fails over to the next tier
    (counted in ``kvmesh_kv_store_dropped_total``).

    An **unmounted** filesystem usually leaves an empty directory at its mount point: without a
    guard it exists and is writable, so it passes, and values would fill the local disk and be
    hidden once the filesystem mounts. Hence a WARNING at start when neither guard is set and the
    path is no mount point (on the same filesystem as its parent); the guards are off by default so
    that a plain directory (tests, ``make run``) works.

    Raises:
        ValueError: one line naming the option, the path and why (``kvmesh.server.main``: exit 2).
    """
    if config.disk_path:
        reason = check_tier_root(config.disk_path, create=True)
        if reason is None:
            reason = check_tier_root(disk_tier_root(config), create=True)
        if reason is not None:
            raise ValueError(f"--disk-path {config.disk_path}: {reason}")
    if config.shared_path:
        reason = check_tier_root(
            config.shared_path, create=False, require_mount=config.shared_require_mount, marker=config.shared_marker
        )
        if reason == NOT_A_DIRECTORY:
            raise ValueError(f"--shared-path {config.shared_path}: {reason}")
        if reason is not None:
            log.error("degraded mode tier=sharedfs --shared-path %s: %s; the tier stays configured and each demotion "
                      "to it goes on to the next tier until the path is usable",
                      config.shared_path, reason)
        elif not (config.shared_require_mount or config.shared_marker) and not os.path.ismount(config.shared_path):
            log.warning("--shared-path %s is not a mount point (the same filesystem as its parent) and no guard is "
                        "set: if the shared filesystem is not mounted there, values fill the local disk and are "
                        "hidden once it mounts; set --shared-require-mount (the path is the mount) or --shared-marker "
                        "(a file created once on the mounted filesystem)", config.shared_path)


def _host_port_problem(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` (port 1-65535), or None."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return "not host:port"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not 1-65535"
    return None


def mooncake_client_missing() -> str | None:
    """Why Mooncake's client binding (``mooncake.store``) cannot be imported here, or None (not imported:
    only looked up, so the native library loads on first use)."""
    try:
        found = importlib.util.find_spec("mooncake.store") is not None
    except (ImportError, ValueError) as exc:
        return f"the mooncake client is not installed (make mooncake-venv): {exc}"
    return None if found else "the mooncake client is not installed (make mooncake-venv): no module mooncake.store"


def check_mooncake(config: KvStoreConfig) -> list[str]:
    """Check the Mooncake tier before anything starts, as :func:`check_tier_paths` checks the shared path.

    ``--mooncake-master`` (and ``--mooncake-master-http`` when set) must be ``host:port``, and
    Mooncake's client (``mooncake.store``) importable. A failure is a **degraded start**: one ERROR
    line naming the option(s) and why (``degraded mode tier=mooncake --mooncake-master nothost: not
    host:port``, problems joined by ``; ``); the tier stays configured and each demotion to it goes on to the next tier (the
    run-time row of docs/degraded-modes.md), so the service stays up. Returns the problems (empty: none).
    """
    if not config.mooncake_master:
        return []
    problems = []
    bad = _host_port_problem(config.mooncake_master)
    if bad:
        problems.append(f"--mooncake-master {config.mooncake_master}: {bad}")
    if config.mooncake_master_http:
        bad = _host_port_problem(config.mooncake_master_http)
        if bad:
            problems.append(f"--mooncake-master-http {config.mooncake_master_http}: {bad}")
    missing = mooncake_client_missing()
    if missing:
        problems.append(f"--mooncake-master {config.mooncake_master}: {missing}")
    if problems:
        log.error("degraded mode tier=mooncake %s; the tier stays configured and each demotion to it goes on to "
                  "the next tier (none: the value is lost, counted)", "; ".join(problems))
    return problems


def build_tiers(config: KvStoreConfig) -> list[StoreTier]:
    """The configured tiers, fastest first (see the module docstring)."""
    tiers: list[StoreTier] = [CpuTier(config.cpu_capacity_bytes)]
    if config.disk_path:
        tiers.append(DiskTier(disk_tier_root(config), config.disk_capacity_bytes, config.disk_fsync))
    if config.shared_path:
        tiers.append(SharedFsTier(
            config.shared_path, config.shared_capacity_bytes, config.shared_fsync,
            require_mount=config.shared_require_mount, marker=config.shared_marker,
        ))
    if config.mooncake_master:
        client = LazyMooncakeClient(config)
        lister = mooncake_key_lister(config.mooncake_master_http) if config.mooncake_master_http else None
        tiers.append(MooncakeTier(client, config.mooncake_capacity_bytes, config.mooncake_namespace, lister))
    return tiers


MOONCAKE_LIST_TIMEOUT_S = 10.0


def mooncake_key_lister(master_http: str) -> Callable[[], list[str]]:
    """A blocking call returning every key the Mooncake cluster holds: ``GET http://<master_http>/get_all_keys``
    (mooncake_master 0.3.13.post1's HTTP port answers one key per line)."""

    def list_keys() -> list[str]:
        with urllib.request.urlopen(f"http://{master_http}/get_all_keys", timeout=MOONCAKE_LIST_TIMEOUT_S) as reply:
            text = reply.read().decode()
        return [line.strip() for line in text.splitlines() if line.strip()]

    return list_keys


async def rescan_mooncake(store: BlockStore) -> int:
    """Adopt and republish the Mooncake tier's values (:meth:`MooncakeTier.rescan`); 0 when the
    cluster cannot be listed (logged: a degraded start, the values are still served when read)."""
    adopted = 0
    for tier in store.tiers:
        if isinstance(tier, MooncakeTier):
            try:
                adopted += await tier.rescan()
            except TierUnavailable as exc:
                log.warning("mooncake rescan skipped: %s", exc)
    republished = store.adopt_rescanned()
    store.republished += republished
    if adopted:
        log.info("mooncake rescan: %d values adopted, %d republished", adopted, republished)
    return republished


def shared_domains(config: KvStoreConfig) -> list[str]:
    """Names of this instance's shared namespaces (``config.shared_domains``, else derived)."""
    if config.shared_domains:
        return list(config.shared_domains)
    domains = []
    if config.shared_path:
        domains.append(f"sharedfs:{os.path.realpath(config.shared_path)}")
    if config.mooncake_master:
        domains.append(f"mooncake:{config.mooncake_master}/{config.mooncake_namespace}")
    return domains


class EventSink:
    """Where the store's residency events go: buffered until the publisher exists (the gRPC port,
    which names the source, is known only once the server started), then published as they come."""

    def __init__(self) -> None:
        self.publisher: StoreEventPublisher | None = None
        self._early: list[list[KVEvent]] = []

    def __call__(self, events: list[KVEvent]) -> None:
        if self.publisher is None:
            self._early.append(events)
        else:
            self.publisher.publish(events)

    def attach(self, publisher: StoreEventPublisher) -> None:
        self.publisher = publisher
        for events in self._early:
            publisher.publish(events)
        self._early.clear()


def build_service(config: KvStoreConfig) -> GrpcService:
    """The kv_store as a GrpcService: the configured tiers behind one BlockStore and the servicer.

    With ``events_endpoint`` a background task publishes the store's residency (vLLM KV events)
    and registers the instance as a KV-event source in etcd (:mod:`services.kv_store.events`).

    Raises:
        ValueError: ``events_endpoint`` without ``events_model``; a disk or shared path that
            cannot hold its tier (:func:`check_tier_paths`).
    """
    if config.events_endpoint and not config.events_model:
        raise ValueError("--events-endpoint needs --events-model (the model whose blocks are published)")
    check_tier_paths(config)
    check_mooncake(config)
    sink = EventSink()
    store = BlockStore(
        build_tiers(config), write_through=config.write_through, promote_on_hit=config.promote_on_hit,
        on_events=sink if config.events_endpoint else None, tier_timeout_s=config.tier_timeout_s,
    )
    register_metrics(store)
    servicer = KVStoreServicer(
        store, config.get_chunk_bytes, config.max_inflight_put_bytes,
        block_size_tokens=config.events_block_size_tokens,
        put_budget_wait_s=config.put_budget_wait_s, put_idle_timeout_s=config.put_idle_timeout_s,
    )

    def add_servicers(server: grpc.aio.Server) -> None:
        add_to_server(servicer, server)

    async def publish_residency() -> None:
        publisher = StoreEventPublisher(
            config.events_endpoint, service.address, config.events_model,
            replay_endpoint=config.events_replay_endpoint, buffer_steps=config.events_buffer_steps,
        )
        source = Endpoint(
            id=EndpointId(service.address),
            url=f"grpc://{service.address}",
            model=config.events_model,
            block_size_tokens=config.events_block_size_tokens,
            events_endpoint=config.events_endpoint,
            labels={KV_SOURCE_LABEL: "kv_store", SHARED_DOMAINS_LABEL: ",".join(shared_domains(config))},
            instance_id=uuid.uuid4().hex,
            replay_endpoint=publisher.replay_endpoint,
        )
        registration = None
        if config.etcd_endpoints:
            registration = LeaseRegistration(
                config.etcd_endpoints, kv_source_key(source), source.to_json(), ttl_seconds=config.lease_ttl_seconds
            )
            await registration.start()
        if not await publisher.wait_subscribed(SUBSCRIBER_WAIT_S):
            log.warning("no subscriber on %s after %.0f s: publishing anyway (kv_indexer replays gaps)",
                        config.events_endpoint, SUBSCRIBER_WAIT_S)
        sink.attach(publisher)  # the rescanned blocks (store.republished) and any early puts, in order
        log.info("kv_store publishing residency: %d rescanned blocks republished", store.republished)
        try:
            await asyncio.Event().wait()
        finally:
            if registration is not None:
                with contextlib.suppress(Exception):
                    await registration.stop()
            publisher.shutdown()

    # LMCache's lm:// protocol on its own port, from the same store (reported as "lmcache" in the ports file)
    lmcache = LmcacheServer(
        store, budget=servicer.put_budget, max_connections=config.lmcache_max_connections,
        budget_wait_s=config.put_budget_wait_s, idle_timeout_s=config.put_idle_timeout_s,
    ) if config.lmcache_port is not None else None

    async def start_lmcache() -> None:
        if lmcache is not None and config.lmcache_port is not None:
            service.extra_ports["lmcache"] = await lmcache.start(config.host, config.lmcache_port)

    async def stop_lmcache() -> None:
        if lmcache is not None:
            await lmcache.stop()
        await servicer.detached.drain(5.0)  # moves of calls cancelled at shutdown land before the tiers close
        if store.abandoned:  # timed-out tier operations that just ended are settled (a hung one is left)
            await store.drain(1.0)

    async def start_rescan() -> None:
        if config.mooncake_master and config.mooncake_master_http:
            await rescan_mooncake(store)

    if lmcache is not None:
        register_lmcache_metrics(lmcache.stats)
    spec = ServiceSpec(
        name="kv_store", service_names=[SERVICE_NAME], add_servicers=add_servicers,
        on_start=[start_rescan, start_lmcache], on_stop=[stop_lmcache],
        background=[publish_residency] if config.events_endpoint else [],
    )
    service = GrpcService(config, spec)
    return service
