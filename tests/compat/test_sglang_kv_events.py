"""SGLang 0.5.23 KV events through kvmesh's decoder, event filter and index.

Fixtures (``tests/compat/fixtures/sglang-0.5.23/kv_events.jsonl``) were *encoded by SGLang's own
code*, not recorded from a running engine: SGLang does not run on this machine's CPU, so
``tests/compat/record_sglang.py`` loads ``sglang/srt/disaggregation/kv_events.py`` (the structs and
their msgspec encoding) and ``sglang/srt/mem_cache/events.py`` (``KVCacheEventRecorder``: pages,
coalescing, parent links, LoRA names, ``cache_salt``, media) from the ``sglang`` 0.5.23 wheel and
drives them as its radix cache does. Only the page hash values are a stand-in (SGLang's are a
native SHA-256 chain); kvmesh treats them as opaque ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.kv_events import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_seq,
    encode_sglang_batch,
    stored_key_scope,
)
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.events.fields import EventFieldFilter
from services.kv_indexer.events.pool import RawMessage
from services.kv_indexer.events.subscriber import parse_frames
from services.kv_indexer.index import ApplyOutcome, InMemoryIndex

FIXTURE = Path(__file__).parent / "fixtures" / "sglang-0.5.23" / "kv_events.jsonl"
PAGE = 4
EP = EndpointId("127.0.0.1:30000")
TOPIC = f"kv@{EP}@qwen".encode()


def _messages() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def _shared_tokens() -> list[int]:
    return _messages()[0]["decoded"][1][0]["token_ids"][: 3 * PAGE]


def test_fixture_payloads_decode_with_every_sglang_field() -> None:
    seen: dict[str, set[str]] = {}
    for message in _messages():
        payload = bytes.fromhex(message["raw_hex"])
        batch = decode_batch(payload)
        ts, events, rank = message["decoded"]
        assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (ts, rank, len(events))
        for event, raw in zip(batch.events, events, strict=True):
            assert type(event).__name__ == raw["type"]
            seen.setdefault(raw["type"], set()).update(raw)
            if isinstance(event, BlockStored):
                assert event.block_size == PAGE and len(event.token_ids) == PAGE * len(event.block_hashes)
                assert event.extra_keys is None and event.group_idx == 0  # vLLM-only fields at their defaults
                assert event.cache_salt == raw.get("cache_salt", msgspec.UNSET)
    # SGLang's shapes: no extra_keys / group_idx; lora_id always sent (None); salt and name when set
    assert seen["BlockStored"] == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "cache_salt", "lora_name"}
    assert seen["BlockRemoved"] == {"type", "block_hashes", "medium"}
    assert seen["AllBlocksCleared"] == {"type"}


def test_fixture_replay_indexes_scopes_media_ranks_and_clears() -> None:
    index = InMemoryIndex()
    rank1 = EndpointId(f"{EP}#dp1")
    for eid, rank in ((EP, None), (rank1, 1)):
        index.register_endpoint(Endpoint(eid, f"http://{EP}", "qwen", PAGE, data_parallel_rank=rank))
    fields = EventFieldFilter()
    shared = _shared_tokens()
    chain = _messages()[0]["decoded"][1][0]["token_ids"]  # the prompt and its branch: 5 pages

    def matched(tokens: list[int], scope: KeyScope = DEFAULT_SCOPE, endpoint: EndpointId = EP) -> int:
        return {s.endpoint_id: s.matched_blocks for s in index.score("qwen", tokens, scope=scope).scores}.get(endpoint, 0)

    for seq, message in enumerate(_messages()):
        parsed = parse_frames([TOPIC, encode_seq(seq), bytes.fromhex(message["raw_hex"])])
        assert isinstance(parsed, RawMessage)
        for event in decode_batch(parsed.payload).events:
            if fields.admit(parsed.endpoint_id, event):
                assert index.apply(parsed.endpoint_id, event) is ApplyOutcome.APPLIED
        scenario = message["scenario"]
        if scenario == "store_chain":
            assert matched(chain) == 5
        elif scenario == "store_salted":
            assert matched(shared, KeyScope(None, "t1")) == 3
            assert matched(shared, KeyScope(None, "t2")) == 0
        elif scenario == "store_lora":
            [stored] = decode_batch(parsed.payload).events
            assert isinstance(stored, BlockStored) and stored_key_scope(stored)[0] == KeyScope("sql-adapter", None)
            assert matched(shared, KeyScope("sql-adapter")) == 3
            assert matched(shared, KeyScope("other-adapter")) == 0
            assert matched(shared, KeyScope("sql-adapter", "t1")) == 0
        elif scenario == "move_to_host":  # HiCache backup to CPU_PINNED, then GPU eviction
            [score] = [s for s in index.score("qwen", chain).scores if s.endpoint_id == EP]
            assert score.matched_blocks == 5
            assert score.matched_blocks_by_medium == {Medium.GPU: 3, Medium.CPU: 2}
        elif scenario == "remove_host":
            assert matched(chain) == 3
        elif scenario == "store_rank1":
            assert parsed.endpoint_id == rank1
            assert matched(shared, endpoint=rank1) == 3
        elif scenario == "all_cleared":
            assert matched(chain) == 0 and matched(shared, KeyScope(None, "t1")) == 0
            assert matched(shared, endpoint=rank1) == 3  # another rank's cache is its own
    assert matched(shared) == 0


def test_kvmesh_writes_sglang_shapes_that_read_back_the_same() -> None:
    """The simulator's SGLang personality publishes through :func:`encode_sglang_batch`."""
    stored = BlockStored([2**64 - 1, 5], None, list(range(8)), PAGE, lora_name="sql-adapter",
                         extra_keys=[["sql-adapter", "t1"], ["sql-adapter"]])
    payload = encode_sglang_batch(1.0, [stored, BlockRemoved([5], "CPU")], 0)
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [-1, 5], "parent_block_hash": None,
                         "token_ids": list(range(8)), "block_size": PAGE, "lora_id": None, "medium": "GPU",
                         "cache_salt": "t1", "lora_name": "sql-adapter"}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU_PINNED"}
    [back, removed] = decode_batch(payload).events
    assert isinstance(back, BlockStored) and stored_key_scope(back)[0] == stored_key_scope(stored)[0]
    assert isinstance(removed, BlockRemoved) and Medium.parse(removed.medium) is Medium.CPU
