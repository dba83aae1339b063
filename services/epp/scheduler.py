"""The scheduler: one Pick = validate, find candidates, always filter liveness, run the profile, record.

Algorithm (one call of :meth:`Scheduler.pick`)::

    model empty                          -> InvalidRequest
    no registered endpoint serves model  -> UnknownModel
    candidates = live-endpoint-filter(datastore.candidates(model))   # model, exclusions, fresh metrics
    candidates empty                     -> NoEndpointsAvailable
    await profile.prepare(candidates)    # scorers' I/O: tokenize, kv_indexer Score (suspends)
    candidates = live-endpoint-filter(datastore.candidates(model))   # fresh load snapshot
    ranked = profile.run(candidates)     # profile filters, weighted scorers, picker (no suspension)
    target = ranked[0]; fallbacks = ranked[1:]; datastore.note_pick(target)

The load snapshot is re-taken after ``prepare`` and nothing from there to ``note_pick`` suspends, so
concurrent picks are serialised where it matters: each sees the picks that completed before it.
(Taking the snapshot before awaiting kv_indexer let a burst of concurrent picks all score the same
queues and all land on one endpoint.)

One DEBUG line per decision carries the per-scorer breakdown; every outcome is counted in
``kvmesh_epp_pick_total{outcome}`` and timed in ``kvmesh_epp_scheduler_e2e_duration_seconds``.
No grpc here: the servicer converts protobuf to :class:`SchedulingRequest` and back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvmesh.errors import InvalidRequest, KvmeshError, NoEndpointsAvailable, UnknownModel
from kvmesh.types import Endpoint
from services.epp.datastore import Datastore
from services.epp.framework.cycle_state import PREFIX_MATCH, TOKEN_IDS, CycleState
from services.epp.framework.interfaces import Candidate, SchedulingRequest, ScoredCandidate
from services.epp.framework.profile import SchedulerProfile
from services.epp.metrics import PickOutcome, record_pick, record_plugin
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PickDecision:
    """The target, fallbacks best first, every candidate's breakdown (ranked order), the profile run."""

    target: Endpoint
    fallbacks: list[Endpoint]
    breakdown: list[ScoredCandidate]
    profile: str
    prompt_tokens: int = 0


_OUTCOMES: dict[type[KvmeshError], PickOutcome] = {
    InvalidRequest: PickOutcome.INVALID_REQUEST,
    UnknownModel: PickOutcome.UNKNOWN_MODEL,
    NoEndpointsAvailable: PickOutcome.NO_ENDPOINTS,
}


def _prefill_tokens(state: CycleState, request: SchedulingRequest, target: Candidate) -> int:
    """Prompt tokens ``target`` must compute: the prompt minus its cached prefix as kv_indexer saw it.

    0 when the prompt's tokens are unknown (a text prompt under a profile that does not tokenize).
    """
    tokens = state.get(TOKEN_IDS) or request.token_ids
    match = state.get(PREFIX_MATCH)
    if not tokens:
        return 0
    if match is None or match.total_blocks <= 0:
        return len(tokens)
    block = target.metrics.block_size_tokens or target.endpoint.block_size_tokens or 0
    return max(0, len(tokens) - match.matched_blocks.get(target.id, 0) * block)


class Scheduler:
    def __init__(self, datastore: Datastore, profile: SchedulerProfile, live_filter: LiveEndpointFilter) -> None:
        self.datastore = datastore
        self.profile = profile
        self._live_filter = live_filter

    async def pick(self, request: SchedulingRequest) -> PickDecision:
        """Choose an endpoint for ``request``.

        Raises:
            InvalidRequest: empty model.
            UnknownModel: no registered endpoint serves the model.
            NoEndpointsAvailable: endpoints exist but none is live and not excluded.
            PluginError: a plugin broke its contract.
        """
        started = time.perf_counter()
        try:
            decision = await self._pick(request)
        except Exception as exc:
            outcome = next((o for cls, o in _OUTCOMES.items() if isinstance(exc, cls)), PickOutcome.ERROR)
            record_pick(outcome, time.perf_counter() - started)
            logger.debug("pick failed request_id=%s model=%s outcome=%s error=%s", request.request_id,
                         request.model, outcome, exc)
            raise
        elapsed = time.perf_counter() - started
        record_pick(PickOutcome.PICKED, elapsed)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "pick request_id=%s model=%s profile=%s target=%s took_ms=%.3f breakdown=%s",
                request.request_id, request.model, decision.profile, decision.target.id, elapsed * 1e3,
                "; ".join(
                    f"{s.id} total={s.total:.3f} " + " ".join(f"{k}={v:.3f}" for k, v in s.scores.items())
                    for s in decision.breakdown
                ),
            )
        return decision

    def _live_candidates(
        self, state: CycleState, request: SchedulingRequest, all_of_model: list[Candidate]
    ) -> list[Candidate]:
        candidates = self._live_filter.filter(state, request, all_of_model)
        if not candidates:
            excluded = sum(1 for c in all_of_model if c.id in request.exclude_endpoint_ids)
            raise NoEndpointsAvailable(
                f"no live endpoint for model {request.model!r}: {len(all_of_model)} registered, "
                f"{excluded} excluded, {len(all_of_model) - excluded} without fresh metrics"
            )
        return candidates

    async def _pick(self, request: SchedulingRequest) -> PickDecision:
        if not request.model.strip():
            raise InvalidRequest("model is required")
        all_of_model = self.datastore.candidates(request.model)
        if not all_of_model:
            raise UnknownModel(f"no endpoint serves model {request.model!r}")
        state = CycleState()
        candidates = self._live_candidates(state, request, all_of_model)
        await self.profile.prepare(state, request, candidates, observer=record_plugin)
        # A fresh snapshot: picks that completed while this one awaited its I/O are now counted.
        # From here to note_pick nothing suspends (scorers read what prepare fetched).
        all_of_model = self.datastore.candidates(request.model)
        candidates = self._live_candidates(state, request, all_of_model)
        result = await self.profile.run(state, request, candidates, observer=record_plugin)
        target = result.ranked[0]
        self.datastore.note_pick(target.id, _prefill_tokens(state, request, target.candidate))
        tokens = state.get(TOKEN_IDS)
        return PickDecision(
            target=target.candidate.endpoint,
            fallbacks=[s.candidate.endpoint for s in result.ranked[1:]],
            breakdown=result.ranked,
            profile=result.profile,
            prompt_tokens=len(tokens) if tokens and not request.token_ids else 0,
        )
