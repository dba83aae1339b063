"""Prefix scoring: per endpoint, the longest run of a prompt's block keys it holds from block 0.

Given the prompt's chained keys ``k_0..k_{n-1}`` (:func:`kvmesh.hashing.block_keys`; key ``i``
depends on every token of blocks ``0..i``, so holding ``k_i`` means holding that whole prefix's
content for block ``i``) and a table ``key -> {endpoint: {medium: refcount}}``, walk the keys in
order keeping the set of endpoints that matched every block so far. An endpoint leaves the set at
the first block it does not hold; its match is the number of blocks before it. The walk stops when
the set is empty or a key has no holder at all.

Cost: O(matched blocks x active endpoints) dict look-ups, after O(n) to compute the keys (done once
per request and block size). Same walk as llm-d's ``kvblock`` longest-prefix scorer and Dynamo's
``find_matches`` over its radix tree, on a flat hash map since the keys are already chained.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvmesh.types import EndpointId, Medium

Holders = Mapping[EndpointId, Mapping[Medium, int]]
"""Endpoints holding one block key, and on which media (value: refcount, > 0)."""


def longest_prefix_matches(
    keys: Sequence[int],
    table: Mapping[int, Holders],
    candidates: Collection[EndpointId] | None = None,
) -> dict[EndpointId, tuple[int, dict[Medium, int]]]:
    """Per endpoint with at least one matched block: ``(matched_blocks, blocks_by_medium)``.

    Args:
        keys: the prompt's chained block keys, block 0 first.
        table: block key -> holders (endpoint -> media).
        candidates: restrict to these endpoints (None: every holder).

    Returns:
        ``{endpoint: (n, {medium: count})}`` where ``n >= 1`` is the longest consecutive prefix of
        ``keys`` the endpoint holds and ``count <= n`` the blocks of that prefix held on ``medium``.
    """
    if not keys:
        return {}
    first = table.get(keys[0])
    if not first:
        return {}
    active: dict[EndpointId, dict[Medium, int]] = {}
    for endpoint_id in first:
        if candidates is None or endpoint_id in candidates:
            active[endpoint_id] = {}
    result: dict[EndpointId, tuple[int, dict[Medium, int]]] = {}
    for i, key in enumerate(keys):
        holders = table.get(key) if i else first
        if not holders:
            break
        for endpoint_id in list(active):
            media = holders.get(endpoint_id)
            if media is None:
                counts = active.pop(endpoint_id)
                if i:
                    result[endpoint_id] = (i, counts)
                continue
            counts = active[endpoint_id]
            for medium in media:
                counts[medium] = counts.get(medium, 0) + 1
        if not active:
            return result
    else:
        i = len(keys)
    for endpoint_id, counts in active.items():
        if i:
            result[endpoint_id] = (i, counts)
    return result
