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
* **Events** (``take_events``), exactly vLLM 0.32's default form (``offloading/events.py``
  ``_placeholder_stored``, used unless ``kv_connector_extra_config["self_describing_kv_events"]``):
  one ``BlockStored`` **per block** whose store completed, with ``block_hashes=[hash]``,
  ``parent_block_hash=None``, ``token_ids=[]``, ``block_size=0``, ``lora_id=None``, ``lora_name=None``,
  ``medium="CPU"``, ``group_idx=0`` (``extra_keys`` and ``kv_cache_spec_kind`` left out, as vLLM's
  encoder omits them at their default ``None``); and one ``BlockRemoved(medium="CPU", group_idx=0)``
  per eviction batch (all blocks one store evicted, vLLM's one ``OffloadingEvent(removed=True)`` per
  ``prepare_store``). On the wire these are byte-identical to vLLM's (``tests/unit/engine_simulator/
  test_sim_offload.py`` holds vLLM's own encoding).
* **Recency** (vLLM's ``LRUOffloadingManager`` with ``on_request_finished``, ``cpu/policies/base.py``
  and ``lru.py``): a request admitted with GPU prefix hits still offers those blocks to the CPU tier
  (vLLM's store range starts at chunk 0 unless the chunks were loaded), so an evicted hot block is
  offloaded again and a resident one refreshed; when a request finishes, all its blocks in the CPU
  tier are touched, the prefix head last (most recently used), so hot prefixes stay in the tier.
* **Model time.** The manager is pure: the scheduler passes the model time (:meth:`OffloadManager.advance`,
  at every ``schedule``), which completes the store jobs and kv_store writes due by then.
* **Load**: a waiting request's prefix is first matched against the GPU prefix cache; the blocks
  right after the GPU hit are then looked up in the offloaded tiers (``lookup``: the longest run
  present). Those blocks are loaded asynchronously: the request holds GPU blocks for them, waits
  (vLLM's ``WAITING_FOR_REMOTE_KVS``) for the modeled transfer, and is then scheduled with
  them counted as computed (they are never recomputed); the loaded blocks then enter the GPU
  prefix cache (``BlockStored(medium="GPU")``) as vLLM caches them once the load finishes.
  Loads share the links: every load occupies the host-to-device PCIe lane for all its blocks, one
  load after another, and a load from kv_store also the host's network-ingress lane for its remote
  blocks, so two loads started together finish one after the other (``start_load``).
  A request whose hit blocks another request is loading now is held back (``being_loaded``, vLLM
  0.32's ``_chunks_being_loaded`` check in ``offloading/scheduler.py``) and then hits them on the GPU.
* **kv_store residency is confirmed before a load** (vLLM's ``LookupResult.RETRY``: the manager
  cannot answer now, starts an asynchronous lookup, the scheduler defers the request and asks again
  at a later step). A block the engine believes is in kv_store (it was acknowledged by a put) is a
  hit only after kv_store's batched ``Lookup`` confirmed it for this load, on the medium kv_store
  reports *now*; :meth:`OffloadManager.take_lookups` hands the I/O side the hashes to ask,
  :meth:`remote_lookup_done` takes the answer (absent keys are forgotten, so the block is recomputed
  and written again) and :meth:`remote_lookup_failed` a failed RPC: kv_store unreachable degrades to
  no kv_store hits (recompute) for ``remote_retry_seconds`` of model time, counted, never a hang.
  What the engine remembers of kv_store is an LRU of ``max_remote_blocks`` hashes.
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

Transfer time of a load of n blocks of ``bytes_per_block`` bytes (model seconds), r of them from kv_store::

    H2D PCIe lane:      n * bytes / pcie_bandwidth                     (every block crosses PCIe)
    ingress lane:       sum over the r blocks of bytes / network_bandwidth (CPU medium), or
                        bytes / min(nvme_bandwidth, network_bandwidth) (DISK/SHARED medium)

Each lane serves loads one after another (``max(now, lane free) + seconds``); the load is ready when
both of its lanes are done, plus ``load_latency_seconds`` (and ``network_latency_seconds`` when r > 0).
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

from msgspec import UNSET

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
    max_remote_blocks: int = 262_144
    """Hashes of kv_store blocks the engine remembers (LRU; 2 TiB of 8 MiB blocks); older ones are forgotten."""
    remote_retry_seconds: float = 1.0
    """Model seconds after a failed kv_store lookup during which kv_store blocks count as misses (not asked)."""

    def __post_init__(self) -> None:
        for name in ("cpu_capacity_blocks", "bytes_per_block", "pcie_bandwidth", "nvme_bandwidth",
                     "network_bandwidth", "max_inflight_store_blocks", "max_pending_puts", "max_remote_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("load_latency_seconds", "network_latency_seconds", "remote_retry_seconds"):
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
    """Model seconds from the start of the load to its end (transfers, latencies, and waiting for busy lanes)."""
    ready_at: float = 0.0
    """Model time the load completes (set by :meth:`OffloadManager.start_load`)."""

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
    store_allocation_failures: int = 0
    """Store offers with at least one block skipped for lack of room (vLLM's ``prepare_store`` returning None)."""
    load_transfer_seconds: float = 0.0
    """Modeled link-busy seconds of every load (what vLLM's ``kv_offload_load_time`` sums), no queueing."""
    remote_lookups: int = 0
    """Batched kv_store ``Lookup`` RPCs answered."""
    remote_lookup_blocks: int = 0
    """Blocks asked in those lookups."""
    remote_lookup_failures: int = 0
    """kv_store ``Lookup`` RPCs that failed (kv_store down, deadline): their blocks counted as misses."""
    remote_missing_blocks: int = 0
    """Blocks the engine believed were in kv_store and kv_store no longer holds (forgotten, recomputed)."""
    remote_degraded_misses: int = 0
    """Lookups that stopped at a kv_store block not asked because kv_store failed recently."""
    remote_lookup_deferrals: int = 0
    """Lookups answered "ask again later" while kv_store confirms (vLLM's RETRY)."""
    remote_forgotten_blocks: int = 0
    """kv_store hashes dropped from the engine's bounded memory (``max_remote_blocks``)."""
    load_deferrals: int = 0
    """Requests held back because another request was loading some of their blocks."""


def cpu_stored_event(block_hash: int) -> BlockStored:
    """vLLM 0.32's CPU-tier ``BlockStored`` for one block with default settings (``offloading/events.py``
    ``_placeholder_stored``): no tokens, no parent, ``block_size=0``, ``group_idx=0``; ``extra_keys`` and
    ``kv_cache_spec_kind`` are left unset so they are not encoded, as vLLM's encoder omits them (None)."""
    return BlockStored(
        block_hashes=[block_hash], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
        medium=CPU_MEDIUM, lora_name=None, extra_keys=UNSET, group_idx=0,  # type: ignore[arg-type]
        kv_cache_spec_kind=UNSET,  # type: ignore[arg-type]
    )


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
        self._remote: OrderedDict[int, str] = OrderedDict()
        """Hash -> the kv_store medium last reported (CPU, DISK or SHARED), least recently used first;
        at most ``max_remote_blocks``."""
        self._confirmed: OrderedDict[int, None] = OrderedDict()
        """kv_store blocks its last lookup confirmed, not yet used by a load (each load asks again)."""
        self._to_check: dict[int, None] = {}
        """kv_store blocks a lookup needs confirmed, not yet handed to the I/O side (:meth:`take_lookups`)."""
        self._checking: set[int] = set()
        self._denied: set[int] = set()
        """Blocks whose lookup failed: the next lookup of each counts it a miss (a deferred request moves on)."""
        self._degraded_until = -1.0
        self._h2d_free_at = 0.0
        self._net_in_free_at = 0.0
        self._load_jobs: deque[tuple[float, list[int]]] = deque()
        self._being_loaded: dict[int, int] = {}
        """Hash -> loads in flight that carry it (vLLM's ``_chunks_being_loaded``)."""
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

    def lookup(self, block_hashes: Sequence[int]) -> int | None:
        """Length of the longest run from ``block_hashes[0]`` an offloaded tier can load now, or None: some
        kv_store block of the run needs kv_store's confirmation first (vLLM's ``LookupResult.RETRY``; it is
        queued for :meth:`take_lookups`; scanning goes on to the first miss, as vLLM's does, so one RPC
        asks for the whole run). A CPU block is a hit; a kv_store block is a hit once confirmed (see the
        module docstring), a miss while kv_store is failing."""
        n = 0
        defer = False
        for h in block_hashes:
            if h in self._cpu:
                n += 1
                continue
            if h not in self._remote:
                break
            if h in self._confirmed:
                n += 1
                continue
            if h in self._denied:  # its lookup failed: a miss, once (the deferred request moves on)
                self._denied.difference_update(block_hashes)
                break
            if self.now < self._degraded_until:
                self.stats.remote_degraded_misses += 1
                break
            if h not in self._checking:
                self._to_check[h] = None
            defer = True
        if defer:
            self.stats.remote_lookup_deferrals += 1
            return None
        return n

    def being_loaded(self, block_hashes: Sequence[int]) -> bool:
        """Whether a load in flight carries any of ``block_hashes`` (vLLM then delays the request)."""
        loading = self._being_loaded
        return bool(loading) and any(h in loading for h in block_hashes)

    def take_lookups(self) -> list[tuple[int, str]]:
        """kv_store blocks to confirm, ``(hash, kv_store key)``, for one batched ``Lookup``; each is
        answered by :meth:`remote_lookup_done` or :meth:`remote_lookup_failed`."""
        if not self._to_check:
            return []
        hashes = list(self._to_check)
        self._to_check.clear()
        self._checking.update(hashes)
        return [(h, kv_store_key(self.model, self.block_size, h)) for h in hashes]

    @property
    def num_pending_lookups(self) -> int:
        """kv_store blocks waiting for a lookup or its answer."""
        return len(self._to_check) + len(self._checking)

    def remote_lookup_done(self, answers: Sequence[tuple[int, str | None]]) -> None:
        """kv_store answered a lookup: per block, the medium of the fastest tier holding it now, or None
        (absent: forgotten, so it is recomputed and its next store writes it to kv_store again)."""
        self.stats.remote_lookups += 1
        self.stats.remote_lookup_blocks += len(answers)
        self._denied.clear()  # kv_store answers again
        missing = []
        for h, medium in answers:
            self._checking.discard(h)
            if medium is None:
                missing.append(h)
                continue
            self._remember(h, medium)
            self._confirmed[h] = None
            self._confirmed.move_to_end(h)
        while len(self._confirmed) > self.config.max_remote_blocks:
            self._confirmed.popitem(last=False)
        if missing:
            self.stats.remote_missing_blocks += len(missing)
            self.remote_missing(missing)

    def remote_lookup_failed(self, block_hashes: Sequence[int]) -> None:
        """A lookup failed (kv_store down or too slow): these blocks are misses now, and kv_store blocks are
        not tried for ``remote_retry_seconds`` (the requests waiting for them recompute instead)."""
        self.stats.remote_lookup_failures += 1
        for h in block_hashes:
            self._checking.discard(h)
            self._denied.add(h)
        self._degraded_until = self.now + self.config.remote_retry_seconds

    def _remember(self, block_hash: int, medium: str) -> None:
        self._remote[block_hash] = medium
        self._remote.move_to_end(block_hash)
        while len(self._remote) > self.config.max_remote_blocks:
            old, _ = self._remote.popitem(last=False)
            self._confirmed.pop(old, None)
            self.stats.remote_forgotten_blocks += 1

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
                self._remember(h, self._arriving.pop(h)[1])
        while self._load_jobs and self._load_jobs[0][0] <= now:
            for h in self._load_jobs.popleft()[1]:
                left = self._being_loaded[h] - 1
                if left:
                    self._being_loaded[h] = left
                else:
                    del self._being_loaded[h]

    def next_load_done(self) -> float | None:
        """Model time the earliest load in flight completes; None when none is."""
        return self._load_jobs[0][0] if self._load_jobs else None

    def next_store_done(self) -> float | None:
        """Model time the earliest in-flight store job completes; None when none is in flight."""
        return self._jobs[0][0] if self._jobs else None

    def _complete_store(self, hashes: list[int], puts: list[BlockStored]) -> None:
        for h in hashes:
            self._storing.discard(h)
            self._cpu[h] = None
            self._events.append(cpu_stored_event(h))
        self.stats.stored_blocks += len(hashes)
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
        """The transfer of ``block_hashes`` (all loadable, see :meth:`lookup`) on idle links: CPU where there,
        else kv_store. Seconds: ``load_latency`` (+ ``network_latency`` with kv_store blocks) + the longer of
        all blocks over PCIe and the kv_store blocks over the network (NVMe for DISK/SHARED values)."""
        cfg = self.config
        plan = LoadPlan()
        net_seconds = 0.0
        for h in block_hashes:
            if h in self._cpu:
                plan.cpu_blocks += 1
            else:
                bw = cfg.network_bandwidth if self._remote[h] == CPU_MEDIUM else min(cfg.network_bandwidth,
                                                                                       cfg.nvme_bandwidth)
                plan.remote_blocks += 1
                net_seconds += cfg.bytes_per_block / bw
        if plan.num_blocks:
            pcie_seconds = plan.num_blocks * cfg.bytes_per_block / cfg.pcie_bandwidth
            plan.seconds = self._load_latency(plan) + max(pcie_seconds, net_seconds)
        return plan

    def _load_latency(self, plan: LoadPlan) -> float:
        return self.config.load_latency_seconds + (self.config.network_latency_seconds if plan.remote_blocks else 0.0)

    # -- mutations ---------------------------------------------------------------------------
    def start_load(self, block_hashes: Sequence[int], now: float | None = None) -> LoadPlan:
        """Start the load of ``block_hashes`` at model time ``now`` (default: the last :meth:`advance`) and
        count it; CPU hits become most recently used (vLLM's ``prepare_load`` + ``touch``), kv_store
        confirmations are used up (the next load asks again).

        The load takes the host-to-device PCIe lane for all its blocks after the loads before it, and the
        network-ingress lane for its kv_store blocks, likewise; it is ready (``LoadPlan.ready_at``) when both
        are done, plus the latencies. Until then its blocks are :meth:`being_loaded`.
        """
        cfg = self.config
        start = self.now if now is None else now
        plan = self.plan_load(block_hashes)
        net_seconds = 0.0
        for h in block_hashes:
            if h in self._cpu:
                self._cpu.move_to_end(h)
            else:
                self._confirmed.pop(h, None)
                self._remote.move_to_end(h)
                bw = cfg.network_bandwidth if self._remote[h] == CPU_MEDIUM else min(cfg.network_bandwidth,
                                                                                       cfg.nvme_bandwidth)
                net_seconds += cfg.bytes_per_block / bw
        h2d_done = max(start, self._h2d_free_at) + plan.num_blocks * cfg.bytes_per_block / cfg.pcie_bandwidth
        self._h2d_free_at = h2d_done
        done = h2d_done
        if plan.remote_blocks:
            net_done = max(start, self._net_in_free_at) + net_seconds
            self._net_in_free_at = net_done
            done = max(done, net_done)
        transfer = plan.seconds
        plan.ready_at = done + self._load_latency(plan)
        plan.seconds = plan.ready_at - start
        hashes = list(block_hashes)
        for h in hashes:
            self._being_loaded[h] = self._being_loaded.get(h, 0) + 1
        self._load_jobs.append((plan.ready_at, hashes))
        if len(self._load_jobs) > 1 and self._load_jobs[-2][0] > plan.ready_at:
            self._load_jobs = deque(sorted(self._load_jobs, key=lambda job: job[0]))
        s = self.stats
        s.loads += 1
        s.loaded_cpu_blocks += plan.cpu_blocks
        s.loaded_remote_blocks += plan.remote_blocks
        s.load_seconds += plan.seconds
        s.load_transfer_seconds += transfer
        return plan

    def on_request_finished(self, block_hashes: Sequence[int]) -> None:
        """A request finished (or was aborted) with these full blocks, in prefix order: touch those in the CPU
        tier, the prefix head last, so it is the most recently used (vLLM 0.32's ``on_request_finished`` of
        the LRU policy: ``_update_recency(reversed(keys))``)."""
        cpu = self._cpu
        for h in reversed(block_hashes):
            if h in cpu:
                cpu.move_to_end(h)

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

        evicted: list[ExternalBlockHash] = []
        skipped = self.stats.store_skipped_blocks
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
                evicted.append(old)
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
        if evicted:  # one eviction batch, one event (vLLM: one OffloadingEvent(removed=True) per prepare_store)
            self._events.append(BlockRemoved(block_hashes=evicted, medium=CPU_MEDIUM, group_idx=0))
        if self.stats.store_skipped_blocks > skipped:
            self.stats.store_allocation_failures += 1
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
            self._remember(block_hash, medium)
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
            self._confirmed.pop(h, None)

    def reset(self) -> None:
        """``/reset_prefix_cache``: drop the CPU tier (``BlockRemoved(medium=CPU)``); kv_store keeps its values."""
        if self._cpu:
            self._events.append(BlockRemoved(block_hashes=list(self._cpu), medium=CPU_MEDIUM, group_idx=0))
            self._cpu.clear()
        self._jobs.clear()  # stores in flight complete into nothing
        self._storing.clear()
        self._transit = 0

    def take_events(self) -> list[KVEvent]:
        """CPU-tier events since the last call, in order."""
        events, self._events = self._events, []
        return events
