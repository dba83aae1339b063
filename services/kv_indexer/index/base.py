"""The KV-block index contract (:class:`KVBlockIndex`) and the core nouns it speaks.

An index maps kvmesh's own block keys (:func:`kvmesh.hashing.block_keys`: chained 64-bit keys
over token ids, full blocks only, one key space per ``(model, block_size_tokens)``) to the
endpoints holding each block and on which :class:`~kvmesh.types.Medium`. Per endpoint it also
maps the engine's block hashes (uint64, :func:`kvmesh.hashing.external_hash_to_int`) to those
keys, so a ``BlockRemoved`` (which carries only engine hashes) works without knowing the
engine's hash seed or algorithm.

Modelled on llm-d's ``pkg/kvcache/kvblock/index.go`` (lookup/add/evict behind one interface,
metrics as a decorator) and Dynamo's ``lib/kv-router/src/indexer/traits.rs`` (apply an event,
remove a worker, dump state as replayable events). Unlike llm-d's, the contract is synchronous:
the in-memory backend does no I/O and its callers (one asyncio loop) never block on it.

Fence: only endpoints registered with :meth:`KVBlockIndex.register_endpoint` have their events
applied; :meth:`KVBlockIndex.remove_endpoint` purges one, and events arriving for it later are
ignored (:attr:`ApplyOutcome.UNREGISTERED`) until it registers again, which starts it from an
empty state. Entries belong to one *incarnation* (``Endpoint.instance_id``): registering the same
address with another instance id purges the old entries first.

Chains without their parents: a ``BlockStored`` whose parent hash nobody is known to hold is kept
by its engine hashes (:attr:`ApplyOutcome.ORPHANED`); its kvmesh keys resolve as soon as the
parent's key is known (the parent stored by any endpoint of the key space, or a prompt scored
whose engine hashes the index can compute from the registration's ``hash_algo``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.types import Endpoint, EndpointId, Medium

BlockKey = int
"""kvmesh's own 64-bit chained block key (:func:`kvmesh.hashing.block_keys`)."""

EngineBlockHash = int
"""An engine's block hash as uint64 (:func:`kvmesh.hashing.external_hash_to_int`)."""


@dataclass(frozen=True, slots=True)
class KeyedBlockStored:
    """A ``BlockStored`` whose kvmesh keys are already computed: what :meth:`KVBlockIndex.dump`
    emits (the index keeps keys, not token ids). ``block_keys[i]`` belongs to ``block_hashes[i]``.

    Replaying these into an index where the endpoint is registered rebuilds its state exactly.
    """

    block_hashes: tuple[EngineBlockHash, ...]
    block_keys: tuple[BlockKey, ...]
    block_size: int
    medium: Medium = Medium.GPU


IndexEvent = BlockStored | BlockRemoved | AllBlocksCleared | KeyedBlockStored
"""What :meth:`KVBlockIndex.apply` accepts: vLLM's wire events (``kvmesh.kv_events``) or a dump."""


class ApplyOutcome(enum.StrEnum):
    """Result of applying one event; a low-cardinality metric label."""

    APPLIED = "applied"
    """The event was applied (including an idempotent repeat of a known block)."""
    UNREGISTERED = "unregistered"
    """The endpoint is not registered (never joined, or left): ignored."""
    ORPHANED = "orphaned"
    """A ``BlockStored`` whose parent's key is unknown: held by engine hash, keyed once the parent is."""
    INVALID = "invalid"
    """Unusable content: unknown medium, token count not ``len(block_hashes) * block_size``, ..."""


@dataclass(frozen=True, slots=True)
class EndpointScore:
    """One endpoint's match for a prompt.

    Attributes:
        endpoint_id: the endpoint.
        matched_blocks: longest consecutive prefix of the prompt's full blocks it holds (>= 0).
        matched_tokens: ``matched_blocks * block_size_tokens`` of that endpoint.
        matched_blocks_by_medium: of the matched blocks, how many it holds on each medium (a block
            on two media counts in both).
        reached_blocks: of ``matched_blocks``, how many lie past the endpoint's own longest run: blocks it
            can only load from a kv_store it reaches (folded by the indexer; 0 when nothing is folded).
    """

    endpoint_id: EndpointId
    matched_blocks: int
    matched_tokens: int
    matched_blocks_by_medium: Mapping[Medium, int] = field(default_factory=dict)
    reached_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Scores of one prompt: endpoints with at least one matched block, longest match first
    (ties by endpoint id). ``total_blocks`` is the prompt's full blocks at ``block_size_tokens``
    (0 and 0 when no endpoint of the model is registered)."""

    scores: list[EndpointScore]
    total_blocks: int
    block_size_tokens: int


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Holders of one prompt block: ``holders[endpoint] = media``, empty when nobody has it."""

    block_key: BlockKey
    holders: Mapping[EndpointId, frozenset[Medium]]


