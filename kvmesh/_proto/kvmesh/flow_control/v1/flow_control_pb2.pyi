from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
QUEUE_OUTCOME_UNSPECIFIED: QueueOutcome
QUEUE_OUTCOME_DISPATCHED: QueueOutcome
QUEUE_OUTCOME_REJECTED_CAPACITY: QueueOutcome
QUEUE_OUTCOME_EVICTED_TTL: QueueOutcome
QUEUE_OUTCOME_SHED: QueueOutcome
QUEUE_OUTCOME_REJECTED_OTHER: QueueOutcome

class Enqueue(_message.Message):
    __slots__ = ("request_id", "flow_id", "priority", "prompt_tokens", "max_tokens", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FLOW_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    flow_id: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., flow_id: _Optional[str] = ..., priority: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

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

class AdmitResponse(_message.Message):
    __slots__ = ("outcome", "reason", "queue_seconds")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    outcome: QueueOutcome
    reason: str
    queue_seconds: float
    def __init__(self, outcome: _Optional[_Union[QueueOutcome, str]] = ..., reason: _Optional[str] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("in_flight", "queued", "max_in_flight", "dispatched_total", "rejected_total")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued: int
    max_in_flight: int
    dispatched_total: int
    rejected_total: int
    def __init__(self, in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., dispatched_total: _Optional[int] = ..., rejected_total: _Optional[int] = ...) -> None: ...
