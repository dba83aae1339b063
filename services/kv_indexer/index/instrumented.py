"""Metrics as a decorator around any :class:`KVBlockIndex` (llm-d's ``instrumented_index.go``).

Every call is forwarded unchanged; around it the decorator records events applied or skipped
(by type and :class:`ApplyOutcome`), Score time and matched blocks per medium, and exposes the
index's size as gauges read at scrape time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence

from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer import metrics
from services.kv_indexer.index.base import (
    ApplyOutcome,
    BlockLocation,
    EngineBlockHash,
    IndexEvent,
    IndexStats,
    KVBlockIndex,
    ScoreResult,
)


class InstrumentedIndex:
    """A :class:`KVBlockIndex` that records :mod:`services.kv_indexer.metrics` around ``inner``."""

    def __init__(self, inner: KVBlockIndex) -> None:
        self.inner = inner
        block_count = getattr(inner, "block_count", None)
        metrics.track_index_size(
            block_count if callable(block_count) else (lambda: inner.stats().blocks),
            lambda: len(inner.registered()),
        )

    def register_endpoint(self, endpoint: Endpoint) -> None:
        self.inner.register_endpoint(endpoint)

    def remove_endpoint(self, endpoint_id: EndpointId) -> bool:
        return self.inner.remove_endpoint(endpoint_id)

    def registered(self) -> Mapping[EndpointId, Endpoint]:
        return self.inner.registered()

    def is_registered(self, endpoint_id: EndpointId) -> bool:
        return self.inner.is_registered(endpoint_id)

    def apply(self, endpoint_id: EndpointId, event: IndexEvent) -> ApplyOutcome:
        outcome = self.inner.apply(endpoint_id, event)
        metrics.record_event(type(event).__name__, outcome.value)
        return outcome

    def apply_batch(self, endpoint_id: EndpointId, events: Sequence[IndexEvent]) -> list[ApplyOutcome]:
        """The inner index's ``apply_batch`` (else ``apply`` per event); metrics counted once per
        (event type, outcome) of the batch."""
        inner_batch = getattr(self.inner, "apply_batch", None)
        if inner_batch is not None:
            outcomes: list[ApplyOutcome] = inner_batch(endpoint_id, events)
        else:
            outcomes = [self.inner.apply(endpoint_id, event) for event in events]
        kinds = list(map(type, events))
        stored, removed = kinds.count(BlockStored), kinds.count(BlockRemoved)
        if stored + removed == len(kinds) and outcomes.count(ApplyOutcome.APPLIED) == len(kinds):  # the common batch
            if stored:
                metrics.record_event("BlockStored", "applied", stored)
            if removed:
                metrics.record_event("BlockRemoved", "applied", removed)
            return outcomes
        for (kind, outcome), count in Counter(zip(kinds, outcomes, strict=True)).items():
            metrics.record_event(kind.__name__, outcome.value, count)
        return outcomes

    def score(
        self,
        model: str,
        token_ids: Sequence[int],
        endpoint_ids: Sequence[EndpointId] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> ScoreResult:
        start = time.perf_counter()
        result = self.inner.score(model, token_ids, endpoint_ids, scope)
        hits: Counter[str] = Counter()
        for score in result.scores:
            for medium, count in score.matched_blocks_by_medium.items():
                hits[str(medium)] += count
        metrics.record_score(time.perf_counter() - start, hits)
        return result

    def lookup(self, model: str, token_ids: Sequence[int], scope: KeyScope = DEFAULT_SCOPE) -> list[BlockLocation]:
        return self.inner.lookup(model, token_ids, scope)

    def stats(self) -> IndexStats:
        return self.inner.stats()

    def held_blocks(self, endpoint_id: EndpointId) -> dict[EngineBlockHash, frozenset[Medium]]:
        return self.inner.held_blocks(endpoint_id)

    def forget_blocks(self, endpoint_id: EndpointId) -> int:
        """The inner index's ``forget_blocks`` (an ``AllBlocksCleared`` where it has none)."""
        forget = getattr(self.inner, "forget_blocks", None)
        if forget is not None:
            return int(forget(endpoint_id))
        held = len(self.inner.held_blocks(endpoint_id))
        self.inner.apply(endpoint_id, AllBlocksCleared())
        return held

    def dump(self) -> list[tuple[EndpointId, IndexEvent]]:
        return self.inner.dump()
