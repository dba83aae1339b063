"""The kv_indexer ``Score`` RPC behind the framework's :class:`PrefixIndex` protocol (the only grpc use in the core path)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh.channels import insecure_channel
from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from services.epp.framework.interfaces import PrefixMatch


class GrpcPrefixIndex:
    """Calls ``kvmesh.kv_indexer.v1.KVIndexer/Score`` with a per-call timeout."""

    def __init__(self, address: str, timeout_seconds: float) -> None:
        self._address = address
        self._timeout = timeout_seconds
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
        return PrefixMatch(reply.total_blocks, {s.endpoint_id: s.matched_blocks for s in reply.scores})

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
