"""LMCache's remote-server wire protocol (``lm://``), as lmcache 0.5.6 speaks it: a pure codec.

Frames <-> typed messages, no I/O (the TCP adapter is :mod:`services.kv_store.lmcache_server`).
Upstream definition: ``lmcache/v1/protocol.py`` (``ClientMetaMessage``, ``ServerMetaMessage``,
``ClientCommand``, ``ServerReturnCode``, ``DTYPE_TO_INT``, ``LOCATION_TO_INT``), the server
``lmcache/v1/server/__main__.py`` and the client ``lmcache/v1/storage_backend/connector/lm_connector.py``
(``LMCServerConnector``), key strings from ``lmcache/utils.py`` (``CacheEngineKey.to_string``,
``parse_cache_key``); memory formats from ``lmcache/v1/memory_management.py`` (``MemoryFormat``).

Wire format (every integer a 4-byte signed ``int`` in the host's byte order, which upstream packs
with ``struct``'s native ``"i"``; little-endian on every platform LMCache runs on, so this codec
fixes ``<``):

* request header, 186 bytes: ``command, length, fmt, dtype, location, shape0..shape3`` (9 ints),
  then the key string, UTF-8, right-padded with spaces to :data:`MAX_KEY_LENGTH` (150) bytes.
  ``PUT`` is followed by ``length`` payload bytes and gets **no reply**; ``GET``, ``EXIST``,
  ``HEALTH`` carry ``length=0`` and get one reply.
* reply header, 36 bytes: ``code, length, fmt, dtype, shape0..shape3, location`` (note: location
  last, unlike the request), followed by ``length`` payload bytes on a ``GET`` hit.
* ``code`` 200 (``SUCCESS``) or 400 (``FAIL``). A ``GET`` miss is ``FAIL`` with length 0; ``EXIST``
  is ``SUCCESS``/``FAIL``; ``HEALTH`` is ``SUCCESS``. The upstream server sends misses and
  ``EXIST``/``HEALTH`` replies with ``fmt=1, dtype=2 (float16), shape=0,0,0,0, location=0``;
  :func:`encode_reply` does the same.
* ``LIST`` (4) exists as a command code but neither upstream side implements it: 0.5.6's server reads
  it and never answers, its client's ``list()`` is an empty stub. The reply is defined only by the
  server's commented-out TODO: ``SUCCESS``, ``length`` = the byte length of the key strings joined by
  ``"\n"``, then those bytes (:func:`list_reply_payload`, :func:`decode_list_payload`); kv_store
  answers that rather than leaving a client hung.

Key mapping: LMCache's ``CacheEngineKey`` string ``model@world_size@worker_id@chunk_hash_hex@dtype``
(optionally ``@layer_id`` for a ``LayerCacheEngineKey``, then ``@tag%value`` tags) is parsed as
upstream parses it and re-rendered canonically (:meth:`LmCacheKey.canonical`), so two spellings
upstream treats as one key (``00ff`` and ``ff``) are one kv_store key: ``lmcache/<canonical>``
(:meth:`LmCacheKey.store_key`).

Stored values keep LMCache's metadata in a 32-byte envelope in front of the payload
(:func:`encode_envelope`): ``b"LMC1"``, then ``length, fmt, dtype, shape0..shape3`` as little-endian
int32. A value without the envelope (put through gRPC) is served to ``lm://`` clients as
``BINARY_BUFFER`` uint8 bytes of shape ``[n, 0, 0, 0]`` (:func:`split_envelope`): the byte format
LMCache's ``LocalCPUBackend`` can allocate on receive (it refuses ``BINARY``).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAX_KEY_LENGTH = 150
"""Bytes of the space-padded key field (upstream ``MAX_KEY_LENGTH``)."""
REQUEST = struct.Struct(f"<9i{MAX_KEY_LENGTH}s")
REPLY = struct.Struct("<9i")
_FRAMING = struct.Struct("<2i")  # a request header's command and length
REQUEST_BYTES = REQUEST.size  # 186
REPLY_BYTES = REPLY.size  # 36
ENVELOPE_MAGIC = b"LMC1"
ENVELOPE = struct.Struct("<4s7i")
ENVELOPE_BYTES = ENVELOPE.size  # 32
KEY_PREFIX = "lmcache/"
"""kv_store keys of values put over ``lm://`` start with this."""
INT32_MAX = 2**31 - 1


