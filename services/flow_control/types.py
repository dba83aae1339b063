"""Nouns of the flow controller: the request it admits, its outcome and the decision sent back.

Outcomes follow GIE's ``pkg/epp/flowcontrol/types/outcomes.go``: a small closed set used as a
metric label; the detail of a rejection travels in :attr:`AdmissionDecision.reason`, never in a label.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

DEFAULT_FLOW_ID = "default"


class QueueOutcome(enum.StrEnum):
    """How a request left the controller (a low-cardinality metric label).

    ``DISPATCHED`` .. ``REJECTED_OTHER`` mirror the proto's ``QueueOutcome``;
    ``EVICTED_CANCELLED`` (the client went away while queued) has no wire form because
    no response can be delivered.
    """

    DISPATCHED = "dispatched"
    REJECTED_CAPACITY = "rejected_capacity"
    EVICTED_TTL = "evicted_ttl"
    SHED = "shed"
    REJECTED_OTHER = "rejected_other"
    EVICTED_CANCELLED = "evicted_cancelled"


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What the router tells the controller about one request.

    Attributes:
        request_id: the caller's request id (logging only).
        flow_id: fairness key (tenant); ``""`` becomes :data:`DEFAULT_FLOW_ID`.
        priority: priority band, higher is more important (stored now, used by bands later).
        prompt_tokens: prompt size in tokens (estimated when unknown).
        max_tokens: maximum new tokens.
        model: target model name.
    """

    request_id: str = ""
    flow_id: str = DEFAULT_FLOW_ID
    priority: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    model: str = ""


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The controller's answer for one request.

    Attributes:
        outcome: dispatched or why not.
        reason: human-readable reason of a rejection (``""`` when dispatched).
        queue_seconds: seconds spent queued (0 when dispatched or rejected on arrival).
    """

    outcome: QueueOutcome
    reason: str = ""
    queue_seconds: float = 0.0
