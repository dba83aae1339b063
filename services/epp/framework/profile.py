"""A scheduler profile: filters, then weighted scorers, then one picker.

Follows GIE's ``scheduler_profile.go`` and ``weighted_scorer.go``: weights live in the profile (the
wrapper), not in the plugins. ``prepare`` runs the scorers' I/O (``Scorer.prepare``); ``run`` is::

    candidates = filter_k(... filter_1(candidates))          # order as configured
    total[e]   = sum_i weight_i * score_i[e]                  # score_i[e] in [0, 1], checked
    ranked     = picker.pick(scored)                          # target first, then fallbacks

A scorer that returns a value outside [0, 1] (or NaN), misses a candidate or invents one is a
bug: it is logged at ERROR and the pick fails with :class:`PluginError` (INTERNAL); nothing is
clamped. Every plugin call is timed through ``observer(extension_point, plugin_type, seconds)``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.errors import NoEndpointsAvailable
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    ExtensionPoint,
    Filter,
    Picker,
    PluginError,
    SchedulingRequest,
    ScoredCandidate,
    Scorer,
)

logger = logging.getLogger(__name__)

PluginObserver = Callable[[ExtensionPoint, str, float], None]
"""Receives (extension point, plugin type, seconds) for every plugin call."""


def _ignore(_point: ExtensionPoint, _type: str, _seconds: float) -> None:
    return None


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """``ranked[0]`` is the target, the rest fallbacks in order; ``profile`` names the profile that ran."""

    profile: str
    ranked: list[ScoredCandidate]


@dataclass(frozen=True)
class SchedulerProfile:
    name: str
    filters: Sequence[Filter]
    scorers: Sequence[WeightedScorer]
    picker: Picker

    async def prepare(
        self,
        state: CycleState,
        request: SchedulingRequest,
        candidates: Sequence[Candidate],
        observer: PluginObserver = _ignore,
    ) -> None:
        """Run every scorer's ``prepare`` (their I/O), in order, before the load snapshot is taken.

        Sequential on purpose: scorers share what they fetch (token ids, kv_indexer's match) through
        ``state``, so a second one needing the same data finds it there.
        """
        for weighted in self.scorers:
            plugin = weighted.scorer
            started = time.perf_counter()
            await plugin.prepare(state, request, candidates)
            observer(ExtensionPoint.PREPARE, plugin.type_name, time.perf_counter() - started)

    async def run(
        self,
        state: CycleState,
        request: SchedulingRequest,
        candidates: Sequence[Candidate],
        observer: PluginObserver = _ignore,
    ) -> ProfileResult:
        """Filter, score and pick.

        Raises:
            NoEndpointsAvailable: when no candidate is left after the filters.
            PluginError: when a scorer breaks its contract or the picker returns nothing.
        """
        current = list(candidates)
        for plugin in self.filters:
            started = time.perf_counter()
            before = len(current)
            current = plugin.filter(state, request, current)
            observer(ExtensionPoint.FILTER, plugin.type_name, time.perf_counter() - started)
            if not current:
                raise NoEndpointsAvailable(
                    f"no endpoint for model {request.model!r}: filter {plugin.name!r} dropped all {before}"
                )
        if not current:
            raise NoEndpointsAvailable(f"no endpoint for model {request.model!r}")
        per_scorer: dict[str, dict[str, float]] = {}
        for weighted in self.scorers:
            plugin = weighted.scorer
            started = time.perf_counter()
            scores = await plugin.score(state, request, current)
            observer(ExtensionPoint.SCORER, plugin.type_name, time.perf_counter() - started)
            self._check_scores(plugin, scores, current)
            per_scorer[plugin.name] = scores
        scored = []
        for cand in current:
            breakdown = {name: scores[cand.id] for name, scores in per_scorer.items()}
            total = sum(w.weight * per_scorer[w.scorer.name][cand.id] for w in self.scorers)
            scored.append(ScoredCandidate(cand, breakdown, total))
        started = time.perf_counter()
        result = self.picker.pick(state, scored)
        observer(ExtensionPoint.PICKER, self.picker.type_name, time.perf_counter() - started)
        if not result.ranked:
            raise PluginError(f"picker {self.picker.name!r} returned no endpoint for {len(scored)} candidates")
        return ProfileResult(self.name, result.ranked)

    @staticmethod
    def _check_scores(plugin: Scorer, scores: dict[str, float], candidates: Sequence[Candidate]) -> None:
        expected = {c.id for c in candidates}
        problems: list[str] = []
        missing = expected - scores.keys()
        extra = scores.keys() - expected
        if missing:
            problems.append(f"missing scores for {sorted(missing)}")
        if extra:
            problems.append(f"scores for unknown endpoints {sorted(extra)}")
        bad = {k: v for k, v in scores.items() if not (isinstance(v, int | float) and 0.0 <= v <= 1.0)}
        bad.update({k: v for k, v in scores.items() if isinstance(v, float) and math.isnan(v)})
        if bad:
            problems.append(f"scores outside [0, 1]: {bad}")
        if problems:
            logger.error("scorer contract broken scorer=%s type=%s %s", plugin.name, plugin.type_name, "; ".join(problems))
            raise PluginError(f"scorer {plugin.name!r} ({plugin.type_name}) broke its contract: {'; '.join(problems)}")
