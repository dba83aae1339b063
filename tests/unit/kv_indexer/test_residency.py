"""The residency log the index feeds replicas from: key-level transitions only, in order, bounded."""

from __future__ import annotations

from kvmesh.hashing import block_keys
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.index.residency import ResidencyLog, ResidencyRecord

A = EndpointId("127.0.0.1:9001")
TOKENS = list(range(8))
KEYS = block_keys(TOKENS, 4)


def index_with_log() -> tuple[InMemoryIndex, ResidencyLog]:
    index = InMemoryIndex()
    index.register_endpoint(Endpoint(id=A, url="http://a", model="m", block_size_tokens=4))
    log = index.residency = ResidencyLog()
    return index, log


def test_only_key_level_transitions_are_recorded() -> None:
    index, log = index_with_log()
    index.apply(A, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=4))
    # the same tokens under other engine hashes (another LoRA-less copy): refcount 2, no new residency
    index.apply(A, BlockStored(block_hashes=[3, 4], parent_block_hash=None, token_ids=TOKENS, block_size=4))
    index.apply(A, BlockRemoved(block_hashes=[1, 2]))  # refcount back to 1: still held
    assert log.since(0) == [ResidencyRecord(A, "GPU", False, KEYS, ())]
    index.apply(A, BlockRemoved(block_hashes=[4]))
    index.apply(A, BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=TOKENS[:4], block_size=4,
                               medium="CPU"))
    index.apply(A, AllBlocksCleared())
    assert log.since(1) == [
        ResidencyRecord(A, "GPU", False, (), [KEYS[1]]),
        ResidencyRecord(A, "CPU", False, [KEYS[0]], ()),
        ResidencyRecord(A, "", True, (), ()),
    ]
    assert log.seq == 4 and log.since(4) == []


def test_snapshot_lists_every_holding_per_medium() -> None:
    index, _ = index_with_log()
    index.apply(A, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=4))
    index.apply(A, BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:4], block_size=4,
                               medium="CPU"))
    assert index.residency_snapshot() == [(A, "CPU", [KEYS[0]]), (A, "GPU", KEYS)]


def test_a_reader_behind_the_bounded_log_must_resync() -> None:
    log = ResidencyLog(max_keys=5)
    woken = []
    log.add_listener(lambda: woken.append(1))
    for i in range(4):
        log.record("e", "GPU", [i, i + 100])  # 3 keys' worth each (2 keys + 1 for the record)
    assert len(woken) == 4 and log.seq == 4 and log.first_seq == 4
    assert log.since(0) is None  # records 1-3 are gone
    assert [r.added for r in log.since(3) or []] == [[3, 103]]
    assert log.since(3, limit_keys=1) == log.since(3)
    log.trim(4)  # every watcher read up to 4: nothing kept, the sequence goes on
    assert log.since(4) == [] and log.first_seq == 5
    log.record("e", "GPU", [7])
    assert [r.added for r in log.since(4) or []] == [[7]]
