"""The engine simulator's offload connector (vLLM 0.32 OffloadingConnector semantics; engine_simulator/offload.py).

Upstream: vLLM 0.32 ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``,
``.../offloading/scheduler.py`` (``_chunks_being_loaded``, ``LookupResult.RETRY`` deferral), ``.../offloading/events.py``
(default CPU events: ``_placeholder_stored``, one block per ``BlockStored``, ``block_size=0``, no tokens) and
``vllm/v1/kv_offload/cpu/`` (LRU CPU tier, ``on_request_finished`` recency).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.latency_model import LatencyModel
from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode, cpu_stored_event, kv_store_key
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.clock import ManualClock
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockRemoved, BlockStored, KVEvent

B = 16
BYTES = 1_000_000


def _hashes(tokens: list[int]) -> list[int]:
    return [external_hash_to_int(d) for d in sha256_cbor_block_hashes(tokens, B)]


def _offload(mode: OffloadMode = OffloadMode.CPU, cpu_blocks: int = 1024, **kw: float) -> OffloadManager:
    model: dict[str, float] = {"pcie_bandwidth": 1e9, "nvme_bandwidth": 1e8, "network_bandwidth": 5e8,
                               "load_latency_seconds": 0.0, "network_latency_seconds": 0.0, **kw}
    cfg = OffloadConfig(mode=mode, cpu_capacity_blocks=cpu_blocks, bytes_per_block=BYTES, **model)  # type: ignore[arg-type]
    return OffloadManager(cfg, B, "m")


def _core(blocks: int, offload: OffloadManager | None) -> EngineCore:
    return EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512),
                      PrefixCache(blocks, B, offload=offload))


def _stored_event(tokens: list[int]) -> BlockStored:
    hashes = _hashes(tokens)
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=tokens, block_size=B,
                       medium="GPU", extra_keys=[None] * len(hashes))


def _drive(core: EngineCore, *requests: Request, now: float = 0.0) -> float:
    """Run to completion on model time (each step 1 s; loads wait their modeled time)."""
    for r in requests:
        core.add_request(r)
    for _ in range(10_000):
        if not core.has_work():
            return now
        step = core.schedule(now)
        if step.empty:
            ready = core.next_load_ready()
            assert ready is not None
            now = max(now, ready)
            continue
        now += 1.0
        core.update(step)
    raise AssertionError("did not finish")


def test_store_emits_vllm_offload_events_and_lru_evicts() -> None:
    """vLLM's CPU events: one token-less BlockStored per block; an eviction batch is one BlockRemoved(CPU)."""
    off = _offload(cpu_blocks=3)
    a = list(range(2 * B))
    off.store(_stored_event(a))
    assert off.take_events() == [] and off.num_storing_blocks == 2  # announced when the copy completes
    off.advance(1.0)
    events = off.take_events()
    assert events == [cpu_stored_event(h) for h in _hashes(a)]
    assert all(e.block_size == 0 and e.token_ids == [] and e.medium == "CPU" for e in events)
    off.store(_stored_event(a))  # already there: refreshed, no event
    assert off.take_events() == []
    b = list(range(100, 100 + 2 * B))
    off.store(_stored_event(b))
    off.advance(2.0)
    ev = off.take_events()
    assert ev[0] == BlockRemoved(block_hashes=[_hashes(a)[0]], medium="CPU")  # least recently used first
    assert ev[1:] == [cpu_stored_event(h) for h in _hashes(b)]
    assert off.cpu_hashes() == [_hashes(a)[1], *_hashes(b)]
    assert off.stats.evicted_blocks == 1 and off.stats.stored_blocks == 4


