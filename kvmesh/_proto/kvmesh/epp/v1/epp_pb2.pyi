from kvmesh._proto.kvmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompletionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_OUTCOME_UNSPECIFIED: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_SUCCESS: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_ERROR: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_CANCELLED: _ClassVar[CompletionOutcome]
    COMPLETION_OUTCOME_NOT_DISPATCHED: _ClassVar[CompletionOutcome]
COMPLETION_OUTCOME_UNSPECIFIED: CompletionOutcome
COMPLETION_OUTCOME_SUCCESS: CompletionOutcome
COMPLETION_OUTCOME_ERROR: CompletionOutcome
COMPLETION_OUTCOME_CANCELLED: CompletionOutcome
COMPLETION_OUTCOME_NOT_DISPATCHED: CompletionOutcome

class PickRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "prompt", "messages", "exclude_endpoint_ids", "lora_name", "cache_salt", "render_json", "prompt_token_ids_packed", "max_endpoints", "omit_breakdown")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ENDPOINT_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RENDER_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    MAX_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    OMIT_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    exclude_endpoint_ids: _containers.RepeatedScalarFieldContainer[str]
    lora_name: str
    cache_salt: str
    render_json: bytes
    prompt_token_ids_packed: bytes
    max_endpoints: int
    omit_breakdown: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., exclude_endpoint_ids: _Optional[_Iterable[str]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., render_json: _Optional[bytes] = ..., prompt_token_ids_packed: _Optional[bytes] = ..., max_endpoints: _Optional[int] = ..., omit_breakdown: _Optional[bool] = ...) -> None: ...

class ScoreBreakdown(_message.Message):
    __slots__ = ("endpoint_id", "scores", "total")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    scores: _containers.ScalarMap[str, float]
    total: float
    def __init__(self, endpoint_id: _Optional[str] = ..., scores: _Optional[_Mapping[str, float]] = ..., total: _Optional[float] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("target", "fallbacks", "breakdown", "profile", "prompt_tokens")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.Endpoint
    fallbacks: _containers.RepeatedCompositeFieldContainer[_common_pb2.Endpoint]
    breakdown: _containers.RepeatedCompositeFieldContainer[ScoreBreakdown]
    profile: str
    prompt_tokens: int
    def __init__(self, target: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., fallbacks: _Optional[_Iterable[_Union[_common_pb2.Endpoint, _Mapping]]] = ..., breakdown: _Optional[_Iterable[_Union[ScoreBreakdown, _Mapping]]] = ..., profile: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndpointState(_message.Message):
    __slots__ = ("endpoint", "num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "metrics_age_seconds")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    METRICS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    endpoint: _common_pb2.Endpoint
    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage_perc: float
    metrics_age_seconds: float
    def __init__(self, endpoint: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., num_requests_waiting: _Optional[float] = ..., num_requests_running: _Optional[float] = ..., kv_cache_usage_perc: _Optional[float] = ..., metrics_age_seconds: _Optional[float] = ...) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointState]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointState, _Mapping]]] = ...) -> None: ...

class GetPickerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PickerInfo(_message.Message):
    __slots__ = ("needs_prompt", "profiles", "packed_token_ids")
    NEEDS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    needs_prompt: bool
    profiles: _containers.RepeatedScalarFieldContainer[str]
    packed_token_ids: bool
    def __init__(self, needs_prompt: _Optional[bool] = ..., profiles: _Optional[_Iterable[str]] = ..., packed_token_ids: _Optional[bool] = ...) -> None: ...

class CompletedRequest(_message.Message):
    __slots__ = ("request_id", "endpoint_id", "prompt_tokens", "cached_tokens", "outcome", "completion_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    endpoint_id: str
    prompt_tokens: int
    cached_tokens: int
    outcome: CompletionOutcome
    completion_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., endpoint_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., outcome: _Optional[_Union[CompletionOutcome, str]] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class CompletedBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[CompletedRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[CompletedRequest, _Mapping]]] = ...) -> None: ...

class CompletedReply(_message.Message):
    __slots__ = ("matched",)
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    matched: int
    def __init__(self, matched: _Optional[int] = ...) -> None: ...

class PickEntry(_message.Message):
    __slots__ = ("id", "request", "traceparent", "tracestate", "timeout_seconds", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: PickRequest
    traceparent: str
    tracestate: str
    timeout_seconds: float
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[PickRequest, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., cancel: _Optional[bool] = ...) -> None: ...

class PickBatch(_message.Message):
    __slots__ = ("entries", "completed")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PickEntry]
    completed: _containers.RepeatedCompositeFieldContainer[CompletedRequest]
    def __init__(self, entries: _Optional[_Iterable[_Union[PickEntry, _Mapping]]] = ..., completed: _Optional[_Iterable[_Union[CompletedRequest, _Mapping]]] = ...) -> None: ...

class PickError(_message.Message):
    __slots__ = ("code", "error_class", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    error_class: str
    message: str
    def __init__(self, code: _Optional[str] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PickResult(_message.Message):
    __slots__ = ("id", "response", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: PickResponse
    error: PickError
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[PickResponse, _Mapping]] = ..., error: _Optional[_Union[PickError, _Mapping]] = ...) -> None: ...

class PickResults(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PickResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PickResult, _Mapping]]] = ...) -> None: ...