class LmCommand(enum.IntEnum):
    """Upstream ``ClientCommand``."""

    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class LmReturnCode(enum.IntEnum):
    """Upstream ``ServerReturnCode``."""

    SUCCESS = 200
    FAIL = 400


class MemoryFormat(enum.IntEnum):
    """Upstream ``MemoryFormat`` values (lmcache 0.5.6)."""

    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6
    EC_TD = 7
    HS_TD = 8


DTYPE_CODES = {
    0: None,
    1: "half",
    2: "float16",
    3: "bfloat16",
    4: "float32",
    5: "float64",
    6: "uint8",
    7: "float8_e4m3fn",
    8: "float8_e5m2",
}
"""Upstream ``INT_TO_DTYPE`` (torch dtypes by name); 1 and 2 are both ``torch.float16``."""
DTYPE_UINT8 = 6
DTYPE_FLOAT16 = 2  # what upstream's DTYPE_TO_INT[torch.float16] is (the later of two equal keys)
LOCATIONS = {0: None, 1: "LocalCPUBackend", 2: "LocalDiskBackend"}
"""Upstream ``INT_TO_LOCATION``."""

KEY_DTYPES = frozenset(
    {
        "half",
        "bfloat16",
        "float",
        "double",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "fp8_e4m3fn",
        "fp8_e4m3fnuz",
        "fp8_e5m2",
        "fp8_e5m2fnuz",
    }
)
"""dtype names a key string may carry (upstream ``STR_DTYPE_TO_TORCH_DTYPE``)."""


class LmProtocolError(ValueError):
    """A frame upstream's server could not parse either; the connection is closed.

    Attributes:
        reason: short label for the metric (``bad_command``, ``bad_key``, ``bad_length``, ``bad_field``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LmCacheKey:
    """A parsed ``CacheEngineKey`` / ``LayerCacheEngineKey`` string (see the module docstring)."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    layer_id: int | None = None
    tags: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def parse(text: str) -> LmCacheKey:
        """Parse as upstream ``parse_cache_key`` does.

        Raises:
            LmProtocolError: (``bad_key``) fewer than 5 ``@`` fields, a non-integer world size,
                worker id or layer id, a non-hex chunk hash, an unknown dtype, a tag without ``%``.
        """
        parts = text.strip().split("@")
        if len(parts) < 5:
            raise LmProtocolError("bad_key", f"key {text!r} has {len(parts)} '@' fields, needs 5")
        layer_id: int | None = None
        rest = parts[5:]
        try:
            if rest and rest[0].isdigit():
                layer_id = int(rest[0])
                rest = rest[1:]
            world_size, worker_id, chunk_hash = int(parts[1]), int(parts[2]), int(parts[3], 16)
        except ValueError as exc:
            raise LmProtocolError("bad_key", f"key {text!r}: {exc}") from exc
        if parts[4] not in KEY_DTYPES:
            raise LmProtocolError("bad_key", f"key {text!r}: unknown dtype {parts[4]!r}")
        tags = []
        for tag in rest:
            name, sep, value = tag.partition("%")
            if not sep:
                raise LmProtocolError("bad_key", f"key {text!r}: tag {tag!r} has no '%'")
            tags.append((name, value))
        return LmCacheKey(parts[0], world_size, worker_id, chunk_hash, parts[4], layer_id, tuple(tags))

    def canonical(self) -> str:
        """The string upstream's ``to_string`` renders for this key (hash in lowercase hex)."""
        text = f"{self.model_name}@{self.world_size}@{self.worker_id}@{self.chunk_hash:x}@{self.dtype}"
        if self.layer_id is not None:
            text += f"@{self.layer_id}"
        for name, value in self.tags:
            text += f"@{name}%{value}"
        return text

    def store_key(self) -> str:
        """The kv_store key: ``lmcache/<canonical>``."""
        return KEY_PREFIX + self.canonical()


