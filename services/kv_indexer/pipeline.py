"""The kv_indexer pipeline, wired: etcd membership -> ZMQ subscriber -> event pool -> index -> scores.

| stage | component | does |
| --- | --- | --- |
| membership | :class:`kvmesh.membership.EndpointWatcher` | join: register in the index (fence opens), connect to binding engines; leave: purge |
| transport | :class:`~services.kv_indexer.events.subscriber.ZmqSubscriber` | SUB socket bound for engines that connect, connected to engines that bind |
| ordering | :class:`~services.kv_indexer.events.pool.EventPool` | per-endpoint order, sequence gaps, decode, bad messages dropped |
| state | :class:`~services.kv_indexer.index.base.KVBlockIndex` | block keys -> endpoints and media |
| queries | :class:`~services.kv_indexer.indexer.BlockIndexer` | ``score`` / ``lookup`` / ``stats``, what the gRPC servicer exposes |

This module owns the I/O (the SUB socket and the etcd watch) and their lifetime; the pure core,
:class:`~services.kv_indexer.indexer.BlockIndexer`, takes membership changes as plain dicts.
"""

from __future__ import annotations

import logging

from kvmesh.membership import EndpointWatcher
from services.kv_indexer.config import KvIndexerConfig
from services.kv_indexer.events.pool import EventPool
from services.kv_indexer.events.subscriber import ZmqSubscriber
from services.kv_indexer.index.base import KVBlockIndex
from services.kv_indexer.indexer import BlockIndexer

logger = logging.getLogger(__name__)


class IndexerPipeline:
    """Owns the pipeline's components; ``start()``/``stop()`` bracket it, ``receive()`` is the
    background receive loop and ``indexer`` the core the servicer queries."""

    def __init__(self, config: KvIndexerConfig, index: KVBlockIndex) -> None:
        self.config = config
        self.pool = EventPool(
            index,
            workers=config.event_workers,
            queue_size=config.event_queue_size_messages,
            pending_batches=config.pending_batches_per_endpoint,
            pending_ttl_seconds=config.pending_ttl_seconds,
        )
        self.subscriber = ZmqSubscriber(self.pool, config.events_bind_endpoint, config.zmq_rcvhwm_messages)
        self.indexer = BlockIndexer(index, self.pool, self.subscriber)
        self.watcher: EndpointWatcher | None = None

    async def start(self) -> None:
        """Bind the SUB socket, start the pool, then follow etcd (returns after the first load)."""
        self.subscriber.start()
        self.pool.start()
        if self.config.etcd_endpoints:
            self.watcher = EndpointWatcher(self.config.etcd_endpoints)
            self.watcher.add_listener(self.indexer.on_membership)
            await self.watcher.start()
        else:
            logger.warning("no etcd endpoints: no endpoint will ever be registered, events are held then dropped")

    async def receive(self) -> None:
        await self.subscriber.run()

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        self.subscriber.close()
        await self.pool.shutdown()