@dataclass(frozen=True, slots=True)
class EndpointIndexStats:
    """Per endpoint: distinct blocks held (any medium) and events applied since it registered."""

    endpoint_id: EndpointId
    model: str
    block_size_tokens: int
    blocks: int
    events_applied: int


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Whole-index counters. ``blocks`` counts distinct block keys held by any endpoint;
    ``outcomes`` counts every applied-or-skipped event by :class:`ApplyOutcome`."""

    blocks: int
    endpoints: int
    events_applied: int
    outcomes: Mapping[ApplyOutcome, int]
    per_endpoint: list[EndpointIndexStats]


@runtime_checkable
class KVBlockIndex(Protocol):
    """Block keys -> endpoints and media, fed by KV events, queried by prompt token ids.

    Every method is synchronous and must not block on I/O. Callers apply one endpoint's events
    in order (the event pool shards by endpoint); events of different endpoints may interleave.
    """

    def register_endpoint(self, endpoint: Endpoint) -> None:
        """Start accepting events for ``endpoint`` (model and block size from its registration).

        Called when it joins etcd. Registering an already registered endpoint with the same model,
        block size and ``instance_id`` keeps its state; otherwise it is purged first (a new
        incarnation starts empty).
        """
        ...

    def remove_endpoint(self, endpoint_id: EndpointId) -> bool:
        """Purge every entry of ``endpoint_id`` and stop accepting its events (it left etcd).

        Returns False when it was not registered.
        """
        ...

    def registered(self) -> Mapping[EndpointId, Endpoint]:
        """Endpoints whose events are currently applied."""
        ...

    def is_registered(self, endpoint_id: EndpointId) -> bool:
        """Whether ``endpoint_id``'s events are currently applied (O(1))."""
        ...

    def apply(self, endpoint_id: EndpointId, event: IndexEvent) -> ApplyOutcome:
        """Apply one event of ``endpoint_id``.

        ``BlockStored``: compute the chain's keys from the parent's key (looked up by
        ``parent_block_hash`` in this endpoint's hash map; None starts a prompt) and the token
        ids, then record each ``(engine hash -> key)`` and ``key -> endpoint, medium``.
        ``BlockRemoved``: drop those hashes on that medium. ``AllBlocksCleared``: drop every
        entry of the endpoint. Repeats are idempotent. Never raises for bad content: it returns
        the :class:`ApplyOutcome` instead.
        """
        ...

    def score(
        self,
        model: str,
        token_ids: Sequence[int],
        endpoint_ids: Sequence[EndpointId] | None = None,
        scope: KeyScope = DEFAULT_SCOPE,
    ) -> ScoreResult:
        """Per endpoint of ``model`` (or of ``endpoint_ids`` only), the longest consecutive
        prefix of the prompt's full blocks it holds, in the request's key ``scope`` (LoRA adapter,
        ``cache_salt``: :class:`kvmesh.hashing.KeyScope`). An unknown model gives an empty result."""
        ...

    def lookup(self, model: str, token_ids: Sequence[int], scope: KeyScope = DEFAULT_SCOPE) -> list[BlockLocation]:
        """One :class:`BlockLocation` per full block of the prompt (in ``scope``), in order."""
        ...

    def stats(self) -> IndexStats:
        ...

    def held_blocks(self, endpoint_id: EndpointId) -> dict[EngineBlockHash, frozenset[Medium]]:
        """Engine block hashes the index holds for ``endpoint_id`` (orphans included), with their media."""
        ...

    def dump(self) -> list[tuple[EndpointId, IndexEvent]]:
        """The state as events: replaying them (endpoints registered first) rebuilds it."""
        ...
