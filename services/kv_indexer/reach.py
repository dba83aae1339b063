"""Blocks an engine can reach through kv_store instances: who reaches what, and folded scores.

kv_store instances publish their residency as KV events (``CPU``, ``DISK``, ``SHARED``) and
register under ``/kvmesh/v1/kv_sources/`` (label ``kv_source=kv_store``); the index holds their
blocks under their own id (their gRPC ``host:port``) like any endpoint. They are not routable:
here their blocks are *folded* into the engines that can load them.

Reach (from registrations only):

* an engine reaches the sources named in its ``kv_stores`` label (:data:`kvmesh.types.KV_STORES_LABEL`):
  every block those hold counts for it, on the source's medium (``CPU``/``DISK`` of the kv_store
  host, ``SHARED``);
* a ``SHARED`` block is reachable through every source naming the same shared domain
  (:data:`kvmesh.types.SHARED_DOMAINS_LABEL`, e.g. one Lustre path or one Mooncake namespace), so
  it counts for every engine reaching any of those sources.

Folding (``Score``): an engine's match is the longest run of the prompt's blocks from block 0 that
it holds itself **or** reaches; ``matched_blocks_by_medium`` counts each matched block once per
medium it is available on (its own GPU/CPU copy and a reachable kv_store copy both count, as a block
on two media already does). ``Lookup`` lists, per block, each engine with the media it can load
the block from; the sources themselves are left out. Only sources whose stream is ``live`` are
folded (an unknown stream never adds claims). Cost: one ``Lookup`` walk over the prompt's blocks
(O(blocks x holders)), only for models that have a live source some candidate reaches.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvmesh import kv_reach
from kvmesh.kv_reach import Reach, split_label
from kvmesh.types import KV_SOURCE_LABEL, KV_STORES_LABEL, SHARED_DOMAINS_LABEL, Endpoint, EndpointId, Medium
from services.kv_indexer.index.base import BlockLocation, EndpointScore


def is_source(endpoint: Endpoint) -> bool:
    """Whether a registration is a KV-event source (a kv_store), not a routable engine."""
    return bool(endpoint.labels.get(KV_SOURCE_LABEL))


def build_reach(registered: Mapping[EndpointId, Endpoint], live_sources: Collection[EndpointId]) -> Reach[EndpointId]:
    """The reach of every engine in ``registered`` over the ``live_sources`` (ids of registered sources),
    from their labels (:func:`kvmesh.kv_reach.build_reach`)."""
    sources = {
        sid: split_label(registered[sid].labels.get(SHARED_DOMAINS_LABEL, ""))
        for sid in live_sources if sid in registered
    }
    engines = {
        eid: [EndpointId(s) for s in split_label(endpoint.labels.get(KV_STORES_LABEL, ""))]
        for eid, endpoint in registered.items() if not is_source(endpoint)
    }
    return kv_reach.build_reach(engines, sources)


def _reachable_media(engine: EndpointId, holders: Mapping[EndpointId, frozenset[Medium]], reach: Reach) -> set[Medium]:
    media = set(holders.get(engine, ()))
    for sid in reach.direct.get(engine, ()):
        media |= holders.get(sid, frozenset())
    for sid in reach.shared.get(engine, ()):
        if Medium.SHARED in holders.get(sid, frozenset()):
            media.add(Medium.SHARED)
    return media


def fold_lookup(
    locations: Sequence[BlockLocation], reach: Reach, sources: Collection[EndpointId], engines: Collection[EndpointId]
) -> list[BlockLocation]:
    """``locations`` with the sources' blocks folded into the ``engines`` that reach them, sources left out."""
    folded = []
    for location in locations:
        holders: dict[EndpointId, frozenset[Medium]] = {
            eid: media for eid, media in location.holders.items() if eid not in sources
        }
        for engine in engines:
            if engine in reach.direct:
                media = _reachable_media(engine, location.holders, reach)
                if media:
                    holders[engine] = frozenset(media)
        folded.append(BlockLocation(location.block_key, holders))
    return folded


def fold_scores(
    locations: Sequence[BlockLocation], reach: Reach, engines: Collection[EndpointId], block_size_tokens: int
) -> list[EndpointScore]:
    """Scores of the ``engines`` that reach a source, each over what it holds or reaches (longest run from block 0)."""
    scores = []
    for engine in engines:
        if engine not in reach.direct:
            continue
        counts: dict[Medium, int] = {}
        matched = 0
        for location in locations:
            media = _reachable_media(engine, location.holders, reach)
            if not media:
                break
            matched += 1
            for medium in media:
                counts[medium] = counts.get(medium, 0) + 1
        if matched:
            scores.append(EndpointScore(engine, matched, matched * block_size_tokens, counts))
    return scores
