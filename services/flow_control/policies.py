"""The plugin registry: fairness and ordering policies by their (GIE) type names, chosen by config.

| kind | name | module |
|---|---|---|
| fairness | ``global-strict-fairness-policy`` (GIE default) | :mod:`.fairness.policies` |
| fairness | ``round-robin-fairness-policy`` | :mod:`.fairness.policies` |
| fairness | ``least-attained-service-fairness-policy`` (token-weighted, kvmesh) | :mod:`.fairness.policies` |
| ordering | ``fcfs-ordering-policy`` (GIE default) | :mod:`.queues.fcfs` |
| ordering | ``edf-ordering-policy`` | :mod:`.queues.deadline` |
| ordering | ``slo-deadline-ordering-policy`` | :mod:`.queues.deadline` |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.flow_control.fairness.base import FairnessPolicy
from services.flow_control.fairness.policies import (
    GLOBAL_STRICT,
    LEAST_ATTAINED_SERVICE,
    ROUND_ROBIN,
    GlobalStrictFairness,
    LeastAttainedServiceFairness,
    RoundRobinFairness,
)
from services.flow_control.queues.base import QueueOrdering
from services.flow_control.queues.deadline import EDF_TYPE_NAME, SLO_DEADLINE_TYPE_NAME, EdfQueue, SloDeadlineQueue
from services.flow_control.queues.fcfs import TYPE_NAME as FCFS_TYPE_NAME
from services.flow_control.queues.fcfs import FcfsQueue

ORDERING_POLICIES: dict[str, Callable[[], QueueOrdering]] = {
    FCFS_TYPE_NAME: FcfsQueue,
    EDF_TYPE_NAME: EdfQueue,
    SLO_DEADLINE_TYPE_NAME: SloDeadlineQueue,
}
FAIRNESS_POLICIES = (GLOBAL_STRICT, ROUND_ROBIN, LEAST_ATTAINED_SERVICE)
DEFAULT_FAIRNESS_POLICY = GLOBAL_STRICT
DEFAULT_ORDERING_POLICY = FCFS_TYPE_NAME


def ordering_factory(name: str) -> Callable[[], QueueOrdering]:
    """The queue factory of ordering policy ``name``. Raises ``ValueError`` naming the known ones."""
    try:
        return ORDERING_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown ordering policy {name!r} (known: {', '.join(ORDERING_POLICIES)})") from None


def fairness_policy(name: str, weights: Mapping[str, float] | None = None) -> FairnessPolicy:
    """A new fairness policy instance (one per band). Raises ``ValueError`` for an unknown name."""
    if name == GLOBAL_STRICT:
        return GlobalStrictFairness()
    if name == ROUND_ROBIN:
        return RoundRobinFairness()
    if name == LEAST_ATTAINED_SERVICE:
        return LeastAttainedServiceFairness(weights)
    raise ValueError(f"unknown fairness policy {name!r} (known: {', '.join(FAIRNESS_POLICIES)})")
