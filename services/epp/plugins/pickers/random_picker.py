"""``random-picker``: a uniformly random target, whatever the scores.

Intent:
    A baseline, and a tie-breaker for experiments (GIE's ``random-picker``).
Inputs consumed:
    Candidate list; totals only to order the fallbacks.
Math:
    Target uniform over candidates; fallbacks are the others by total descending (ties random).
Parameters:
    none.
Example YAML::

    - type: random-picker
Failure modes:
    Ignores load and cache affinity entirely.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Picker, PickerResult, PluginHandle, ScoredCandidate
from services.epp.framework.registry import NoParams, parse_params
from services.epp.plugins.pickers.max_score import rank_by_total

TYPE = "random-picker"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> RandomPicker:
    parse_params(NoParams, TYPE, name, params)
    return RandomPicker(name, handle.rng)


class RandomPicker(Picker):
    type_name = TYPE

    def __init__(self, name: str, rng: random.Random | None = None) -> None:
        super().__init__(name)
        self._rng = rng or random.Random()

    def pick(self, state: CycleState, scored: Sequence[ScoredCandidate]) -> PickerResult:
        target = self._rng.choice(list(scored))
        rest = rank_by_total([s for s in scored if s is not target], self._rng)
        return PickerResult([target, *rest])