def test_lookup_and_transfer_model() -> None:
    """The longest offloaded run; CPU over PCIe, kv_store over the network (and NVMe for DISK/SHARED)."""
    off = _offload(OffloadMode.CPU_KV_STORE, cpu_blocks=2)
    tokens = list(range(4 * B))
    h = _hashes(tokens)
    off.store(_stored_event(tokens))  # CPU room for two (blocks being stored are not evictable); all go to kv_store
    off.advance(1.0)
    assert off.cpu_hashes() == h[:2] and off.stats.store_skipped_blocks == 0
    assert [p.block_hash for p in off.take_puts()] == h
    cpu_only = _offload(cpu_blocks=2)
    cpu_only.store(_stored_event(tokens))  # without kv_store the two that find no room are skipped
    assert cpu_only.num_storing_blocks == 2 and cpu_only.stats.store_skipped_blocks == 2
    off.remote_stored(h[2], "CPU")
    off.remote_stored(h[3], "DISK")
    off.advance(2.0)  # their modeled transfers are over
    assert off.lookup(h) is None  # kv_store must confirm h[2:] first (vLLM's RETRY)
    assert sorted(off.take_lookups()) == sorted((x, kv_store_key("m", B, x)) for x in h[2:])
    off.remote_lookup_done([(h[2], "CPU"), (h[3], "DISK")])
    assert off.lookup(h) == 4 and off.lookup(h[1:]) == 3 and off.lookup([123]) == 0
    plan = off.plan_load(h)
    assert (plan.cpu_blocks, plan.remote_blocks) == (2, 2)
    # all 4 over PCIe while the kv_store ones cross the network (CPU medium: 5e8; DISK: min(nvme, network))
    assert plan.seconds == pytest.approx(max(4 * BYTES / 1e9, BYTES / 5e8 + BYTES / 1e8))
    off.remote_missing(h[2:])
    assert off.lookup(h) == 2 and off.lookup(h[2:]) == 0
    cpu_only = _offload()
    cpu_only.remote_stored(h[0], "CPU")
    assert cpu_only.plan_load(h[:1]).seconds == pytest.approx(BYTES / 5e8)  # network slower than PCIe


def test_kv_store_puts_carry_one_block_events_with_tokens() -> None:
    """Each block is queued once with key vllm:<model>:<block_size>:<hash hex> and its own chained BlockStored."""
    off = _offload(OffloadMode.CPU_KV_STORE)
    tokens = list(range(3 * B))
    h = _hashes(tokens)
    off.store(_stored_event(tokens))
    off.store(_stored_event(tokens))  # being stored already: not twice
    assert off.take_puts() == []  # written to kv_store from CPU, once the GPU -> CPU copy is done
    off.advance(1.0)
    off.store(_stored_event(tokens))  # queued already: not twice
    puts = off.take_puts()
    assert [p.key for p in puts] == [kv_store_key("m", B, x) for x in h]
    assert puts[0].key == f"vllm:m:{B}:{h[0]:016x}"
    for i, p in enumerate(puts):
        assert p.event.block_hashes == [h[i]]
        assert p.event.parent_block_hash == (h[i - 1] if i else None)
        assert p.event.token_ids == tokens[i * B:(i + 1) * B] and p.event.block_size == B
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p.event), type=BlockStored)
        assert decoded == p.event
    off.remote_failed(h[0])
    off.store(_stored_event(tokens))  # a failed put is retried on the next store
    assert [p.block_hash for p in off.take_puts()] == [h[0]]
    with pytest.raises(ValueError):
        OffloadManager(OffloadConfig(), B)
    with pytest.raises(ValueError):
        OffloadConfig(pcie_bandwidth=0)


