"""``prefill-cost-scorer``: prefer the endpoint that would produce the first token soonest, in prompt tokens.

Intent:
    Trade cache hits against load in one unit, as Dynamo's KV router does (``kv_router/scheduler.rs``:
    ``logit = overlap_weight * prefill_blocks + active_blocks``, lowest wins). A prefix hit is worth
    exactly the tokens it saves, and an endpoint is only worth those if it does not already have more
    than that to prefill for others. Normalised queue depth (``queue-scorer``) cannot express this: its
    penalty is capped (a 30-deep queue costs as much as a 1-deep one) and counts requests, not tokens,
    so a heavy prefix weight piles follow-ups onto their holder however long its queue.
Inputs consumed:
    ``TOKEN_IDS`` and ``PREFIX_MATCH`` from the cycle state, written once per pick by the
    ``prefix-match`` prepare step (required in the profile). Per candidate, from the
    datastore: ``queued_prefill_tokens`` (uncached prompt tokens of epp's picks to it that have not had
    their first token, reconciled with ``vllm:time_to_first_token_seconds_count``),
    ``unprefilled_requests`` and ``known_unprefilled_requests``, and ``block_size_tokens``.
Math:
    ``own(e) = uncached_prompt_tokens(e) = max(0, prompt_tokens - matched_blocks(e) * block_size(e))``
    (tokens ``e`` must prefill for this request; the one formula, in ``plugins/prepare/prefix_match.py``),
    ``queued(e) = queued_prefill_tokens(e) + unknown(e) * guess(e)`` where
    ``unknown(e) = unprefilled_requests(e) - known_unprefilled_requests(e)`` (requests whose tokens epp
    does not know) and ``guess(e)`` is the larger of the known ones' mean and ``prompt_tokens``;
    ``active(e) = active_prompt_tokens(e)``: the KV the endpoint's in-flight requests hold or will hold
    (whole prompts of epp's picks not yet completed; the datastore's "Active prompt tokens");
    ``cost(e) = own(e) + queued_weight * queued(e) + active_weight * (active(e) + prompt_tokens)``;
    ``score(e) = 1 - cost(e) / max_e cost(e)`` (all 1 when every cost is 0). The best score is the least
    cost; scores are in [0, 1]. With ``active_weight`` 1 this is Dynamo's KV router cost (NVIDIA Dynamo
    ``docs/design_docs/router_design.md``, "Cost Calculation": ``overlap_score_weight * prefill_blocks +
    decode_blocks``, where decode blocks are the worker's active blocks plus the request's own; here in
    tokens, and prefill counted as the request's own uncached tokens plus those queued ahead).
Parameters:
    ``queued_weight`` (float > 0, default 1.0): tokens queued ahead count this much relative to the
    request's own uncached tokens (Dynamo's ``overlap_score_weight``, inverted).
    ``active_weight`` (float >= 0, default 0.0: the term off): weight of the KV held by in-flight
    requests (Dynamo's decode blocks, weight 1 there). vLLM 0.32 admits a request only when KV blocks for
    its whole prompt are free (``scheduler_reserve_full_isl``), so an endpoint whose pool is taken by
    other requests' prompts makes a new one wait there however little of it is left to prefill.
Example YAML::

    - type: prefix-match
    - type: prefill-cost-scorer
      name: prefill-cost
      parameters: {queued_weight: 1.0, active_weight: 0.0}
Failure modes:
    kv_indexer or tokenization failing: ``own(e)`` is the whole prompt everywhere, so the pick is by
    queued tokens alone (still load-aware). Text prompts under ``prefix-match`` with ``tokenize: false``:
    prompt length 0, same.
    The queued estimate assumes FCFS prefill (vLLM's default) and ignores decode cost, which is small
    next to prefill for the prompts this targets; requests epp did not route count with a guessed size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import pydantic

from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    PluginHandle,
    PrefixMatch,
    SchedulingRequest,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.registry import parse_params
from services.epp.plugins.prepare.prefix_match import (
    PREFIX_MATCH,
    TOKEN_IDS,
    prompt_token_ids,
    uncached_prompt_tokens,
)

TYPE = "prefill-cost-scorer"


class PrefillCostScorerParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    queued_weight: float = pydantic.Field(default=1.0, gt=0, le=1000)
    active_weight: float = pydantic.Field(default=0.0, ge=0, le=1000)


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> PrefillCostScorer:
    parsed = parse_params(PrefillCostScorerParams, TYPE, name, params)
    return PrefillCostScorer(name, parsed.queued_weight, parsed.active_weight)


_ENDPOINT_ID = attrgetter("endpoint.id")
_UNPREFILLED = attrgetter("metrics.unprefilled_requests")
_ACTIVE = attrgetter("metrics.active_prompt_tokens")


def prefill_cost_column(
    candidates: Sequence[Candidate], prompt_tokens: int, match: PrefixMatch | None, queued_weight: float,
    active_weight: float = 0.0,
) -> tuple[list[EndpointId], list[float]]:
    """The candidates' ids and ``cost(e)`` in tokens, in candidate order (see the module docstring); pure.

    O(candidates) with the common case in C: every cost starts as the whole prompt (plus the active
    term, read with one ``map``), and only endpoints holding a match or with requests not yet
    prefilled are revisited in Python (at 100 endpoints most have neither; issue 10's decision budget)."""
    ids: list[EndpointId] = list(map(_ENDPOINT_ID, candidates))
    if active_weight:
        base = prompt_tokens * (1.0 + active_weight)
        costs = [base + active_weight * a for a in map(_ACTIVE, candidates)]
    else:
        costs = [float(prompt_tokens)] * len(ids)
    if match is not None and match.total_blocks > 0 and match.matched_blocks:
        where: dict[str, int] = dict(zip(ids, range(len(ids)), strict=True))
        for cid, n in match.matched_blocks.items():
            i = where.get(cid)
            if i is not None and n > 0:
                costs[i] += uncached_prompt_tokens(candidates[i], prompt_tokens, match) - prompt_tokens
    for i, unprefilled in enumerate(map(_UNPREFILLED, candidates)):
        if unprefilled:
            m = candidates[i].metrics
            known = m.known_unprefilled_requests
            tokens = m.queued_prefill_tokens
            guess = max(tokens / known if known else 0, prompt_tokens)
            costs[i] += queued_weight * (tokens + max(0, unprefilled - known) * guess)
    return ids, costs


def prefill_costs(
    candidates: Sequence[Candidate], prompt_tokens: int, match: PrefixMatch | None, queued_weight: float,
    active_weight: float = 0.0,
) -> dict[EndpointId, float]:
    """``cost(e)`` in tokens by endpoint id (see the module docstring); pure."""
    ids, costs = prefill_cost_column(candidates, prompt_tokens, match, queued_weight, active_weight)
    return dict(zip(ids, costs, strict=True))


class PrefillCostScorer(Scorer):
    """Least estimated prefill work (own uncached tokens + tokens queued ahead) scores highest."""

    type_name = TYPE
    category = ScorerCategory.BALANCE
    consumes = frozenset({TOKEN_IDS, PREFIX_MATCH})

    def __init__(self, name: str, queued_weight: float = 1.0, active_weight: float = 0.0) -> None:
        super().__init__(name)
        self.queued_weight = queued_weight
        self.active_weight = active_weight

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        tokens = prompt_token_ids(state, request)
        ids, costs = prefill_cost_column(
            candidates, len(tokens), state.get(PREFIX_MATCH), self.queued_weight, self.active_weight)
        worst = max(costs)
        if worst <= 0:
            return dict.fromkeys(ids, 1.0)
        return dict(zip(ids, [1.0 - c / worst for c in costs], strict=True))
