"""``precise-prefix-cache-scorer``: prefer endpoints that already hold the longest prefix of the prompt.

Intent:
    Cache affinity from exact knowledge: kv_indexer follows every engine's KV events, so its ``Score``
    says, per endpoint, how many leading full blocks of this prompt are cached there (llm-d's
    ``precise-prefix-cache-scorer``).
Inputs consumed:
    ``PREFIX_MATCH`` from the cycle state, written once per pick by the ``prefix-match`` prepare step
    (which tokenizes the prompt when needed and asks kv_indexer); a profile with this scorer and no
    ``prefix-match`` step is refused at config load.
Math:
    ``score(e) = held(e) / total_blocks``, with ``total_blocks`` the prompt's full blocks and ``held(e)``
    the matched blocks the endpoint holds itself (``matched_blocks - reached_blocks``: blocks it could only
    load from a kv_store it reaches do not count, since every endpoint reaching that kv_store could; llm-d's
    scorer reads engines' own KV events only); 0 for every endpoint when the prompt has no full block or
    there is no match.
Parameters:
    none (tokenization is the ``prefix-match`` step's ``tokenize``).
Example YAML::

    - type: prefix-match
    - type: precise-prefix-cache-scorer
      name: prefix
Failure modes:
    kv_indexer unreachable or slow, or tokenization failing: the step writes no match and every
    candidate scores 0, so the pick falls back to the other scorers. Susceptible to hot-spotting when
    one endpoint holds a popular prefix; pair it with load scorers (the ``llm-d-blend`` config: prefix 3,
    queue 2, kv-utilization 2; ``precise-prefix`` puts ``session-affinity-scorer`` in front of that blend),
    or price hits and load in tokens (``prefill-cost-scorer``, the ``prefill-cost`` config).
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
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH

TYPE = "precise-prefix-cache-scorer"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> PrecisePrefixCacheScorer:
    parse_params(NoParams, TYPE, name, params)
    return PrecisePrefixCacheScorer(name)


class PrecisePrefixCacheScorer(Scorer):
    """The share of the prompt's full blocks cached on each endpoint."""

    type_name = TYPE
    category = ScorerCategory.AFFINITY
    consumes = frozenset({PREFIX_MATCH})

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        match = state.get(PREFIX_MATCH)
        if match is None or match.total_blocks <= 0:
            return dict.fromkeys([c.id for c in candidates], 0.0)
        total = match.total_blocks
        scores = dict.fromkeys([c.id for c in candidates], 0.0)
        reached = match.reached_blocks
        for endpoint_id, blocks in match.matched_blocks.items():  # only the endpoints holding a prefix
            key = EndpointId(endpoint_id)
            if key in scores:
                if reached:  # what it holds itself: every endpoint reaching one kv_store could load the rest
                    blocks -= reached.get(endpoint_id, 0)
                scores[key] = blocks / total  # > 1 is a kv_indexer bug: rejected
        return scores