def test_stores_take_modeled_pcie_and_network_time_in_the_background_bounded() -> None:
    """GPU -> CPU jobs run one after another on the D2H lane (n * bytes / pcie + latency); a block is
    loadable and announced only when its job is done; the in-flight bound skips the excess (vLLM's
    prepare_store returning None); kv_store puts then take bytes / min(network, pcie) each on the
    egress lane and count as remote only once both acknowledged and transferred."""
    off = _offload(OffloadMode.CPU_KV_STORE, max_inflight_store_blocks=4, max_pending_puts=3,
                   load_latency_seconds=1e-4, network_latency_seconds=2e-4)
    a, b = list(range(3 * B)), list(range(500, 500 + 2 * B))
    ha, hb = _hashes(a), _hashes(b)
    off.store(_stored_event(a))  # job 1: 3 blocks, done at 1e-4 + 3 ms
    off.store(_stored_event(b))  # job 2: 1 block fits the bound of 4 in flight, 1 skipped; after job 1
    assert off.num_storing_blocks == 4 and off.stats.store_skipped_blocks == 1
    assert off.next_store_done() == pytest.approx(1e-4 + 3 * BYTES / 1e9)
    assert off.stats.store_seconds == pytest.approx(2e-4 + 4 * BYTES / 1e9)
    off.advance(0.003)
    assert off.num_cpu_blocks == 0 and off.lookup(ha) == 0 and off.take_events() == []
    off.advance(0.0031)
    assert off.cpu_hashes() == ha and off.lookup(ha) == 3
    assert off.take_events() == [cpu_stored_event(h) for h in ha]
    off.advance(1e-4 + 3e-3 + 1e-4 + 1e-3)
    assert off.cpu_hashes() == [*ha, hb[0]] and off.num_storing_blocks == 0
    # 4 blocks in CPU, at most 3 kv_store puts pending: the 4th is skipped
    assert off.stats.puts_queued == 3 and off.stats.puts_skipped == 1
    now = off.now
    puts = off.take_puts()
    per_put = 2e-4 + BYTES / 5e8  # network (5e8) slower than PCIe (1e9)
    assert [p.done_at for p in puts] == pytest.approx([now + per_put * k for k in (1, 2, 3)])
    for p in puts:
        off.remote_stored(p.block_hash, "CPU")  # acknowledged at once by the real kv_store...
    assert not off.in_remote(ha[0])  # ...but the modeled transfer is not over
    off.advance(now + per_put)
    assert off.in_remote(ha[0]) and not off.in_remote(ha[1])
    off.advance(now + 3 * per_put)
    assert all(off.in_remote(h) for h in ha)
    assert off.stats.put_seconds == pytest.approx(3 * per_put)


def test_the_engine_step_never_waits_for_a_store() -> None:
    """With a store lane 1000x slower than the steps, requests finish at the same model times as
    without offload; the blocks simply are not in CPU yet (a repeat after GPU eviction recomputes)."""
    slow = _offload(pcie_bandwidth=1e3)  # 1000 s per block
    core = _core(6, slow)
    plain = _core(6, None)
    assert _drive(core, Request("a", list(range(4 * B + 3)), max_tokens=4, ignore_eos=True)) == \
        _drive(plain, Request("a", list(range(4 * B + 3)), max_tokens=4, ignore_eos=True))
    assert slow.num_storing_blocks == 4 and slow.num_cpu_blocks == 0
    _, again = _evicting_workload(_core(6, _offload(pcie_bandwidth=1e3)))
    assert again.num_cached_tokens == 0 and again.load_plan is None


def _evicting_workload(core: EngineCore) -> tuple[Request, Request]:
    """A 4-block conversation, then another that evicts it from a 6-block GPU pool, then the first again."""
    a_tokens = list(range(4 * B + 3))
    first = Request("a1", a_tokens, max_tokens=1, ignore_eos=True)
    other = Request("b", list(range(1000, 1000 + 4 * B + 3)), max_tokens=1, ignore_eos=True)
    now = _drive(core, first)
    now = _drive(core, other, now=now)
    again = Request("a2", a_tokens, max_tokens=1, ignore_eos=True)
    _drive(core, again, now=now)
    return first, again


