"""``routed-prefill-scorer``: prefer the endpoint epp has placed the least new prompt content on lately.

Intent:
    Issue 9 item 4. Spread *sessions*, not only the queue of the moment. An agent session between two
    calls (the model's answer read, a tool running, the user thinking) holds no place in any engine's
    queue, yet its next call will come back to the engine holding its history (the sticky margin,
    ``session-affinity-scorer``). Queue-based scorers therefore place a new session on whichever engine
    is idle at that instant, which may be the one whose many sessions are all thinking; their follow-ups
    then meet each other there. This is the placement rule of SGLang's and vLLM's router ``cache_aware``
    for a request that matches no worker above ``cache_threshold``: the worker with the smallest radix
    tree, i.e. the least text routed to it. Here the measure is the uncached prompt tokens of epp's
    picks to each endpoint, each decaying with the datastore's half-life (300 s by default), so
    sessions that ended stop counting.
Inputs consumed:
    Per candidate ``metrics.routed_prefill_tokens`` (``services/epp/datastore.py``, "Routed prefill").
Math (``r(e)`` the candidate's routed prefill tokens)::

    score(e) = (max_c r(c) - r(e)) / (max_c r(c) - min_c r(c));   1 for all when every r is equal

    Min-max, as llm-d's queue scorer: the least-placed endpoint scores 1, the most 0, whatever the
    absolute amounts (``cache_aware`` takes the smallest tree outright).
Parameters:
    none (the half-life is epp's: ``Datastore(routed_half_life_seconds=...)``).
Example YAML::

    - type: routed-prefill-scorer
      name: spread
Failure modes:
    Counts only epp's own picks: another epp replica's or a direct client's requests are not seen (as
    Dynamo's active blocks without replica sync). After epp restarts every endpoint starts at 0. Relative
    only: it says which endpoint was given less, not whether that one is busy now; pair it with a load or
    cost scorer (``tier-cost`` weighs the queue of the moment).
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
from services.epp.plugins.scorers.queue import min_max_least

TYPE = "routed-prefill-scorer"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> RoutedPrefillScorer:
    parse_params(NoParams, TYPE, name, params)
    return RoutedPrefillScorer(name)


class RoutedPrefillScorer(Scorer):
    """Min-max of the candidates' decayed routed prefill tokens, the least placed scoring 1."""

    type_name = TYPE
    category = ScorerCategory.BALANCE

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        return min_max_least([c.id for c in candidates], [c.metrics.routed_prefill_tokens for c in candidates])
