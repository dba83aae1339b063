"""The kv_indexer pipeline, wired: etcd membership -> ZMQ subscriber -> event pool -> index -> scores.

| stage | component | does |
| --- | --- | --- |
| snapshot | :mod:`services.kv_indexer.snapshot` | warm start: index + stream positions restored, saved periodically and on stop |
| membership | :class:`kvmesh.membership.EndpointWatcher` | join (same / new incarnation), leave (departed, retained), purge after retention |
| transport | :class:`~services.kv_indexer.events.subscriber.ZmqSubscriber` | SUB socket bound for engines that connect, connected to engines that bind |
| ordering | :class:`~services.kv_indexer.events.pool.EventPool` | exactly once, in seq order; gaps replayed (:class:`~services.kv_indexer.events.replay.ZmqReplayer`), losses healed, quiet tails probed |
| state | :class:`~services.kv_indexer.index.base.KVBlockIndex` | block keys -> endpoints and media |
| queries | :class:`~services.kv_indexer.indexer.BlockIndexer` | ``score`` / ``lookup`` / ``stats``, what the gRPC servicer exposes |

Start order: bind the SUB socket, start the pool, load the snapshot, follow etcd (first load), then
ask every registered endpoint's replay buffer for what it published since the snapshot (from seq 0
without one). :meth:`ready` returns once those recoveries settled (or ``warmup_timeout_seconds``):
until then health is NOT_SERVING and Score answers ``WARMING``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvmesh.membership import KV_SOURCES_PREFIX, EndpointWatcher
from services.kv_indexer import metrics, snapshot
from services.kv_indexer.config import KvIndexerConfig
from services.kv_indexer.events.pool import EventPool
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.events.subscriber import ZmqSubscriber
from services.kv_indexer.index.base import KVBlockIndex
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.parity import ParityMonitor

logger = logging.getLogger(__name__)

_MAINTAIN_SECONDS = 1.0


class IndexerPipeline:
    """Owns the pipeline's components; ``start()``/``stop()`` bracket it, ``receive()`` and
    ``maintain()`` are background loops, ``ready()`` gates health, ``indexer`` is the core."""

    def __init__(self, config: KvIndexerConfig, index: KVBlockIndex) -> None:
        self.config = config
        self.parity = ParityMonitor()
        self.replayer = ZmqReplayer()
        self.pool = EventPool(
            index,
            workers=config.event_workers,
            queue_size=config.event_queue_size_messages,
            pending_batches=config.pending_batches_per_endpoint,
            pending_ttl_seconds=config.pending_ttl_seconds,
            replayer=self.replayer,
            replay_timeout_seconds=config.replay_timeout_seconds,
            recovery_buffer_messages=config.recovery_buffer_messages,
            parity=self.parity,
            tail_probe_quiet_seconds=config.tail_probe_quiet_seconds,
            tail_probe_timeout_seconds=config.tail_probe_timeout_seconds,
            tail_probe_attempts=config.tail_probe_attempts,
            tail_probe_max_per_second=config.tail_probe_max_per_second,
            tail_probe_concurrency=config.tail_probe_concurrency,
            tail_probe_idle_max_seconds=config.tail_probe_idle_max_seconds,
            departed_retention_seconds=config.departed_retention_seconds,
        )
        self.subscriber = ZmqSubscriber(self.pool, config.events_bind_endpoint, config.zmq_rcvhwm_messages)
        self.indexer = BlockIndexer(
            index, self.pool, self.subscriber, self.parity, departed_retention_seconds=config.departed_retention_seconds
        )
        self.indexer.ready = False
        metrics.set_ready(False)
        orphan_count = getattr(index, "orphan_count", None)
        inner = getattr(index, "inner", None)
        if orphan_count is None and inner is not None:
            orphan_count = getattr(inner, "orphan_count", None)
        metrics.track_states(self.indexer.state_counts, orphan_count if callable(orphan_count) else (lambda: 0.0))
        self.watcher: EndpointWatcher | None = None
        self.source_watcher: EndpointWatcher | None = None
        """kv_store instances publishing KV events (``/kvmesh/v1/kv_sources/``): indexed like endpoints."""

    async def start(self) -> None:
        """Bind, start the pool, restore the snapshot, follow etcd, start the startup recoveries."""
        self.subscriber.start()
        self.pool.start()
        restored = snapshot.load(self.indexer, self.config.snapshot_path) if self.config.snapshot_path else set()
        if self.config.etcd_endpoints:
            self.watcher = EndpointWatcher(self.config.etcd_endpoints)
            self.watcher.add_listener(self.indexer.on_membership)
            await self.watcher.start()
            self.source_watcher = EndpointWatcher(self.config.etcd_endpoints, root=KV_SOURCES_PREFIX)
            self.source_watcher.add_listener(self.indexer.on_membership)
            await self.source_watcher.start()
            live = {**self.watcher.snapshot(), **self.source_watcher.snapshot()}
            for endpoint_id in restored - live.keys():
                self.indexer.on_membership({}, {endpoint_id: self.indexer.index.registered()[endpoint_id]})
        else:
            logger.warning("no etcd endpoints: no endpoint will ever be registered, events are held then dropped")
        for endpoint in list(self.indexer.index.registered().values()):
            if endpoint.id not in self.indexer.departed():
                self.pool.recover(endpoint, "startup")

    async def ready(self) -> None:
        """Return once the startup recoveries settled (or the warm-up deadline passed)."""
        try:
            await asyncio.wait_for(self.pool.settled(), self.config.warmup_timeout_seconds)
        except TimeoutError:
            logger.warning("warm-up took over %.0fs: serving with recoveries still running", self.config.warmup_timeout_seconds)
        self.indexer.ready = True
        metrics.set_ready(True)
        logger.info("kv index warm: %s", dict(self.indexer.state_counts()))

    async def receive(self) -> None:
        await self.subscriber.run()

    async def maintain(self) -> None:
        """Purge departed endpoints past their retention; snapshot every ``snapshot_interval_seconds``."""
        loop = asyncio.get_running_loop()
        next_snapshot = loop.time() + self.config.snapshot_interval_seconds
        while True:
            await asyncio.sleep(_MAINTAIN_SECONDS)
            self.indexer.expire_departed()
            if self.config.snapshot_path and self.indexer.ready and loop.time() >= next_snapshot:
                next_snapshot = loop.time() + self.config.snapshot_interval_seconds
                self.save_snapshot()

    def save_snapshot(self) -> None:
        try:
            snapshot.save(self.indexer, self.config.snapshot_path)
        except OSError as exc:
            logger.error("snapshot failed path=%s error=%s", self.config.snapshot_path, exc)

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.source_watcher is not None:
            await self.source_watcher.stop()
        self.subscriber.close()
        await self.pool.shutdown()
        if self.config.snapshot_path and self.indexer.ready:
            self.save_snapshot()
        with contextlib.suppress(Exception):
            self.replayer.close()