def test_gpu_miss_loads_from_cpu_instead_of_recomputing() -> None:
    """The repeat misses the GPU pool, loads 4 blocks from CPU with the modeled time, computes only the rest."""
    off = _offload()
    core = _core(6, off)
    _, again = _evicting_workload(core)
    assert again.num_cached_tokens == 4 * B
    assert again.load_plan is not None and again.load_plan.cpu_blocks == 4
    assert again.load_plan.seconds == pytest.approx(4 * BYTES / 1e9)
    assert core.external_hits_tokens == 4 * B and off.stats.loaded_cpu_blocks == 4
    # vLLM's connector stats: every request's tokens past its GPU hit were looked up (3 requests, no GPU hits)
    assert core.external_queries_tokens == 3 * (4 * B + 3)
    events = core.cache.take_events()
    # the loaded blocks re-enter the GPU prefix cache with their tokens (vLLM caches them once loaded)
    gpu_stores = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu_stores[-1].block_hashes == _hashes(again.prompt_token_ids[:4 * B])
    cpu = [e for e in events if isinstance(e, (BlockStored, BlockRemoved)) and e.medium == "CPU"]
    assert cpu and all(isinstance(e, BlockStored) and e.token_ids == [] and e.parent_block_hash is None
                       and e.block_size == 0 and len(e.block_hashes) == 1 for e in cpu)

    plain = _core(6, None)
    _, recomputed = _evicting_workload(plain)
    assert recomputed.num_cached_tokens == 0  # without offload the eviction costs the whole prefix
    assert plain.external_queries_tokens == plain.external_hits_tokens == 0  # no connector: no lookups


async def test_engine_exposes_vllm_external_prefix_cache_counters() -> None:
    """``vllm:external_prefix_cache_{queries,hits}_total`` (vLLM 0.32's connector prefix-cache stats, beside
    the GPU-only ``vllm:prefix_cache_*``): a repeat whose 4 blocks were evicted to CPU counts 4 blocks of
    external hits over its 4 blocks + 3 tokens queried; the GPU counters count them as misses."""
    from engine_simulator.metrics import EngineMetrics
    from kvmesh_cli.report import parse_prometheus_counter

    latency = LatencyModel(base_seconds=0.01, prefill_seconds_per_token=0.0, decode_seconds_per_seq=0.0,
                           decode_seconds_per_context_token=0.0)
    metrics = EngineMetrics("m", {"block_size": str(B)}, 512)
    engine = AsyncEngine(_core(6, _offload()), latency, ManualClock(), NullEventPublisher(), metrics)
    engine.start()
    try:
        a_tokens = list(range(4 * B + 3))
        for rid, tokens in (("a1", a_tokens), ("b", list(range(1000, 1000 + 4 * B + 3))), ("a2", a_tokens)):
            queue = engine.submit(Request(rid, tokens, max_tokens=1, ignore_eos=True))
            while not (await asyncio.wait_for(queue.get(), 5)).finished:
                pass
    finally:
        await engine.stop()
    text = metrics.exposition().decode()
    assert parse_prometheus_counter(text, "vllm:external_prefix_cache_hits_total") == 4 * B
    assert parse_prometheus_counter(text, "vllm:external_prefix_cache_queries_total") == 3 * (4 * B + 3)
    assert parse_prometheus_counter(text, "vllm:prefix_cache_hits_total") == 0
    assert parse_prometheus_counter(text, "vllm:prefix_cache_queries_total") == 3 * (4 * B + 3)


