"""Prefix scoring (the walk itself is :func:`kvmesh.prefix_index.longest_prefix_matches`, shared with epp's replica): per endpoint, the longest run of a prompt's block keys it holds from block 0.

Given the prompt's chained keys ``k_0..k_{n-1}`` (:func:`kvmesh.hashing.block_keys`; key ``i``
depends on every token of blocks ``0..i``, so holding ``k_i`` means holding that whole prefix's
content for block ``i``) and a table ``key -> {endpoint: packed per-medium refcounts}`` (:data:`Holders`), walk the keys in
order keeping the set of endpoints that matched every block so far. An endpoint leaves the set at
the first block it does not hold; its match is the number of blocks before it. The walk stops when
the set is empty or a key has no holder at all.

Cost: O(matched blocks) C-level work (holders fetched with ``map(table.get)``, runs of equal
holders skipped by ``groupby``; a subset test and the survivors only where the holders change),
after O(n) to compute the keys (once per request and block size). Per-medium counts cost another O(matched blocks) per
endpoint, and only for endpoints holding blocks on more than one medium (the index knows). Same
walk as llm-d's longest-prefix scorer and Dynamo's ``find_matches``, on a flat hash map since the
keys are already chained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvmesh.prefix_index import longest_prefix_matches
from kvmesh.types import EndpointId, Medium

__all__ = [
    "LANE_MASK", "MEDIA", "MEDIUM_LANE", "MEDIUM_SHIFT", "Holders", "longest_prefix_matches", "media_counts",
    "media_of", "prefix_matches",
]

prefix_matches = longest_prefix_matches
"""The walk (:func:`kvmesh.prefix_index.longest_prefix_matches`, shared with epp's replica) under the
name this service's index uses: per endpoint holding block 0 (among ``candidates``), its matched
leading blocks."""

Holders = Mapping[EndpointId, int]
"""Endpoints holding one block key, and on which media: per endpoint one int packing a 32-bit
refcount per :class:`~kvmesh.types.Medium` (lane ``i`` = bits ``32i..32i+31``, media in enum order;
:data:`MEDIUM_LANE`, :func:`media_of`). Never 0 (an endpoint holding nothing is not listed).
One int instead of a ``{medium: refcount}`` dict per (block, endpoint) halves the index's memory
and its ingest time (issue 10)."""

MEDIA: tuple[Medium, ...] = tuple(Medium)
MEDIUM_LANE: dict[Medium, int] = {m: 1 << (32 * i) for i, m in enumerate(MEDIA)}
"""Add this to a holder's packed refcounts for one more hash of that endpoint on that medium."""
LANE_MASK = 0xFFFFFFFF
MEDIUM_SHIFT: dict[Medium, int] = {m: 32 * i for i, m in enumerate(MEDIA)}


def media_of(packed: int) -> frozenset[Medium]:
    """The media with a non-zero refcount in a holder's packed refcounts."""
    return frozenset(m for i, m in enumerate(MEDIA) if (packed >> (32 * i)) & LANE_MASK)


def media_counts(keys: Sequence[int], table: Mapping[int, Holders], endpoint_id: EndpointId) -> dict[Medium, int]:
    """How many of ``keys`` (all held by ``endpoint_id``) it holds on each medium."""
    counts: dict[Medium, int] = {}
    for key in keys:
        packed = table[key][endpoint_id]
        for i, medium in enumerate(MEDIA):
            if (packed >> (32 * i)) & LANE_MASK:
                counts[medium] = counts.get(medium, 0) + 1
    return counts
