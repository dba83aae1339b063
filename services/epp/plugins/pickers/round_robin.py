"""``round-robin-picker``: cycle through the candidates in endpoint-id order (the baseline policy).

Intent:
    The ``round-robin`` baseline is this picker alone (plus the always-on live-endpoint filter), with
    no scorers: it ignores load and caches, which is what the comparison needs.
Inputs consumed:
    Candidate ids only.
Math:
    Candidates sorted by id; the k-th pick of this instance targets ``sorted[k mod n]``; fallbacks follow
    in rotation order (``sorted[k+1 mod n]``, ...). A counter, not a cursor per endpoint, so when the
    candidate set changes (an endpoint joins, leaves or is excluded) the rotation shifts but stays even.
Parameters:
    none.
Example YAML::

    - type: round-robin-picker
      name: round-robin
Failure modes:
    Even spread of requests, not of load: long requests pile up like short ones. One epp replica keeps
    one counter; several replicas rotate independently.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Picker, PickerResult, PluginHandle, ScoredCandidate
from services.epp.framework.registry import NoParams, parse_params

TYPE = "round-robin-picker"


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> RoundRobinPicker:
    parse_params(NoParams, TYPE, name, params)
    return RoundRobinPicker(name)


class RoundRobinPicker(Picker):
    type_name = TYPE

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._counter = itertools.count()

    def pick(self, state: CycleState, scored: Sequence[ScoredCandidate]) -> PickerResult:
        ordered = sorted(scored, key=lambda s: s.id)
        start = next(self._counter) % len(ordered)
        return PickerResult(ordered[start:] + ordered[:start])
