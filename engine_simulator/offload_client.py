"""The offload connector's I/O side: writes offloaded blocks to kv_store over gRPC, in the background.

:class:`KVStoreUploader` drains :meth:`engine_simulator.offload.OffloadManager.take_puts` on the engine's
event loop (the engine loop and the uploader share one thread, so the pure manager needs no lock) and sends
each block as one streamed ``KVStore.Put`` (``proto/kvmesh/kv_store/v1``): ``key`` =
``vllm:<model>:<block_size>:<hash hex>``, a stand-in value of ``value_bytes`` bytes (the simulator holds no
KV), and the block's vLLM ``BlockStored`` (msgpack map) as ``block_stored_event`` so kv_store publishes it
for kv_indexer. A success records the tier kv_store put it on (``PutResponse.medium``), after which the
block is loadable from kv_store. kv_store down or refusing is a degraded mode: the put is dropped and
counted (``OffloadStats.puts_failed``), the engine runs on, and a later store of the block retries.

Modeled time: the uploader advances the manager to the engine clock's model time at every poll
(``clock``), so store jobs and network transfers complete while the engine is idle too; each put
it takes carries its modeled transfer (``PendingPut.done_at``, on the host's egress lane), and the
block becomes loadable from kv_store once both the real put was acknowledged and that time passed.
Back-pressure: at most ``concurrency`` puts are on the wire, and the manager queues at most
``OffloadConfig.max_pending_puts`` (more are skipped and counted), so a slow kv_store never grows
the engine's memory nor delays its steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import msgspec

from engine_simulator.offload import OffloadManager, PendingPut
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2, kv_store_pb2_grpc
from kvmesh.clock import Clock
from kvmesh.wire import medium_from_proto

logger = logging.getLogger(__name__)
_ENCODER = msgspec.msgpack.Encoder()


class KVStoreUploader:
    """Background kv_store writer for one engine.

    Args:
        manager: the engine's offload manager (``mode == cpu+kv_store``).
        address: kv_store gRPC ``host:port``.
        value_bytes: bytes sent per block.
        concurrency: puts in flight at once.
        timeout_seconds: deadline of one put (wall seconds).
        clock: the engine's clock (model seconds); None: the manager advances only with the engine's steps.
    """

    def __init__(self, manager: OffloadManager, address: str, value_bytes: int = 4096, concurrency: int = 8,
                 timeout_seconds: float = 5.0, clock: Clock | None = None) -> None:
        self.manager = manager
        self.clock = clock
        self.address = address
        self.value = b"\0" * value_bytes
        self.concurrency = concurrency
        self.timeout_seconds = timeout_seconds
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._sem = asyncio.Semaphore(concurrency)
        self._inflight: set[asyncio.Task[None]] = set()
        self._last_error = ""

    def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._task = asyncio.create_task(self._run(), name="kv-store-uploader")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in list(self._inflight):
            t.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def flush(self, timeout_seconds: float = 10.0) -> None:
        """Wait until every queued put has been answered (tests, shutdown)."""
        for _ in range(max(1, int(timeout_seconds / 0.01))):
            if not (self.manager.num_pending_puts or self._inflight):
                return
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        assert self._channel is not None
        stub = kv_store_pb2_grpc.KVStoreStub(self._channel)
        while True:
            if self.clock is not None:
                self.manager.advance(self.clock.now())
            puts = self.manager.take_puts(self.concurrency * 4)
            if not puts:
                await asyncio.sleep(0.005)
                continue
            for put in puts:
                await self._sem.acquire()
                task = asyncio.create_task(self._put(stub, put))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _put(self, stub: kv_store_pb2_grpc.KVStoreStub, put: PendingPut) -> None:
        value = self.value
        event = _ENCODER.encode(put.event)

        async def requests() -> AsyncIterator[kv_store_pb2.PutRequest]:
            yield kv_store_pb2.PutRequest(key=put.key, total_bytes=len(value), data=value, block_stored_event=event)

        try:
            response = await stub.Put(requests(), timeout=self.timeout_seconds)
        except grpc.aio.AioRpcError as exc:
            self.manager.remote_failed(put.block_hash)
            message = f"{exc.code().name}: {exc.details()}"
            if message != self._last_error:  # one line per kind of failure, not per block
                logger.warning("kv_store put failed address=%s key=%s error=%s", self.address, put.key, message)
                self._last_error = message
        else:
            self.manager.remote_stored(put.block_hash, str(medium_from_proto(response.medium)))
        finally:
            self._sem.release()
