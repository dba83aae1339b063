"""``kv-cache-utilization-scorer``: prefer endpoints with free KV-cache blocks.

Intent:
    Avoid endpoints whose KV cache is nearly full (they preempt or queue). As GIE's
    ``kv-cache-utilization-scorer``.
Inputs consumed:
    Per candidate ``metrics.kv_cache_usage_perc`` (``vllm:kv_cache_usage_perc``, a fraction in [0, 1];
    the datastore rejects scrapes outside that range).
Math:
    ``score(e) = 1 - kv_cache_usage_perc(e)``.
Parameters:
    none.
Example YAML::

    - type: kv-cache-utilization-scorer
      name: kv-utilization
Failure modes:
    Counts cached-but-unreferenced prefix blocks as free or used depending on the engine's accounting
    (vLLM counts only blocks in use), so it does not see prefix-cache pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    PluginHandle,
    SchedulingRequest,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.registry import NoParams, parse_params

TYPE = "kv-cache-utilization-scorer"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> KVCacheUtilizationScorer:
    parse_params(NoParams, TYPE, name, params)
    return KVCacheUtilizationScorer(name)


class KVCacheUtilizationScorer(Scorer):
    type_name = TYPE
    category = ScorerCategory.DISTRIBUTION

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        return {c.id: 1.0 - c.metrics.kv_cache_usage_perc for c in candidates}