def test_load_waits_modeled_time_and_does_not_block_others() -> None:
    """While a load is in flight the request is not scheduled (WAITING_FOR_REMOTE_KVS); others run."""
    off = _offload()
    core = _core(16, off)
    tokens = list(range(4 * B + 3))
    off.store(_stored_event(tokens[:4 * B]))
    off.advance(0.0)
    assert off.lookup(_hashes(tokens[:4 * B])) == 0  # not loadable while its store is in flight
    off.advance(4 * BYTES / 1e9)
    off.take_events()
    loaded = Request("l", tokens, max_tokens=1, ignore_eos=True)
    other = Request("o", list(range(500, 520)), max_tokens=1, ignore_eos=True)
    core.add_request(loaded)
    core.add_request(other)
    step = core.schedule(0.0)  # model time behind the manager's: nothing moves back
    assert [r.request_id for r, _ in step.scheduled] == ["o"]
    assert core.loading == [loaded] and core.next_load_ready() == pytest.approx(4 * BYTES / 1e9)
    core.update(step)
    assert [r.request_id for r, _ in core.schedule(0.001).scheduled] == []
    step = core.schedule(0.01)
    assert step.scheduled == [(loaded, 3)] and step.prefill_tokens == 3  # only the unaligned tail is computed
    assert core.abort_request("l") is loaded
    assert core.cache.num_free_blocks == 15


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_a_load_that_would_wait_on_another_loaded_prefix_does_not_start(reserve_full_isl: bool) -> None:
    """vLLM 0.32 (``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``, the ``load_kv_async`` branch): a load
    is admitted by ``allocate_slots(..., full_sequence_must_fit=scheduler_reserve_full_isl,
    reserved_blocks=_inflight_prefill_reserved_blocks())``. Two requests whose 5-block prefixes sit in CPU, each 10
    blocks in all, on an 11-block pool: x's load starts (10 <= 11 free; 5 <= 11 - 0 reserved); y's does not, with
    the full-ISL check (10 > 6 free) and, when that is off, by the reservation alone (5 > 6 free - 5 that x still
    needs). y starts only once x has finished, and nobody is preempted. (The simulator used to start both loads,
    leaving both waiting for 4 more blocks with 1 free, and then freed y's loaded blocks by a preemption vLLM does
    not have; vLLM never gets there.)"""
    off = _offload()
    core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      scheduler_reserve_full_isl=reserve_full_isl), PrefixCache(12, B, offload=off))
    prefixes = [list(range(k * 1000, k * 1000 + 5 * B)) for k in (1, 2)]
    for prefix in prefixes:
        off.store(_stored_event(prefix))
    off.advance(10.0)
    off.take_events()
    x = Request("x", prefixes[0] + list(range(50_000, 50_000 + 4 * B + 3)), max_tokens=1, ignore_eos=True)
    y = Request("y", prefixes[1] + list(range(60_000, 60_000 + 4 * B + 3)), max_tokens=1, ignore_eos=True)
    core.add_request(x)
    core.add_request(y)
    assert core.schedule(10.0).empty  # x loads 5 blocks (5 ms); y's load is refused and stops the queue
    assert core.loading == [x] and list(core.waiting) == [y] and not y.blocks and core.cache.num_free_blocks == 6
    step = core.schedule(10.005)  # x's load done: its 67-token tail, 64 now (4 more blocks); y still refused
    assert step.scheduled == [(x, 64)] and list(core.waiting) == [y] and core.cache.num_free_blocks == 2
    core.update(step)
    step = core.schedule(11.005)
    assert step.scheduled == [(x, 3)] and not y.blocks
    core.update(step)  # x done: its 10 blocks are free (cached)
    assert x.finish_reason is not None and core.schedule(12.005).empty and core.loading == [y]
    _drive(core, now=12.01)
    assert y.finish_reason is not None and y.load_plan is not None and y.load_plan.cpu_blocks == 5
    assert core.num_preemptions == 0 and y.num_preemptions == 0 and core.cache.num_free_blocks == 11


def test_a_load_leaves_free_what_in_flight_prefills_still_need() -> None:
    """vLLM 0.32's ``reserved_blocks`` for async loads (``Scheduler._inflight_prefill_reserved_blocks``: every
    request still prefilling, loads in flight included, reserves the blocks of its whole sequence it does not hold
    yet). 21-block pool (20 free). x (227 tokens, 15 blocks) loads its 2 offloaded blocks: 15 <= 20, 2 <= 20; it
    then needs 13 more. y (147 tokens, 10 blocks, 9 of them offloaded) passes the full-ISL check (10 <= 18 free)
    but not the reservation (9 > 18 - 13), and stops the queue. A request without a load is not held to the
    reservation (vLLM passes ``reserved_blocks`` only with ``load_kv_async``): z (5 blocks, no offloaded prefix)
    in y's place starts at once."""
    def setup(second: Request) -> EngineCore:
        off = _offload()
        core = _core(21, off)
        off.store(_stored_event(list(range(1000, 1000 + 2 * B))))
        off.store(_stored_event(list(range(2000, 2000 + 9 * B))))
        off.advance(10.0)
        off.take_events()
        core.add_request(Request("x", list(range(1000, 1000 + 14 * B + 3)), max_tokens=1, ignore_eos=True))
        core.add_request(second)
        return core

    y = Request("y", list(range(2000, 2000 + 9 * B + 3)), max_tokens=1, ignore_eos=True)
    core = setup(y)
    assert core.schedule(10.0).empty
    assert [r.request_id for r in core.loading] == ["x"] and list(core.waiting) == [y] and not y.blocks
    assert core.cache.num_free_blocks == 18
    z = Request("z", list(range(7000, 7000 + 4 * B + 3)), max_tokens=1, ignore_eos=True)
    core = setup(z)
    assert core.schedule(10.0).scheduled == [(z, 64)]
    assert [r.request_id for r in core.loading] == ["x"] and core.cache.num_free_blocks == 14


