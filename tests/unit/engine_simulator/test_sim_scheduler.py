"""The engine core: cached-token accounting, events, batching limits, preemption, and the async loop."""

import asyncio
import itertools
import json
from pathlib import Path

import pytest

from engine_simulator.engine import AsyncEngine
from engine_simulator.latency_model import LatencyModel
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import EngineCore, FinishReason, Request, SchedulerConfig
from kvmesh.clock import ManualClock
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockRemoved, BlockStored

B = 4


def _core(blocks: int = 64, **limits: int) -> EngineCore:
    return EngineCore(
        SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, **limits}),
        PrefixCache(blocks, B),
    )


def _run(core: EngineCore, *requests: Request) -> list[Request]:
    for r in requests:
        core.add_request(r)
    steps = 0
    while core.has_work():
        core.update(core.schedule(0.0))
        steps += 1
        assert steps < 10_000
    return list(requests)


def _stored(core: EngineCore) -> list[BlockStored]:
    return [e for e in core.cache.take_events() if isinstance(e, BlockStored)]


def _ints(tokens: list[int]) -> list[int]:
    return [external_hash_to_int(d) for d in sha256_cbor_block_hashes(tokens, B)]


@pytest.mark.parametrize(
    ("prompt_len", "expected_cached"),
    [(16, 12), (18, 16), (3, 0), (4, 0), (5, 4)],
    ids=[
        "aligned-full-hit-recomputes-last-block",
        "unaligned-all-full-blocks",
        "short",
        "one-block",
        "one-plus",
    ],
)
def test_cached_tokens_on_repeat_like_vllm(prompt_len: int, expected_cached: int) -> None:
    """vLLM caps the hit at len-1 tokens: an aligned, fully cached prompt reports (n_blocks-1)*B."""
    core = _core()
    prompt = list(range(10, 10 + prompt_len))
    (first,) = _run(core, Request("a", prompt, max_tokens=1))
    (second,) = _run(core, Request("b", prompt, max_tokens=1))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_cached
    assert core.prefix_queries_tokens == 2 * prompt_len and core.prefix_hits_tokens == expected_cached


def test_block_stored_hashes_are_sha256_cbor_and_generated_blocks_are_stored() -> None:
    core = _core()
    prompt = [1] + list(range(100, 109))  # 10 tokens: 2 full blocks + 2
    (req,) = _run(core, Request("a", prompt, max_tokens=7, ignore_eos=True))
    events = _stored(core)
    full = prompt + req.output_token_ids[:-1]  # the last sampled token is never computed
    expected = _ints(full)
    assert len(expected) == 4
    assert [h for e in events for h in e.block_hashes] == expected
    assert events[0].parent_block_hash is None and events[0].token_ids == prompt[:8]
    for prev, ev in itertools.pairwise(events):
        assert ev.parent_block_hash == prev.block_hashes[-1]
    # a repeat re-announces the generated blocks (identical prompt -> identical tokens)
    (again,) = _run(core, Request("b", prompt, max_tokens=7, ignore_eos=True))
    assert again.output_token_ids == req.output_token_ids
    assert [h for e in _stored(core) for h in e.block_hashes] == expected[2:]


def test_chunked_prefill_respects_budget_and_max_num_seqs() -> None:
    core = _core(max_num_batched_tokens=16, max_num_seqs=2)
    reqs = [Request(f"r{i}", list(range(i * 100, i * 100 + 40)), max_tokens=2) for i in range(3)]
    for r in reqs:
        core.add_request(r)
    step = core.schedule(0.0)
    assert [(r.request_id, n) for r, n in step.scheduled] == [("r0", 16)]
    assert step.prefill_tokens == 16 and step.decode_seqs == 0
    core.update(step)
    assert reqs[0].output_token_ids == []  # mid-prefill: nothing sampled
    seen_running = 0
    while core.has_work():
        step = core.schedule(0.0)
        assert sum(n for _, n in step.scheduled) <= 16
        seen_running = max(seen_running, core.num_running)
        core.update(step)
    assert seen_running == 2
    assert all(r.finish_reason == FinishReason.LENGTH and len(r.output_token_ids) == 2 for r in reqs)


def test_decode_steps_count_context() -> None:
    core = _core()
    req = Request("a", list(range(10)), max_tokens=3, ignore_eos=True)
    core.add_request(req)
    core.update(core.schedule(0.0))
    step = core.schedule(0.0)
    assert step.decode_seqs == 1 and step.prefill_tokens == 0 and step.decode_context_tokens == 11


