"""A fixed pool of KV blocks with vLLM's prefix caching and KV events. Pure: no I/O, no clock.

Follows vLLM 0.32's ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``:

* ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is the reserved *null block*, so
  ``num_gpu_blocks - 1`` hold KV. ``usage`` is ``1 - free / (num_gpu_blocks - 1)``, where *free*
  counts every block nobody references (cached or not): vLLM's ``vllm:kv_cache_usage_perc``.
* Every block has a reference count (running sequences using it). A request's blocks are freed
  in reverse order (its tail first; ``single_type_kv_cache_manager.py`` ``free``). Of the blocks
  whose count drops to 0 (``block_pool.py`` ``free_blocks``), those *without* a hash (a partly
  filled tail block, or any block when caching is off) go to the **head** of the *free queue*,
  in that order, so they are reused first at no cache cost (``prepend_n``); those *with* a hash
  go to the **tail** (``append_n``) and keep it, so a later request can hit them.
* Allocation pops from the head of the free queue. Popping a block that still has a hash evicts
  it from the prefix cache and emits ``BlockRemoved([hash])``, one event per block, as vLLM does;
  popping an unhashed block emits nothing.
* When blocks become full they are cached under their hash (several physical blocks may share a
  hash: a repeated prompt's recomputed last block, or generated blocks) and one ``BlockStored``
  is emitted for the newly full run of blocks: ``parent_block_hash`` is the hash of the block
  before the run (None at the start), ``token_ids`` the run's tokens, ``medium="GPU"``. It is
  emitted every time, also for hashes already cached: consumers must be idempotent.
* :meth:`reset` (``POST /reset_prefix_cache``) succeeds only when no block is referenced; it
  drops every hash and emits ``AllBlocksCleared``.

Block hashes are the uint64 form of vLLM's ``sha256_cbor`` digests (the default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); callers compute them (see ``scheduler.Request``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class LoraLike(Protocol):
    """What a store needs of a LoRA adapter (``engine_simulator.scheduler.LoraAdapter``)."""

    @property
    def name(self) -> str: ...

    @property
    def adapter_id(self) -> int: ...

if TYPE_CHECKING:
    from engine_simulator.offload import OffloadManager

NULL_BLOCK = 0
MEDIUM = "GPU"


class PrefixCache:
    """The block pool.

    Args:
        num_gpu_blocks: total blocks including the null block (>= 2).
        block_size: tokens per block (> 0).
        enable_caching: False disables hits and events (``--no-enable-prefix-caching``).
        offload: the offload connector (``engine_simulator/offload.py``): every newly full block is
            offered to it as it is cached, and its CPU-tier events follow the GPU ones; None: no offload.

    Raises:
        ValueError: for out-of-range arguments.
    """

    def __init__(
        self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True,
        offload: OffloadManager | None = None,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (one is the null block), got {num_gpu_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_gpu_blocks
        self._hash: list[int | None] = [None] * num_gpu_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_gpu_blocks))
        self._cached: dict[int, dict[int, None]] = {}
        self._events: list[KVEvent] = []
        self._ref[NULL_BLOCK] = 1
        self.offload = offload

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by running sequences, in [0, 1]."""
        return 1.0 - len(self._free) / (self.num_gpu_blocks - 1)

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        """Every block hash currently in the prefix cache (what a KV-event consumer should hold), ascending."""
        return sorted(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (no side effects)."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        cached = self._cached
        for h in block_hashes:
            blocks = cached.get(h)
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def free_queue(self) -> list[int]:
        """The free block ids in allocation order: ``allocate(n)`` takes the first ``n``."""
        return list(self._free)

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (touching them uses free capacity)."""
        return sum(1 for b in block_ids if self._ref[b] == 0)

    # -- mutations -------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Reference prefix-hit blocks for a sequence (removing free ones from the free queue)."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks (ref count 1) from the free queue's head, evicting cached ones; None if short."""
        if n > len(self._free):
            return None
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._evict(b, h)
            self._ref[b] = 1
            out.append(b)
        return out

    def _evict(self, block_id: int, block_hash: int) -> None:
        self._hash[block_id] = None
        blocks = self._cached.get(block_hash)
        if blocks is not None:
            blocks.pop(block_id, None)
            if not blocks:
                del self._cached[block_hash]
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM))

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        lora: LoraLike | None = None,
        extra_keys: Sequence[object | None] | None = None,
    ) -> None:
        """Register newly full blocks under their hashes and emit one ``BlockStored``.

        Args:
            block_ids: the run of newly full blocks, in sequence order.
            block_hashes: their hashes (same length).
            parent_hash: hash of the block before the run, None at the start of the sequence.
            token_ids: the run's tokens (``len(block_ids) * block_size`` of them).
            lora: the request's LoRA adapter (``lora_id``/``lora_name`` of the event), None for the base model.
            extra_keys: per block, the untagged extra keys vLLM publishes (None: no LoRA/salt).
        """
        if not self.enable_caching or not block_ids:
            return
        for b, h in zip(block_ids, block_hashes, strict=True):
            if self._hash[b] is None:
                self._hash[b] = h
                self._cached.setdefault(h, {})[b] = None
        stored = BlockStored(
            block_hashes=list(block_hashes),
            parent_block_hash=parent_hash,
            token_ids=list(token_ids),
            block_size=self.block_size,
            lora_id=None if lora is None else lora.adapter_id,
            medium=MEDIUM,
            lora_name=None if lora is None else lora.name,
            extra_keys=list(extra_keys) if extra_keys is not None else [None] * len(block_ids),
        )
        self._events.append(stored)
        if self.offload is not None:
            self.offload.store(stored)
            self._events.extend(self.offload.take_events())

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each of a sequence's blocks (given in sequence order).

        The blocks are released tail first. Those left unreferenced join the free queue: unhashed
        ones at its head (reused next, in release order), hashed ones at its tail (evicted last),
        as vLLM 0.32's ``BlockPool.free_blocks``.
        """
        fresh: list[int] = []
        for b in reversed(block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    fresh.append(b)
                else:
                    self._free[b] = None
        for b in reversed(fresh):  # the first released ends up at the very head
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every hash (``AllBlocksCleared``). Refused (False) while any block is referenced."""
        if len(self._free) != self.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_gpu_blocks
        if self.enable_caching:
            self._events.append(AllBlocksCleared())
        if self.offload is not None:
            self.offload.reset()
            self._events.extend(self.offload.take_events())
        return True

    def pending_events(self) -> int:
        """Events not yet taken (published at the next step)."""
        return len(self._events)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order (offload stores completed since are appended)."""
        if self.offload is not None:
            self._events.extend(self.offload.take_events())
        events, self._events = self._events, []
        return events
