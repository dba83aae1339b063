"""kv_indexer behind the framework's :class:`PrefixIndex` protocol (the only grpc use in the core path).

Two modes (``EppConfig.prefix_index_mode``):

* ``rpc`` (:class:`GrpcPrefixIndex`): every pick calls ``KVIndexer/Score``.
* ``replica`` (:class:`ReplicaPrefixIndex`): a :class:`kvmesh.prefix_index.PrefixReplica` fed by
  ``KVIndexer/Watch`` (snapshot, then ordered residency deltas) scores in process, so a precise pick
  makes no kv_indexer call (llm-d's EPP embeds its kv-cache indexer the same way). While the stream
  is down, resyncing or stale (no message for ``stale_seconds``; the server heartbeats every 1 s),
  and for models with kv_store sources whose reach the kv_indexer does not list (one from before
  ``WatchedEndpoint.reach_listed``; otherwise the replica folds their blocks itself), it calls ``Score`` as the ``rpc`` mode does; when that fails too, the pick degrades as before
  (``docs/degraded-modes.md``).

Both return per-endpoint per-medium match counts (``PrefixMatch.matched_blocks_by_medium``, what
``tier-cost-scorer`` prices loads by); the replica computes them as ``Score`` does. Each score is
counted in ``kvmesh_epp_prefix_index_scores_total{path="replica"|"rpc_fallback"|"rpc"}``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

import grpc

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh.channels import insecure_channel
from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.logging import RateLimitedLog
from kvmesh.prefix_index import PrefixReplica, ReplicaEndpoint, ReplicaGap
from services.epp.framework.interfaces import PrefixMatch
from services.epp.metrics import PrefixIndexPath, record_prefix_index_score

logger = logging.getLogger(__name__)


class GrpcPrefixIndex:
    """Calls ``kvmesh.kv_indexer.v1.KVIndexer/Score`` with a per-call timeout.

    ``path`` labels each call in ``kvmesh_epp_prefix_index_scores_total`` (``rpc``; the replica's
    fallback client uses ``rpc_fallback``)."""

    def __init__(self, address: str, timeout_seconds: float, path: PrefixIndexPath = PrefixIndexPath.RPC) -> None:
        self._address = address
        self._timeout = timeout_seconds
        self._path = path
        self._channel: grpc.aio.Channel | None = None
        self._stub: kv_indexer_pb2_grpc.KVIndexerStub | None = None

    def _ensure_stub(self) -> kv_indexer_pb2_grpc.KVIndexerStub:
        # Created on first use, inside the serving event loop (grpc.aio binds a channel to its loop).
        if self._stub is None:
            self._channel = insecure_channel(self._address)
            self._stub = kv_indexer_pb2_grpc.KVIndexerStub(self._channel)
        return self._stub

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        """Raises grpc.aio.AioRpcError on failure or timeout (the ``prefix-match`` step degrades to no match)."""
        return await self.score_scoped(model, token_ids, endpoint_ids, DEFAULT_SCOPE)

    async def score_scoped(
        self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str], scope: KeyScope
    ) -> PrefixMatch:
        """``Score`` in the request's key scope (LoRA adapter, cache_salt). Raises as :meth:`score`."""
        record_prefix_index_score(self._path)
        reply = await self._ensure_stub().Score(
            kv_indexer_pb2.ScoreRequest(
                model=model,
                token_ids=token_ids,
                endpoint_ids=endpoint_ids,
                lora_name=scope.lora_name or "",
                cache_salt=scope.cache_salt or "",
            ),
            timeout=self._timeout,
        )
        if reply.state in (kv_indexer_pb2.INDEX_STATE_WARMING, kv_indexer_pb2.INDEX_STATE_LOAD_ONLY):
            # an unready indexer (health NOT_SERVING) or a load-only model: no prefix data, not an error
            return PrefixMatch(reply.total_blocks, {})
        return PrefixMatch(
            reply.total_blocks,
            {s.endpoint_id: s.matched_blocks for s in reply.scores},
            {s.endpoint_id: dict(s.matched_blocks_by_medium) for s in reply.scores if s.matched_blocks_by_medium},
            {s.endpoint_id: s.reached_blocks for s in reply.scores if s.reached_blocks},
        )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class ReplicaPrefixIndex:
    """Scores on a local replica of kv_indexer's key residency; ``Score`` RPC while it is not usable.

    Args:
        address: kv_indexer's gRPC ``host:port``.
        timeout_seconds: deadline of a fallback ``Score`` call.
        stale_seconds: a replica whose stream sent nothing for this long is not used.
        prompt_key_cache_bytes: the replica's prompt key cache (a prompt extending a recent one hashes
            only its new blocks).
        clock: monotonic seconds.

    ``run()`` is a background coroutine: it keeps the ``Watch`` stream open, reconnecting with
    backoff (0.1 s doubling to 2 s); a gap in the stream's sequence reconnects at once (a resync).
    Counters ``local_scores`` / ``rpc_scores`` / ``resyncs`` / ``snapshots`` say how picks were scored
    (the first two also in ``kvmesh_epp_prefix_index_scores_total``).
    """

    def __init__(
        self,
        address: str,
        timeout_seconds: float,
        stale_seconds: float = 2.0,
        prompt_key_cache_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rpc = GrpcPrefixIndex(address, timeout_seconds, PrefixIndexPath.RPC_FALLBACK)
        self.replica = PrefixReplica(prompt_key_cache_bytes)
        self._stale = stale_seconds
        self._clock = clock
        self._last_message = -math.inf
        self.local_scores = 0
        self.rpc_scores = 0
        self.resyncs = 0
        self.snapshots = 0
        self._watch_log = RateLimitedLog(logger, 10.0, clock)

    def usable(self, model: str) -> bool:
        """Whether a pick for ``model`` is scored on the replica (synced, fresh, any kv_store sources folded)."""
        return (
            self.replica.synced
            and self._clock() - self._last_message <= self._stale
            and not self.replica.defers(model)
        )

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        return await self.score_scoped(model, token_ids, endpoint_ids, DEFAULT_SCOPE)

    async def score_scoped(
        self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str], scope: KeyScope
    ) -> PrefixMatch:
        """Local when :meth:`usable`, else ``Score`` (raises as :meth:`GrpcPrefixIndex.score`)."""
        if self.usable(model):
            self.local_scores += 1
            record_prefix_index_score(PrefixIndexPath.REPLICA)
            result = self.replica.score(model, token_ids, endpoint_ids, scope)
            return PrefixMatch(result.total_blocks, result.matched_blocks, result.matched_blocks_by_medium,
                               result.reached_blocks)
        self.rpc_scores += 1
        return await self.rpc.score_scoped(model, token_ids, endpoint_ids, scope)

    def apply(self, message: kv_indexer_pb2.WatchResponse) -> None:
        """Apply one ``Watch`` message. Raises :class:`ReplicaGap` when it does not follow the replica."""
        replica = self.replica
        if message.reset:
            self.snapshots += 1
            replica.reset(message.seq)
        else:
            replica.check_sequence(message.prev_seq)
        if message.endpoints_changed:
            replica.set_endpoints(
                ReplicaEndpoint(e.endpoint_id, e.model, e.block_size_tokens, e.state, e.kv_source,
                                tuple(e.kv_stores), tuple(e.shared_domains), e.reach_listed)
                for e in message.endpoints
            )
        replica.set_status(message.ready, message.load_only_models)
        for delta in message.deltas:
            replica.apply_delta(delta.endpoint_id, delta.medium, delta.added_keys, delta.removed_keys, delta.cleared)
        replica.advance(message.seq, message.synced)
        self._last_message = self._clock()

    async def run(self) -> None:
        """Keep the replica fed until cancelled (background task of the epp process)."""
        backoff = 0.1
        while True:
            try:
                call = self.rpc._ensure_stub().Watch(kv_indexer_pb2.WatchRequest())
                async for message in call:
                    self.apply(message)
                    backoff = 0.1
                raise ConnectionError("kv_indexer ended the Watch stream")
            except asyncio.CancelledError:
                raise
            except ReplicaGap as exc:
                self.resyncs += 1
                logger.warning("kv_indexer replica out of sequence (%s); resyncing", exc)
                call.cancel()
                backoff = 0.0
            except Exception as exc:  # unreachable, restarted, UNIMPLEMENTED: the Score RPC serves meanwhile
                self._watch_log.warning("watch_down", "kv_indexer Watch stream down (%r); scoring through Score "
                                        "until it is back", exc)
            self.replica.synced = False
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, 0.1), 2.0)

    async def close(self) -> None:
        await self.rpc.close()
