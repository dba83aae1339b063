"""Prefix scoring (the walk itself is :func:`kvmesh.prefix_index.longest_prefix_matches`, shared with epp's replica): per endpoint, the longest run of a prompt's block keys it holds from block 0.

Given the prompt's chained keys ``k_0..k_{n-1}`` (:func:`kvmesh.hashing.block_keys`; key ``i``
depends on every token of blocks ``0..i``, so holding ``k_i`` means holding that whole prefix's
content for block ``i``) and a table ``key -> {endpoint: packed per-medium refcounts}`` (:data:`Holders`), walk the keys in
order keeping the set of endpoints that matched every block so far. An endpoint leaves the set at
the first block it does not hold; its match is the number of blocks before it. The walk stops when
the set is empty or a key has no holder at all.

Cost: O(matched blocks) set operations over the active endpoints (a subset test per block, done in
C; the survivors are recomputed only at blocks where someone drops out), after O(n) to compute the
keys (once per request and block size). Per-medium counts cost another O(matched blocks) per
endpoint, and only for endpoints holding blocks on more than one medium (the index knows). Same
walk as llm-d's longest-prefix scorer and Dynamo's ``find_matches``, on a flat hash map since the
keys are already chained.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from itertools import groupby

from kvmesh.prefix_index import longest_prefix_matches
from kvmesh.types import EndpointId, Medium

__all__ = [
    "LANE_MASK", "MEDIA", "MEDIUM_LANE", "MEDIUM_SHIFT", "Holders", "longest_prefix_matches", "media_counts",
    "media_of", "prefix_matches",
]

_FIRST_CHUNK = 32
"""Blocks fetched in the walk's first pass; each later pass fetches 4x more."""


def prefix_matches(
    keys: Sequence[int], table: Mapping[int, Holders], candidates: Collection[EndpointId] | None = None
) -> dict[EndpointId, int]:
    """Same answer as :func:`kvmesh.prefix_index.longest_prefix_matches`, walked in C-level passes.

    The holders of a pass's keys are fetched with one ``map(table.get, ...)``; runs of equal
    holders (the one shared value of keys a single endpoint holds alone, or equal dicts) are
    skipped by :func:`itertools.groupby`, so Python work is per change of holders, not per block.
    Passes start at 32 blocks and grow 4x, so a prompt whose prefix nobody holds past a few blocks
    fetches little. Stops at the first key with no holder or when every endpoint has dropped out.

    Returns:
        ``{endpoint: n}`` with ``1 <= n <= len(keys)``, for endpoints holding at least block 0.
    """
    total = len(keys)
    if not total:
        return {}
    get = table.get
    first = get(keys[0])
    if not first:
        return {}
    active = set(first) if candidates is None else set(first).intersection(candidates)
    result: dict[EndpointId, int] = {}
    matched = 0  # blocks every endpoint in ``active`` holds
    checked: object = None  # the last holders value found to cover ``active``
    chunk = _FIRST_CHUNK
    while active and matched < total:
        stop = min(total, matched + chunk)
        chunk *= 4
        for holders, run in groupby(map(get, keys[matched:stop])):
            if not holders:  # nobody holds this block: nobody matches further
                for endpoint_id in active:
                    result[endpoint_id] = matched
                return result
            if holders is not checked:
                present = holders.keys()
                if not present >= active:
                    survivors = active.intersection(present)
                    for endpoint_id in active.difference(survivors):
                        result[endpoint_id] = matched
                    active = survivors
                    if not active:
                        return result
                checked = holders
            matched += len(list(run))
    for endpoint_id in active:
        result[endpoint_id] = matched
    return result

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
