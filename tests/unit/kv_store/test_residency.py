"""kv_store's residency as vLLM 0.32 KV events: a move is a store then a removal, never a lost block.

Replays the events into kv_indexer's InMemoryIndex (what kv_indexer does with them) and checks
the index's view against what the tiers really hold.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer.index import InMemoryIndex
from services.kv_store.residency import BadBlockEvent, parse_block_event
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier

B = 4
SOURCE = EndpointId("127.0.0.1:7000")


def block(i: int) -> BlockStored:
    """Block i of one prompt (hash 100+i, parent 100+i-1), as an engine's GPU BlockStored."""
    return BlockStored(
        block_hashes=[100 + i], parent_block_hash=None if i == 0 else 99 + i,
        token_ids=list(range(i * B, (i + 1) * B)), block_size=B,
    )


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    def __call__(self, events: list[KVEvent]) -> None:
        self.batches.append(events)

    def flat(self) -> list[tuple[str, int, str]]:
        out = []
        for batch in self.batches:
            for e in batch:
                assert isinstance(e, BlockStored | BlockRemoved)
                out.append((type(e).__name__, int(e.block_hashes[0]), str(e.medium)))
        return out


def store_with(tmp_path: Path, cpu: int = 20, disk: int = 40, **kw: object) -> tuple[BlockStore, Recorder]:
    rec = Recorder()
    (tmp_path / "shared").mkdir(exist_ok=True)
    tiers = [CpuTier(cpu), DiskTier(tmp_path / "nvme", disk), SharedFsTier(tmp_path / "shared", 1000)]
    return BlockStore(tiers, on_events=rec, **kw), rec  # type: ignore[arg-type]


def index_of(rec: Recorder) -> dict[int, frozenset[Medium]]:
    index = InMemoryIndex()
    index.register_endpoint(Endpoint(id=SOURCE, url="grpc://x", model="m", block_size_tokens=B))
    for batch in rec.batches:
        for event in batch:
            index.apply(SOURCE, event)
    return index.held_blocks(SOURCE)


async def test_put_publishes_cpu_and_demotion_is_a_store_then_a_removal(tmp_path: Path) -> None:
    store, rec = store_with(tmp_path)
    await store.put("k0", b"x" * 10, block(0))
    await store.put("k1", b"y" * 10, block(1))
    assert rec.flat() == [("BlockStored", 100, "CPU"), ("BlockStored", 101, "CPU")]
    rec.batches.clear()
    await store.put("k2", b"z" * 10, block(2))  # CPU full: k0 demoted to disk
    assert rec.batches == [rec.batches[0]]  # one batch for the whole put
    assert rec.flat() == [("BlockStored", 102, "CPU"), ("BlockStored", 100, "DISK"), ("BlockRemoved", 100, "CPU")]
    assert index_of(rec) == {102: {Medium.CPU}, 100: {Medium.DISK}}


async def test_promotion_and_delete_and_the_index_matches_the_tiers(tmp_path: Path) -> None:
    store, rec = store_with(tmp_path)
    for i in range(3):
        await store.put(f"k{i}", bytes([i]) * 10, block(i))
    mark = len(rec.batches)
    assert (await store.get("k0")).medium is Medium.DISK  # promoted: k1 demoted to make room
    assert [e for e in rec.flat()[-4:]] == [  # each move a store, then a removal
        ("BlockStored", 100, "CPU"), ("BlockRemoved", 100, "DISK"), ("BlockStored", 101, "DISK"),
        ("BlockRemoved", 101, "CPU"),
    ]
    assert len(rec.batches) == mark + 1
    assert await store.delete("k2")
    assert rec.flat()[-1] == ("BlockRemoved", 102, "CPU")
    tiers = {}
    for i in range(3):
        medium = (await store.media([f"k{i}"]))[0]
        if medium is not None:
            tiers[100 + i] = frozenset({medium})
    assert index_of(rec) == tiers == {100: {Medium.CPU}, 101: {Medium.DISK}}


