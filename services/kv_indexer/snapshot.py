"""kv_indexer snapshots: the index and each endpoint's stream position, on disk, for a warm restart.

A snapshot is one msgpack file (written to ``<path>.tmp`` then renamed, so a crash mid-write
leaves the previous one) holding, per endpoint: its registration (``Endpoint`` JSON, with its
``instance_id``), the next sequence number it expects (everything before it is applied) and
whether its stream was reliable (always, since a loss heals; an endpoint saved unreliable by an older
kvmesh is restored without its entries, which may be stale); and the index as :meth:`KVBlockIndex.dump` events (keyed blocks,
and orphans as their ``BlockStored``). Restoring registers the endpoints, re-applies the dump and
restores the stream positions; the pipeline then asks each publisher's replay buffer for what came
after (vLLM keeps ``buffer_steps`` messages), so the index is warm and exact without a cold start.

Taken synchronously on the service's loop, so the dump and the positions are of one instant.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

import msgspec

from kvmesh.kv_events import BlockStored
from kvmesh.types import Endpoint, EndpointId, Medium
from services.kv_indexer import metrics
from services.kv_indexer.index.base import KeyedBlockStored
from services.kv_indexer.indexer import BlockIndexer

logger = logging.getLogger(__name__)

VERSION = 2
"""2: block keys are XXH3-64 (kvmesh.hashing, issue 10); version 1 held BLAKE2b keys, which a load refuses (cold start)."""


class _EndpointRecord(msgspec.Struct, array_like=True):
    endpoint: str
    next_seq: int | None
    reliable: bool


class _Keyed(msgspec.Struct, array_like=True, tag="k"):
    endpoint_id: str
    block_hashes: list[int]
    block_keys: list[int]
    block_size: int
    medium: str


class _Orphan(msgspec.Struct, array_like=True, tag="o"):
    endpoint_id: str
    block_hash: int
    parent: int
    token_ids: list[int]
    block_size: int
    medium: str


class _Snapshot(msgspec.Struct):
    version: int
    saved_at: float
    endpoints: list[_EndpointRecord]
    blocks: list[_Keyed | _Orphan]


def save(indexer: BlockIndexer, path: str | Path) -> int:
    """Write the snapshot; returns its size in bytes.

    Raises:
        OSError: the file cannot be written.
    """
    start = time.perf_counter()
    positions = indexer.pool.export()
    registered = indexer.index.registered()
    records = [
        _EndpointRecord(ep.to_json(), positions.get(eid, (None, True))[0], positions.get(eid, (None, True))[1])
        for eid, ep in sorted(registered.items())
    ]
    blocks: list[_Keyed | _Orphan] = []
    for endpoint_id, event in indexer.index.dump():
        if isinstance(event, KeyedBlockStored):
            blocks.append(_Keyed(endpoint_id, list(event.block_hashes), list(event.block_keys), event.block_size, str(event.medium)))
        elif isinstance(event, BlockStored) and event.parent_block_hash is not None:
            blocks.append(_Orphan(
                endpoint_id, int(event.block_hashes[0]), int(event.parent_block_hash),
                list(event.token_ids), event.block_size, event.medium or "GPU",
            ))
    data = msgspec.msgpack.encode(_Snapshot(VERSION, time.time(), records, blocks))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    metrics.record_snapshot("save", time.perf_counter() - start)
    logger.info("snapshot saved path=%s endpoints=%d block_records=%d bytes=%d", target, len(records), len(blocks), len(data))
    return len(data)


def load(indexer: BlockIndexer, path: str | Path) -> set[EndpointId]:
    """Restore a snapshot into an empty indexer; returns the endpoints restored (none when the file
    is missing; an unreadable or foreign-version file is logged and ignored: a cold start)."""
    start = time.perf_counter()
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        logger.info("no snapshot at %s: cold start", path)
        return set()
    try:
        snap = msgspec.msgpack.decode(raw, type=_Snapshot)
        if snap.version != VERSION:
            raise ValueError(f"snapshot version {snap.version}, expected {VERSION}")
        endpoints = [(Endpoint.from_json(r.endpoint), r) for r in snap.endpoints]
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        logger.error("ignoring unreadable snapshot path=%s error=%s: cold start", path, exc)
        return set()
    restored: set[EndpointId] = set()
    lost: set[EndpointId] = set()
    for endpoint, record in endpoints:
        indexer.index.register_endpoint(endpoint)
        indexer.parity.register(endpoint)
        indexer.pool.restore(endpoint, record.next_seq)
        restored.add(endpoint.id)
        if not record.reliable:
            lost.add(endpoint.id)
    forgotten: Counter[EndpointId] = Counter()
    for block in snap.blocks:
        eid = EndpointId(block.endpoint_id)
        if eid in lost:
            forgotten[eid] += len(block.block_hashes) if isinstance(block, _Keyed) else 1
            continue
        if isinstance(block, _Keyed):
            indexer.index.apply(eid, KeyedBlockStored(
                tuple(block.block_hashes), tuple(block.block_keys), block.block_size, Medium.parse(block.medium)
            ))
        else:
            indexer.index.apply(eid, BlockStored(
                block_hashes=[block.block_hash], parent_block_hash=block.parent, token_ids=block.token_ids,
                block_size=block.block_size, medium=block.medium,
            ))
    for endpoint_id in sorted(lost):
        metrics.record_loss("snapshot", forgotten[endpoint_id])
        logger.warning(
            "snapshot endpoint=%s was saved unreliable (messages lost for good, an older kvmesh): its %d entries "
            "are not restored, it is followed live from seq=%s", endpoint_id, forgotten[endpoint_id],
            indexer.pool.export().get(endpoint_id, (None, True))[0],
        )
    metrics.record_snapshot("load", time.perf_counter() - start)
    logger.info(
        "snapshot loaded path=%s age=%.1fs endpoints=%d blocks=%d",
        path, time.time() - snap.saved_at, len(restored), indexer.index.stats().blocks,
    )
    return restored
