"""The kv_indexer core: membership, incarnations, recovery states and queries over one index, free of I/O.

:class:`BlockIndexer` applies etcd membership (as plain ``joined``/``left`` dicts) to the index,
the event pool and the event feed:

- a join of a *new incarnation* (an address never seen, or seen with another
  ``Endpoint.instance_id``): the old entries are purged, the endpoint starts empty, its held
  messages are sequenced, its events followed;
- a join of the *same incarnation* (a lease that expired during an etcd pause, re-granted): its
  entries, which kept following its events while it was away, are scored again;
- a leave: the endpoint stops being scored at once, but its entries and its event stream are kept
  for ``departed_retention_seconds`` (a lease lost to an etcd outage is not an engine lost);
  after that :meth:`expire_departed` purges it and closes the fence.

Score answers per model with an :class:`IndexState`: ``WARMING`` until the indexer is warm
(snapshot loaded and startup recoveries done), ``LOAD_ONLY`` while the model has a parity mismatch,
else ``READY``; endpoints whose stream is ``recovering`` (a gap being replayed) are returned as
*unknown* rather than scored (their entries cannot be vouched for). A loss no replay can serve is
healed by the event pool (older entries forgotten, live again), so no endpoint stays unscored for it.

The transport (ZMQ) and the etcd watch are plugged in by :mod:`services.kv_indexer.pipeline`;
here the feed is only the :class:`EventFeed` port. Everything runs on one asyncio loop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.errors import UnknownEndpoint, quoted
from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.kv_reach import split_label
from kvmesh.prefix_index import ReplicaEndpoint
from kvmesh.types import KV_STORES_LABEL, SHARED_DOMAINS_LABEL, Endpoint, EndpointId
from services.kv_indexer import metrics
from services.kv_indexer.events.pool import EndpointState, EventPool, IngestStats
from services.kv_indexer.index.base import BlockLocation, EngineBlockHash, IndexStats, KVBlockIndex, ScoreResult
from services.kv_indexer.index.residency import ResidencyLog
from services.kv_indexer.parity import ParityMonitor
from services.kv_indexer.reach import build_reach, fold_lookup, fold_scores, is_source

logger = logging.getLogger(__name__)


class EventFeed(Protocol):
    """Where the KV events of registered endpoints come from (the ZMQ subscriber in production)."""

    def follow(self, endpoint: Endpoint) -> None:
        """Start receiving ``endpoint``'s events (connect to it when it binds its publisher)."""

    def unfollow(self, endpoint_id: EndpointId) -> None:
        """Stop receiving the endpoint's events (disconnect when the feed connected to it)."""


class IndexState(enum.StrEnum):
    """What a Score answer is worth (mirrors ``kvmesh.kv_indexer.v1.IndexState``)."""

    READY = "ready"
    WARMING = "warming"
    LOAD_ONLY = "load_only"


DEPARTED = "departed"
"""Recovery-state label of an endpoint that left etcd and is retained, not scored."""


@dataclass(frozen=True, slots=True)
class IndexerScore:
    """A Score answer: the index's result, the state it was given in, and the endpoints whose
    entries are unknown (recovering streams, not scored)."""

    result: ScoreResult
    state: IndexState
    unknown: list[EndpointId] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class IndexerStats:
    index: IndexStats
    ingest: IngestStats
    states: dict[EndpointId, str] = field(default_factory=dict)
    ready: bool = True
    parity_mismatches: dict[EndpointId, str] = field(default_factory=dict)