async def test_write_through_keeps_the_shared_copy_and_last_tier_eviction_removes(tmp_path: Path) -> None:
    store, rec = store_with(tmp_path, write_through=["sharedfs"])
    await store.put("k0", b"a" * 10, block(0))
    assert rec.flat() == [("BlockStored", 100, "CPU"), ("BlockStored", 100, "SHARED")]
    for i in range(1, 8):  # push k0 through CPU and disk: disk's victims fall off, the shared copy stays
        await store.put(f"k{i}", b"b" * 10, block(i))
    held = index_of(rec)
    assert held[100] == {Medium.SHARED}
    assert all(len(media) >= 1 for media in held.values())
    for i in range(8):
        want = {m for m in (await store.media([f"k{i}"])) if m is not None}
        assert want <= set(held[100 + i])


async def test_values_without_a_block_event_are_not_published(tmp_path: Path) -> None:
    store, rec = store_with(tmp_path)
    await store.put("plain", b"v" * 10)
    await store.get("plain")
    assert rec.batches == []
    assert store.residency.ignored > 0


def test_parse_block_event_checks_shape() -> None:
    raw = msgspec.msgpack.encode(block(0))
    assert parse_block_event(raw, B).block_hashes == [100]
    with pytest.raises(BadBlockEvent, match="block_size"):
        parse_block_event(raw, 8)
    two = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=B)
    with pytest.raises(BadBlockEvent, match="one block"):
        parse_block_event(msgspec.msgpack.encode(two))
    with pytest.raises(BadBlockEvent, match="not a vLLM BlockStored"):
        parse_block_event(b"\x93garbage")


def test_put_request_parser_reads_the_block_event_field() -> None:
    from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2
    from services.kv_store.servicer import parse_put_request

    raw = msgspec.msgpack.encode(block(0))
    chunk = parse_put_request(
        kv_store_pb2.PutRequest(key="k", total_bytes=3, data=b"abc", block_stored_event=raw).SerializeToString()
    )
    assert (chunk.key, chunk.total_bytes, bytes(chunk.data), chunk.block_stored_event) == ("k", 3, b"abc", raw)


async def test_a_restarted_store_republishes_what_its_file_tiers_rescanned(tmp_path: Path) -> None:
    store, rec = store_with(tmp_path, write_through=["sharedfs"])
    for i in range(6):  # CPU holds 2; k0-k3 spill to disk (holds 4); every block is also on the shared FS
        await store.put(f"k{i}", bytes([i]) * 10, block(i))
    await store.put("plain", b"p" * 10)  # no description: served after the restart, never published
    before = {h: m - {Medium.CPU} for h, m in index_of(rec).items()}

    # a new process on the same paths: CPU is empty, disk and shared FS are rescanned and republished
    again, rec2 = store_with(tmp_path, write_through=["sharedfs"])
    assert again.republished == 4 + 6  # 4 on disk, 6 described on the shared FS ("plain" is not)
    assert all(isinstance(e, BlockStored) for batch in rec2.batches for e in batch)
    after = index_of(rec2)
    assert after == {h: m for h, m in before.items() if m}
    assert after[102] == {Medium.DISK, Medium.SHARED} and after[105] == {Medium.SHARED}
    # the republished event is the engine's own block (hash, parent, tokens), with the tier's medium
    stored = [e for batch in rec2.batches for e in batch if isinstance(e, BlockStored) and e.block_hashes == [103]]
    assert {e.medium for e in stored} == {"DISK", "SHARED"}
    assert all(e.parent_block_hash == 102 and e.token_ids == block(3).token_ids for e in stored)
    # moves after the restart keep the field rule (store before removal) on the adopted blocks
    assert (await again.get("k2")).medium is Medium.DISK
    assert rec2.flat()[-2:] == [("BlockStored", 102, "CPU"), ("BlockRemoved", 102, "DISK")]
    assert (await again.get("plain")).value == b"p" * 10


async def test_a_second_store_on_the_same_disk_republishes_nothing_twice(tmp_path: Path) -> None:
    store, _ = store_with(tmp_path)
    for i in range(4):
        await store.put(f"k{i}", bytes([i]) * 10, block(i))
    tier = DiskTier(tmp_path / "nvme", 40)
    assert sorted(key for key, _ in tier.take_rescanned()) == ["k0", "k1"]
    assert tier.take_rescanned() == []  # handed over once