def test_a_load_refused_its_full_sequence_stops_the_waiting_queue() -> None:
    """A load refused by the full-ISL check ends the step's admissions as any refused allocation does (``allocate_slots``
    returns None: ``break``): x (6 blocks, 4 offloaded) cannot start its load beside w (5 free); v (1 block), behind
    it, waits too; once w has finished, x's load starts and v beside it."""
    off = _offload()
    core = _core(9, off)  # 8 free
    prefix = list(range(1000, 1000 + 4 * B))
    off.store(_stored_event(prefix))
    off.advance(10.0)
    off.take_events()
    x = Request("x", prefix + list(range(9000, 9000 + B + 3)), max_tokens=1, ignore_eos=True)  # 83 tokens, 6 blocks
    w = Request("w", list(range(3000, 3000 + 3 * B)), max_tokens=2, ignore_eos=True)  # 48 tokens, 4 blocks
    core.add_request(w)
    core.add_request(x)
    step = core.schedule(10.0)  # w starts (3 blocks now); x loads 4 blocks: full 6 <= 5? no
    assert step.scheduled == [(w, 48)] and core.loading == [] and list(core.waiting) == [x]
    core.update(step)
    v = Request("v", list(range(5000, 5010)), max_tokens=1, ignore_eos=True)
    core.add_request(v)
    step = core.schedule(11.0)  # w decodes (4th block); x: full 6 > 4 free: break, v stays behind it
    assert step.scheduled == [(w, 1)] and list(core.waiting) == [x, v]
    core.update(step)
    assert w.finish_reason is not None
    step = core.schedule(12.0)  # x's load starts (6 <= 8; 4 <= 8 - 0); v (1 block) then starts beside it
    assert step.scheduled == [(v, 10)] and core.loading == [x]
    core.update(step)
    step = core.schedule(12.01)  # x's load done: tried first, its 19-token rest
    assert step.scheduled == [(x, 19)] and core.loading == [] and not core.waiting


def test_loaded_prefixes_go_before_the_waiting_queue_and_stop_it() -> None:
    """vLLM 0.32 drains ``kv_holding_waiting`` (loads in flight, skipped, and finished loads) before ``waiting``, and a
    finished load that cannot get its blocks ends the step's admissions (``break``; its full-ISL check, blocks it
    holds subtracted, runs again when it resumes). 9-block pool (8 free): x (83 tokens, 6 blocks) loads its 2
    offloaded blocks (6 <= 8); w (80 tokens, 5 blocks, a fresh request, no reservation) starts beside it with 64
    tokens (5 <= 6 free; 4 blocks). Next step w takes its 5th block (1 free); x's load is done but it needs 4 more
    blocks: break, so v (10 tokens, 1 block, 1 free) behind it in ``waiting`` does not start."""
    off = _offload()
    core = _core(9, off)
    prefix = list(range(1000, 1000 + 2 * B))
    off.store(_stored_event(prefix))
    off.advance(10.0)
    off.take_events()
    x = Request("x", prefix + list(range(9000, 9000 + 3 * B + 3)), max_tokens=1, ignore_eos=True)
    w = Request("w", list(range(3000, 3000 + 5 * B)), max_tokens=3, ignore_eos=True)
    core.add_request(x)
    core.add_request(w)
    step = core.schedule(10.0)
    assert step.scheduled == [(w, 64)] and core.loading == [x] and core.cache.num_free_blocks == 2
    core.update(step)
    v = Request("v", list(range(5000, 5010)), max_tokens=1, ignore_eos=True)
    core.add_request(v)
    step = core.schedule(11.0)
    assert step.scheduled == [(w, 16)] and core.loading == [x] and x.load_ready_time is None
    assert list(core.waiting) == [v] and core.cache.num_free_blocks == 1 and core.num_waiting == 2
    core.update(step)
    _drive(core, now=12.0)
    assert v.finish_reason is not None and x.finish_reason is not None and core.num_preemptions == 0


