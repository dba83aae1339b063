"""Which kv_store sources' blocks each engine can load: the reach, from registrations alone (pure).

kv_store instances register as KV-event sources; an engine names the sources it loads from in its
``kv_stores`` label, and a source names the shared domains it mounts (one Lustre path, one Mooncake
namespace) in its ``shared_domains`` label (:mod:`kvmesh.types`). An engine reaches:

* every block of the sources it names (``direct``), on the source's medium (``CPU``/``DISK`` of the
  kv_store host, ``SHARED``);
* the ``SHARED`` blocks of every other source naming a domain one of its named sources mounts
  (``shared``).

kv_indexer folds reached blocks into engines' scores (``services/kv_indexer/reach.py``) and epp's local
replica of the index does the same (:class:`kvmesh.prefix_index.PrefixReplica`); both build the reach here.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

E = TypeVar("E", bound=Hashable)
"""An endpoint id type (``str``, ``kvmesh.types.EndpointId``)."""


@dataclass(frozen=True, slots=True)
class Reach(Generic[E]):
    """Per engine: the sources whose every medium it reaches, and those whose ``SHARED`` blocks it reaches.
    An engine reaching no live source is in neither map."""

    direct: Mapping[E, frozenset[E]]
    shared: Mapping[E, frozenset[E]]

    def reaches_any(self, engines: Collection[E]) -> bool:
        return any(self.direct.get(e) or self.shared.get(e) for e in engines)


def split_label(value: str) -> list[str]:
    """A comma-separated label value as its non-empty, stripped items."""
    return [item.strip() for item in value.split(",") if item.strip()]


def build_reach(engines: Mapping[E, Iterable[E]], sources: Mapping[E, Iterable[str]]) -> Reach[E]:
    """The reach of each engine over the ``sources``.

    Args:
        engines: engine id -> the source ids it names (its ``kv_stores``); names that are not in
            ``sources`` (unknown, departed, not live) are ignored.
        sources: live source id -> the shared domains it mounts.
    """
    domains = {sid: frozenset(found) for sid, found in sources.items()}
    by_domain: dict[str, set[E]] = {}
    for sid, names in domains.items():
        for domain in names:
            by_domain.setdefault(domain, set()).add(sid)
    direct: dict[E, frozenset[E]] = {}
    shared: dict[E, frozenset[E]] = {}
    for eid, named_ids in engines.items():
        named = frozenset(s for s in named_ids if s in domains)
        if not named:
            continue
        direct[eid] = named
        siblings: set[E] = set()
        for sid in named:
            for domain in domains[sid]:
                siblings |= by_domain.get(domain, set())
        shared[eid] = frozenset(siblings - named)
    return Reach(direct, shared)