@dataclass(frozen=True, slots=True)
class ValueMeta:
    """LMCache's description of a payload: byte length, memory format, dtype code, 4-d shape."""

    length: int
    fmt: int = MemoryFormat.BINARY_BUFFER
    dtype: int = DTYPE_UINT8
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)

    @staticmethod
    def binary(length: int) -> ValueMeta:
        """Raw bytes: ``BINARY_BUFFER``, uint8, shape ``[length, 0, 0, 0]`` (upstream's bytes convention)."""
        return ValueMeta(length, MemoryFormat.BINARY_BUFFER, DTYPE_UINT8, (length, 0, 0, 0))


MISS_META = ValueMeta(0, MemoryFormat.KV_2LTD, DTYPE_FLOAT16, (0, 0, 0, 0))
"""What upstream's server puts in a reply without payload."""


@dataclass(frozen=True, slots=True)
class LmRequest:
    """One decoded request header; a ``PUT``'s ``meta.length`` payload bytes follow it on the wire."""

    command: LmCommand
    key: LmCacheKey
    meta: ValueMeta
    location: int = 0


@dataclass(frozen=True, slots=True)
class LmReply:
    """One decoded reply header; on a ``GET`` hit ``meta.length`` payload bytes follow it."""

    code: LmReturnCode
    meta: ValueMeta
    location: int = 0


def _check_meta(length: int, fmt: int, dtype: int, shape: tuple[int, ...]) -> ValueMeta:
    if length < 0:
        raise LmProtocolError("bad_length", f"negative length {length}")
    if fmt not in MemoryFormat._value2member_map_:
        raise LmProtocolError("bad_field", f"unknown memory format {fmt}")
    if dtype not in DTYPE_CODES:
        raise LmProtocolError("bad_field", f"unknown dtype code {dtype}")
    if any(d < 0 for d in shape):
        raise LmProtocolError("bad_field", f"negative dimension in shape {shape}")
    return ValueMeta(length, fmt, dtype, (shape[0], shape[1], shape[2], shape[3]))


def decode_request(header: bytes | bytearray | memoryview) -> LmRequest:
    """Decode a 186-byte request header.

    Raises:
        LmProtocolError: wrong size (``truncated``), unknown command (``bad_command``), negative
            length (``bad_length``), unknown format/dtype/location or negative dimension
            (``bad_field``), a key that is not UTF-8 or does not parse (``bad_key``).
    """
    if len(header) != REQUEST_BYTES:
        raise LmProtocolError("truncated", f"request header of {len(header)} bytes, expected {REQUEST_BYTES}")
    command, length, fmt, dtype, location, s0, s1, s2, s3, raw_key = REQUEST.unpack(header)
    if command not in LmCommand._value2member_map_:
        raise LmProtocolError("bad_command", f"unknown command {command}")
    if location not in LOCATIONS:
        raise LmProtocolError("bad_field", f"unknown location {location}")
    meta = _check_meta(length, fmt, dtype, (s0, s1, s2, s3))
    try:
        text = raw_key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LmProtocolError("bad_key", f"key is not UTF-8: {exc}") from exc
    return LmRequest(LmCommand(command), LmCacheKey.parse(text), meta, location)


