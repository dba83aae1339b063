"""Nouns of the flow controller: the request it admits, its outcome and the decision sent back.

A *flow* is ``(flow_id, priority)``: ``flow_id`` is GIE's fairness id (``x-gateway-inference-fairness-id``),
``priority`` the band (GIE's ``InferenceObjective.priority``; higher is more important, negative
bands are sheddable). Outcomes follow GIE's ``pkg/epp/flowcontrol/types/outcomes.go``: a small
closed set used as a metric label; the detail of a rejection travels in
:attr:`AdmissionDecision.reason`, never in a label.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_FLOW_ID = "default"
MAX_FLOW_ID_CHARS = 256
"""Longest fairness id accepted (the router answers 400 above it; the servicer INVALID_ARGUMENT)."""


class QueueOutcome(enum.StrEnum):
    """How a request left the controller (a low-cardinality metric label).

    ``DISPATCHED`` .. ``REJECTED_NO_ENDPOINTS`` mirror the proto's ``QueueOutcome``;
    ``EVICTED_CANCELLED`` (the client went away while queued) has no wire form because
    no response can be delivered.
    """

    DISPATCHED = "dispatched"
    REJECTED_CAPACITY = "rejected_capacity"
    EVICTED_TTL = "evicted_ttl"
    SHED = "shed"
    REJECTED_OTHER = "rejected_other"
    REJECTED_RATE_LIMITED = "rejected_rate_limited"
    REJECTED_NO_ENDPOINTS = "rejected_no_endpoints"
    EVICTED_CANCELLED = "evicted_cancelled"


@dataclass(frozen=True, slots=True)
class FlowQuota:
    """A tenant's quotas, set by the router from its tenant config (0 = unlimited).

    Attributes:
        max_concurrency: requests of the flow dispatched and not yet released; more wait in the
            queue (they are not rejected).
        rate_per_second: sustained arrivals per second (token bucket); an arrival that finds the
            bucket empty is rejected (``REJECTED_RATE_LIMITED``, HTTP 429).
        burst: bucket size in requests (0 = ``max(1, rate_per_second)``).
    """

    max_concurrency: int = 0
    rate_per_second: float = 0.0
    burst: int = 0


NO_QUOTA = FlowQuota()


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What the router tells the controller about one request.

    Attributes:
        request_id: the caller's request id (logging only).
        flow_id: fairness key (tenant); ``""`` becomes :data:`DEFAULT_FLOW_ID`.
        priority: priority band, higher is more important; negative bands are sheddable.
        prompt_tokens: prompt size in tokens (estimated when unknown).
        max_tokens: maximum new tokens.
        model: target model name.
        byte_size: request body size in bytes (capacity limits in bytes; 0 when unknown).
        ttl_seconds: the request's own queue TTL (0 = none; the effective TTL is the minimum of
            the global, band and request TTLs).
        ttft_slo_seconds: the request's TTFT objective (``x-slo-ttft-ms``; 0 = none), read by the
            ``slo-deadline-ordering-policy``.
        quota: the tenant's quotas (:data:`NO_QUOTA` when none).
    """

    request_id: str = ""
    flow_id: str = DEFAULT_FLOW_ID
    priority: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    model: str = ""
    byte_size: int = 0
    ttl_seconds: float = 0.0
    ttft_slo_seconds: float = 0.0
    quota: FlowQuota = NO_QUOTA


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The controller's answer for one request.

    Attributes:
        outcome: dispatched or why not.
        reason: human-readable reason of a rejection (``""`` when dispatched).
        queue_seconds: seconds spent queued (0 when dispatched or rejected on arrival).
        retry_after_seconds: a hint for the client of a rejection (0 = none).
    """

    outcome: QueueOutcome
    reason: str = ""
    queue_seconds: float = 0.0
    retry_after_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class ServedTokens:
    """Tokens a finished request actually consumed (from the router's ``Complete``)."""

    prompt_tokens: int
    completion_tokens: int