class BlockIndexer:
    """The index, its event pool and its event feed, kept in step with membership.

    Args:
        index: the block index queries read and events are applied to.
        pool: the ordered event workers feeding ``index`` (started and stopped by the caller).
        feed: the event source to follow and unfollow endpoints on.
        parity: the parity monitor the pool reports to (a fresh one when None).
        departed_retention_seconds: how long a departed endpoint's entries are kept for a rejoin.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        index: KVBlockIndex,
        pool: EventPool,
        feed: EventFeed,
        parity: ParityMonitor | None = None,
        departed_retention_seconds: float = 120.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.index = index
        self.pool = pool
        self.feed = feed
        self.parity = parity or ParityMonitor()
        self._retention = departed_retention_seconds
        self._clock = clock or time.monotonic
        self._departed: dict[EndpointId, float] = {}
        self.ready = True
        self._status_listeners: list[Callable[[], None]] = []

    def add_status_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` after every membership change (join, leave, purge): the ``Watch`` streams'
        wake-up, so a departure reaches epp's replicas at once rather than at their next status poll.
        It must be cheap (set a flag)."""
        self._status_listeners.append(listener)

    def remove_status_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._status_listeners:
            self._status_listeners.remove(listener)

    def _status_changed(self) -> None:
        for listener in list(self._status_listeners):
            listener()

    def on_membership(self, joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        """Leaves first (no longer scored, retained), then joins (same incarnation: kept; new: fresh)."""
        try:
            self._on_membership(joined, left)
        finally:
            self._status_changed()

    def _on_membership(self, joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        now = self._clock()
        for endpoint_id in left:
            if endpoint_id in joined or not self.index.is_registered(endpoint_id):
                continue
            self._departed[endpoint_id] = now
            self.pool.endpoint_departed(endpoint_id)
            logger.info("endpoint departed id=%s: not scored, entries kept %.0fs for a rejoin", endpoint_id, self._retention)
        for endpoint in joined.values():
            self.join(endpoint)

    def join(self, endpoint: Endpoint) -> bool:
        """Register ``endpoint``; True when it is a new incarnation (it starts empty)."""
        endpoint_id = endpoint.id
        previous = self.index.registered().get(endpoint_id)
        same = (
            previous is not None
            and previous.instance_id == endpoint.instance_id
            and previous.model == endpoint.model
            and previous.block_size_tokens == endpoint.block_size_tokens
        )
        if previous is not None and not same and previous.instance_id != endpoint.instance_id:
            metrics.record_incarnation("instance_id")
            logger.info(
                "endpoint=%s new incarnation instance_id=%s (was %s): old entries purged",
                endpoint_id, endpoint.instance_id or "-", previous.instance_id or "-",
            )
        self._departed.pop(endpoint_id, None)
        self.index.register_endpoint(endpoint)
        self.parity.register(endpoint)
        self.pool.endpoint_joined(endpoint, new_incarnation=not same)
        self.feed.follow(endpoint)
        logger.info(
            "indexing endpoint=%s model=%s block_size_tokens=%d instance_id=%s events=%s replay=%s (%s)",
            endpoint_id, endpoint.model, endpoint.block_size_tokens, endpoint.instance_id or "-",
            endpoint.events_endpoint or "-", endpoint.replay_endpoint or "-", "same incarnation" if same else "fresh",
        )
        return not same

    def purge(self, endpoint_id: EndpointId) -> None:
        """Forget an endpoint now: entries, stream, parity state; its late events are dropped."""
        self._departed.pop(endpoint_id, None)
        self.feed.unfollow(endpoint_id)
        self.index.remove_endpoint(endpoint_id)
        self.pool.endpoint_left(endpoint_id)
        self.parity.forget(endpoint_id)
        logger.info("purged endpoint=%s", endpoint_id)

    def expire_departed(self) -> list[EndpointId]:
        """Purge departed endpoints older than the retention; returns them."""
        now = self._clock()
        expired = [eid for eid, since in self._departed.items() if now - since >= self._retention]
        for endpoint_id in expired:
            self.purge(endpoint_id)
        if expired:
            self._status_changed()
        return expired

    def departed(self) -> set[EndpointId]:
        return set(self._departed)

    def score(
        self,
        model: str,
        token_ids: Sequence[int],
        endpoint_ids: Sequence[EndpointId] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> IndexerScore:
        """Engines' prefix matches; kv_store sources are never scored themselves, their blocks count
        for the engines that reach them (:mod:`services.kv_indexer.reach`)."""
        answer = self._score(model, token_ids, endpoint_ids, scope)
        sources = self._sources(model)
        if not sources or answer.state is not IndexState.READY:
            return answer
        result = answer.result
        engines = {s.endpoint_id: s for s in result.scores if s.endpoint_id not in sources}
        registered = self.index.registered()
        excluded = set(answer.unknown) | self._departed.keys()
        allowed = [
            e for e in (endpoint_ids or [e for e, ep in registered.items() if ep.model == model])
            if e in registered and e not in sources and e not in excluded
        ]
        reach = build_reach(registered, self._live(sources))
        if reach.reaches_any(allowed):
            locations = self.index.lookup(model, token_ids, scope)
            for folded in fold_scores(locations, reach, allowed, result.block_size_tokens):
                own = engines.get(folded.endpoint_id)
                if own is None or folded.matched_blocks >= own.matched_blocks:
                    held = own.matched_blocks if own is not None else 0
                    engines[folded.endpoint_id] = dataclasses.replace(folded, reached_blocks=folded.matched_blocks - held)
        scores = sorted(engines.values(), key=lambda s: (-s.matched_blocks, s.endpoint_id))
        return IndexerScore(ScoreResult(scores, result.total_blocks, result.block_size_tokens), answer.state, answer.unknown)

    def _sources(self, model: str) -> set[EndpointId]:
        return {e for e, ep in self.index.registered().items() if ep.model == model and is_source(ep)}

    def _live(self, ids: set[EndpointId]) -> set[EndpointId]:
        states = self.pool.states()
        return {e for e in ids if states.get(e, EndpointState.LIVE) is EndpointState.LIVE and e not in self._departed}

    def _score(
        self,
        model: str,
        token_ids: Sequence[int],
        endpoint_ids: Sequence[EndpointId] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> IndexerScore:
        if not self.ready:
            return IndexerScore(ScoreResult([], 0, 0), IndexState.WARMING)
        if self.parity.load_only(model):
            return IndexerScore(ScoreResult([], 0, 0), IndexState.LOAD_ONLY)
        registered = self.index.registered()
        states = self.pool.states()
        candidates = (
            list(endpoint_ids) if endpoint_ids
            else [e for e, ep in registered.items() if ep.model == model and not is_source(ep)]
        )
        unknown = [
            e for e in candidates
            if e in registered and states.get(e, EndpointState.LIVE) is not EndpointState.LIVE and e not in self._departed
        ]
        excluded = set(unknown) | self._departed.keys()
        if excluded.intersection(candidates):
            allowed = [e for e in candidates if e not in excluded]
            if not allowed:
                result = self.index.score(model, token_ids, [EndpointId("")], scope)
                return IndexerScore(ScoreResult([], result.total_blocks, result.block_size_tokens), IndexState.READY, unknown)
            return IndexerScore(self.index.score(model, token_ids, allowed, scope), IndexState.READY, unknown)
        return IndexerScore(self.index.score(model, token_ids, endpoint_ids, scope), IndexState.READY, unknown)

    def lookup(self, model: str, token_ids: Sequence[int], scope: KeyScope = DEFAULT_SCOPE) -> list[BlockLocation]:
        """Holders of each block; kv_store sources' blocks folded into the engines that reach them."""
        locations = self.index.lookup(model, token_ids, scope)
        sources = self._sources(model)
        if not sources:
            return locations
        registered = self.index.registered()
        engines = [e for e, ep in registered.items() if ep.model == model and not is_source(ep) and e not in self._departed]
        return fold_lookup(locations, build_reach(registered, self._live(sources)), sources, engines)

    # -- replicas (Watch) ---------------------------------------------------------------------

    def _residency_index(self) -> object | None:
        inner = getattr(self.index, "inner", self.index)
        return inner if hasattr(inner, "residency_snapshot") else None

    def open_residency(self, max_keys: int = 1_000_000) -> ResidencyLog | None:
        """The index's residency log, attached on first use (None: this backend cannot feed replicas)."""
        inner = self._residency_index()
        if inner is None:
            return None
        log: ResidencyLog | None = getattr(inner, "residency", None)
        if log is None:
            log = ResidencyLog(max_keys)
            inner.residency = log  # type: ignore[attr-defined]
        return log

    def close_residency(self) -> None:
        """Stop recording once no watcher listens (ingest then pays nothing for replicas)."""
        inner = self._residency_index()
        log: ResidencyLog | None = getattr(inner, "residency", None) if inner is not None else None
        if log is not None and not log.listeners:
            inner.residency = None  # type: ignore[attr-defined]

    def residency_snapshot(self) -> list[tuple[EndpointId, str, list[int]]]:
        """``(endpoint, medium, keys)`` for every holding of the index (see ``InMemoryIndex``)."""
        inner = self._residency_index()
        return inner.residency_snapshot() if inner is not None else []  # type: ignore[attr-defined]

    def watch_endpoints(self) -> list[ReplicaEndpoint]:
        """Every registered endpoint with the state Score treats it by (``live`` is scored)."""
        states = self.pool.states()
        return [
            ReplicaEndpoint(
                e, ep.model, ep.block_size_tokens,
                DEPARTED if e in self._departed else str(states.get(e, EndpointState.LIVE)), is_source(ep),
                kv_stores=tuple(split_label(ep.labels.get(KV_STORES_LABEL, ""))),
                shared_domains=tuple(split_label(ep.labels.get(SHARED_DOMAINS_LABEL, ""))),
                reach_listed=True,
            )
            for e, ep in sorted(self.index.registered().items())
        ]

    def endpoint_blocks(self, endpoint_id: EndpointId) -> tuple[list[EngineBlockHash], str]:
        """The engine block hashes the index holds for ``endpoint_id`` (any medium, orphans included,
        ascending) and its state as Score treats it (``live``, ``recovering``, ``departed``).

        Raises:
            UnknownEndpoint: the index does not know ``endpoint_id``: never registered (or not yet:
                kv_indexer learns membership from etcd), or purged after its departed retention.
        """
        if not self.index.is_registered(endpoint_id):
            warming = "" if self.ready else "; the index is still warming up"
            raise UnknownEndpoint(
                f"endpoint {quoted(endpoint_id)!r} is not in the index (never registered, not yet seen in etcd, or purged "
                f"{self._retention:.0f}s after it departed){warming}")
        state = DEPARTED if endpoint_id in self._departed else str(self.pool.states().get(endpoint_id, EndpointState.LIVE))
        return sorted(self.index.held_blocks(endpoint_id)), state

    def load_only_models(self) -> list[str]:
        models = {ep.model for ep in self.index.registered().values()}
        return sorted(m for m in models if self.parity.load_only(m))

    def state_counts(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for endpoint_id, state in self.pool.states().items():
            counts[DEPARTED if endpoint_id in self._departed else str(state)] += 1
        return counts

    def stats(self) -> IndexerStats:
        states: dict[EndpointId, str] = {e: str(s) for e, s in self.pool.states().items()}
        for endpoint_id in self._departed:
            states[endpoint_id] = DEPARTED
        return IndexerStats(
            self.index.stats(), self.pool.stats, states, self.ready, self.parity.mismatches()
        )