def test_preemption_frees_blocks_and_recomputes() -> None:
    core = _core(blocks=7, max_num_batched_tokens=64)  # 6 usable blocks of 4
    a = Request("a", list(range(8)), max_tokens=12, ignore_eos=True)
    b = Request("b", list(range(50, 58)), max_tokens=12, ignore_eos=True)
    _run(core, a, b)
    assert core.num_preemptions > 0
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert core.cache.num_free_blocks == 6


def test_abort_frees_everything() -> None:
    core = _core()
    req = Request("a", list(range(20)), max_tokens=50)
    core.add_request(req)
    core.update(core.schedule(0.0))
    assert core.cache.usage > 0
    assert core.abort_request("a") is req and req.finish_reason == FinishReason.ABORT
    assert core.cache.usage == 0 and not core.has_work()
    assert core.abort_request("a") is None


def test_eviction_events_under_pressure() -> None:
    core = _core(blocks=5)  # 4 usable blocks
    _run(core, Request("a", list(range(12)), max_tokens=1))  # 3 blocks cached
    core.cache.take_events()
    _run(core, Request("b", list(range(200, 212)), max_tokens=1))
    removed = [e for e in core.cache.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2  # one free block, then the LRU tail of "a" goes first


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [([], 1, "empty"), ([1], 0, "max_tokens"), (list(range(500)), 20, "maximum context length")],
    ids=["empty", "zero-max-tokens", "too-long"],
)
def test_rejects_bad_requests(prompt: list[int], max_tokens: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _core().add_request(Request("x", prompt, max_tokens))


async def test_async_engine_on_manual_clock_matches_latency_model() -> None:
    """The loop spends exactly the modelled time per step (an offline simulator can reuse it)."""
    latency = LatencyModel(
        base_seconds=0.01,
        prefill_seconds_per_token=0.001,
        decode_seconds_per_seq=0.0,
        decode_seconds_per_context_token=0.0,
    )
    clock = ManualClock()
    engine = AsyncEngine(_core(), latency, clock, NullEventPublisher())
    engine.start()
    try:
        req = Request("a", list(range(20)), max_tokens=3, ignore_eos=True)
        queue = engine.submit(req)
        outs = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        assert [o.finished for o in outs] == [False, False, True]
        assert req.first_token_time == pytest.approx(0.01 + 0.020)
        assert req.last_token_time == pytest.approx(0.030 + 2 * 0.01)
    finally:
        await engine.stop()


COMPAT_SCRIPT = Path(__file__).resolve().parents[2] / "compat" / "fixtures" / "vllm-0.32.0" / "script.json"


def _event_trace(events: list) -> list[tuple[str, list[int]]]:
    """(type, uint64 block hashes) per event, from recorded dicts or the simulator's structs."""
    out = []
    for e in events:
        kind = e["type"] if isinstance(e, dict) else type(e).__name__
        hashes = e.get("block_hashes", []) if isinstance(e, dict) else getattr(e, "block_hashes", [])
        out.append((kind, [external_hash_to_int(bytes.fromhex(h["__bytes__"]) if isinstance(h, dict) else h)
                           for h in hashes]))
    return out


@pytest.mark.skipif(not COMPAT_SCRIPT.is_file(), reason="vLLM compat fixtures not recorded")
def test_eviction_order_replays_recorded_vllm_exactly() -> None:
    """The compat script's prompts through the engine core give vLLM 0.32's recorded events, in order.

    ``tests/compat/fixtures/vllm-0.32.0/script.json`` was recorded from real vLLM 0.32 with 24 blocks
    of 32 tokens. Which cached blocks get evicted (``BlockRemoved``) follows from the free-queue
    order (``vllm/v1/core/block_pool.py`` ``free_blocks``: unhashed blocks first, hashed ones last,
    see ``test_sim_prefix_cache.py``). Every block stored in this script is a prompt block, so the
    hashes agree even though the generated tokens differ.
    """
    recorded = json.loads(COMPAT_SCRIPT.read_text())
    core = EngineCore(SchedulerConfig(max_model_len=512), PrefixCache(24, 32))
    for step in recorded:
        expected = _event_trace([e for m in step["messages"] for e in m["payload"][1]])
        if step["request"] is None:  # the reset: vLLM publishes AllBlocksCleared at its next step
            assert core.reset_prefix_cache() and expected == []
            continue
        req = Request(step["name"], step["prompt_token_ids"], step["request"]["max_tokens"], ignore_eos=True)
        _run(core, req)
        assert req.num_cached_tokens == step["response"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert _event_trace(core.cache.take_events()) == expected, step["name"]
