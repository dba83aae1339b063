"""The sidecar's pure core: from a stream of health observations to register/deregister decisions.

No I/O: :class:`HealthTracker` counts consecutive good and bad polls and says when the
registration should change. Like Kubernetes probes (``successThreshold``/``failureThreshold``):
``failure_threshold`` consecutive failures take a registered engine out, ``success_threshold``
consecutive successes put an unregistered one (back) in. The first registration needs the same
``success_threshold`` successes as a recovery.

A busy engine is not a dead one (issue 14): a poll that *timed out* (the engine accepted the
connection but did not answer in time: its event loop is busy, e.g. encoding a long prompt) counts
as a failure, but deregisters only once the engine has been unresponsive for
``unresponsive_grace_seconds`` in a row (and ``failure_threshold`` polls). A refused connection or a
non-200 status is a plain failure (the engine is down or says it is unhealthy) and deregisters after
``failure_threshold`` polls, as before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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
    unresponsive_grace_seconds: float = 0.0
    registered: bool = False
    successes: int = 0
    failures: int = 0
    unresponsive_since: float | None = None

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError(
                f"thresholds must be >= 1 (failure={self.failure_threshold}, success={self.success_threshold})"
            )

    def observe(self, healthy: bool, *, unresponsive: bool = False, now: float = 0.0) -> Action:
        """Record one poll result; return the registration change it calls for (at most one).

        Args:
            healthy: the poll answered 200.
            unresponsive: a failed poll timed out (connection accepted, no answer); ignored when healthy.
            now: monotonic time of the poll (seconds), for ``unresponsive_grace_seconds``.
        """
        if healthy:
            self.successes += 1
            self.failures = 0
            self.unresponsive_since = None
            if not self.registered and self.successes >= self.success_threshold:
                self.registered = True
                return Action.REGISTER
            return Action.NONE
        self.failures += 1
        self.successes = 0
        if unresponsive:
            if self.unresponsive_since is None:
                self.unresponsive_since = now
            within_grace = now - self.unresponsive_since < self.unresponsive_grace_seconds
        else:
            self.unresponsive_since = None
            within_grace = False
        if self.registered and self.failures >= self.failure_threshold and not within_grace:
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
    instance_id: str = "",
    replay_endpoint: str = "",
    hash_algo: str = "",
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
        instance_id=instance_id,
        replay_endpoint=replay_endpoint,
        hash_algo=hash_algo,
    )


def engine_identity_from_metrics(text: str) -> tuple[str, str]:
    """``(instance id, hash algorithm)`` from a vLLM ``/metrics`` body: the incarnation is the
    process start time (``process_start_time_seconds``, in ms), the algorithm
    ``vllm:cache_config_info{prefix_caching_hash_algo}``; ``""`` for what is absent."""
    instance_id = hash_algo = ""
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "process_start_time_seconds":
                    instance_id = f"start-{int(sample.value * 1000)}"
                elif sample.name == "vllm:cache_config_info":
                    hash_algo = sample.labels.get("prefix_caching_hash_algo", "")
    except ValueError:
        return "", ""
    return instance_id, hash_algo


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


def max_model_len_or_reason(status: int, body: object, model: str) -> int | str:
    """``max_model_len`` of ``model`` from a ``GET /v1/models`` answer, or why it cannot be read (a message).

    401 says the engine wants an API key (vLLM ``--api-key``: ``--engine-api-key``); a model missing
    from the list, or listed without a positive ``max_model_len``, is named as such.
    """
    if status == 401:
        return "GET /v1/models answered 401: the engine requires an API key (set --engine-api-key)"
    if status != 200:
        return f"GET /v1/models answered HTTP {status}"
    value = max_model_len_from_models(body, model)
    if value is not None:
        return value
    listed = [e.get("id") for e in (body.get("data") or []) if isinstance(e, dict)] if isinstance(body, dict) else []
    if model not in listed:
        return f"GET /v1/models does not list model {model!r} (listed: {listed}); check --model"
    return f"GET /v1/models lists {model!r} without a positive max_model_len; set --max-model-len"
