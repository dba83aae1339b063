"""The engine's KV offload connector, with vLLM 0.32's OffloadingConnector semantics. Pure: no I/O.

vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`` and
``vllm/v1/kv_offload/``: ``OffloadingManager``, ``LRUOffloadingManager``, ``CPUOffloadingSpec``):

* **Store** as blocks fill: every full block the engine computes is copied GPU -> CPU in the
  background (the connector's scheduler side collects a request's newly computed full blocks each
  step); the GPU copy stays, so offload never delays the step. The copy takes modeled time (below)
  on the GPU's device-to-host PCIe lane, one store job after another; the block is in the CPU tier
  (loadable, evictable, announced) only when its job completes (vLLM's ``complete_store``). The CPU
  tier is an LRU of ``cpu_capacity_blocks`` that counts blocks being stored, which cannot be evicted
  (vLLM's ``LRUOffloadingManager``: ``prepare_store`` only evicts ready, unreferenced blocks);
  storing a block that is already there only refreshes it. With kv_store, a block that finds no
  CPU room is still copied (through a staging buffer) for its kv_store put, without entering CPU.
* **Back-pressure.** A store whose blocks do not fit (the CPU tier full of blocks still being
  stored, or more than ``max_inflight_store_blocks`` in flight) is skipped for those blocks, as
  vLLM's ``prepare_store`` returning ``None`` skips a store: the engine step never waits for
  offload, the backlog stays bounded, and a later store of the same block retries
  (``OffloadStats.store_skipped_blocks``).
* **Events** (``take_events``): ``BlockStored`` with ``token_ids=[]``, ``parent_block_hash=None``
  and ``medium="CPU"`` for blocks whose store completed, ``BlockRemoved(medium="CPU")`` for
  blocks its LRU evicted. kv_indexer applies this token-less form (``docs/kv-store.md``).
* **Model time.** The manager is pure: the scheduler passes the model time (:meth:`OffloadManager.advance`,
  at every ``schedule``), which completes the store jobs and kv_store writes due by then.
* **Load**: a waiting request's prefix is first matched against the GPU prefix cache; the blocks
  right after the GPU hit are then looked up in the offloaded tiers (``lookup``: the longest run
  present). Those blocks are loaded asynchronously: the request holds GPU blocks for them, waits
  (vLLM's ``WAITING_FOR_REMOTE_KVS``) for the modeled transfer time, and is then scheduled with
  them counted as computed (they are never recomputed); the loaded blocks then enter the GPU
  prefix cache (``BlockStored(medium="GPU")``) as vLLM caches them once the load finishes.
* **kv_store tier** (``mode="cpu+kv_store"``, kvmesh's extension of the connector): every block
  whose CPU store completed is also queued for a gRPC ``Put`` to kv_store (CPU -> kv_store, as
  LMCache's remote backend writes from host memory) under
  ``vllm:<model>:<block_size>:<hash as 16 hex>`` with the block's own one-block ``BlockStored``
  (token ids included) as ``block_stored_event``, so kv_store publishes it for kv_indexer. The I/O
  side (:class:`engine_simulator.app.KVStoreUploader`) drains :meth:`OffloadManager.take_puts` and
  reports each success back with the tier kv_store put it on (:meth:`remote_stored`); a block
  counts as loadable from kv_store only after that *and* after its modeled network transfer
  (each put taken occupies the host's egress lane for its transfer time, one after another). At
  most ``max_pending_puts`` puts are queued or in flight; beyond that a block is not written to
  kv_store (``OffloadStats.puts_skipped``; a later store retries).

Transfer time of a load (model seconds), per block of ``bytes_per_block`` bytes::

    CPU tier:           bytes / pcie_bandwidth
    kv_store, CPU:      bytes / min(network_bandwidth, pcie_bandwidth)
    kv_store, DISK/SHARED: bytes / min(nvme_bandwidth, network_bandwidth, pcie_bandwidth)

plus ``load_latency_seconds`` once per load (remote loads add ``network_latency_seconds``).
Stores take the same bandwidths in the other direction (PCIe and NICs are full duplex, so stores
never slow loads down)::

    GPU -> CPU store job of n blocks:   load_latency_seconds + n * bytes / pcie_bandwidth
    CPU -> kv_store put of one block:   network_latency_seconds + bytes / min(network_bandwidth, pcie_bandwidth)

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
from collections import OrderedDict, deque
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
    max_inflight_store_blocks: int = 4096
    """Blocks being copied GPU -> CPU at once (32 GiB of 8 MiB blocks, ~0.7 s of PCIe at 50 GB/s); more are skipped."""
    max_pending_puts: int = 4096
    """kv_store puts queued or in flight at once; more are skipped."""

    def __post_init__(self) -> None:
        for name in ("cpu_capacity_blocks", "bytes_per_block", "pcie_bandwidth", "nvme_bandwidth",
                     "network_bandwidth", "max_inflight_store_blocks", "max_pending_puts"):
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

    def store_seconds(self, num_blocks: int) -> float:
        """Model seconds of one GPU -> CPU store job of ``num_blocks`` blocks."""
        return self.load_latency_seconds + num_blocks * self.bytes_per_block / self.pcie_bandwidth

    def put_seconds(self) -> float:
        """Model seconds of one CPU -> kv_store put of a block."""
        return self.network_latency_seconds + self.bytes_per_block / min(self.network_bandwidth, self.pcie_bandwidth)


@dataclass(frozen=True, slots=True)
class PendingPut:
    """A block to write to kv_store: its key and its one-block vLLM ``BlockStored`` (GPU form, with tokens)."""

    block_hash: int
    key: str
    event: BlockStored
    done_at: float = 0.0
    """Model time its transfer over the network completes (set when taken)."""


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
    store_jobs: int = 0
    store_seconds: float = 0.0
    """Modeled GPU -> CPU transfer seconds of every store job (the lane's busy time)."""
    store_skipped_blocks: int = 0
    """Blocks not offloaded: the CPU tier or the in-flight bound was full of blocks still being stored."""
    puts_skipped: int = 0
    """Blocks not written to kv_store: ``max_pending_puts`` were queued or in flight."""
    put_seconds: float = 0.0
    """Modeled CPU -> kv_store transfer seconds of every put taken."""


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
        """Blocks in the CPU tier whose store completed, least recently used first."""
        self._jobs: deque[tuple[float, list[int], list[BlockStored], int]] = deque()
        """Store jobs in flight on the D2H lane, in completion order: (done at, CPU-bound hashes, kv_store
        events, blocks copied for kv_store only)."""
        self._storing: set[int] = set()
        self._transit = 0
        self._pcie_free_at = 0.0
        self._net_free_at = 0.0
        self.now = 0.0
        """The model time of the last :meth:`advance`."""
        self._remote: dict[int, str] = {}
        """Hash -> the kv_store medium it was put on (CPU, DISK or SHARED)."""
        self._arriving: dict[int, tuple[float, str]] = {}
        """Acknowledged puts whose modeled transfer is not over yet: hash -> (done at, medium)."""
        self._queued: set[int] = set()
        self._taken: dict[int, float] = {}
        """Puts handed to the uploader, not yet answered: hash -> modeled done time."""
        self._puts: list[PendingPut] = []
        self._events: list[KVEvent] = []
        self.stats = OffloadStats()

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cpu_blocks(self) -> int:
        return len(self._cpu)

    @property
    def num_storing_blocks(self) -> int:
        """Blocks whose GPU -> CPU copy is in flight (they hold CPU-tier room, are not loadable yet)."""
        return len(self._storing) + self._transit

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

    def advance(self, now: float) -> None:
        """Model time is ``now``: complete the store jobs and kv_store transfers due by then."""
        if now < self.now:
            return
        self.now = now
        while self._jobs and self._jobs[0][0] <= now:
            _, hashes, puts, transit = self._jobs.popleft()
            self._transit -= transit
            self._complete_store(hashes, puts)
        if self._arriving:
            for h in [h for h, (done, _) in self._arriving.items() if done <= now]:
                self._remote[h] = self._arriving.pop(h)[1]

    def next_store_done(self) -> float | None:
        """Model time the earliest in-flight store job completes; None when none is in flight."""
        return self._jobs[0][0] if self._jobs else None

    def _complete_store(self, hashes: list[int], puts: list[BlockStored]) -> None:
        new: list[ExternalBlockHash] = []
        for h in hashes:
            self._storing.discard(h)
            self._cpu[h] = None
            new.append(h)
        if new:
            self.stats.stored_blocks += len(new)
            self._events.append(
                BlockStored(block_hashes=new, parent_block_hash=None, token_ids=[], block_size=self.block_size,
                            medium=CPU_MEDIUM)
            )
        for event in puts:
            self._queue_put(event)

    def _queue_put(self, event: BlockStored) -> None:
        """Queue the kv_store write of a block now in the CPU tier (once; bounded by ``max_pending_puts``)."""
        h = int(event.block_hashes[0])
        if h in self._remote or h in self._queued or h in self._arriving or h in self._taken:
            return
        if len(self._puts) + len(self._taken) >= self.config.max_pending_puts:
            self.stats.puts_skipped += 1
            return
        self._queued.add(h)
        self._puts.append(PendingPut(h, kv_store_key(self.model, event.block_size, h), event))
        self.stats.puts_queued += 1

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
        """Offload the blocks of a GPU ``BlockStored`` (the blocks just filled): one store job on the
        D2H lane (then kv_store puts), completing at ``max(now, lane free) + store_seconds(n)``.

        Blocks already in the CPU tier are refreshed; blocks already being stored are left alone; the
        LRU evicts ready blocks to make room (``BlockRemoved(medium=CPU)`` at once); blocks that find
        no room are skipped (see the module docstring). ``BlockStored(medium=CPU)`` follows when the
        job completes (:meth:`advance`).
        """
        cfg = self.config
        bs = stored.block_size
        hashes = [h if isinstance(h, int) else int.from_bytes(h[-8:], "big") for h in stored.block_hashes]
        job: list[int] = []
        transit = 0
        puts: list[BlockStored] = []
        def put_event(i: int, h: int) -> BlockStored:
            extra = stored.extra_keys[i] if stored.extra_keys else None
            return BlockStored(
                block_hashes=[h], parent_block_hash=hashes[i - 1] if i > 0 else stored.parent_block_hash,
                token_ids=stored.token_ids[i * bs:(i + 1) * bs], block_size=bs, lora_id=stored.lora_id,
                medium="GPU", lora_name=stored.lora_name, extra_keys=[extra],
            )

        for i, h in enumerate(hashes):
            if h in self._cpu:
                self._cpu.move_to_end(h)
                if cfg.uses_kv_store:
                    self._queue_put(put_event(i, h))  # in CPU already: a failed put is retried from there
                continue
            if h in self._storing:
                continue
            if self.num_storing_blocks + transit >= cfg.max_inflight_store_blocks:
                self.stats.store_skipped_blocks += 1
                continue
            while len(self._cpu) + len(self._storing) >= cfg.cpu_capacity_blocks and self._cpu:
                old, _ = self._cpu.popitem(last=False)
                self.stats.evicted_blocks += 1
                self._events.append(BlockRemoved(block_hashes=[old], medium=CPU_MEDIUM))
            if len(self._cpu) + len(self._storing) < cfg.cpu_capacity_blocks:
                self._storing.add(h)
                job.append(h)
            elif cfg.uses_kv_store:
                transit += 1  # no CPU room (all of it being stored): copied through for kv_store only
            else:
                self.stats.store_skipped_blocks += 1  # every CPU block is still being stored
                continue
            if cfg.uses_kv_store:
                puts.append(put_event(i, h))
        if not job and not transit:
            return
        seconds = cfg.store_seconds(len(job) + transit)
        done = max(self.now, self._pcie_free_at) + seconds
        self._pcie_free_at = done
        self._transit += transit
        self._jobs.append((done, job, puts, transit))
        self.stats.store_jobs += 1
        self.stats.store_seconds += seconds

    def take_puts(self, limit: int | None = None) -> list[PendingPut]:
        """Queued kv_store writes, oldest first (at most ``limit``), each given its modeled network
        transfer on the egress lane (``done_at``): the I/O side sends them now, and a block becomes
        loadable from kv_store once acknowledged and ``done_at`` has passed."""
        if limit is None or limit >= len(self._puts):
            puts, self._puts = self._puts, []
        else:
            puts, self._puts = self._puts[:limit], self._puts[limit:]
        seconds = self.config.put_seconds()
        timed = []
        for put in puts:
            done = max(self.now, self._net_free_at) + seconds
            self._net_free_at = done
            self.stats.put_seconds += seconds
            self._taken[put.block_hash] = done
            timed.append(PendingPut(put.block_hash, put.key, put.event, done))
        return timed

    @property
    def num_pending_puts(self) -> int:
        return len(self._puts)

    def remote_stored(self, block_hash: int, medium: str) -> None:
        """kv_store acknowledged a put on ``medium`` (``CPU``, ``DISK``, ``SHARED``)."""
        self._queued.discard(block_hash)
        done = self._taken.pop(block_hash, 0.0)
        if done <= self.now:
            self._remote[block_hash] = medium
        else:
            self._arriving[block_hash] = (done, medium)
        self.stats.puts_done += 1
        self.stats.by_medium[medium] = self.stats.by_medium.get(medium, 0) + 1

    def remote_failed(self, block_hash: int) -> None:
        """A put failed (kv_store down or full): the block is not loadable from kv_store; a later store retries."""
        self._queued.discard(block_hash)
        self._taken.pop(block_hash, None)
        self.stats.puts_failed += 1

    def remote_missing(self, block_hashes: Sequence[int]) -> None:
        """kv_store no longer holds these (found by a read or a Contains): forget them."""
        for h in block_hashes:
            self._remote.pop(h, None)
            self._arriving.pop(h, None)

    def reset(self) -> None:
        """``/reset_prefix_cache``: drop the CPU tier (``BlockRemoved(medium=CPU)``); kv_store keeps its values."""
        if self._cpu:
            self._events.append(BlockRemoved(block_hashes=list(self._cpu), medium=CPU_MEDIUM))
            self._cpu.clear()
        self._jobs.clear()  # stores in flight complete into nothing
        self._storing.clear()
        self._transit = 0

    def take_events(self) -> list[KVEvent]:
        """CPU-tier events since the last call, in order."""
        events, self._events = self._events, []
        return events
