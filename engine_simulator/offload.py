"""The engine's KV offload connector, with vLLM 0.32's OffloadingConnector semantics. Pure: no I/O.

vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`` and
``vllm/v1/kv_offload/``: ``OffloadingManager``, ``LRUOffloadingManager``, ``CPUOffloadingSpec``):

* **Store** as blocks fill: every full block the engine computes is copied GPU -> CPU in the
  background (the connector's scheduler side collects a request's newly computed full blocks each
  step); the GPU copy stays, so offload never delays the step. The CPU tier is an LRU of
  ``cpu_capacity_blocks``; storing a block that is already there only refreshes it.
* **Events** (``take_events``): ``BlockStored`` with ``token_ids=[]``, ``parent_block_hash=None``
  and ``medium="CPU"`` for blocks that entered the CPU tier, ``BlockRemoved(medium="CPU")`` for
  blocks its LRU evicted. kv_indexer applies this token-less form (``docs/kv-store.md``).
* **Load**: a waiting request's prefix is first matched against the GPU prefix cache; the blocks
  right after the GPU hit are then looked up in the offloaded tiers (``lookup``: the longest run
  present). Those blocks are loaded asynchronously: the request holds GPU blocks for them, waits
  (vLLM's ``WAITING_FOR_REMOTE_KVS``) for the modeled transfer time, and is then scheduled with
  them counted as computed (they are never recomputed); the loaded blocks then enter the GPU
  prefix cache (``BlockStored(medium="GPU")``) as vLLM caches them once the load finishes.
* **kv_store tier** (``mode="cpu+kv_store"``, kvmesh's extension of the connector): every block
  stored to CPU is also queued for a gRPC ``Put`` to kv_store under
  ``vllm:<model>:<block_size>:<hash as 16 hex>`` with the block's own one-block ``BlockStored``
  (token ids included) as ``block_stored_event``, so kv_store publishes it for kv_indexer. The I/O
  side (:class:`engine_simulator.app.KVStoreUploader`) drains :meth:`OffloadManager.take_puts` and
  reports each success back with the tier kv_store put it on (:meth:`remote_stored`); a block
  counts as loadable from kv_store only after that.

Transfer time of a load (model seconds), per block of ``bytes_per_block`` bytes::

    CPU tier:           bytes / pcie_bandwidth
    kv_store, CPU:      bytes / min(network_bandwidth, pcie_bandwidth)
    kv_store, DISK/SHARED: bytes / min(nvme_bandwidth, network_bandwidth, pcie_bandwidth)

plus ``load_latency_seconds`` once per load (remote loads add ``network_latency_seconds``).
Defaults (sources):

* ``bytes_per_block``: 131,072 B of KV per token for Llama-3.1-8B BF16 (the latency model's
  profile: 2 x 32 layers x 8 KV heads x 128 x 2 B) times the block size.
* ``pcie_bandwidth``: 50 GB/s, PCIe 5.0 x16 (H100 SXM host link, 64 GB/s per direction per
  PCI-SIG's 32 GT/s x 16 lanes, 128b/130b) at ~80 % efficiency.
* ``nvme_bandwidth``: 7 GB/s, sequential read of a PCIe 4.0 x4 datacenter NVMe SSD (e.g. Samsung
  PM9A3 / Micron 7450 datasheets: 6.5-7 GB/s).
* ``network_bandwidth``: 25 GB/s, one 200 Gb/s NIC (NVIDIA ConnectX-7 at 200 GbE/HDR) per GPU.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.kv_events import BlockRemoved, BlockStored, ExternalBlockHash, KVEvent

CPU_MEDIUM = "CPU"
KV_BYTES_PER_TOKEN_LLAMA_8B = 131_072
"""Llama-3.1-8B BF16: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes."""


class OffloadMode(enum.StrEnum):
    """``--offload``: ``off``, ``cpu`` (a local CPU tier) or ``cpu+kv_store`` (and kv_store)."""

    OFF = "off"
    CPU = "cpu"
    CPU_KV_STORE = "cpu+kv_store"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Offload tier sizes and the transfer model (bandwidths in bytes/s, latencies in seconds).

    Raises:
        ValueError: for a non-positive capacity, block size or bandwidth.
    """

    mode: OffloadMode = OffloadMode.OFF
    cpu_capacity_blocks: int = 16384
    bytes_per_block: int = 64 * KV_BYTES_PER_TOKEN_LLAMA_8B
    pcie_bandwidth: float = 50e9
    nvme_bandwidth: float = 7e9
    network_bandwidth: float = 25e9
    load_latency_seconds: float = 50e-6
    network_latency_seconds: float = 200e-6

    def __post_init__(self) -> None:
        for name in ("cpu_capacity_blocks", "bytes_per_block", "pcie_bandwidth", "nvme_bandwidth",
                     "network_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("load_latency_seconds", "network_latency_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return self.mode != OffloadMode.OFF

    @property
    def uses_kv_store(self) -> bool:
        return self.mode == OffloadMode.CPU_KV_STORE


@dataclass(frozen=True, slots=True)
class PendingPut:
    """A block to write to kv_store: its key and its one-block vLLM ``BlockStored`` (GPU form, with tokens)."""

    block_hash: int
    key: str
    event: BlockStored


@dataclass(slots=True)
class LoadPlan:
    """Blocks a request loads from offloaded tiers: how many from each, and the modeled seconds."""

    cpu_blocks: int = 0
    remote_blocks: int = 0
    seconds: float = 0.0

    @property
    def num_blocks(self) -> int:
        return self.cpu_blocks + self.remote_blocks


@dataclass(slots=True)
class OffloadStats:
    """Counters (blocks) for ``/metrics`` and the benchmark."""

    stored_blocks: int = 0
    evicted_blocks: int = 0
    loaded_cpu_blocks: int = 0
    loaded_remote_blocks: int = 0
    puts_queued: int = 0
    puts_done: int = 0
    puts_failed: int = 0
    load_seconds: float = 0.0
    loads: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)


