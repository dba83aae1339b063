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

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent, ignored_fields, is_full_attention
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

    def forget(self, endpoint_id: EndpointId) -> None:
        """Drop what is known of an endpoint's groups (it left)."""
        self._other_groups.pop(endpoint_id, None)
