"""``prefill-cost-scorer``: prefer the endpoint that would produce the first token soonest, in prompt tokens.

Intent:
    Trade cache hits against load in one unit, as Dynamo's KV router does (``kv_router/scheduler.rs``:
    ``logit = overlap_weight * prefill_blocks + active_blocks``, lowest wins). A prefix hit is worth
    exactly the tokens it saves, and an endpoint is only worth those if it does not already have more
    than that to prefill for others. Normalised queue depth (``queue-scorer``) cannot express this: its
    penalty is capped (a 30-deep queue costs as much as a 1-deep one) and counts requests, not tokens,
    so a heavy prefix weight piles follow-ups onto their holder however long its queue.
Inputs consumed:
    The prompt's token ids and kv_indexer's match, fetched in ``prepare`` exactly as
    ``precise-prefix-cache-scorer`` does (shared through the cycle state). Per candidate, from the
    datastore: ``queued_prefill_tokens`` (uncached prompt tokens of epp's picks to it that have not had
    their first token, reconciled with ``vllm:time_to_first_token_seconds_count``),
    ``unprefilled_requests`` and ``known_unprefilled_requests``, and ``block_size_tokens``.
Math:
    ``own(e) = prompt_tokens - matched_blocks(e) * block_size(e)`` (tokens ``e`` must prefill for this
    request), ``queued(e) = queued_prefill_tokens(e) + unknown(e) * guess(e)`` where
    ``unknown(e) = unprefilled_requests(e) - known_unprefilled_requests(e)`` (requests whose tokens epp
    does not know) and ``guess(e)`` is the larger of the known ones' mean and ``prompt_tokens``;
    ``cost(e) = own(e) + queued_weight * queued(e)``; ``score(e) = 1 - cost(e) / max_e cost(e)``
    (all 1 when every cost is 0). The best score is the least cost; scores are in [0, 1].
Parameters:
    ``tokenize`` (bool, default true): as ``precise-prefix-cache-scorer``.
    ``queued_weight`` (float > 0, default 1.0): tokens queued ahead count this much relative to the
    request's own uncached tokens (Dynamo's ``overlap_score_weight``, inverted).
Example YAML::

    - type: prefill-cost-scorer
      name: prefill-cost
      parameters: {tokenize: true, queued_weight: 1.0}
Failure modes:
    kv_indexer or tokenization failing: ``own(e)`` is the whole prompt everywhere, so the pick is by
    queued tokens alone (still load-aware). Text prompts with ``tokenize: false``: prompt length 0, same.
    The queued estimate assumes FCFS prefill (vLLM's default) and ignores decode cost, which is small
    next to prefill for the prompts this targets; requests epp did not route count with a guessed size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import PREFIX_MATCH, TOKEN_IDS
from services.epp.framework.interfaces import (
    Candidate,
    ConfigError,
    CycleState,
    PluginHandle,
    PrefixIndex,
    SchedulingRequest,
    ScorerCategory,
    Tokenizer,
)
from services.epp.framework.registry import parse_params
from services.epp.plugins.scorers.precise_prefix_cache import PrecisePrefixCacheScorer

TYPE = "prefill-cost-scorer"


class PrefillCostScorerParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    tokenize: bool = True
    queued_weight: float = pydantic.Field(1.0, gt=0, le=1000)


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> PrefillCostScorer:
    parsed = parse_params(PrefillCostScorerParams, TYPE, name, params)
    if handle.prefix_index is None:
        raise ConfigError(f"plugin {name!r} (type {TYPE}) needs kv_indexer: set --kv-indexer-address")
    return PrefillCostScorer(
        name, handle.prefix_index, handle.tokenizer if parsed.tokenize else None, parsed.queued_weight
    )


def prefill_costs(
    candidates: Sequence[Candidate], prompt_tokens: int, matched_blocks: Mapping[str, int], queued_weight: float
) -> dict[EndpointId, float]:
    """``cost(e)`` in tokens (see the module docstring); pure."""
    costs: dict[EndpointId, float] = {}
    for c in candidates:
        m = c.metrics
        block = m.block_size_tokens or c.endpoint.block_size_tokens
        own = max(0, prompt_tokens - matched_blocks.get(c.id, 0) * block)
        known = m.known_unprefilled_requests
        guess = max(m.queued_prefill_tokens / known if known else 0, prompt_tokens)
        queued = m.queued_prefill_tokens + max(0, m.unprefilled_requests - known) * guess
        costs[c.id] = own + queued_weight * queued
    return costs


class PrefillCostScorer(PrecisePrefixCacheScorer):
    """Least estimated prefill work (own uncached tokens + tokens queued ahead) scores highest."""

    type_name = TYPE
    category = ScorerCategory.BALANCE

    def __init__(
        self, name: str, prefix_index: PrefixIndex, tokenizer: Tokenizer | None, queued_weight: float = 1.0
    ) -> None:
        super().__init__(name, prefix_index, tokenizer)
        self.queued_weight = queued_weight

    async def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        if PREFIX_MATCH not in state:  # used without prepare (the scheduler always prepares)
            await self.prepare(state, request, candidates)
        match = state.get(PREFIX_MATCH)
        tokens = state.get(TOKEN_IDS) or request.token_ids
        matched = match.matched_blocks if match is not None and match.total_blocks > 0 else {}
        costs = prefill_costs(candidates, len(tokens), matched, self.queued_weight)
        worst = max(costs.values())
        if worst <= 0:
            return {i: 1.0 for i in costs}
        return {i: 1.0 - c / worst for i, c in costs.items()}
