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

Lookups: before a request loads blocks from kv_store, the manager asks for their confirmation
(:meth:`~engine_simulator.offload.OffloadManager.take_lookups`); the uploader sends them as one batched
``KVStore.Lookup`` (per key: present, and the medium of the fastest tier holding it) with a deadline of
``lookup_timeout_seconds``, reports the answer (absent keys are forgotten) or the failure (the blocks are
recomputed; kv_store is not asked again for ``OffloadConfig.remote_retry_seconds``), then wakes the engine
loop (``wake``) so the deferred requests are scheduled at once. Any exception of a put or a lookup
(not only a gRPC status) is reported as a failure, so no block stays queued forever.

The channel is :func:`kvmesh.channels.insecure_channel` (reconnect backoff bounded to 1 s, so a restarted
kv_store is used again within a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import msgspec

from engine_simulator.offload import OffloadManager, PendingPut
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2, kv_store_pb2_grpc
from kvmesh.channels import insecure_channel
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
        wake: called after a lookup is answered (the engine loop's wake-up); None: nothing to wake.
        lookup_timeout_seconds: deadline of one ``Lookup`` (wall seconds): how long a request waits at most
            for kv_store's confirmation before it recomputes.
    """

    def __init__(self, manager: OffloadManager, address: str, value_bytes: int = 4096, concurrency: int = 8,
                 timeout_seconds: float = 5.0, clock: Clock | None = None,
                 wake: Callable[[], None] | None = None, lookup_timeout_seconds: float = 1.0) -> None:
        self.manager = manager
        self.wake = wake
        self.lookup_timeout_seconds = lookup_timeout_seconds
        self.clock = clock
        self.address = address
        self.value = b"\0" * value_bytes
        self.concurrency = concurrency
        self.timeout_seconds = timeout_seconds
        self._channel: grpc.aio.Channel | None = None
        self._lookups: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._sem = asyncio.Semaphore(concurrency)
        self._inflight: set[asyncio.Task[None]] = set()
        self._last_error = ""

    def start(self) -> None:
        self._channel = insecure_channel(self.address, client_spans=False)
        self._task = asyncio.create_task(self._run(), name="kv-store-uploader")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for t in [*self._inflight, *self._lookups]:
            t.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def flush(self, timeout_seconds: float = 10.0) -> None:
        """Wait until every queued put and lookup has been answered (tests, shutdown, the benchmark's loop)."""
        for _ in range(max(1, int(timeout_seconds / 0.001))):
            if not (self.manager.num_pending_puts or self._inflight or self.manager.num_pending_lookups
                    or self._lookups):
                return
            await asyncio.sleep(0.001)

    async def _run(self) -> None:
        assert self._channel is not None
        stub = kv_store_pb2_grpc.KVStoreStub(self._channel)
        while True:
            if self.clock is not None:
                self.manager.advance(self.clock.now())
            lookups = self.manager.take_lookups()
            if lookups:
                task = asyncio.create_task(self._lookup(stub, lookups))
                self._lookups.add(task)
                task.add_done_callback(self._lookups.discard)
            puts = self.manager.take_puts(self.concurrency * 4)
            if not puts:
                await asyncio.sleep(0.001 if self._lookups else 0.005)
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
            medium = str(medium_from_proto(response.medium))
        except asyncio.CancelledError:
            self.manager.remote_failed(put.block_hash)
            raise
        except Exception as exc:  # a gRPC status or anything else: the block must not stay taken
            self.manager.remote_failed(put.block_hash)
            self._warn("put", put.key, exc)
        else:
            self.manager.remote_stored(put.block_hash, medium)
        finally:
            self._sem.release()

    async def _lookup(self, stub: kv_store_pb2_grpc.KVStoreStub, lookups: Sequence[tuple[int, str]]) -> None:
        hashes = [h for h, _ in lookups]
        try:
            response = await stub.Lookup(kv_store_pb2.LookupRequest(keys=[key for _, key in lookups]),
                                         timeout=self.lookup_timeout_seconds)
            if len(response.present) != len(lookups):
                raise ValueError(f"Lookup answered {len(response.present)} flags for {len(lookups)} keys")
            answers = [
                (h, str(medium_from_proto(m)) if present and m != common_pb2.MEDIUM_UNSPECIFIED else
                 ("CPU" if present else None))
                for h, present, m in zip(hashes, response.present, response.medium, strict=False)
            ]
        except asyncio.CancelledError:
            self.manager.remote_lookup_failed(hashes)
            raise
        except Exception as exc:  # kv_store down, deadline, bad answer: recompute, never hang
            self.manager.remote_lookup_failed(hashes)
            self._warn("lookup", lookups[0][1], exc)
        else:
            self.manager.remote_lookup_done(answers)
        if self.wake is not None:
            self.wake()

    def _warn(self, what: str, key: str, exc: Exception) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            message = f"{exc.code().name}: {exc.details()}"
        else:
            message = f"{type(exc).__name__}: {exc}"
        if message != self._last_error:  # one line per kind of failure, not per block
            logger.warning("kv_store %s failed address=%s key=%s error=%s", what, self.address, key, message)
            self._last_error = message
