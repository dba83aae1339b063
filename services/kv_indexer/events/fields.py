"""Which events reach the index, and which of their fields kvmesh does not act on (counted).

Every field of vLLM 0.32's and SGLang 0.5.23's event structs is either honoured by the index or
counted here (:data:`kvmesh.kv_events.FIELD_HANDLING` lists them all):

* KV-cache groups (vLLM's hybrid allocator: ``group_idx``, ``kv_cache_spec_kind``): kvmesh keys
  full-attention blocks only. A ``BlockStored`` of another kind (sliding window, mamba) is skipped,
  and its ``group_idx`` remembered per endpoint, so a later ``BlockRemoved`` from that group does
  not drop the full-attention copy of the same hash. Both count as
  ``kvmesh_kv_indexer_event_fields_ignored_total{field="kv_cache_spec_kind"|"group_idx"}``.
* Attribution-only fields (``session_id``, ``locality``, ``ownership``, ``kv_cache_spec_sliding_window``)
  are counted under their name whenever an event carries them set.

Pure state (per endpoint: the non-full-attention group indices seen), no I/O.
"""

from __future__ import annotations

from msgspec import UNSET

from kvmesh.kv_events import (
    FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    ignored_fields,
    is_full_attention,
)
from kvmesh.types import EndpointId
from services.kv_indexer import metrics


class EventFieldFilter:
    """Admits the events the index keys, counting every field it leaves aside."""

    def __init__(self) -> None:
        self._other_groups: dict[EndpointId, set[int]] = {}

    def admit(self, endpoint_id: EndpointId, event: KVEvent) -> bool:
        """Whether ``event`` goes to the index (counts the fields it ignores either way)."""
        kind = type(event).__name__
        for name in ignored_fields(event):
            metrics.record_field_ignored(kind, name)
        if isinstance(event, BlockStored):
            if is_full_attention(event):
                return True
            if event.group_idx is not None:
                self._other_groups.setdefault(endpoint_id, set()).add(event.group_idx)
            metrics.record_field_ignored(kind, "kv_cache_spec_kind")
            return False
        if isinstance(event, BlockRemoved) and event.group_idx in self._other_groups.get(endpoint_id, ()):
            metrics.record_field_ignored(kind, "group_idx")
            return False
        return True

    def admit_all(self, endpoint_id: EndpointId, events: list[KVEvent]) -> list[KVEvent]:
        """The events of one batch that go to the index, in order (``events`` itself when all do).

        Same verdicts and counts as :meth:`admit` per event; events with nothing to count (a
        full-attention store, a removal from no skipped group, no attribution field set) are
        admitted by a few identity tests each."""
        others = self._other_groups.get(endpoint_id)
        for i, event in enumerate(events):
            if type(event) is BlockStored:
                if (
                    event.kv_cache_spec_kind == FULL_ATTENTION
                    and event.session_id is UNSET and event.locality is UNSET
                    and event.ownership is UNSET and event.kv_cache_spec_sliding_window is UNSET
                ):
                    continue
            elif type(event) is BlockRemoved:
                if event.locality is UNSET and event.ownership is UNSET and (others is None or event.group_idx not in others):
                    continue
            elif type(event) is AllBlocksCleared:
                continue
            # something to count or to skip: the per-event path from here on
            return list(events[:i]) + [e for e in events[i:] if self.admit(endpoint_id, e)]
        return events

    def forget(self, endpoint_id: EndpointId) -> None:
        """Drop what is known of an endpoint's groups (it left)."""
        self._other_groups.pop(endpoint_id, None)
