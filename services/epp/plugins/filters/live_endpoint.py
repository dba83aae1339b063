"""``live-endpoint-filter``: keep endpoints that serve the model, are not excluded and report fresh metrics.

Intent:
    Only live, observable endpoints are candidates. The scheduler always runs one instance (built from
    ``EppConfig``) before any profile, so every config filters before scoring; a config may add another
    with stricter parameters.
Inputs consumed:
    ``request.model``, ``request.exclude_endpoint_ids``; per candidate ``endpoint.model``,
    ``metrics.age_seconds`` and ``metrics.consecutive_failures``.
Parameters:
    ``max_metrics_age_seconds`` (float > 0, default 2.0): drop endpoints whose last good scrape is older
    (``age_seconds``: epp's own loop lag since the scrape not counted; services/epp/datastore.py).
    ``max_consecutive_scrape_failures`` (int >= 1, default 3): drop endpoints whose scrape failed this many
    times in a row (a dead process is dropped after about this many scrape intervals, before its etcd lease
    expires).
Example YAML::

    - type: live-endpoint-filter
      name: fresh-only
      parameters: {max_metrics_age_seconds: 1.0, max_consecutive_scrape_failures: 2}
Failure modes:
    An endpoint never scraped yet (just joined) is not a candidate until its first scrape (~one interval),
    except when no endpoint of the model has been scraped at all (epp just started, or the whole pool just
    joined): then the scheduler fails open to the not-yet-scraped, not-failing ones
    (``kvmesh_epp_picks_without_metrics_total``) instead of refusing every request meanwhile.
    Endpoints without a vLLM ``/metrics`` are never picked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import Candidate, Filter, PluginHandle, SchedulingRequest
from services.epp.framework.registry import parse_params

TYPE = "live-endpoint-filter"


class LiveEndpointFilterParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    max_metrics_age_seconds: float = pydantic.Field(default=2.0, gt=0)
    max_consecutive_scrape_failures: int = pydantic.Field(default=3, ge=1)


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> LiveEndpointFilter:
    return LiveEndpointFilter(name, parse_params(LiveEndpointFilterParams, TYPE, name, params))


class LiveEndpointFilter(Filter):
    type_name = TYPE

    def __init__(self, name: str, params: LiveEndpointFilterParams | None = None) -> None:
        super().__init__(name)
        self.params = params or LiveEndpointFilterParams()

    def is_live(self, candidate: Candidate) -> bool:
        m = candidate.metrics
        return (
            m.age_seconds is not None
            and m.age_seconds <= self.params.max_metrics_age_seconds
            and m.consecutive_failures < self.params.max_consecutive_scrape_failures
        )

    def filter(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        model, excluded = request.model, request.exclude_endpoint_ids
        max_age = self.params.max_metrics_age_seconds
        max_failures = self.params.max_consecutive_scrape_failures
        return [  # is_live, inlined (100 candidates per pick)
            c
            for c in candidates
            if c.endpoint.model == model and c.id not in excluded
            and (age := c.metrics.age_seconds) is not None and age <= max_age
            and c.metrics.consecutive_failures < max_failures
        ]