async def test_async_engine_sleeps_through_a_load_on_manual_clock() -> None:
    """The engine loop waits for the load's model time when nothing else can run."""
    latency = LatencyModel(base_seconds=0.01, prefill_seconds_per_token=0.0, decode_seconds_per_seq=0.0,
                           decode_seconds_per_context_token=0.0)
    off = _offload()
    core = _core(16, off)
    tokens = list(range(4 * B + 3))
    off.store(_stored_event(tokens[:4 * B]))
    off.advance(1.0)
    clock = ManualClock()
    engine = AsyncEngine(core, latency, clock, NullEventPublisher())
    engine.start()
    try:
        req = Request("a", tokens, max_tokens=1, ignore_eos=True)
        out = await asyncio.wait_for(engine.submit(req).get(), 5)
        assert out.finished
        assert req.first_token_time == pytest.approx(4 * BYTES / 1e9 + 0.01)
    finally:
        await engine.stop()


def test_reset_drops_cpu_tier() -> None:
    off = _offload()
    core = _core(16, off)
    _drive(core, Request("a", list(range(2 * B + 1)), max_tokens=1, ignore_eos=True))
    off.advance(1000.0)
    core.cache.take_events()
    assert core.reset_prefix_cache()
    events: list[KVEvent] = core.cache.take_events()
    assert isinstance(events[-1], BlockRemoved) and events[-1].medium == "CPU" and off.num_cpu_blocks == 0


def test_config_flags() -> None:
    """``--offload`` takes off|cpu|cpu+kv_store; kv_store needs --kv-stores; the app builds the manager."""
    from engine_simulator.app import offload_manager

    assert offload_manager(SimulatorConfig()) is None
    mgr = offload_manager(SimulatorConfig(offload="cpu", block_size_tokens=32, offload_cpu_blocks=7))
    assert mgr is not None and mgr.config.bytes_per_block == 32 * 131_072 and mgr.config.cpu_capacity_blocks == 7
    with pytest.raises(ValueError):
        SimulatorConfig(offload="disk")
    with pytest.raises(ValueError):
        SimulatorConfig(offload="cpu+kv_store")
    cfg = SimulatorConfig(offload="cpu+kv_store", kv_stores="127.0.0.1:1")
    mgr = offload_manager(cfg)
    assert mgr is not None and mgr.config.uses_kv_store


@pytest.mark.parametrize("command", ["up", "compare"])
def test_cli_takes_offload_and_refuses_unknown_modes(command: str) -> None:
    """``kvmesh up|compare --offload`` takes off|cpu|cpu+kv_store; anything else is a usage error before a mesh starts."""
    from typer.testing import CliRunner

    from kvmesh_cli.main import OFFLOAD_MODES, app

    assert OFFLOAD_MODES == ("off", "cpu", "cpu+kv_store")
    result = CliRunner().invoke(app, [command, "--offload", "disk"])
    assert result.exit_code == 2
    assert "--offload" in result.output and "cpu+kv_store" in result.output
    assert "--offload" in CliRunner().invoke(app, [command, "--help"]).output
