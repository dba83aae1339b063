"""The scheduler: one Pick = validate, find candidates, always filter liveness, run the profile, record.

Algorithm (one call of :meth:`Scheduler.pick`)::

    model empty                          -> InvalidRequest
    no registered endpoint serves model  -> UnknownModel
    candidates = live-endpoint-filter(datastore.candidates(model))   # model, exclusions, fresh metrics
    candidates empty                     -> NoEndpointsAvailable
    await profile.prepare(candidates)    # prepare steps, once each: tokenize, kv_indexer Score (suspends)
    candidates = live-endpoint-filter(datastore.candidates(model))   # fresh load snapshot
    ranked = profile.run(candidates)     # profile filters, weighted scorers, picker (sync)
    target = ranked[0]; fallbacks = ranked[1:]
    datastore.note_pick(target, uncached_prompt_tokens(target, len(prompt), PREFIX_MATCH))

The load snapshot is re-taken after ``prepare`` and nothing from there to ``note_pick`` suspends
(``profile.run`` is synchronous), so concurrent picks are serialised where it matters: each sees the
picks that completed before it. (Taking the snapshot before awaiting kv_indexer let a burst of
concurrent picks all score the same queues and all land on one endpoint.)

The decision carries the per-scorer breakdown (``PickResponse.breakdown``); a DEBUG line repeats it
for people reading logs (nothing parses it). Every outcome is counted in
``kvmesh_epp_pick_total{outcome}`` and timed in ``kvmesh_epp_scheduler_e2e_duration_seconds``.
No grpc here: the servicer converts protobuf to :class:`SchedulingRequest` and back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import eq
from typing import overload

from kvmesh.errors import InvalidRequest, KvmeshError, NoEndpointsAvailable, UnknownModel, quoted
from kvmesh.types import Endpoint
from services.epp.datastore import Datastore
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Candidate, SchedulingRequest, ScoredCandidate
from services.epp.framework.profile import SchedulerProfile
from services.epp.metrics import PickOutcome, record_pick, record_plugin, record_unscraped_pick
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.plugins.prepare.prefix_match import (
    PREFIX_MATCH,
    TOKEN_IDS,
    prompt_token_ids,
    uncached_prompt_tokens,
)

logger = logging.getLogger(__name__)


class RankedFallbacks(Sequence[Endpoint]):
    """The endpoints of ``ranked[1:]`` (best first), read on access: a router's pick reads the first few of
    99, so the list is not built per pick. Read only; ``==`` compares with any sequence of endpoints."""

    __slots__ = ("_ranked",)

    def __init__(self, ranked: Sequence[ScoredCandidate]) -> None:
        self._ranked = ranked

    def __len__(self) -> int:
        return max(0, len(self._ranked) - 1)

    @overload
    def __getitem__(self, i: int) -> Endpoint: ...
    @overload
    def __getitem__(self, i: slice) -> list[Endpoint]: ...

    def __getitem__(self, i: int | slice) -> Endpoint | list[Endpoint]:
        if isinstance(i, slice):
            return [s.candidate.endpoint for s in self._ranked[1:][i]]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._ranked[i + 1].candidate.endpoint

    def __iter__(self) -> Iterator[Endpoint]:
        return (s.candidate.endpoint for s in islice(self._ranked, 1, None))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(map(eq, self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True, slots=True)
class PickDecision:
    """The target, fallbacks best first, every candidate's breakdown (ranked order), the profile run."""

    target: Endpoint
    fallbacks: Sequence[Endpoint]  # a RankedFallbacks (built on access), or a list
    breakdown: list[ScoredCandidate]
    profile: str
    prompt_tokens: int = 0


_OUTCOMES: dict[type[KvmeshError], PickOutcome] = {
    InvalidRequest: PickOutcome.INVALID_REQUEST,
    UnknownModel: PickOutcome.UNKNOWN_MODEL,
    NoEndpointsAvailable: PickOutcome.NO_ENDPOINTS,
}


class Scheduler:
    def __init__(self, datastore: Datastore, profile: SchedulerProfile, live_filter: LiveEndpointFilter) -> None:
        self.datastore = datastore
        self.profile = profile
        self._live_filter = live_filter
        self.lazy_fallbacks = True
        """Fallbacks as :class:`RankedFallbacks` (read on access); off: a list built per pick (the benchmark's
        A/B switch; the same endpoints)."""

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
        self, state: CycleState, request: SchedulingRequest, all_of_model: list[Candidate], final: bool = False
    ) -> list[Candidate]:
        candidates = self._live_filter.filter(state, request, all_of_model)
        if not candidates and not any(c.metrics.age_seconds is not None for c in all_of_model):
            # Nothing of this model scraped yet (epp just started, or the whole pool just joined): fail open
            # to the endpoints not yet scraped and not failing, scored on empty metrics, rather than refuse
            # every request for the first scrape interval (a restarted epp refused 5 of 21,859 in the soak).
            candidates = [c for c in all_of_model if c.endpoint.model == request.model
                          and c.id not in request.exclude_endpoint_ids and c.metrics.consecutive_failures == 0]
            if candidates:
                if final:
                    record_unscraped_pick()
                return candidates
        if not candidates:
            excluded = sum(1 for c in all_of_model if c.id in request.exclude_endpoint_ids)
            raise NoEndpointsAvailable(
                f"no live endpoint for model {request.model!r}: {len(all_of_model)} registered, "
                f"{excluded} excluded, {len(all_of_model) - excluded} without fresh metrics"
            )
        if final:  # served on metrics kept fresh only by crediting epp's own loop lag: counted (O(1) without lag)
            self.datastore.note_lagged_candidates(candidates, self._live_filter.params.max_metrics_age_seconds)
        return candidates

    async def _pick(self, request: SchedulingRequest) -> PickDecision:
        if not request.model.strip():
            raise InvalidRequest("model is required")
        all_of_model = self.datastore.candidates(request.model)
        if not all_of_model:
            raise UnknownModel(f"no endpoint serves model {quoted(request.model)!r}")
        state = CycleState()
        candidates = self._live_candidates(state, request, all_of_model)
        await self.profile.prepare(state, request, candidates, observer=record_plugin)
        # A fresh snapshot: picks that completed while this one awaited its I/O are now counted.
        # From here to note_pick nothing suspends (scorers read what prepare fetched).
        all_of_model = self.datastore.candidates(request.model)
        candidates = self._live_candidates(state, request, all_of_model, final=True)
        result = self.profile.run(state, request, candidates, observer=record_plugin)
        target = result.ranked[0]
        prompt = prompt_token_ids(state, request)
        self.datastore.note_pick(
            target.id, uncached_prompt_tokens(target.candidate, len(prompt), state.get(PREFIX_MATCH)), request.request_id,
            len(prompt))
        tokens = state.get(TOKEN_IDS)
        return PickDecision(
            target=target.candidate.endpoint,
            fallbacks=RankedFallbacks(result.ranked) if self.lazy_fallbacks else [s.candidate.endpoint for s in result.ranked[1:]],
            breakdown=result.ranked,
            profile=result.profile,
            prompt_tokens=len(tokens) if tokens and not request.token_ids else 0,
        )
