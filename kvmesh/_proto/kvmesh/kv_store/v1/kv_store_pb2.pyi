from kvmesh._proto.kvmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("key", "total_bytes", "data", "block_stored_event")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STORED_EVENT_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_bytes: int
    data: bytes
    block_stored_event: bytes
    def __init__(self, key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., block_stored_event: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("medium", "evicted", "lost")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    medium: _common_pb2.Medium
    evicted: int
    lost: int
    def __init__(self, medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., evicted: _Optional[int] = ..., lost: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("total_bytes", "data", "medium")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    medium: _common_pb2.Medium
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("keys", "stop_at_first_miss")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIRST_MISS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    stop_at_first_miss: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., stop_at_first_miss: _Optional[bool] = ...) -> None: ...

class BatchGetResponse(_message.Message):
    __slots__ = ("index", "found", "total_bytes", "medium", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    total_bytes: int
    medium: _common_pb2.Medium
    data: bytes
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., total_bytes: _Optional[int] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present", "medium", "prefix_hits")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    medium: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    prefix_hits: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., medium: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ..., prefix_hits: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("medium", "capacity_bytes", "used_bytes", "keys", "hits", "misses", "evictions", "name", "corrupted", "errors")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    medium: _common_pb2.Medium
    capacity_bytes: int
    used_bytes: int
    keys: int
    hits: int
    misses: int
    evictions: int
    name: str
    corrupted: int
    errors: int
    def __init__(self, medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., keys: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., name: _Optional[str] = ..., corrupted: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...
