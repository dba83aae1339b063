"""Block hashing against vLLM 0.32.0 (CPU build) recordings, and kvmesh's own block keys."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.hashing import block_keys, external_hash_to_int, sha256_cbor_block_hashes
from tests.support import recording


def _decoded_bytes(value):
    return bytes.fromhex(value["__bytes__"]) if isinstance(value, dict) else value


@pytest.mark.parametrize("filename", ["kv_events_int_hashes.jsonl", "kv_events_bytes_hashes.jsonl"])
def test_sha256_cbor_matches_vllm_0_32_events(filename: str) -> None:
    """Every root BlockStored chain recorded from vLLM 0.32.0 (sha256_cbor) is recomputed exactly."""
    checked = 0
    for line in recording(filename).read_text().splitlines():
        _ts, events, _rank = json.loads(line)["decoded"]
        for event in events:
            if event["type"] != "BlockStored" or event["parent_block_hash"] is not None:
                continue
            expected = [_decoded_bytes(h) for h in event["block_hashes"]]
            digests = sha256_cbor_block_hashes(event["token_ids"], event["block_size"])
            if isinstance(expected[0], int):
                assert [external_hash_to_int(d) for d in digests] == expected
            else:
                assert digests == expected
                assert [external_hash_to_int(d) for d in digests] == [int.from_bytes(e[-8:], "big") for e in expected]
            checked += 1
    assert checked > 0


def test_block_keys_full_blocks_only() -> None:
    assert block_keys(list(range(63)), 64) == []
    assert len(block_keys(list(range(130)), 64)) == 2


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0)
    with pytest.raises(ValueError, match="block_size"):
        sha256_cbor_block_hashes([1, 2], -1)


@given(
    st.lists(st.integers(0, 2**31), min_size=0, max_size=200),
    st.lists(st.integers(0, 2**31), min_size=0, max_size=200),
)
def test_keys_equal_exactly_on_shared_prefix(a: list[int], b: list[int]) -> None:
    size = 8
    keys_a, keys_b = block_keys(a, size), block_keys(b, size)
    for i in range(min(len(keys_a), len(keys_b))):
        assert (keys_a[i] == keys_b[i]) == (a[: (i + 1) * size] == b[: (i + 1) * size])


def test_chaining_from_parent() -> None:
    tokens = list(range(96))
    whole = block_keys(tokens, 32)
    assert block_keys(tokens[32:], 32, parent_key=whole[0]) == whole[1:]


def test_key_scope_roots_separate_lora_and_salt_and_keep_the_default_unchanged() -> None:
    from kvmesh.hashing import DEFAULT_SCOPE, KeyScope, block_keys

    tokens = list(range(64))
    assert DEFAULT_SCOPE.root_key() == 0 and KeyScope("", "").is_default
    assert block_keys(tokens, 16, DEFAULT_SCOPE.root_key()) == block_keys(tokens, 16)
    roots = {KeyScope(lora, salt).root_key() for lora in (None, "a", "ab") for salt in (None, "c", "bc")}
    assert len(roots) == 9  # presence bytes and length prefixes: ("a", "bc") != ("ab", "c")
    chains = [block_keys(tokens, 16, KeyScope(lora, salt).root_key()) for lora in (None, "x") for salt in (None, "s")]
    assert len({k for chain in chains for k in chain}) == 4 * 4  # no key shared across scopes
    assert block_keys(tokens, 16, 0, [None, b"img"])[0] == block_keys(tokens, 16)[0]
    assert block_keys(tokens, 16, 0, [None, b"img"])[1] != block_keys(tokens, 16)[1]


def test_block_keys_are_xxh3_chained_over_uint32_le_token_bytes() -> None:
    """The key formula (issue 10): XXH3-64 of the block's uint32-LE tokens, seeded with the parent key.

    Pinned so a change of formula is deliberate: snapshots hold keys (snapshot.VERSION) and every
    index must agree with every scorer."""
    import xxhash

    tokens = list(range(40))
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    k0 = xxhash.xxh3_64_intdigest(raw[:64], 0)
    k1 = xxhash.xxh3_64_intdigest(raw[64:128], k0)
    assert block_keys(tokens, 16) == [k0, k1]
    assert block_keys(tokens, 16, 0, [None, b"img"])[1] == xxhash.xxh3_64_intdigest(raw[64:128] + b"\xffextra" + b"img", k0)


def test_block_keys_accept_every_token_buffer_alike() -> None:
    from array import array

    import numpy as np

    tokens = [7, 2**32 - 1, 0, 123456] * 40
    expected = block_keys(tokens, 16)
    assert len(expected) == 10
    assert block_keys(array("I", tokens), 16) == expected
    assert block_keys(np.array(tokens, dtype=np.int64), 16) == expected
    assert block_keys(np.array(tokens, dtype=np.uint32).tobytes(), 16) == expected
    assert block_keys(memoryview(np.array(tokens, dtype="<u4").tobytes()), 16) == expected
    for bad in ([-1] * 16, [2**32] * 16, np.array([2**32] * 16)):
        with pytest.raises(OverflowError):
            block_keys(bad, 16)
    with pytest.raises(ValueError, match="uint32"):
        block_keys(b"\x00" * 7, 1)


@given(
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=120), min_size=1, max_size=8),
    st.sampled_from([0, 12345]),
)
def test_prefix_key_cache_always_equals_block_keys(prompts: list[list[int]], parent: int) -> None:
    """Prompts over a tiny alphabet share prefixes of every length: reuse must never change a key."""
    from kvmesh.hashing import PrefixKeyCache

    cache = PrefixKeyCache(max_bytes=4096, per_bucket=2)
    for prompt in prompts + prompts[::-1]:
        assert cache.block_keys(prompt, 4, parent) == block_keys(prompt, 4, parent)
        assert cache.size_bytes <= 4096


def test_prefix_key_cache_hashes_only_the_new_blocks_of_a_growing_prompt() -> None:
    from kvmesh.hashing import PrefixKeyCache

    cache = PrefixKeyCache()
    history = list(range(64 * 100))
    cache.block_keys(history, 64)
    assert cache.hashed_blocks == 99  # block 0 is hashed to find the bucket
    grown = history + list(range(10**6, 10**6 + 64 * 3))
    assert cache.block_keys(grown, 64) == block_keys(grown, 64)
    assert (cache.reused_blocks, cache.hashed_blocks) == (100, 102)
    assert len(cache) == 1  # the grown prompt replaced the one it extends
    edited = history[: 64 * 50] + [0] + history[64 * 50 + 1 :]  # one token changed in block 50
    assert cache.block_keys(edited, 64) == block_keys(edited, 64)
    assert cache.reused_blocks == 150 and len(cache) == 2
    assert cache.block_keys(history[: 64 * 10], 64) == block_keys(history[: 64 * 10], 64)  # a prefix: no new entry
    assert len(cache) == 2
    off = PrefixKeyCache(max_bytes=0)
    assert off.block_keys(grown, 64) == block_keys(grown, 64) and len(off) == 0
