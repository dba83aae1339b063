"""``vllm:num_requests_waiting`` counts requests whose KV load is in flight, as vLLM 0.32 does.

Upstream: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py``: ``get_request_counts`` returns ``len(self.running),
len(self.waiting) + len(self.kv_holding_waiting)``; ``make_stats`` splits the waiting count into
``num_waiting_reqs`` (``reason="capacity"``) and ``num_skipped_waiting_reqs = len(self.deferred_waiting)``
(``reason="deferred"``: loads in flight and loaded prefixes not yet admitted); ``vllm/v1/metrics/loggers.py``
sets ``vllm:num_requests_waiting`` to their sum. The per-step equality with vLLM's own scheduler is checked in
``tests/compat/test_vllm_long_prefill.py``; here the simulator's counts, the long-prefill cap they size and the
exported gauges.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_simulator.engine import AsyncEngine
from engine_simulator.latency_model import LatencyModel
from engine_simulator.metrics import EngineMetrics
from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.clock import ManualClock
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored
from kvmesh_cli.report import parse_prometheus_counter

B = 16
LOAD_SECONDS = 5.0


def _offload_holding(prefix: list[int]) -> OffloadManager:
    """A CPU tier that holds ``prefix``'s full blocks; a load takes ``LOAD_SECONDS``."""
    off = OffloadManager(OffloadConfig(mode=OffloadMode.CPU, cpu_capacity_blocks=1024, bytes_per_block=1,
                                       pcie_bandwidth=1e12, load_latency_seconds=LOAD_SECONDS), B, "m")
    hashes: list[int | bytes] = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(prefix, B)]
    off.store(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(prefix), block_size=B,
                          medium="GPU", extra_keys=[None] * len(hashes)))
    while (done := off.next_store_done()) is not None:
        off.advance(done)
    off.take_events()
    return off


def _core(off: OffloadManager, *, max_num_seqs: int = 8, threshold: int = 0) -> EngineCore:
    return EngineCore(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=512,
                                      long_prefill_token_threshold=threshold), PrefixCache(64, B, offload=off))


def test_a_load_in_flight_counts_as_waiting_and_deferred() -> None:
    """x's 2 offloaded blocks load for 5 s; o runs; w waits for the only slot (``max_num_seqs=1``; a load in flight
    takes no slot). The gauge counts x from the step its load starts to the step it is admitted: first as a load in
    flight, then, its load done while w holds the slot, as a loaded prefix (vLLM leaves ``deferred_waiting`` only
    on admission); w counts as waiting for capacity until it gets the slot."""
    prefix = list(range(1000, 1000 + 2 * B))
    core = _core(_offload_holding(prefix), max_num_seqs=1)
    x = Request("x", prefix + list(range(9000, 9010)), max_tokens=1, ignore_eos=True)
    o = Request("o", list(range(3000, 3020)), max_tokens=3, ignore_eos=True)
    w = Request("w", list(range(5000, 5010)), max_tokens=5, ignore_eos=True)
    for r in (x, o, w):
        core.add_request(r)
    assert (core.num_running, core.num_waiting, core.num_deferred) == (0, 3, 0)
    step = core.schedule(0.0)
    core.update(step)
    assert [r.request_id for r, _ in step.scheduled] == ["o"] and core.loading == [x]
    assert x.load_ready_time == pytest.approx(LOAD_SECONDS)  # still WAITING_FOR_REMOTE_KVS
    assert (core.num_running, core.num_waiting, core.num_deferred) == (1, 2, 1)
    for t in (1.0, 2.0):
        core.update(core.schedule(t))
    assert o.finish_reason is not None and (core.num_running, core.num_waiting, core.num_deferred) == (0, 2, 1)
    core.update(core.schedule(3.0))  # x's load is still in flight, so w gets the slot
    assert core.running == [w] and (core.num_running, core.num_waiting, core.num_deferred) == (1, 1, 1)
    for t in (4.0, 5.0, 6.0):
        core.update(core.schedule(t))
    assert core.running == [w] and core.loading == [x]  # x's load is done but w holds the only slot
    assert (core.num_running, core.num_waiting, core.num_deferred) == (1, 1, 1)
    core.update(core.schedule(7.0))
    assert w.finish_reason is not None and (core.num_running, core.num_waiting, core.num_deferred) == (0, 1, 1)
    step = core.schedule(8.0)  # promoted and admitted: it leaves the waiting side
    assert step.scheduled == [(x, 10)] and (core.num_running, core.num_waiting, core.num_deferred) == (1, 0, 0)


def test_a_load_in_flight_makes_the_long_prefill_cap_apply() -> None:
    """vLLM sizes the cap with the same ``get_request_counts``: with x loading, a lone long prefill is not alone, so
    the threshold cuts it (it would get the whole budget if the load did not count)."""
    prefix = list(range(1000, 1000 + 2 * B))
    core = _core(_offload_holding(prefix), threshold=16)
    x = Request("x", prefix + list(range(9000, 9010)), max_tokens=1, ignore_eos=True)
    core.add_request(x)
    assert core.schedule(0.0).scheduled == [] and core.loading == [x]
    a = Request("a", list(range(3000, 3200)), max_tokens=1, ignore_eos=True)
    core.add_request(a)
    assert core.long_prefill_cap() == 16
    assert core.schedule(1.0).scheduled == [(a, 16)]
    assert core.abort_request("x") is x
    assert core.long_prefill_cap() == 0  # a alone now


class _GatedClock(ManualClock):
    """A manual clock whose ``sleep`` holds the engine loop until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.sleeping = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.sleeping.set()
        await self.gate.wait()
        await super().sleep(seconds)


async def test_engine_exports_loads_in_flight_in_the_waiting_gauge() -> None:
    """The engine loop's step record: with x's load in flight (the loop sleeping until it is done) the engine
    exports ``vllm:num_requests_waiting`` 1, ``..._by_reason{reason="deferred"}`` 1 and ``{reason="capacity"}`` 0;
    the reasons sum to the gauge, as vLLM documents."""
    prefix = list(range(1000, 1000 + 2 * B))
    metrics = EngineMetrics("m", {"block_size": str(B)}, 512)
    clock = _GatedClock()
    latency = LatencyModel(base_seconds=0.01, prefill_seconds_per_token=0.0, decode_seconds_per_seq=0.0,
                           decode_seconds_per_context_token=0.0)
    engine = AsyncEngine(_core(_offload_holding(prefix)), latency, clock, NullEventPublisher(), metrics)
    engine.start()
    try:
        queue = engine.submit(Request("x", prefix + list(range(9000, 9010)), max_tokens=1, ignore_eos=True))
        await asyncio.wait_for(clock.sleeping.wait(), 5)
        text = metrics.exposition().decode()
        assert parse_prometheus_counter(text, "vllm:num_requests_waiting") == 1
        assert parse_prometheus_counter(text, "vllm:num_requests_running") == 0
        lines = {line.split("reason=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line.startswith("vllm:num_requests_waiting_by_reason{")}
        assert lines == {"capacity": 0.0, "deferred": 1.0}
        clock.gate.set()
        while not (await asyncio.wait_for(queue.get(), 5)).finished:
            pass
        text = metrics.exposition().decode()
        assert parse_prometheus_counter(text, "vllm:num_requests_waiting") == 0
    finally:
        clock.gate.set()
        await engine.stop()
