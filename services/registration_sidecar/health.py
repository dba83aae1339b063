"""The sidecar's pure core: from a stream of health observations to register/deregister decisions.

No I/O: :class:`HealthTracker` counts consecutive good and bad polls and says when the
registration should change. Like Kubernetes probes (``successThreshold``/``failureThreshold``):
``failure_threshold`` consecutive failures take a registered engine out, ``success_threshold``
consecutive successes put an unregistered one (back) in. The first registration needs the same
``success_threshold`` successes as a recovery.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmesh.types import Endpoint, EndpointId, EndpointRole


class Action(enum.StrEnum):
    """What the runner must do after an observation."""

    NONE = "none"
    REGISTER = "register"
    DEREGISTER = "deregister"


@dataclass
class HealthTracker:
    """Consecutive-count hysteresis over health polls.

    Attributes:
        failure_threshold: consecutive failures (>= 1) that deregister.
        success_threshold: consecutive successes (>= 1) that register.
        registered: whether the endpoint is (meant to be) registered now.
    """

    failure_threshold: int = 3
    success_threshold: int = 1
    registered: bool = False
    successes: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError(
                f"thresholds must be >= 1 (failure={self.failure_threshold}, success={self.success_threshold})"
            )

    def observe(self, healthy: bool) -> Action:
        """Record one poll result; return the registration change it calls for (at most one)."""
        if healthy:
            self.successes += 1
            self.failures = 0
            if not self.registered and self.successes >= self.success_threshold:
                self.registered = True
                return Action.REGISTER
        else:
            self.failures += 1
            self.successes = 0
            if self.registered and self.failures >= self.failure_threshold:
                self.registered = False
                return Action.DEREGISTER
        return Action.NONE


def build_endpoint(
    endpoint_id: str,
    url: str,
    model: str,
    block_size_tokens: int,
    events_endpoint: str,
    role: EndpointRole,
    engine_label: str,
    max_model_len: int | None,
) -> Endpoint:
    """The etcd registration of an engine: ``Endpoint`` with labels ``engine`` and ``max_model_len``.

    ``max_model_len`` None (unknown) leaves the label out; the router then lets the engine check.
    """
    labels = {"engine": engine_label}
    if max_model_len:
        labels["max_model_len"] = str(max_model_len)
    return Endpoint(
        id=EndpointId(endpoint_id),
        url=url.rstrip("/"),
        model=model,
        block_size_tokens=block_size_tokens,
        events_endpoint=events_endpoint,
        role=EndpointRole(role),
        labels=labels,
    )


def max_model_len_from_models(body: object, model: str) -> int | None:
    """``max_model_len`` of ``model`` in a ``GET /v1/models`` body (vLLM's shape), or None.

    vLLM answers ``{"object": "list", "data": [{"id": <served name>, "max_model_len": n, ...}]}``.
    """
    if not isinstance(body, dict):
        return None
    for entry in body.get("data") or []:
        if isinstance(entry, dict) and entry.get("id") == model:
            value = entry.get("max_model_len")
            if isinstance(value, int) and value > 0:
                return value
    return None
