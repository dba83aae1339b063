"""A scheduler profile: prepare steps, then filters, weighted scorers and one picker.

Follows GIE's ``scheduler_profile.go`` and ``weighted_scorer.go``: weights live in the profile (the
wrapper), not in the plugins. ``prepare`` runs the prepare steps (the cycle's I/O, once per pick,
in the order configured); ``run`` is synchronous (no suspension point) and is::

    candidates = filter_k(... filter_1(candidates))          # order as configured
    total[e]   = sum_i weight_i * score_i[e]                  # score_i[e] in [0, 1], checked
    ranked     = picker.pick(scored)                          # target first, then fallbacks

Data dependencies are checked when the profile is built (GIE's ``Produces``/``Consumes``): every key
a plugin ``consumes`` must be produced by a prepare step of the profile (a step by an earlier one),
and no key by two steps; otherwise :class:`ConfigError` names the plugin, the key and its producer.
``needs_prompt`` is True iff some plugin of the profile ``reads_prompt``.

A scorer that returns a value outside [0, 1] (or NaN), misses a candidate or invents one is a
bug: it is logged at ERROR and the pick fails with :class:`PluginError` (INTERNAL); nothing is
clamped. Every plugin call is timed through ``observer(extension_point, plugin_type, seconds)``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, mul

from kvmesh.errors import NoEndpointsAvailable
from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    ConfigError,
    ExtensionPoint,
    Filter,
    Picker,
    Plugin,
    PluginError,
    PrepareStep,
    SchedulingRequest,
    ScoreColumns,
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


def check_data_dependencies(
    profile: str, prepare_steps: Sequence[PrepareStep], consumers: Sequence[Plugin]
) -> None:
    """Refuse a profile whose plugins consume a cycle-state key that none of its prepare steps produces.

    Raises:
        ConfigError: a key consumed but not produced (by an earlier step, for a step), or produced twice.
    """
    produced: dict[str, PrepareStep] = {}

    def require(plugin: Plugin, available: dict[str, PrepareStep]) -> None:
        for key in sorted(plugin.consumes, key=lambda k: k.name):
            if key.name not in available:
                hint = f"; add a {key.producer!r} step to the profile" if key.producer else ""
                raise ConfigError(
                    f"profile {profile!r}: {plugin.extension_point} {plugin.name!r} ({plugin.type_name}) consumes "
                    f"{key.name!r}, which no prepare step {'before it ' if isinstance(plugin, PrepareStep) else ''}"
                    f"in the profile produces{hint}"
                )

    for step in prepare_steps:
        require(step, produced)
        for key in sorted(step.produces, key=lambda k: k.name):
            if key.name in produced:
                raise ConfigError(
                    f"profile {profile!r}: {key.name!r} is produced by both {produced[key.name].name!r} and {step.name!r}"
                )
            produced[key.name] = step
    for plugin in consumers:
        require(plugin, produced)


@dataclass(frozen=True)
class SchedulerProfile:
    """One profile. Building it checks its data dependencies (:func:`check_data_dependencies`).

    Raises:
        ConfigError: from the constructor, when a consumed key has no producer in the profile.
    """

    name: str
    filters: Sequence[Filter]
    scorers: Sequence[WeightedScorer]
    picker: Picker
    prepare_steps: Sequence[PrepareStep] = field(default=())

    def __post_init__(self) -> None:
        consumers: list[Plugin] = [*self.filters, *(w.scorer for w in self.scorers), self.picker]
        check_data_dependencies(self.name, self.prepare_steps, consumers)

    def plugins(self) -> Iterator[Plugin]:
        """Every plugin of the profile: prepare steps, filters, scorers, then the picker."""
        yield from self.prepare_steps
        yield from self.filters
        yield from (w.scorer for w in self.scorers)
        yield self.picker

    @property
    def needs_prompt(self) -> bool:
        """Whether some plugin reads the request's prompt (token ids, text or messages)."""
        return any(p.reads_prompt for p in self.plugins())

    async def prepare(
        self,
        state: CycleState,
        request: SchedulingRequest,
        candidates: Sequence[Candidate],
        observer: PluginObserver = _ignore,
    ) -> None:
        """Run every prepare step once, in order (their I/O), before the load snapshot is taken."""
        for step in self.prepare_steps:
            started = time.perf_counter()
            await step.prepare(state, request, candidates)
            observer(ExtensionPoint.PREPARE, step.type_name, time.perf_counter() - started)

    def run(
        self,
        state: CycleState,
        request: SchedulingRequest,
        candidates: Sequence[Candidate],
        observer: PluginObserver = _ignore,
    ) -> ProfileResult:
        """Filter, score and pick, without suspending.

        Raises:
            NoEndpointsAvailable: when no candidate is left after the filters.
            PluginError: when a scorer breaks its contract or the picker returns nothing.
        """
        current = candidates if isinstance(candidates, list) else list(candidates)
        for filter_plugin in self.filters:
            started = time.perf_counter()
            before = len(current)
            current = filter_plugin.filter(state, request, current)
            observer(ExtensionPoint.FILTER, filter_plugin.type_name, time.perf_counter() - started)
            if not current:
                raise NoEndpointsAvailable(
                    f"no endpoint for model {request.model!r}: filter {filter_plugin.name!r} dropped all {before}"
                )
        if not current:
            raise NoEndpointsAvailable(f"no endpoint for model {request.model!r}")
        ids = [c.id for c in current]
        n = len(ids)
        totals: list[float] = [0.0] * n
        names: list[str] = []
        columns: list[list[float]] = []
        for weighted in self.scorers:
            scorer = weighted.scorer
            started = time.perf_counter()
            scores = scorer.score(state, request, current)
            observer(ExtensionPoint.SCORER, scorer.type_name, time.perf_counter() - started)
            column = self._column(scorer, scores, current, ids)
            names.append(scorer.name)
            columns.append(column)
            # total[e] = sum_i weight_i * score_i[e], added in scorer order (as sum() would): in C
            totals = list(map(add, totals, map(mul, repeat(weighted.weight), column)))
        scored = ScoredCandidate.rows(current, totals, ScoreColumns(tuple(names), tuple(columns)))
        started = time.perf_counter()
        result = self.picker.pick(state, scored)
        observer(ExtensionPoint.PICKER, self.picker.type_name, time.perf_counter() - started)
        if not result.ranked:
            raise PluginError(f"picker {self.picker.name!r} returned no endpoint for {len(scored)} candidates")
        return ProfileResult(self.name, result.ranked)

    @classmethod
    def _column(
        cls, plugin: Scorer, scores: dict[EndpointId, float], candidates: Sequence[Candidate], ids: list[EndpointId]
    ) -> list[float]:
        """``scores`` in candidate order, checked (one score per candidate, each in [0, 1], no NaN).

        Raises:
            PluginError: the scorer broke its contract (logged at ERROR).
        """
        try:
            column = list(map(scores.__getitem__, ids))  # in C; a missing id raises KeyError
            # one score per candidate and no other (ids are distinct); min/max miss a NaN, their sum does not
            if (len(scores) == len(ids) and min(column) >= 0.0 and max(column) <= 1.0
                    and (total := sum(column)) == total):
                return column
        except (KeyError, TypeError):
            pass  # missing, or not comparable: the checks below name it
        cls._check_scores(plugin, scores, candidates)
        raise PluginError(f"scorer {plugin.name!r} ({plugin.type_name}) broke its contract")  # pragma: no cover

    @staticmethod
    def _check_scores(
        plugin: Scorer, scores: dict[EndpointId, float], candidates: Sequence[Candidate],
        expected: set[EndpointId] | None = None,
    ) -> None:
        if expected is None:
            expected = {c.id for c in candidates}
        if len(scores) == len(expected) and scores.keys() == expected:  # the common case, in C
            values = scores.values()
            try:  # min/max miss a NaN; their sum does not (NaN != NaN)
                if min(values) >= 0.0 and max(values) <= 1.0 and (total := sum(values)) == total:
                    return
            except TypeError:
                pass  # not comparable: the checks below name it
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
