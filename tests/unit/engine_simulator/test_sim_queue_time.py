"""Where an offload load's time goes in vLLM 0.32's per-request histograms, as the simulator records them.

Upstream: vLLM 0.32 ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``: a request whose KV loads
asynchronously (``load_kv_async``) is put in ``WAITING_FOR_REMOTE_KVS`` and skipped *before* the
``EngineCoreEventType.SCHEDULED`` event; the event is recorded when it is scheduled after the load.
``vllm/v1/metrics/stats.py``: ``queued_time = scheduled_ts - queued_ts`` (``vllm:request_queue_time_seconds``),
``prefill_time = first_token_ts - scheduled_ts`` (``vllm:request_prefill_time_seconds``). So the load, and any wait
after it, is queue time, not prefill time.
"""

from __future__ import annotations

import pytest

from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored

B = 16
BYTES = 1_000_000


def test_a_loaded_request_is_first_scheduled_after_its_load_not_when_it_starts() -> None:
    off = OffloadManager(OffloadConfig(mode=OffloadMode.CPU, cpu_capacity_blocks=64, bytes_per_block=BYTES,
                                       pcie_bandwidth=1e9, load_latency_seconds=0.0), B, "m")
    core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512),
                      PrefixCache(16, B, offload=off))
    tokens = list(range(4 * B + 3))
    hashes = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(tokens[:4 * B], B)]
    off.store(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:4 * B], block_size=B,
                          medium="GPU", extra_keys=[None] * 4))
    off.advance(1.0)
    loaded = Request("l", tokens, max_tokens=1, ignore_eos=True)
    plain = Request("p", list(range(500, 520)), max_tokens=1, ignore_eos=True)
    core.add_request(loaded)
    core.add_request(plain)
    step = core.schedule(0.0)  # the load starts (4 MB at 1 GB/s: 4 ms); the plain request is scheduled
    assert [r.request_id for r, _ in step.scheduled] == ["p"] and plain.first_scheduled_time == 0.0
    assert loaded.first_scheduled_time is None and loaded.num_cached_tokens == 4 * B
    core.update(step)
    assert core.schedule(0.001).scheduled == []  # still WAITING_FOR_REMOTE_KVS
    step = core.schedule(0.01)
    assert step.scheduled == [(loaded, 3)]
    assert loaded.first_scheduled_time == pytest.approx(0.01)  # queue time = arrival to here, the load included
