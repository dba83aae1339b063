"""The kv_indexer pipeline, wired: etcd membership -> ZMQ subscriber -> event pool -> index -> scores.

| stage | component | does |
| --- | --- | --- |
| membership | :class:`kvmesh.membership.EndpointWatcher` | join: register in the index (fence opens), connect to binding engines; leave: purge |
| transport | :class:`~services.kv_indexer.events.subscriber.ZmqSubscriber` | SUB socket bound for engines that connect, connected to engines that bind |
| ordering | :class:`~services.kv_indexer.events.pool.EventPool` | per-endpoint order, sequence gaps, decode, bad messages dropped |
| state | :class:`~services.kv_indexer.index.base.KVBlockIndex` | block keys -> endpoints and media |
| queries | ``score`` / ``lookup`` / ``stats`` | what the gRPC servicer exposes |

Everything runs on one asyncio loop; the index is synchronous, so a membership change and an
event never interleave mid-update.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.membership import EndpointWatcher
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.config import KvIndexerConfig
from services.kv_indexer.events.pool import EventPool, IngestStats
from services.kv_indexer.events.subscriber import ZmqSubscriber
from services.kv_indexer.index.base import BlockLocation, IndexStats, KVBlockIndex, ScoreResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IndexerStats:
    index: IndexStats
    ingest: IngestStats


class KvIndexer:
    """Owns the pipeline's components; ``start()``/``stop()`` bracket it, ``receive()`` is the
    background receive loop."""

    def __init__(self, config: KvIndexerConfig, index: KVBlockIndex) -> None:
        self.config = config
        self.index = index
        self.pool = EventPool(
            index,
            workers=config.event_workers,
            queue_size=config.event_queue_size_messages,
            pending_batches=config.pending_batches_per_endpoint,
            pending_ttl_seconds=config.pending_ttl_seconds,
        )
        self.subscriber = ZmqSubscriber(self.pool, config.events_bind_endpoint, config.zmq_rcvhwm_messages)
        self.watcher: EndpointWatcher | None = None

    async def start(self) -> None:
        """Bind the SUB socket, start the pool, then follow etcd (returns after the first load)."""
        self.subscriber.start()
        self.pool.start()
        if self.config.etcd_endpoints:
            self.watcher = EndpointWatcher(self.config.etcd_endpoints)
            self.watcher.add_listener(self.on_membership)
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

    def on_membership(self, joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        """Leaves first (purge, fence closes), then joins (fresh state, fence opens, held messages applied)."""
        for endpoint_id in left:
            self.subscriber.unfollow(endpoint_id)
            self.index.remove_endpoint(endpoint_id)
            self.pool.endpoint_left(endpoint_id)
            logger.info("purged endpoint=%s", endpoint_id)
        for endpoint_id, endpoint in joined.items():
            self.index.register_endpoint(endpoint)
            self.pool.endpoint_joined(endpoint_id)
            self.subscriber.follow(endpoint)
            logger.info(
                "indexing endpoint=%s model=%s block_size_tokens=%d events_endpoint=%s",
                endpoint_id, endpoint.model, endpoint.block_size_tokens, endpoint.events_endpoint or "-",
            )

    def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[EndpointId] | None = None) -> ScoreResult:
        return self.index.score(model, token_ids, endpoint_ids)

    def lookup(self, model: str, token_ids: Sequence[int]) -> list[BlockLocation]:
        return self.index.lookup(model, token_ids)

    def stats(self) -> IndexerStats:
        return IndexerStats(self.index.stats(), self.pool.stats)
