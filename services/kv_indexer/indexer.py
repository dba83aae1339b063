"""The kv_indexer core: membership changes and queries over one index, free of I/O.

:class:`BlockIndexer` applies etcd membership (as plain ``joined``/``left`` dicts) to the index,
the event pool and the event feed, in the order that keeps the membership fence:

- a leave: stop following the endpoint, purge it from the index (fence closes), drop its pool state;
- a join: register it in the index (fresh state, fence opens), apply the messages the pool held for
  it, then start following its events.

Queries (``score`` / ``lookup`` / ``stats``) are what the gRPC servicer exposes. The transport (ZMQ)
and the etcd watch are plugged in by :mod:`services.kv_indexer.pipeline`; here the feed is only the
:class:`EventFeed` port. Everything runs on one asyncio loop and the index is synchronous, so a
membership change and an event never interleave mid-update.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.events.pool import EventPool, IngestStats
from services.kv_indexer.index.base import BlockLocation, IndexStats, KVBlockIndex, ScoreResult

logger = logging.getLogger(__name__)


class EventFeed(Protocol):
    """Where the KV events of registered endpoints come from (the ZMQ subscriber in production)."""

    def follow(self, endpoint: Endpoint) -> None:
        """Start receiving ``endpoint``'s events (connect to it when it binds its publisher)."""

    def unfollow(self, endpoint_id: EndpointId) -> None:
        """Stop receiving the endpoint's events (disconnect when the feed connected to it)."""


@dataclass(frozen=True, slots=True)
class IndexerStats:
    index: IndexStats
    ingest: IngestStats


class BlockIndexer:
    """The index, its event pool and its event feed, kept in step with membership.

    Args:
        index: the block index queries read and events are applied to.
        pool: the ordered event workers feeding ``index`` (started and stopped by the caller).
        feed: the event source to follow and unfollow endpoints on.
    """

    def __init__(self, index: KVBlockIndex, pool: EventPool, feed: EventFeed) -> None:
        self.index = index
        self.pool = pool
        self.feed = feed

    def on_membership(self, joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        """Leaves first (purge, fence closes), then joins (fresh state, fence opens, held messages applied)."""
        for endpoint_id in left:
            self.feed.unfollow(endpoint_id)
            self.index.remove_endpoint(endpoint_id)
            self.pool.endpoint_left(endpoint_id)
            logger.info("purged endpoint=%s", endpoint_id)
        for endpoint_id, endpoint in joined.items():
            self.index.register_endpoint(endpoint)
            self.pool.endpoint_joined(endpoint_id)
            self.feed.follow(endpoint)
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
