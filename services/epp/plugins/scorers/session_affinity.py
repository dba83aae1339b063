"""``session-affinity-scorer``: keep a request on the endpoint holding its history until that endpoint is really busy.

Intent:
    Issue 9 item 4: sessions stay put until their engine is really busy. The llm-d blend
    (``precise-prefix-cache-scorer`` + ``queue-scorer`` + ``kv-cache-utilization-scorer``) trades a
    prefix share against *relative* load, so a session with a long history still leaves it whenever
    the min-max queue term outweighs its prefix share, and a second copy of its history then evicts
    other sessions' prefixes from a pool that cannot hold them all. This scorer is the sticky margin
    of the cache-aware routers (SGLang's and vLLM's router ``cache_aware``: follow the prefix match
    above ``cache_threshold`` unless the load is imbalanced beyond ``balance_abs_threshold`` /
    ``balance_rel_threshold``), with the margin counted in prefill tokens, the unit a move costs.
Inputs consumed:
    ``PREFIX_MATCH`` (the ``prefix-match`` prepare step). Per candidate, from the datastore:
    ``queued_prefill_tokens`` / ``unprefilled_requests`` / ``known_unprefilled_requests`` (epp's picks
    there without a first token yet, with their uncached tokens; pending picks included, freed when
    the router reports a completion) and ``block_size_tokens``.
Math (``m(e)`` matched blocks the endpoint holds itself: ``PrefixMatch.held``, without blocks it could only
load from a kv_store it reaches, which every endpoint reaching that kv_store could; ``T`` the prompt's full
blocks, ``b`` block size, ``P`` prompt tokens)::

    holder(e)   = m(e) >= min_match_fraction * T  and  m(e) > 0
    queued(e)   = queued_prefill_tokens(e) + unknown(e) * guess(e)         (as prefill-cost-scorer)
    margin(e)   = busy_history_factor * m(e) * b + busy_tokens              (tokens)
    busy(e)     = queued(e) - min_c queued(c) > margin(e)
    score(e)    = 1 if holder(e) and not busy(e) else 0

    A move costs the history's recompute on the target (``m(e) * b`` tokens) and, on a full pool,
    about as much again for the other sessions' prefixes the copy pushes out: hence the default
    ``busy_history_factor`` 2. The holder's queue is compared with the least-loaded candidate's, so an
    evenly busy pool keeps every session where it is.
Parameters:
    ``min_match_fraction`` (0 < x <= 1, default 0.5; SGLang's ``cache_threshold`` 0.5 in its docs, 0.3 in
    later defaults): the share of the prompt an endpoint must hold to count as the session's holder.
    ``busy_history_factor`` (>= 0, default 2.0): queued tokens beyond the least-loaded candidate's, per
    token of held history, before the holder counts as busy.
    ``busy_tokens`` (>= 0, default 2048 = one chunked-prefill step of vLLM's default budget): the
    absolute part of the margin (short histories still tolerate one step of others' prefill).
Example YAML::

    - type: prefix-match
    - type: session-affinity-scorer
      name: sticky
      parameters: {min_match_fraction: 0.5, busy_history_factor: 2.0}
Failure modes:
    No match (kv_indexer down, tokenization failed): every endpoint scores 0 and the other scorers pick.
    A lost completion leaves load on the holder until the datastore's TTL clears it (a session may move
    once meanwhile). Requests epp did not route count with a guessed size (the prompt's).
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
    SchedulingRequest,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.registry import parse_params
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH, TOKEN_IDS, prompt_token_ids

TYPE = "session-affinity-scorer"


class SessionAffinityParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    min_match_fraction: float = pydantic.Field(default=0.5, gt=0, le=1)
    busy_history_factor: float = pydantic.Field(default=2.0, ge=0, le=1000)
    busy_tokens: int = pydantic.Field(default=2048, ge=0)


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> SessionAffinityScorer:
    return SessionAffinityScorer(name, parse_params(SessionAffinityParams, TYPE, name, params))


_QUEUED_PREFILL = attrgetter("metrics.queued_prefill_tokens")


def queued_tokens(candidate: Candidate, prompt_tokens: int) -> float:
    """Prefill tokens queued on ``candidate`` ahead of a new request (``queued(e)`` above); pure."""
    m = candidate.metrics
    known = m.known_unprefilled_requests
    guess = max(m.queued_prefill_tokens / known if known else 0, prompt_tokens)
    return m.queued_prefill_tokens + max(0, m.unprefilled_requests - known) * guess


class SessionAffinityScorer(Scorer):
    """1 for the endpoints holding at least ``min_match_fraction`` of the prompt whose queue is within
    the margin of the least-loaded candidate's, else 0."""

    type_name = TYPE
    category = ScorerCategory.AFFINITY
    consumes = frozenset({TOKEN_IDS, PREFIX_MATCH})

    def __init__(self, name: str, params: SessionAffinityParams | None = None) -> None:
        super().__init__(name)
        self.params = params or SessionAffinityParams()
        self.floor_shortcut = True
        """Skip the least queue when a holder is within its margin of the queues' floor (off: always computed;
        the benchmark's A/B switch; the same scores)."""

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        scores = dict.fromkeys([c.id for c in candidates], 0.0)
        match = state.get(PREFIX_MATCH)
        if match is None or match.total_blocks <= 0 or not match.matched_blocks:
            return scores
        p = self.params
        need = p.min_match_fraction * match.total_blocks
        held = match.matched_blocks
        if match.reached_blocks:  # PrefixMatch.held for every endpoint, in one pass
            reached = match.reached_blocks
            held = {e: n - reached.get(e, 0) for e, n in held.items()}
        holders = [(c, n) for c in candidates if (n := held.get(c.id, 0)) > 0 and n >= need]
        if not holders:
            return scores
        prompt = len(prompt_token_ids(state, request))
        # least >= floor: queued(e) adds a non-negative term to queued_prefill_tokens(e). A holder within
        # its margin of the floor is within it of the least (the usual sticky case: no O(candidates)
        # Python pass); only otherwise is the least computed.
        floor = min(map(_QUEUED_PREFILL, candidates))
        least: float | None = None
        for c, n in holders:
            block = c.metrics.block_size_tokens or c.endpoint.block_size_tokens or 0
            margin = p.busy_history_factor * n * block + p.busy_tokens
            queued = queued_tokens(c, prompt)
            if queued - floor > margin or not self.floor_shortcut:
                if least is None:
                    least = min(queued_tokens(e, prompt) for e in candidates)
                if queued - least > margin:
                    continue
            scores[c.id] = 1.0
        return scores
