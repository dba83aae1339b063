"""gRPC KVIndexer servicer: protobuf in, :class:`~services.kv_indexer.indexer.BlockIndexer` call, protobuf out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
from kvmesh.errors import InvalidRequest
from kvmesh.hashing import KeyScope
from kvmesh.prefix_index import ReplicaEndpoint
from kvmesh.types import EndpointId
from kvmesh.wire import medium_to_proto
from services.kv_indexer.index.residency import ResidencyRecord
from services.kv_indexer.indexer import BlockIndexer, IndexState

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVIndexer"].full_name


WATCH_POLL_SECONDS = 0.25
"""How often a Watch stream checks endpoint states and readiness when nothing woke it
(``KvIndexerConfig.watch_status_poll_seconds``; a residency or membership change wakes it at once)."""
WATCH_HEARTBEAT_SECONDS = 1.0
"""An idle Watch stream sends a heartbeat this often (``KvIndexerConfig.watch_heartbeat_seconds``;
epp's replica calls a stream stale after ``kv_indexer_watch_stale_seconds``, 3 s)."""
WATCH_CHUNK_KEYS = 65536
"""Keys per Watch message (snapshot chunks and delta batches stay well under gRPC's 4 MB message limit)."""


class KVIndexerServicer(kv_indexer_pb2_grpc.KVIndexerServicer):
    def __init__(self, indexer: BlockIndexer, watch_status_poll_seconds: float = WATCH_POLL_SECONDS,
                 watch_heartbeat_seconds: float = WATCH_HEARTBEAT_SECONDS) -> None:
        self._indexer = indexer
        self._status_poll = watch_status_poll_seconds
        self._heartbeat = watch_heartbeat_seconds
        self._positions: dict[int, int] = {}
        """Watch streams' log positions (the log keeps only what the slowest has not read)."""

    async def Watch(self, request: pb.WatchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WatchResponse]:
        """Snapshot, then ordered residency deltas, endpoint-state changes and heartbeats (see the proto).
        A model in ``models`` the index does not know yet is watched (its endpoints appear when they
        register). Raises InvalidRequest for an empty ``models`` entry (it would filter out everything)."""
        for i, model in enumerate(request.models):
            if not model.strip():
                raise InvalidRequest(f"'models[{i}]' is empty: name a model, or send no models for every model")
        log = self._indexer.open_residency()
        if log is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this index backend cannot feed replicas")
            return
        wake = asyncio.Event()
        log.add_listener(wake.set)
        self._indexer.add_status_listener(wake.set)
        watcher = id(wake)
        models = set(request.models)
        try:
            while True:  # one pass per snapshot; a watcher that fell behind the log starts again
                seq = log.seq
                self._positions[watcher] = seq
                endpoints, models_of = self._endpoints(models)
                ready, load_only = self._indexer.ready, self._indexer.load_only_models()
                status = (endpoints, ready, load_only)
                chunks = _chunks([
                    pb.ResidencyDelta(endpoint_id=e, medium=m, added_keys=keys)
                    for e, m, keys in self._indexer.residency_snapshot() if e in models_of
                ])
                for i, deltas in enumerate(chunks):
                    yield pb.WatchResponse(
                        prev_seq=seq, seq=seq, reset=i == 0, synced=i == len(chunks) - 1, deltas=deltas,
                        endpoints_changed=i == 0, endpoints=[_watched(e) for e in endpoints] if i == 0 else [],
                        ready=ready, load_only_models=load_only,
                    )
                last_sent = time.monotonic()
                while True:
                    if log.seq <= seq:
                        wake.clear()
                        with contextlib.suppress(TimeoutError):  # asyncio.timeout: no task per wait (wait_for's)
                            async with asyncio.timeout(min(self._status_poll, self._heartbeat)):
                                await wake.wait()
                    records = log.since(seq, WATCH_CHUNK_KEYS)
                    if records is None:
                        break  # dropped from the log before this watcher read them: resync
                    endpoints, models_of = self._endpoints(models)
                    ready, load_only = self._indexer.ready, self._indexer.load_only_models()
                    changed = (endpoints, ready, load_only) != status
                    now = time.monotonic()
                    if not records and not changed and now - last_sent < self._heartbeat:
                        continue
                    status = (endpoints, ready, load_only)
                    prev, seq = seq, seq + len(records)
                    self._positions[watcher] = seq
                    log.trim(min(self._positions.values()))
                    last_sent = now
                    yield pb.WatchResponse(
                        prev_seq=prev, seq=seq, synced=True,
                        deltas=_deltas([r for r in records if not models or r.endpoint_id in models_of]),
                        endpoints_changed=changed, endpoints=[_watched(e) for e in endpoints] if changed else [],
                        ready=ready, load_only_models=load_only,
                    )
        finally:
            self._positions.pop(watcher, None)
            log.remove_listener(wake.set)
            self._indexer.remove_status_listener(wake.set)
            self._indexer.close_residency()

    def _endpoints(self, models: set[str]) -> tuple[list[ReplicaEndpoint], set[str]]:
        endpoints = [e for e in self._indexer.watch_endpoints() if not models or e.model in models]
        return endpoints, {e.endpoint_id for e in endpoints}

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        """Per-endpoint prefix matches. A model the index holds nothing for (no registered endpoint,
        or no event yet) is ``INDEX_STATE_READY`` with no scores, not ``NOT_FOUND``: epp picks for
        models it learnt from etcd on its own, and must not count a degraded Score for one kv_indexer
        has not seen yet or that has no cached block; likewise an ``endpoint_ids`` entry the index does
        not know is not scored (epp learns endpoints from etcd on its own). Raises InvalidRequest for an
        empty (or blank) model or an empty ``endpoint_ids`` entry."""
        _check_model(request.model)
        if "" in request.endpoint_ids:  # one C-level scan: Score is on epp's pick path
            i = list(request.endpoint_ids).index("")
            raise InvalidRequest(f"'endpoint_ids[{i}]' is empty: name an endpoint, or send no endpoint_ids for all")
        endpoint_ids = [EndpointId(e) for e in request.endpoint_ids] or None
        scope = KeyScope(request.lora_name or None, request.cache_salt or None)
        answer = self._indexer.score(request.model, request.token_ids, endpoint_ids, scope)
        result = answer.result
        _annotate_score(request.model, result)
        return pb.ScoreResponse(
            state=_STATES[answer.state],
            unknown_endpoint_ids=answer.unknown,
            scores=[
                pb.EndpointScore(
                    endpoint_id=s.endpoint_id,
                    matched_blocks=s.matched_blocks,
                    matched_tokens=s.matched_tokens,
                    matched_blocks_by_medium={str(m): n for m, n in s.matched_blocks_by_medium.items()},
                    reached_blocks=s.reached_blocks,
                )
                for s in result.scores
            ],
            total_blocks=result.total_blocks,
            block_size_tokens=result.block_size_tokens,
        )

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        """Holders of each block of the prompt. A model with no registered endpoint answers no blocks
        (as Score). Raises InvalidRequest for an empty (or blank) model."""
        _check_model(request.model)
        locations = self._indexer.lookup(
            request.model, request.token_ids, KeyScope(request.lora_name or None, request.cache_salt or None)
        )
        return pb.LookupResponse(
            blocks=[
                pb.BlockLocation(
                    block_key=loc.block_key,
                    holders=[
                        pb.BlockHolder(endpoint_id=eid, medium=medium_to_proto(medium))
                        for eid, media in sorted(loc.holders.items())
                        for medium in sorted(media)
                    ],
                )
                for loc in locations
            ]
        )

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = self._indexer.stats()
        ingest = stats.ingest.per_endpoint
        registered = self._indexer.index.registered()
        return pb.StatsResponse(
            blocks=stats.index.blocks,
            endpoints=stats.index.endpoints,
            events_applied=stats.index.events_applied,
            batches_dropped=stats.ingest.batches_dropped,
            per_endpoint=[
                pb.EndpointIndexStats(
                    endpoint_id=e.endpoint_id,
                    blocks=e.blocks,
                    events_applied=e.events_applied,
                    last_seq=(ingest[e.endpoint_id].last_seq or 0) if e.endpoint_id in ingest else 0,
                    state=stats.states.get(e.endpoint_id, ""),
                    instance_id=registered[e.endpoint_id].instance_id if e.endpoint_id in registered else "",
                )
                for e in stats.index.per_endpoint
            ],
            ready=stats.ready,
            parity_mismatches={str(k): v for k, v in stats.parity_mismatches.items()},
        )

    async def EndpointBlocks(
        self, request: pb.EndpointBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndpointBlocksResponse:
        """The engine block hashes the index holds for one endpoint, ascending, and its state.

        Raises: InvalidRequest for an empty ``endpoint_id``; UnknownEndpoint (``NOT_FOUND``, the id
        named) for one the index does not know (:meth:`BlockIndexer.endpoint_blocks`): an endpoint the
        index knows but holds nothing for answers no hashes and its state."""
        if not request.endpoint_id.strip():
            raise InvalidRequest("endpoint_id is required")
        held, state = self._indexer.endpoint_blocks(EndpointId(request.endpoint_id))
        return pb.EndpointBlocksResponse(block_hashes=held, state=state)


def _check_model(model: str) -> None:
    """Raises InvalidRequest for an empty or blank ``model`` (Score and Lookup are per model)."""
    if not model.strip():
        raise InvalidRequest("model is required")


_STATES = {
    IndexState.READY: pb.INDEX_STATE_READY,
    IndexState.WARMING: pb.INDEX_STATE_WARMING,
    IndexState.LOAD_ONLY: pb.INDEX_STATE_LOAD_ONLY,
}


def add_servicer(server: grpc.aio.Server, indexer: BlockIndexer, watch_status_poll_seconds: float = WATCH_POLL_SECONDS,
                 watch_heartbeat_seconds: float = WATCH_HEARTBEAT_SECONDS) -> None:
    kv_indexer_pb2_grpc.add_KVIndexerServicer_to_server(
        KVIndexerServicer(indexer, watch_status_poll_seconds, watch_heartbeat_seconds), server)


def _annotate_score(model: str, result: object) -> None:
    """Trace attributes an operator reads on the Score span (issue 11): the prompt's blocks, the best
    prefix match and its split per medium (``kvmesh.prefix.matched_blocks.GPU`` ...)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    scores = list(getattr(result, "scores", ()))
    best = max(scores, key=lambda s: s.matched_blocks, default=None)
    span.set_attribute("kvmesh.model", model)
    span.set_attribute("kvmesh.prefix.total_blocks", int(getattr(result, "total_blocks", 0)))
    span.set_attribute("kvmesh.prefix.endpoints_scored", len(scores))
    if best is not None:
        span.set_attribute("kvmesh.prefix.best_endpoint", str(best.endpoint_id))
        span.set_attribute("kvmesh.prefix.matched_blocks", int(best.matched_blocks))
        span.set_attribute("kvmesh.prefix.matched_tokens", int(best.matched_tokens))
        for medium, n in best.matched_blocks_by_medium.items():
            span.set_attribute(f"kvmesh.prefix.matched_blocks.{getattr(medium, 'name', medium)}", int(n))


def _watched(endpoint: ReplicaEndpoint) -> pb.WatchedEndpoint:
    return pb.WatchedEndpoint(
        endpoint_id=endpoint.endpoint_id, model=endpoint.model, block_size_tokens=endpoint.block_size_tokens,
        state=endpoint.state, kv_source=endpoint.kv_source, kv_stores=endpoint.kv_stores,
        shared_domains=endpoint.shared_domains, reach_listed=endpoint.reach_listed,
    )


def _delta(record: ResidencyRecord) -> pb.ResidencyDelta:
    return pb.ResidencyDelta(
        endpoint_id=record.endpoint_id, medium=record.medium, cleared=record.cleared,
        added_keys=record.added, removed_keys=record.removed,
    )


def _deltas(records: list[ResidencyRecord]) -> list[pb.ResidencyDelta]:
    """Records as few deltas as keep their meaning: per (endpoint, medium) the last change of each key
    wins (each record is a transition, so the last one is the state), a ``cleared`` record ends the
    groups before it. One protobuf message per group instead of per engine event."""
    out: list[pb.ResidencyDelta] = []
    groups: dict[tuple[str, str], dict[int, bool]] = {}

    def flush() -> None:
        for (endpoint_id, medium), state in groups.items():
            out.append(pb.ResidencyDelta(
                endpoint_id=endpoint_id, medium=medium,
                added_keys=[k for k, held in state.items() if held],
                removed_keys=[k for k, held in state.items() if not held],
            ))
        groups.clear()

    for record in records:
        if record.cleared:
            flush()
            out.append(_delta(record))
            continue
        state = groups.get((record.endpoint_id, record.medium))
        if state is None:
            state = groups[(record.endpoint_id, record.medium)] = {}
        if record.added:
            state.update(dict.fromkeys(record.added, True))
        if record.removed:
            state.update(dict.fromkeys(record.removed, False))
    flush()
    return out


def _chunks(deltas: list[pb.ResidencyDelta]) -> list[list[pb.ResidencyDelta]]:
    """Snapshot deltas split into messages of at most ``WATCH_CHUNK_KEYS`` keys (at least one message)."""
    chunks: list[list[pb.ResidencyDelta]] = [[]]
    size = 0
    for delta in deltas:
        keys = list(delta.added_keys)
        for start in range(0, max(len(keys), 1), WATCH_CHUNK_KEYS):
            part = keys[start:start + WATCH_CHUNK_KEYS]
            if size + len(part) > WATCH_CHUNK_KEYS and chunks[-1]:
                chunks.append([])
                size = 0
            chunks[-1].append(pb.ResidencyDelta(endpoint_id=delta.endpoint_id, medium=delta.medium, added_keys=part))
            size += len(part)
    return chunks
