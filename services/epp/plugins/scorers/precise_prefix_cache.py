"""``precise-prefix-cache-scorer``: prefer endpoints that already hold the longest prefix of the prompt.

Intent:
    Cache affinity from exact knowledge: kv_indexer follows every engine's KV events, so its ``Score``
    says, per endpoint, how many leading full blocks of this prompt are cached there (llm-d's
    ``precise-prefix-cache-scorer``).
Inputs consumed:
    The prompt's token ids: ``request.token_ids`` when given, else the request's ``prompt`` or
    ``messages`` tokenized by the engine itself (``POST /tokenize`` of a live endpoint of the model,
    through the handle's tokenizer, cached). The ids land in the cycle state (``TOKEN_IDS``), kv_indexer's
    answer too (``PREFIX_MATCH``), both fetched in ``prepare`` (before the scheduler's load snapshot).
    ``request.model`` and the candidate ids go to kv_indexer.
Math:
    ``score(e) = matched_blocks(e) / total_blocks``, with ``total_blocks`` the prompt's full blocks;
    0 for every endpoint when the prompt has no full block.
Parameters:
    ``tokenize`` (bool, default true): tokenize text/messages when no token ids are given; when false,
    such requests score 0 everywhere.
Example YAML::

    - type: precise-prefix-cache-scorer
      name: prefix
      parameters: {tokenize: true}
Failure modes:
    kv_indexer unreachable or slow (past its timeout), or tokenization failing: logged (at most once per
    10 s) and every candidate scores 0, so the pick falls back to the other scorers. Susceptible to
    hot-spotting when one endpoint holds a popular prefix; pair it with load scorers (the
    ``precise-prefix`` config: prefix 3, queue 2, kv-utilization 2), or price hits and load in tokens
    (``prefill-cost-scorer``, the ``prefill-cost`` config).
"""

from __future__ import annotations

import logging
import time
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
    PrefixMatch,
    SchedulingRequest,
    Scorer,
    ScorerCategory,
    Tokenizer,
)
from services.epp.framework.registry import parse_params

logger = logging.getLogger(__name__)

TYPE = "precise-prefix-cache-scorer"
_WARN_EVERY_SECONDS = 10.0


class PrecisePrefixCacheScorerParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    tokenize: bool = True


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> PrecisePrefixCacheScorer:
    parsed = parse_params(PrecisePrefixCacheScorerParams, TYPE, name, params)
    if handle.prefix_index is None:
        raise ConfigError(f"plugin {name!r} (type {TYPE}) needs kv_indexer: set --kv-indexer-address")
    return PrecisePrefixCacheScorer(name, handle.prefix_index, handle.tokenizer if parsed.tokenize else None)


class PrecisePrefixCacheScorer(Scorer):
    type_name = TYPE
    category = ScorerCategory.AFFINITY

    def __init__(self, name: str, prefix_index: PrefixIndex, tokenizer: Tokenizer | None) -> None:
        super().__init__(name)
        self._index = prefix_index
        self._tokenizer = tokenizer
        self._last_warning: dict[str, float] = {}

    def _warn(self, what: str, request: SchedulingRequest, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(what, -_WARN_EVERY_SECONDS) >= _WARN_EVERY_SECONDS:
            self._last_warning[what] = now
            logger.warning(
                "%s failed; prefix scores are 0 scorer=%s request_id=%s model=%s error=%r",
                what, self.name, request.request_id, request.model, exc,
            )

    async def _token_ids(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> list[int]:
        cached = state.get(TOKEN_IDS)
        if cached is not None:
            return cached
        tokens: list[int] = list(request.token_ids)
        if not tokens and self._tokenizer is not None and (request.prompt or request.messages):
            try:
                tokens = await self._tokenizer.tokenize(request, candidates)
            except Exception as exc:
                self._warn("tokenize", request, exc)
                return []
        state.set(TOKEN_IDS, tokens)
        return tokens

    async def prepare(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> None:
        """Fetch the token ids and kv_indexer's match into ``state`` (``TOKEN_IDS``, ``PREFIX_MATCH``)."""
        if PREFIX_MATCH in state:
            return
        tokens = await self._token_ids(state, request, candidates)
        match: PrefixMatch | None = None
        if tokens:
            try:
                match = await self._index.score(request.model, tokens, [c.id for c in candidates])
            except Exception as exc:
                self._warn("kv_indexer score", request, exc)
        state.set(PREFIX_MATCH, match)

    async def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        if PREFIX_MATCH not in state:  # used without prepare (the scheduler always prepares)
            await self.prepare(state, request, candidates)
        match = state.get(PREFIX_MATCH)
        if match is None or match.total_blocks <= 0:
            return {c.id: 0.0 for c in candidates}
        return {
            c.id: match.matched_blocks.get(c.id, 0) / match.total_blocks  # > 1 is a kv_indexer bug: rejected
            for c in candidates
        }
