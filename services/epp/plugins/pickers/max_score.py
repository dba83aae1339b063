"""``max-score-picker``: the highest weighted total wins; ties broken at random.

Intent:
    The standard picker (GIE's and llm-d's ``max-score-picker``); also the default when a profile
    names no picker.
Inputs consumed:
    Each candidate's weighted total.
Math:
    Shuffle, then stable-sort by total descending: equal totals come out in random order, so the target
    is a uniformly random one among the best, and fallbacks follow by total.
Parameters:
    none.
Example YAML::

    - type: max-score-picker
Failure modes:
    With no scorers every total is 0 and it behaves like ``random-picker``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Picker, PickerResult, PluginHandle, ScoredCandidate
from services.epp.framework.registry import NoParams, parse_params

TYPE = "max-score-picker"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> MaxScorePicker:
    parse_params(NoParams, TYPE, name, params)
    return MaxScorePicker(name, handle.rng)


def rank_by_total(scored: Sequence[ScoredCandidate], rng: random.Random) -> list[ScoredCandidate]:
    """Best total first; equal totals in random order (each run of equal totals shuffled: uniform
    among ties, and O(ties) random draws instead of shuffling every candidate)."""
    ranked = sorted(scored, key=_total, reverse=True)
    n = len(ranked)
    totals = list(map(_total, ranked))
    if len(set(totals)) == n:  # no ties (the common case with load scorers): no scan, no draws
        return ranked
    i = 0
    while i < n:
        total = totals[i]
        j = i + 1
        while j < n and totals[j] == total:
            j += 1
        if j - i > 1:
            ties = ranked[i:j]
            rng.shuffle(ties)
            ranked[i:j] = ties
        i = j
    return ranked


_total = attrgetter("total")


class MaxScorePicker(Picker):
    type_name = TYPE

    def __init__(self, name: str, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self._rng = rng or random.Random()

    def pick(self, state: CycleState, scored: Sequence[ScoredCandidate]) -> PickerResult:
        return PickerResult(rank_by_total(scored, self._rng))
