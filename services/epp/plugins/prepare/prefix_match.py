"""``prefix-match``: the prepare step that tokenizes the prompt and asks kv_indexer for its cached prefix, once per pick.

Intent:
    The named producer of the prompt data that cache-aware scorers read (GIE's prepare-data step;
    llm-d's ``ComputeBlockKeys`` then ``GetPodScores``). It runs once per pick before the scheduler's
    load snapshot, whatever number of scorers consume its output, so the prompt is tokenized and
    kv_indexer is asked exactly once.
Inputs consumed:
    The prompt: ``request.token_ids`` when given, else the request's ``prompt`` or ``messages``
    tokenized by the engine itself (``POST /tokenize`` of a live endpoint of the model, through the
    handle's :class:`~services.epp.framework.interfaces.Tokenizer`, cached). ``request.model`` and the
    candidate ids go to kv_indexer (the handle's :class:`~services.epp.framework.interfaces.PrefixIndex`).
Produces:
    ``TOKEN_IDS`` (the prompt's token ids; empty when unknown) and ``PREFIX_MATCH`` (kv_indexer's
    answer: the prompt's full blocks and, per endpoint, the leading blocks cached there; None when the
    prompt has no tokens or the call failed).
Parameters:
    ``tokenize`` (bool, default true): tokenize text/messages when no token ids are given; when false,
    such requests have no tokens (and no match).
    ``max_prompt_tokens`` (int, default 131072): a prompt with more token ids (given or tokenized) is
    not sent to kv_indexer; the pick is scored by load.
    ``max_concurrent_scores`` (int, default 64): kv_indexer ``Score`` calls in flight from this step;
    a pick arriving when all are taken does not wait, it is scored by load.
Example YAML::

    - type: prefix-match
      parameters: {tokenize: true, max_prompt_tokens: 131072, max_concurrent_scores: 64}
Failure modes:
    Every one is a degraded pick (no match: prefix scores 0, prefill cost by load), never an error,
    counted in ``kvmesh_epp_prefix_match_degraded_total{reason}`` and logged at most once per 10 s per
    kind: ``too_large`` (prompt over the tokenizer's character bound or ``max_prompt_tokens``: checked
    before any tokenization or kv_indexer call), ``busy`` (every engine's tokenize slots taken),
    ``error`` (tokenization failed or timed out), ``kv_indexer_busy``, ``kv_indexer_error`` (unreachable,
    or past its timeout). The tokenizer's own bounds (size, one engine, deadline, per-engine
    concurrency) are in ``services/epp/tokenize_client.py``.

:func:`uncached_prompt_tokens` is the one formula for the prompt tokens an endpoint would have to
prefill given the match; the scheduler (for the datastore's queued-prefill accounting) and
``prefill-cost-scorer`` both use it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from kvmesh.logging import RateLimitedLog
from services.epp.framework.cycle_state import CycleState, StateKey
from services.epp.framework.interfaces import (
    Candidate,
    ConfigError,
    PluginHandle,
    PrefixIndex,
    PrefixMatch,
    PrepareStep,
    SchedulingRequest,
    Tokenizer,
)
from services.epp.framework.registry import parse_params
from services.epp.metrics import record_prefix_match_degraded

logger = logging.getLogger(__name__)

TYPE = "prefix-match"
_WARN_EVERY_SECONDS = 10.0

TOKEN_IDS: StateKey[Sequence[int]] = StateKey("token-ids", producer=TYPE)
"""The prompt's token ids (given by the caller or tokenized; the request's own sequence, not a copy:
read only); empty when unknown."""

PREFIX_MATCH: StateKey[PrefixMatch | None] = StateKey("prefix-match", producer=TYPE)
"""kv_indexer's answer for the prompt (None: no tokens, or the call failed)."""


class PrefixMatchParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    tokenize: bool = True
    max_prompt_tokens: int = pydantic.Field(131_072, ge=1)
    max_concurrent_scores: int = pydantic.Field(64, ge=1)


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> PrefixMatchStep:
    parsed = parse_params(PrefixMatchParams, TYPE, name, params)
    if handle.prefix_index is None:
        raise ConfigError(f"plugin {name!r} (type {TYPE}) needs kv_indexer: set --kv-indexer-address")
    return PrefixMatchStep(
        name,
        handle.prefix_index,
        handle.tokenizer if parsed.tokenize else None,
        max_prompt_tokens=parsed.max_prompt_tokens,
        max_concurrent_scores=parsed.max_concurrent_scores,
    )