def kv_store_key(model: str, block_size: int, block_hash: int) -> str:
    """kv_store's key of an engine block: ``vllm:<model>:<block_size>:<hash as 16 hex digits>``."""
    return f"vllm:{model}:{block_size}:{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class OffloadManager:
    """The connector's scheduler side: CPU-tier LRU, kv_store residency, load planning, events.

    Args:
        config: tiers and bandwidths (``mode`` must not be ``off``).
        block_size: tokens per block (the engine's).
        model: served model name (kv_store keys).

    Raises:
        ValueError: ``mode`` is ``off``.
    """

    def __init__(self, config: OffloadConfig, block_size: int, model: str = "") -> None:
        if not config.enabled:
            raise ValueError("OffloadManager needs an offload mode other than 'off'")
        self.config = config
        self.block_size = block_size
        self.model = model
        self._cpu: OrderedDict[int, None] = OrderedDict()
        self._remote: dict[int, str] = {}
        """Hash -> the kv_store medium it was put on (CPU, DISK or SHARED)."""
        self._queued: set[int] = set()
        self._puts: list[PendingPut] = []
        self._events: list[KVEvent] = []
        self.stats = OffloadStats()

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cpu_blocks(self) -> int:
        return len(self._cpu)

    @property
    def num_remote_blocks(self) -> int:
        return len(self._remote)

    def cpu_hashes(self) -> list[int]:
        """Hashes in the CPU tier, least recently used first."""
        return list(self._cpu)

    def in_cpu(self, block_hash: int) -> bool:
        return block_hash in self._cpu

    def in_remote(self, block_hash: int) -> bool:
        return block_hash in self._remote

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Length of the longest run from ``block_hashes[0]`` held by an offloaded tier (no side effects)."""
        n = 0
        for h in block_hashes:
            if h not in self._cpu and h not in self._remote:
                break
            n += 1
        return n

    def plan_load(self, block_hashes: Sequence[int]) -> LoadPlan:
        """The transfer of ``block_hashes`` (all present, see :meth:`lookup`): CPU where there, else kv_store."""
        cfg = self.config
        plan = LoadPlan()
        seconds = 0.0
        remote = False
        for h in block_hashes:
            if h in self._cpu:
                plan.cpu_blocks += 1
                seconds += cfg.bytes_per_block / cfg.pcie_bandwidth
            else:
                medium = self._remote[h]
                bw = min(cfg.network_bandwidth, cfg.pcie_bandwidth)
                if medium != CPU_MEDIUM:
                    bw = min(bw, cfg.nvme_bandwidth)
                plan.remote_blocks += 1
                seconds += cfg.bytes_per_block / bw
                remote = True
        if plan.num_blocks:
            seconds += cfg.load_latency_seconds + (cfg.network_latency_seconds if remote else 0.0)
        plan.seconds = seconds
        return plan

    # -- mutations ---------------------------------------------------------------------------
    def start_load(self, block_hashes: Sequence[int]) -> LoadPlan:
        """Plan a load and count it; CPU hits become most recently used (vLLM's ``prepare_load`` + ``touch``)."""
        plan = self.plan_load(block_hashes)
        for h in block_hashes:
            if h in self._cpu:
                self._cpu.move_to_end(h)
        s = self.stats
        s.loads += 1
        s.loaded_cpu_blocks += plan.cpu_blocks
        s.loaded_remote_blocks += plan.remote_blocks
        s.load_seconds += plan.seconds
        return plan

    def store(self, stored: BlockStored) -> None:
        """Offload the blocks of a GPU ``BlockStored`` (the blocks just filled): CPU tier, then kv_store.

        Emits one token-less ``BlockStored(medium=CPU)`` for the blocks new to the CPU tier and a
        ``BlockRemoved(medium=CPU)`` per block its LRU evicts to make room.
        """
        cfg = self.config
        new: list[ExternalBlockHash] = []
        bs = stored.block_size
        hashes = [h if isinstance(h, int) else int.from_bytes(h[-8:], "big") for h in stored.block_hashes]
        for i, h in enumerate(hashes):
            if h in self._cpu:
                self._cpu.move_to_end(h)
            else:
                while len(self._cpu) >= cfg.cpu_capacity_blocks:
                    old, _ = self._cpu.popitem(last=False)
                    self.stats.evicted_blocks += 1
                    self._events.append(BlockRemoved(block_hashes=[old], medium=CPU_MEDIUM))
                self._cpu[h] = None
                new.append(h)
            if cfg.uses_kv_store and h not in self._remote and h not in self._queued:
                parent = hashes[i - 1] if i > 0 else stored.parent_block_hash
                extra = stored.extra_keys[i] if stored.extra_keys else None
                event = BlockStored(
                    block_hashes=[h], parent_block_hash=parent, token_ids=stored.token_ids[i * bs:(i + 1) * bs],
                    block_size=bs, lora_id=stored.lora_id, medium="GPU", lora_name=stored.lora_name,
                    extra_keys=[extra],
                )
                self._queued.add(h)
                self._puts.append(PendingPut(h, kv_store_key(self.model, bs, h), event))
                self.stats.puts_queued += 1
        if new:
            self.stats.stored_blocks += len(new)
            self._events.append(
                BlockStored(block_hashes=new, parent_block_hash=None, token_ids=[], block_size=bs,
                            medium=CPU_MEDIUM)
            )

    def take_puts(self, limit: int | None = None) -> list[PendingPut]:
        """Queued kv_store writes, oldest first (at most ``limit``)."""
        if limit is None or limit >= len(self._puts):
            puts, self._puts = self._puts, []
        else:
            puts, self._puts = self._puts[:limit], self._puts[limit:]
        return puts

    @property
    def num_pending_puts(self) -> int:
        return len(self._puts)

    def remote_stored(self, block_hash: int, medium: str) -> None:
        """kv_store acknowledged a put on ``medium`` (``CPU``, ``DISK``, ``SHARED``)."""
        self._queued.discard(block_hash)
        self._remote[block_hash] = medium
        self.stats.puts_done += 1
        self.stats.by_medium[medium] = self.stats.by_medium.get(medium, 0) + 1

    def remote_failed(self, block_hash: int) -> None:
        """A put failed (kv_store down or full): the block is not loadable from kv_store; a later store retries."""
        self._queued.discard(block_hash)
        self.stats.puts_failed += 1

    def remote_missing(self, block_hashes: Sequence[int]) -> None:
        """kv_store no longer holds these (found by a read or a Contains): forget them."""
        for h in block_hashes:
            self._remote.pop(h, None)

    def reset(self) -> None:
        """``/reset_prefix_cache``: drop the CPU tier (``BlockRemoved(medium=CPU)``); kv_store keeps its values."""
        if self._cpu:
            self._events.append(BlockRemoved(block_hashes=list(self._cpu), medium=CPU_MEDIUM))
            self._cpu.clear()

    def take_events(self) -> list[KVEvent]:
        """CPU-tier events since the last call, in order."""
        events, self._events = self._events, []
        return events
