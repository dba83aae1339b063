from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QueueOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUEUE_OUTCOME_UNSPECIFIED: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_DISPATCHED: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_REJECTED_CAPACITY: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_EVICTED_TTL: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_SHED: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_REJECTED_OTHER: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_REJECTED_RATE_LIMITED: _ClassVar[QueueOutcome]
    QUEUE_OUTCOME_REJECTED_NO_ENDPOINTS: _ClassVar[QueueOutcome]
QUEUE_OUTCOME_UNSPECIFIED: QueueOutcome
QUEUE_OUTCOME_DISPATCHED: QueueOutcome
QUEUE_OUTCOME_REJECTED_CAPACITY: QueueOutcome
QUEUE_OUTCOME_EVICTED_TTL: QueueOutcome
QUEUE_OUTCOME_SHED: QueueOutcome
QUEUE_OUTCOME_REJECTED_OTHER: QueueOutcome
QUEUE_OUTCOME_REJECTED_RATE_LIMITED: QueueOutcome
QUEUE_OUTCOME_REJECTED_NO_ENDPOINTS: QueueOutcome

class Enqueue(_message.Message):
    __slots__ = ("request_id", "flow_id", "priority", "prompt_tokens", "max_tokens", "model", "byte_size", "ttl_seconds", "ttft_slo_seconds", "max_concurrency", "rate_per_second", "burst")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    RATE_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    flow_id: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    model: str
    byte_size: int
    ttl_seconds: float
    ttft_slo_seconds: float
    max_concurrency: int
    rate_per_second: float
    burst: int
    def __init__(self, request_id: _Optional[str] = ..., flow_id: _Optional[str] = ..., priority: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., model: _Optional[str] = ..., byte_size: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., ttft_slo_seconds: _Optional[float] = ..., max_concurrency: _Optional[int] = ..., rate_per_second: _Optional[float] = ..., burst: _Optional[int] = ...) -> None: ...