def prompt_token_ids(state: CycleState, request: SchedulingRequest) -> Sequence[int]:
    """The prompt's token ids: ``TOKEN_IDS`` when the step ran and found some, else the request's own."""
    return state.get(TOKEN_IDS) or request.token_ids


def uncached_prompt_tokens(candidate: Candidate, prompt_tokens: int, match: PrefixMatch | None) -> int:
    """Prompt tokens ``candidate`` would have to prefill: the prompt minus the prefix cached there.

    ``prompt_tokens - matched_blocks(candidate) * block_size(candidate)``, at least 0, where the block
    size is the engine's scraped ``block_size`` (else its registered one). Without a match (None, or a
    prompt with no full block) the whole prompt; 0 when the prompt's length is unknown (0). Pure.
    """
    if match is None or match.total_blocks <= 0:
        return prompt_tokens
    block = candidate.metrics.block_size_tokens or candidate.endpoint.block_size_tokens or 0
    return max(0, prompt_tokens - match.matched_blocks.get(candidate.id, 0) * block)


class PrefixMatchStep(PrepareStep):
    """Writes ``TOKEN_IDS`` and ``PREFIX_MATCH`` for the pick; never raises for I/O failures."""

    type_name = TYPE
    produces = frozenset({TOKEN_IDS, PREFIX_MATCH})
    reads_prompt = True

    def __init__(
        self,
        name: str,
        prefix_index: PrefixIndex,
        tokenizer: Tokenizer | None,
        max_prompt_tokens: int = 131_072,
        max_concurrent_scores: int = 64,
    ) -> None:
        super().__init__(name)
        self._index = prefix_index
        self._tokenizer = tokenizer
        self._max_tokens = max_prompt_tokens
        self._max_scores = max_concurrent_scores
        self._scores_in_flight = 0
        self._warnings = RateLimitedLog(logger, _WARN_EVERY_SECONDS)

    def _warn(self, what: str, request: SchedulingRequest, exc: BaseException | str, reason: str) -> None:
        record_prefix_match_degraded(reason)
        self._warnings.warning(
            what, "%s failed; prefix scores are 0 step=%s request_id=%s model=%s error=%r",
            what, self.name, request.request_id, request.model, exc,
        )

    async def _token_ids(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> Sequence[int]:
        tokens: Sequence[int] = request.token_ids  # no copy: 32k ids copied per pick cost ~0.1 ms
        if not tokens and self._tokenizer is not None and (request.prompt or request.messages):
            try:
                tokens = await self._tokenizer.tokenize(request, candidates)
            except Exception as exc:
                self._warn("tokenize", request, exc, str(getattr(exc, "reason", "error")))
                return []
        return tokens

    async def _score(self, request: SchedulingRequest, tokens: Sequence[int], candidates: Sequence[Candidate]) -> PrefixMatch | None:
        if len(tokens) > self._max_tokens:
            self._warn("prefix match", request, f"{len(tokens)} tokens exceed {self._max_tokens}", "too_large")
            return None
        if self._scores_in_flight >= self._max_scores:
            self._warn("kv_indexer score", request, f"{self._max_scores} calls in flight", "kv_indexer_busy")
            return None
        self._scores_in_flight += 1
        try:
            if request.scope.is_default:
                return await self._index.score(request.model, tokens, [c.id for c in candidates])
            scoped = getattr(self._index, "score_scoped", None)
            if scoped is None:  # an index that cannot scope: no match rather than another tenant's blocks
                return PrefixMatch(0, {})
            match: PrefixMatch = await scoped(request.model, tokens, [c.id for c in candidates], request.scope)
            return match
        except Exception as exc:
            self._warn("kv_indexer score", request, exc, "kv_indexer_error")
            return None
        finally:
            self._scores_in_flight -= 1

    async def prepare(self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]) -> None:
        """Bounded: a too-long prompt is refused before any tokenization or kv_indexer call."""
        match: PrefixMatch | None = None
        if len(request.token_ids) > self._max_tokens:
            self._warn("prefix match", request, f"{len(request.token_ids)} token ids exceed {self._max_tokens}",
                       "too_large")
            tokens: Sequence[int] = ()
        else:
            tokens = await self._token_ids(request, candidates)
            if tokens:
                match = await self._score(request, tokens, candidates)
        state.set(TOKEN_IDS, tokens)
        state.set(PREFIX_MATCH, match)
