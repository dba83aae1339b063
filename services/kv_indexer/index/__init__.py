"""The KV-block index: contract (:mod:`.base`), in-memory backend, metrics decorator."""

from services.kv_indexer.index.base import (
    ApplyOutcome,
    BlockLocation,
    EndpointIndexStats,
    EndpointScore,
    IndexEvent,
    IndexStats,
    KeyedBlockStored,
    KVBlockIndex,
    ScoreResult,
)
from services.kv_indexer.index.in_memory import InMemoryIndex
from services.kv_indexer.index.instrumented import InstrumentedIndex

__all__ = [
    "ApplyOutcome",
    "BlockLocation",
    "EndpointIndexStats",
    "EndpointScore",
    "InMemoryIndex",
    "IndexEvent",
    "IndexStats",
    "InstrumentedIndex",
    "KVBlockIndex",
    "KeyedBlockStored",
    "ScoreResult",
]