def request_framing(header: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(command, length)`` of a 186-byte request header as sent, unchecked: what a server needs to
    stay in step with the stream (skip a ``PUT``'s ``length`` payload bytes) when
    :func:`decode_request` refuses the header for another field.

    Raises:
        LmProtocolError: (``truncated``) not 186 bytes.
    """
    if len(header) != REQUEST_BYTES:
        raise LmProtocolError("truncated", f"request header of {len(header)} bytes, expected {REQUEST_BYTES}")
    command, length = _FRAMING.unpack_from(header)
    return command, length


def encode_request(request: LmRequest) -> bytes:
    """The 186-byte header of ``request`` (a client's side; used by tests and benchmarks).

    Raises:
        LmProtocolError: (``bad_key``) the key string is longer than 150 bytes.
    """
    key = request.key.canonical().encode()
    if len(key) > MAX_KEY_LENGTH:
        raise LmProtocolError("bad_key", f"key of {len(key)} bytes exceeds {MAX_KEY_LENGTH}")
    m = request.meta
    return REQUEST.pack(
        request.command, m.length, m.fmt, m.dtype, request.location, *m.shape, key.ljust(MAX_KEY_LENGTH)
    )


def encode_reply(code: LmReturnCode, meta: ValueMeta = MISS_META, location: int = 0) -> bytes:
    """The 36-byte reply header (``code, length, fmt, dtype, shape0..3, location``)."""
    return REPLY.pack(code, meta.length, meta.fmt, meta.dtype, *meta.shape, location)


def decode_reply(header: bytes | bytearray | memoryview) -> LmReply:
    """Decode a 36-byte reply header.

    Raises:
        LmProtocolError: wrong size (``truncated``), unknown code (``bad_command``) or fields (``bad_field``).
    """
    if len(header) != REPLY_BYTES:
        raise LmProtocolError("truncated", f"reply header of {len(header)} bytes, expected {REPLY_BYTES}")
    code, length, fmt, dtype, s0, s1, s2, s3, location = REPLY.unpack(header)
    if code not in LmReturnCode._value2member_map_:
        raise LmProtocolError("bad_command", f"unknown return code {code}")
    if location not in LOCATIONS:
        raise LmProtocolError("bad_field", f"unknown location {location}")
    return LmReply(LmReturnCode(code), _check_meta(length, fmt, dtype, (s0, s1, s2, s3)), location)


def list_reply_payload(store_keys: list[str]) -> bytes:
    """The payload of a ``LIST`` reply: ``CacheEngineKey`` strings joined by ``"\n"``, UTF-8.

    ``store_keys`` are kv_store keys (``lmcache/<canonical key>``); the prefix is dropped, so each
    line is the string LMCache's ``parse_cache_key`` reads. No keys: an empty payload.
    """
    return "\n".join(key.removeprefix(KEY_PREFIX) for key in store_keys).encode()


def decode_list_payload(payload: bytes) -> list[LmCacheKey]:
    """The keys of a ``LIST`` reply payload (:func:`list_reply_payload`).

    Raises:
        LmProtocolError: a line that is not UTF-8 or not a ``CacheEngineKey`` string (``bad_key``).
    """
    if not payload:
        return []
    try:
        lines = payload.decode().split("\n")
    except UnicodeDecodeError as exc:
        raise LmProtocolError("bad_key", f"LIST payload is not UTF-8: {exc}") from None
    return [LmCacheKey.parse(line) for line in lines]


def encode_envelope(meta: ValueMeta) -> bytes:
    """The 32 bytes stored in front of a payload put over ``lm://`` (see the module docstring)."""
    return ENVELOPE.pack(ENVELOPE_MAGIC, meta.length, meta.fmt, meta.dtype, *meta.shape)


def split_envelope(value: bytes | bytearray | memoryview) -> tuple[ValueMeta, memoryview]:
    """A stored value's LMCache metadata and payload (a view, no copy).

    A value with a well-formed envelope (magic, length equal to the rest, known format and dtype)
    yields its metadata; anything else is raw bytes (:meth:`ValueMeta.binary`) served whole.
    """
    view = memoryview(value)
    if len(view) >= ENVELOPE_BYTES and view[:4] == ENVELOPE_MAGIC:
        _, length, fmt, dtype, s0, s1, s2, s3 = ENVELOPE.unpack_from(view)
        if length == len(view) - ENVELOPE_BYTES:
            try:
                return _check_meta(length, fmt, dtype, (s0, s1, s2, s3)), view[ENVELOPE_BYTES:]
            except LmProtocolError:
                pass
    return ValueMeta.binary(len(view)), view
