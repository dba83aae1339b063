from kvmesh._proto.kvmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IndexState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_STATE_UNSPECIFIED: _ClassVar[IndexState]
    INDEX_STATE_READY: _ClassVar[IndexState]
    INDEX_STATE_WARMING: _ClassVar[IndexState]
    INDEX_STATE_LOAD_ONLY: _ClassVar[IndexState]
INDEX_STATE_UNSPECIFIED: IndexState
INDEX_STATE_READY: IndexState
INDEX_STATE_WARMING: IndexState
INDEX_STATE_LOAD_ONLY: IndexState

class ScoreRequest(_message.Message):
    __slots__ = ("model", "token_ids", "endpoint_ids", "lora_name", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    endpoint_ids: _containers.RepeatedScalarFieldContainer[str]
    lora_name: str
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., endpoint_ids: _Optional[_Iterable[str]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class EndpointScore(_message.Message):
    __slots__ = ("endpoint_id", "matched_blocks", "matched_tokens", "matched_blocks_by_medium", "reached_blocks")
    class MatchedBlocksByMediumEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_BY_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    REACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    matched_blocks: int
    matched_tokens: int
    matched_blocks_by_medium: _containers.ScalarMap[str, int]
    reached_blocks: int
    def __init__(self, endpoint_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., matched_blocks_by_medium: _Optional[_Mapping[str, int]] = ..., reached_blocks: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "total_blocks", "block_size_tokens", "state", "unknown_endpoint_ids")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_ENDPOINT_IDS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[EndpointScore]
    total_blocks: int
    block_size_tokens: int
    state: IndexState
    unknown_endpoint_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, scores: _Optional[_Iterable[_Union[EndpointScore, _Mapping]]] = ..., total_blocks: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., state: _Optional[_Union[IndexState, str]] = ..., unknown_endpoint_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model", "token_ids", "lora_name", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockHolder(_message.Message):
    __slots__ = ("endpoint_id", "medium")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    medium: _common_pb2.Medium
    def __init__(self, endpoint_id: _Optional[str] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("block_key", "holders")
    BLOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    block_key: int
    holders: _containers.RepeatedCompositeFieldContainer[BlockHolder]
    def __init__(self, block_key: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[BlockHolder, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndpointIndexStats(_message.Message):
    __slots__ = ("endpoint_id", "blocks", "events_applied", "last_seq", "state", "instance_id")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    blocks: int
    events_applied: int
    last_seq: int
    state: str
    instance_id: str
    def __init__(self, endpoint_id: _Optional[str] = ..., blocks: _Optional[int] = ..., events_applied: _Optional[int] = ..., last_seq: _Optional[int] = ..., state: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("blocks", "endpoints", "events_applied", "batches_dropped", "per_endpoint", "ready", "parity_mismatches")
    class ParityMismatchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PARITY_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    endpoints: int
    events_applied: int
    batches_dropped: int
    per_endpoint: _containers.RepeatedCompositeFieldContainer[EndpointIndexStats]
    ready: bool
    parity_mismatches: _containers.ScalarMap[str, str]
    def __init__(self, blocks: _Optional[int] = ..., endpoints: _Optional[int] = ..., events_applied: _Optional[int] = ..., batches_dropped: _Optional[int] = ..., per_endpoint: _Optional[_Iterable[_Union[EndpointIndexStats, _Mapping]]] = ..., ready: _Optional[bool] = ..., parity_mismatches: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EndpointBlocksRequest(_message.Message):
    __slots__ = ("endpoint_id",)
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    def __init__(self, endpoint_id: _Optional[str] = ...) -> None: ...

class EndpointBlocksResponse(_message.Message):
    __slots__ = ("block_hashes", "state")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    state: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., state: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class ResidencyDelta(_message.Message):
    __slots__ = ("endpoint_id", "medium", "cleared", "added_keys", "removed_keys")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    ADDED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    medium: str
    cleared: bool
    added_keys: _containers.RepeatedScalarFieldContainer[int]
    removed_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, endpoint_id: _Optional[str] = ..., medium: _Optional[str] = ..., cleared: _Optional[bool] = ..., added_keys: _Optional[_Iterable[int]] = ..., removed_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchedEndpoint(_message.Message):
    __slots__ = ("endpoint_id", "model", "block_size_tokens", "state", "kv_source", "kv_stores", "shared_domains", "reach_listed")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_STORES_FIELD_NUMBER: _ClassVar[int]
    SHARED_DOMAINS_FIELD_NUMBER: _ClassVar[int]
    REACH_LISTED_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    model: str
    block_size_tokens: int
    state: str
    kv_source: bool
    kv_stores: _containers.RepeatedScalarFieldContainer[str]
    shared_domains: _containers.RepeatedScalarFieldContainer[str]
    reach_listed: bool
    def __init__(self, endpoint_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size_tokens: _Optional[int] = ..., state: _Optional[str] = ..., kv_source: _Optional[bool] = ..., kv_stores: _Optional[_Iterable[str]] = ..., shared_domains: _Optional[_Iterable[str]] = ..., reach_listed: _Optional[bool] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("prev_seq", "seq", "reset", "synced", "deltas", "endpoints_changed", "endpoints", "ready", "load_only_models")
    PREV_SEQ_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOAD_ONLY_MODELS_FIELD_NUMBER: _ClassVar[int]
    prev_seq: int
    seq: int
    reset: bool
    synced: bool
    deltas: _containers.RepeatedCompositeFieldContainer[ResidencyDelta]
    endpoints_changed: bool
    endpoints: _containers.RepeatedCompositeFieldContainer[WatchedEndpoint]
    ready: bool
    load_only_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prev_seq: _Optional[int] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., synced: _Optional[bool] = ..., deltas: _Optional[_Iterable[_Union[ResidencyDelta, _Mapping]]] = ..., endpoints_changed: _Optional[bool] = ..., endpoints: _Optional[_Iterable[_Union[WatchedEndpoint, _Mapping]]] = ..., ready: _Optional[bool] = ..., load_only_models: _Optional[_Iterable[str]] = ...) -> None: ...
