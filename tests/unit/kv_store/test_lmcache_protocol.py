"""The ``lm://`` codec against frames recorded from lmcache 0.5.6's own classes.

The hex frames below were produced by lmcache 0.5.6 (``ClientMetaMessage(...).serialize()`` and
``ServerMetaMessage(...).serialize()`` from ``lmcache/v1/protocol.py``, in ``.venv-lmcache``) for the
key ``CacheEngineKey("tiny", 2, 1, 0xabc123, torch.bfloat16, {"lmcache.tag.user": "alice"})``.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.kv_store.lmcache_protocol import (
    ENVELOPE_BYTES,
    REPLY_BYTES,
    REQUEST,
    REQUEST_BYTES,
    LmCacheKey,
    LmCommand,
    LmProtocolError,
    LmReply,
    LmRequest,
    LmReturnCode,
    MemoryFormat,
    ValueMeta,
    decode_list_payload,
    decode_reply,
    decode_request,
    encode_envelope,
    encode_reply,
    encode_request,
    list_reply_payload,
    split_envelope,
)

KEY = "tiny@2@1@abc123@bfloat16@user%alice"
PAD = "20" * (150 - len(KEY))
UPSTREAM_PUT = (
    "01000000" "00000800" "01000000" "03000000" "00000000" "02000000" "01000000" "00040000" "80000000"
    + KEY.encode().hex() + PAD
)  # fmt: skip
UPSTREAM_GET = (
    "02000000" "00000000" "01000000" "02000000" "00000000" "00000000" "00000000" "00000000" "00000000"
    + KEY.encode().hex() + PAD
)  # fmt: skip
UPSTREAM_HIT = "c80000000000080001000000030000000200000001000000000400008000000000000000"
UPSTREAM_MISS = "900100000000000001000000020000000000000000000000000000000000000000000000"
KV_META = ValueMeta(524288, MemoryFormat.KV_2LTD, 3, (2, 1, 1024, 128))


def test_request_frames_match_lmcache_056() -> None:
    put = decode_request(bytes.fromhex(UPSTREAM_PUT))
    assert put == LmRequest(LmCommand.PUT, LmCacheKey("tiny", 2, 1, 0xABC123, "bfloat16", None, (("user", "alice"),)), KV_META)
    assert put.key.canonical() == KEY
    assert put.key.store_key() == "lmcache/" + KEY
    assert encode_request(put).hex() == UPSTREAM_PUT
    get = decode_request(bytes.fromhex(UPSTREAM_GET))
    assert (get.command, get.meta) == (LmCommand.GET, ValueMeta(0, MemoryFormat.KV_2LTD, 2, (0, 0, 0, 0)))
    assert encode_request(get).hex() == UPSTREAM_GET
    assert REQUEST_BYTES == 186 and REPLY_BYTES == 36


def test_reply_frames_match_lmcache_056() -> None:
    assert encode_reply(LmReturnCode.SUCCESS, KV_META).hex() == UPSTREAM_HIT
    assert encode_reply(LmReturnCode.FAIL).hex() == UPSTREAM_MISS  # a miss, exactly as upstream's server sends it
    assert decode_reply(bytes.fromhex(UPSTREAM_HIT)) == LmReply(LmReturnCode.SUCCESS, KV_META)
    assert decode_reply(bytes.fromhex(UPSTREAM_MISS)).code is LmReturnCode.FAIL


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("tiny@2@1@abc123@bfloat16", "tiny@2@1@abc123@bfloat16"),
        ("tiny@2@1@00ABC123@bfloat16", "tiny@2@1@abc123@bfloat16"),  # upstream parses the hash as an int
        ("tiny@2@1@ff@half@3", "tiny@2@1@ff@half@3"),  # LayerCacheEngineKey (lmcache 0.5.6 rendering)
        ("tiny@2@1@ff@half@3@a%b@c%d=e", "tiny@2@1@ff@half@3@a%b@c%d=e"),
        ("/m/with/slashes@8@0@1@fp8_e4m3fn", "/m/with/slashes@8@0@1@fp8_e4m3fn"),
        ("  tiny@2@1@ff@half   ", "tiny@2@1@ff@half"),  # the key field is space-padded
    ],
)
def test_key_mapping(text: str, canonical: str) -> None:
    key = LmCacheKey.parse(text)
    assert key.canonical() == canonical
    assert LmCacheKey.parse(canonical) == key


@pytest.mark.parametrize(
    "text", ["", "a@b", "tiny@x@1@ff@half", "tiny@2@1@zz@half", "tiny@2@1@ff@complex64", "tiny@2@1@ff@half@notag"]
)
def test_bad_keys(text: str) -> None:
    with pytest.raises(LmProtocolError) as info:
        LmCacheKey.parse(text)
    assert info.value.reason == "bad_key"


def _frame(command: int = 2, length: int = 0, fmt: int = 1, dtype: int = 2, location: int = 0, key: bytes = b"m@1@0@ff@half", dim: int = 0) -> bytes:  # fmt: skip
    return REQUEST.pack(command, length, fmt, dtype, location, dim, 0, 0, 0, key.ljust(150))


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (_frame(command=0), "bad_command"),
        (_frame(command=6), "bad_command"),
        (_frame(length=-1), "bad_length"),
        (_frame(fmt=9), "bad_field"),
        (_frame(dtype=9), "bad_field"),
        (_frame(location=3), "bad_field"),
        (_frame(dim=-2), "bad_field"),
        (_frame(key=b"\xc3\x28@1@0@ff@half"), "bad_key"),
        (_frame()[:-1], "truncated"),
        (_frame() + b" ", "truncated"),
    ],
)
def test_bad_request_frames(frame: bytes, reason: str) -> None:
    with pytest.raises(LmProtocolError) as info:
        decode_request(frame)
    assert info.value.reason == reason


def test_key_longer_than_the_field_is_refused_on_encode() -> None:
    key = LmCacheKey("m" * 150, 1, 0, 1, "half")
    with pytest.raises(LmProtocolError):
        encode_request(LmRequest(LmCommand.GET, key, ValueMeta(0)))


def test_envelope_keeps_metadata_and_raw_values_are_binary_buffers() -> None:
    payload = bytes(range(256)) * 4
    meta = ValueMeta(len(payload), MemoryFormat.KV_T2D, 4, (256, 2, 2, 0))
    stored = encode_envelope(meta) + payload
    got_meta, view = split_envelope(stored)
    assert (got_meta, bytes(view)) == (meta, payload)
    assert len(encode_envelope(meta)) == ENVELOPE_BYTES == 32
    raw = b"LMC1" + b"\x00" * 40  # magic but a length that does not match: raw bytes
    assert split_envelope(raw)[0] == ValueMeta(44, MemoryFormat.BINARY_BUFFER, 6, (44, 0, 0, 0))
    assert bytes(split_envelope(raw)[1]) == raw
    bad_fmt = struct.pack("<4s7i", b"LMC1", 0, 77, 3, 0, 0, 0, 0)  # envelope with an unknown format
    assert split_envelope(bad_fmt)[0].fmt == MemoryFormat.BINARY_BUFFER
    assert split_envelope(b"")[0] == ValueMeta(0, MemoryFormat.BINARY_BUFFER, 6, (0, 0, 0, 0))


@given(
    command=st.sampled_from(list(LmCommand)),
    length=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from(list(MemoryFormat)),
    dtype=st.integers(0, 8),
    shape=st.tuples(*[st.integers(0, 2**31 - 1)] * 4),
    model=st.text(st.characters(blacklist_characters="@", blacklist_categories=("Cs",)), max_size=20).map(str.strip),
    chunk_hash=st.integers(0, 2**256),
    layer=st.none() | st.integers(0, 99),
)
def test_request_round_trip(command, length, fmt, dtype, shape, model, chunk_hash, layer) -> None:  # type: ignore[no-untyped-def]
    key = LmCacheKey(model, 4, 1, chunk_hash, "bfloat16", layer)
    request = LmRequest(command, key, ValueMeta(length, fmt, dtype, shape))
    try:
        frame = encode_request(request)
    except LmProtocolError:
        assert len(key.canonical().encode()) > 150
        return
    assert decode_request(frame) == request


def test_list_payload_round_trip_and_bad_lines() -> None:
    """LIST's payload (lmcache 0.5.6's commented-out server reply): key strings joined by "\\n", no prefix."""
    keys = ["lmcache/tiny@2@1@abc123@bfloat16@user%alice", "lmcache/m@1@0@ff@half@3"]
    payload = list_reply_payload(keys)
    assert payload == b"tiny@2@1@abc123@bfloat16@user%alice\nm@1@0@ff@half@3"
    assert [k.store_key() for k in decode_list_payload(payload)] == keys
    assert list_reply_payload([]) == b"" and decode_list_payload(b"") == []
    for bad in (b"\xff\xfe", b"m@1@0@ff@half\nnot-a-key"):
        with pytest.raises(LmProtocolError) as err:
            decode_list_payload(bad)
        assert err.value.reason == "bad_key"