class Complete(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_seconds", "e2e_seconds", "success")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    E2E_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_seconds: float
    e2e_seconds: float
    success: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_seconds: _Optional[float] = ..., e2e_seconds: _Optional[float] = ..., success: _Optional[bool] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("enqueue", "complete")
    ENQUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    enqueue: Enqueue
    complete: Complete
    def __init__(self, enqueue: _Optional[_Union[Enqueue, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreditRequest(_message.Message):
    __slots__ = ("max_credits",)
    MAX_CREDITS_FIELD_NUMBER: _ClassVar[int]
    max_credits: int
    def __init__(self, max_credits: _Optional[int] = ...) -> None: ...

class CreditReturn(_message.Message):
    __slots__ = ("returned",)
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    returned: int
    def __init__(self, returned: _Optional[int] = ...) -> None: ...

class AdmitEntry(_message.Message):
    __slots__ = ("ticket", "enqueue", "complete", "release", "credit_request", "credit_return", "traceparent", "tracestate", "on_credit")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CREDIT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREDIT_RETURN_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    ON_CREDIT_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    enqueue: Enqueue
    complete: Complete
    release: Release
    credit_request: CreditRequest
    credit_return: CreditReturn
    traceparent: str
    tracestate: str
    on_credit: bool
    def __init__(self, ticket: _Optional[int] = ..., enqueue: _Optional[_Union[Enqueue, _Mapping]] = ..., complete: _Optional[_Union[Complete, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., credit_request: _Optional[_Union[CreditRequest, _Mapping]] = ..., credit_return: _Optional[_Union[CreditReturn, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., on_credit: _Optional[bool] = ...) -> None: ...

class AdmitBatch(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AdmitEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AdmitEntry, _Mapping]]] = ...) -> None: ...

class AdmitError(_message.Message):
    __slots__ = ("code", "error_class", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    error_class: str
    message: str
    def __init__(self, code: _Optional[str] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AdmitDecision(_message.Message):
    __slots__ = ("ticket", "response", "error")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    response: AdmitResponse
    error: AdmitError
    def __init__(self, ticket: _Optional[int] = ..., response: _Optional[_Union[AdmitResponse, _Mapping]] = ..., error: _Optional[_Union[AdmitError, _Mapping]] = ...) -> None: ...

class CreditUpdate(_message.Message):
    __slots__ = ("grant", "revoke", "priority")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    grant: int
    revoke: bool
    priority: int
    def __init__(self, grant: _Optional[int] = ..., revoke: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class AdmitDecisions(_message.Message):
    __slots__ = ("decisions", "credits")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[AdmitDecision]
    credits: CreditUpdate
    def __init__(self, decisions: _Optional[_Iterable[_Union[AdmitDecision, _Mapping]]] = ..., credits: _Optional[_Union[CreditUpdate, _Mapping]] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("outcome", "reason", "queue_seconds", "retry_after_seconds")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    outcome: QueueOutcome
    reason: str
    queue_seconds: float
    retry_after_seconds: float
    def __init__(self, outcome: _Optional[_Union[QueueOutcome, str]] = ..., reason: _Optional[str] = ..., queue_seconds: _Optional[float] = ..., retry_after_seconds: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BandStats(_message.Message):
    __slots__ = ("priority", "name", "queued", "queued_bytes", "in_flight", "flows")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    name: str
    queued: int
    queued_bytes: int
    in_flight: int
    flows: int
    def __init__(self, priority: _Optional[int] = ..., name: _Optional[str] = ..., queued: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., flows: _Optional[int] = ...) -> None: ...

class FlowStats(_message.Message):
    __slots__ = ("flow_id", "priority", "queued", "in_flight", "oldest_wait_seconds", "served_tokens", "share")
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    flow_id: str
    priority: int
    queued: int
    in_flight: int
    oldest_wait_seconds: float
    served_tokens: int
    share: float
    def __init__(self, flow_id: _Optional[str] = ..., priority: _Optional[int] = ..., queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., oldest_wait_seconds: _Optional[float] = ..., served_tokens: _Optional[int] = ..., share: _Optional[float] = ...) -> None: ...

class Saturation(_message.Message):
    __slots__ = ("enabled", "saturated", "stale", "saturation", "headroom", "unseen_dispatches", "metrics_age_seconds")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    SATURATED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    METRICS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    saturated: bool
    stale: bool
    saturation: float
    headroom: float
    unseen_dispatches: int
    metrics_age_seconds: float
    def __init__(self, enabled: _Optional[bool] = ..., saturated: _Optional[bool] = ..., stale: _Optional[bool] = ..., saturation: _Optional[float] = ..., headroom: _Optional[float] = ..., unseen_dispatches: _Optional[int] = ..., metrics_age_seconds: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("in_flight", "queued", "max_in_flight", "dispatched_total", "rejected_total", "queued_bytes", "bands", "flows", "saturation", "jain_index", "fairness_window_seconds", "credits_lent")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BANDS_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    SATURATION_FIELD_NUMBER: _ClassVar[int]
    JAIN_INDEX_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_LENT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued: int
    max_in_flight: int
    dispatched_total: int
    rejected_total: int
    queued_bytes: int
    bands: _containers.RepeatedCompositeFieldContainer[BandStats]
    flows: _containers.RepeatedCompositeFieldContainer[FlowStats]
    saturation: Saturation
    jain_index: float
    fairness_window_seconds: float
    credits_lent: int
    def __init__(self, in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., dispatched_total: _Optional[int] = ..., rejected_total: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., bands: _Optional[_Iterable[_Union[BandStats, _Mapping]]] = ..., flows: _Optional[_Iterable[_Union[FlowStats, _Mapping]]] = ..., saturation: _Optional[_Union[Saturation, _Mapping]] = ..., jain_index: _Optional[float] = ..., fairness_window_seconds: _Optional[float] = ..., credits_lent: _Optional[int] = ...) -> None: ...
