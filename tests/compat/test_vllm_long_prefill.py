"""The simulator's scheduler (``long_prefill_token_threshold[_adaptive]``, ``scheduler_reserve_full_isl``, loads from
an offloaded tier) against vLLM 0.32.0's own ``Scheduler``, step by step.

vLLM's v1 scheduler (``vllm/v1/core/sched/scheduler.py``) is driven in process by
``tests/compat/vllm_long_prefill_schedule.py`` in the vLLM venv (no model runs, nothing is downloaded; the tiny
model's ``config.json`` from ``make model`` feeds ``ModelConfig``); the same scenarios run on the simulator's
``EngineCore``, and every step's scheduled tokens per request must be equal, and so must the request counts after
each step that vLLM's ``SchedulerStats`` carries to its gauges (``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and its ``reason="deferred"`` part) against the simulator's ``num_running``,
``num_waiting`` and ``num_deferred`` (what ``engine_simulator/engine.py`` exports after each step). Scenarios: the hand-derived cases
of ``tests/unit/engine_simulator/test_long_prefill_threshold.py`` plus seeded random mixes (arrivals over time,
prompts of 1-300 tokens, shared prefixes, thresholds 0-64, adaptive on and off, a pool small enough to preempt,
``scheduler_reserve_full_isl`` mostly on (vLLM's default and the simulator's) and sometimes off), and scenarios
with loads from an offloaded tier: on the vLLM side a scripted KV connector (``ScriptedOffloadConnector`` in the
driver) reports the offloaded blocks as vLLM's OffloadingConnector would and each load as received
``load_steps`` steps after it started; on the simulator side the real ``OffloadManager`` holds the same blocks
(its stores of newly computed blocks switched off, as the scripted tier takes none) with a load time of
``load_steps - 0.5`` model seconds at one step per second. This checks vLLM's admission of async loads
(``full_sequence_must_fit``, ``reserved_blocks`` from ``_inflight_prefill_reserved_blocks``, ``kv_holding_waiting``
drained first); the transfer itself (timing, tiers) is the simulator's own model, tested in
``tests/unit/engine_simulator/test_sim_offload.py``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored
from kvmesh_cli.vllm_engine import tiny_model_dir, vllm_python

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("vllm_long_prefill_schedule.py")
BS = 16


def _prompt(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def _scenario(requests: list[list[Any]], threshold: int, adaptive: bool = False, *, steps: int = 40,
              max_num_seqs: int = 8, budget: int = 64, num_blocks: int = 256,
              reserve_full_isl: bool = True) -> dict[str, Any]:
    return {"block_size": BS, "num_blocks": num_blocks, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget, "max_model_len": 512, "long_prefill_token_threshold": threshold,
            "long_prefill_token_threshold_adaptive": adaptive, "scheduler_reserve_full_isl": reserve_full_isl,
            "requests": requests, "steps": steps}


def _random_scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    shared = _prompt(50_000, 96)  # a common prefix some requests start with (prefix-cache hits)
    requests = []
    for k in range(rng.randint(2, 7)):
        n = rng.randint(1, 300)
        prompt = (shared[: rng.choice([16, 48, 96])] + _prompt(1000 * (k + 1), n)) if rng.random() < 0.3 \
            else _prompt(1000 * (k + 1), n)
        requests.append([rng.randint(0, 12), f"r{k}", prompt[:400], rng.randint(1, 8)])
    return _scenario(requests, rng.choice([0, 1, 8, 16, 24, 40, 64]), rng.random() < 0.4, steps=60,
                     max_num_seqs=rng.choice([1, 2, 8]), num_blocks=rng.choice([28, 40, 256]),
                     reserve_full_isl=rng.random() < 0.75)


def _offload_scenario(requests: list[list[Any]], offloaded: list[list[int]], load_steps: int, *,
                      num_blocks: int, reserve_full_isl: bool = True, threshold: int = 0,
                      steps: int = 40, max_num_seqs: int = 8) -> dict[str, Any]:
    return {**_scenario(requests, threshold, steps=steps, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                        reserve_full_isl=reserve_full_isl), "offloaded": offloaded, "load_steps": load_steps}


def _random_offload_scenario(seed: int) -> dict[str, Any]:
    """Sessions sharing prefixes, some of them offloaded (loads of 1-3 steps), arrivals over time, tight pools."""
    rng = random.Random(1000 + seed)
    prefixes = [_prompt(100_000 * (k + 1), rng.choice([32, 64, 96, 160])) for k in range(3)]
    offloaded = [p[: rng.choice([16, 48, len(p)])] for p in prefixes if rng.random() < 0.8]
    requests = []
    for k in range(rng.randint(2, 7)):
        prompt = rng.choice(prefixes) + _prompt(1000 * (k + 1), rng.randint(1, 120)) if rng.random() < 0.75 \
            else _prompt(1000 * (k + 1), rng.randint(1, 200))
        requests.append([rng.randint(0, 10), f"r{k}", prompt[:400], rng.randint(1, 6)])
    return _offload_scenario(requests, offloaded, rng.randint(1, 3), num_blocks=rng.choice([20, 28, 40, 256]),
                             reserve_full_isl=rng.random() < 0.75, threshold=rng.choice([0, 0, 16, 48]),
                             steps=60, max_num_seqs=rng.choice([2, 8]))


SCENARIOS: dict[str, dict[str, Any]] = {
    "lone-long-prefill": _scenario([[0, "a", _prompt(10, 150), 4]], 16),
    "newcomer-beside-long-prefill": _scenario([[0, "a", _prompt(10, 150), 4], [1, "b", _prompt(1010, 40), 4]], 16),
    "cap-before-budget": _scenario([[0, "a", _prompt(10, 150), 2], [0, "b", _prompt(1010, 100), 2],
                                    [0, "c", _prompt(2010, 30), 2]], 48),
    "adaptive-three": _scenario([[0, r, _prompt(1000 * k, 100), 2] for k, r in enumerate("abc")], 8, True),
    "adaptive-high": _scenario([[0, "a", _prompt(10, 150), 2], [0, "b", _prompt(1010, 40), 2]], 40, True),
    "waiting-cannot-run": _scenario([[0, "a", _prompt(10, 40), 2], [0, "b", _prompt(1010, 40), 2]], 16,
                                    max_num_seqs=1),
    "decode-threshold-1": _scenario([[0, "a", _prompt(10, 2), 6], [0, "b", _prompt(1010, 2), 6]], 1),
    "off-prefix-hit": _scenario([[0, "a", _prompt(10, 100), 3], [0, "b", _prompt(1010, 30), 2],
                                 [2, "c", _prompt(10, 64) + [5000, 5001], 2]], 0),
    "capped-prefix-hit": _scenario([[0, "a", _prompt(10, 300), 3], [3, "c", _prompt(10, 64) + _prompt(7000, 50), 2]],
                                   16),
    "tight-pool-full-isl": _scenario([[0, "a", _prompt(10, 300), 2], [1, "b", _prompt(1010, 250), 2]], 0,
                                     num_blocks=30),
    "tight-pool-first-chunk": _scenario([[0, "a", _prompt(10, 300), 2], [1, "b", _prompt(1010, 250), 2]], 0,
                                        num_blocks=30, reserve_full_isl=False),
    **{f"random-{seed}": _random_scenario(seed) for seed in range(40)},
    # loads from an offloaded tier (the cases of tests/unit/engine_simulator/test_sim_offload.py, then random mixes)
    **{f"offload-loads-would-wait-on-each-other-{'full-isl' if on else 'first-chunk'}": _offload_scenario(
        [[0, "x", _prompt(1000, 80) + _prompt(50_000, 67), 1], [0, "y", _prompt(2000, 80) + _prompt(60_000, 67), 1]],
        [_prompt(1000, 80), _prompt(2000, 80)], 1, num_blocks=12, reserve_full_isl=on) for on in (True, False)},
    "offload-reservation": _offload_scenario(
        [[0, "x", _prompt(1000, 14 * BS + 3), 1], [0, "y", _prompt(2000, 9 * BS + 3), 1]],
        [_prompt(1000, 2 * BS), _prompt(2000, 9 * BS)], 2, num_blocks=21),
    "offload-fresh-request-not-reserved": _offload_scenario(
        [[0, "x", _prompt(1000, 14 * BS + 3), 1], [0, "z", _prompt(7000, 4 * BS + 3), 1]],
        [_prompt(1000, 2 * BS)], 2, num_blocks=21),
    "offload-loaded-prefix-stops-the-queue": _offload_scenario(
        [[0, "x", _prompt(1000, 2 * BS) + _prompt(9000, 3 * BS + 3), 1], [0, "w", _prompt(3000, 5 * BS), 3],
         [1, "v", _prompt(5000, 10), 1]], [_prompt(1000, 2 * BS)], 1, num_blocks=9),
    "offload-threshold-and-loads": _offload_scenario(
        [[0, "a", _prompt(10, 300), 2], [1, "b", _prompt(1000, 96) + _prompt(8000, 40), 2],
         [2, "c", _prompt(1000, 96) + _prompt(9000, 20), 2]], [_prompt(1000, 96)], 2, num_blocks=40, threshold=16),
    **{f"offload-random-{seed}": _random_offload_scenario(seed) for seed in range(30)},
}


def _offload(scenario: dict[str, Any]) -> OffloadManager | None:
    """The simulator's CPU tier holding the scenario's offloaded prefixes; loads take ``load_steps - 0.5`` s."""
    if "offloaded" not in scenario:
        return None
    bs = scenario["block_size"]
    off = OffloadManager(OffloadConfig(mode=OffloadMode.CPU, cpu_capacity_blocks=100_000, bytes_per_block=1,
                                       pcie_bandwidth=1e12, load_latency_seconds=scenario["load_steps"] - 0.5),
                         bs, "m")
    for prefix in scenario["offloaded"]:
        hashes: list[int | bytes] = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(prefix, bs)]
        off.store(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(prefix), block_size=bs,
                              medium="GPU", extra_keys=[None] * len(hashes)))
    while (done := off.next_store_done()) is not None:  # the stores complete; model time then restarts at step 0
        off.advance(done)
    off.take_events()
    off.store = lambda stored: None  # type: ignore[method-assign]  # the scripted tier on the vLLM side takes no stores
    return off


def _simulate(scenario: dict[str, Any]) -> tuple[list[list[tuple[str, int]]], list[list[int]]]:
    """Each step's ``(request_id, tokens)`` and ``[running, waiting, deferred]`` after it."""
    core = EngineCore(SchedulerConfig(
        max_num_seqs=scenario["max_num_seqs"], max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_model_len=scenario["max_model_len"], long_prefill_token_threshold=scenario["long_prefill_token_threshold"],
        long_prefill_token_threshold_adaptive=scenario["long_prefill_token_threshold_adaptive"],
        scheduler_reserve_full_isl=scenario["scheduler_reserve_full_isl"],
    ), PrefixCache(scenario["num_blocks"], scenario["block_size"], offload=_offload(scenario)))
    pending = sorted(scenario["requests"], key=lambda r: r[0])
    steps: list[list[tuple[str, int]]] = []
    counts: list[list[int]] = []
    for step in range(scenario["steps"]):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            core.add_request(Request(rid, list(prompt), max_tokens=max_tokens, ignore_eos=True,
                                     arrival_time=float(step)))
        out = core.schedule(float(step))
        core.update(out)
        steps.append([(r.request_id, n) for r, n in out.scheduled])
        counts.append([core.num_running, core.num_waiting, core.num_deferred])
    return steps, counts


@pytest.fixture(scope="module")
def vllm_reply(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("vllm-sched")
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CACHE_ROOT": str(home / "cache"),
           "HF_HOME": str(home / "hf"), "TMPDIR": str(home)}
    doc = {"model_dir": str(tiny_model_dir()), "scenarios": list(SCENARIOS.values())}
    proc = subprocess.run([str(vllm_python()), str(SCRIPT)], input=json.dumps(doc), capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reply = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reply["vllm_version"] == "0.32.0"
    return reply


@pytest.fixture(scope="module")
def vllm_schedules(vllm_reply: dict[str, Any]) -> dict[str, list[list[tuple[str, int]]]]:
    return {name: [[(rid, n) for rid, n in step] for step in steps]
            for name, steps in zip(SCENARIOS, vllm_reply["results"], strict=True)}


@pytest.fixture(scope="module")
def vllm_counts(vllm_reply: dict[str, Any]) -> dict[str, list[list[int]]]:
    return dict(zip(SCENARIOS, vllm_reply["counts"], strict=True))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulator_schedules_like_vllm(name: str, vllm_schedules: dict[str, list[list[tuple[str, int]]]]) -> None:
    """Per step, the same requests get the same number of tokens (order: running first, then new)."""
    expected = vllm_schedules[name]
    got, _ = _simulate(SCENARIOS[name])
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert dict(have) == dict(want), f"step {i}: simulator {have} vs vLLM {want}"
    assert any(expected), "the scenario scheduled nothing"


def test_the_threshold_changes_vllms_schedule(vllm_schedules: dict[str, list[list[tuple[str, int]]]]) -> None:
    """A guard that the vLLM side really ran with the threshold: B starts in the step after it arrives."""
    assert vllm_schedules["newcomer-beside-long-prefill"][1] == [("a", 16), ("b", 16)]
    assert vllm_schedules["lone-long-prefill"][0] == [("a", 64)]


def test_vllms_side_really_loads_and_reserves(vllm_schedules: dict[str, list[list[tuple[str, int]]]]) -> None:
    """A guard that the scripted connector's loads ran on the vLLM side: x waits its 2 load steps before its first
    chunk; y's load (refused while x is in flight by ``reserved_blocks`` alone, full-ISL off) starts only after x
    has finished, and its own load step shows as an empty step."""
    assert vllm_schedules["offload-reservation"][:3] == [[], [], [("x", 64)]]
    assert vllm_schedules["offload-loads-would-wait-on-each-other-first-chunk"][:6] == [
        [], [("x", 64)], [("x", 3)], [], [("y", 64)], [("y", 3)]]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulator_counts_requests_like_vllm(name: str, vllm_counts: dict[str, list[list[int]]]) -> None:
    """Per step, ``[running, waiting, deferred]`` after the step equal vLLM's ``SchedulerStats`` (the gauges
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``..._waiting_by_reason{reason="deferred"}``)."""
    _, got = _simulate(SCENARIOS[name])
    for i, (want, have) in enumerate(zip(vllm_counts[name], got, strict=True)):
        assert have == want, f"step {i}: simulator [running, waiting, deferred] {have} vs vLLM {want}"


def test_vllm_counts_loads_in_flight_as_waiting(vllm_counts: dict[str, list[list[int]]]) -> None:
    """A guard that the count check covers loads in flight: in ``offload-reservation`` after step 0 (nothing
    scheduled) x's load is in flight (``WAITING_FOR_REMOTE_KVS``) and y waits, its load refused by the reservation;
    vLLM's ``vllm:num_requests_waiting`` is 2, x being its ``deferred`` part (the simulator before this check said 1)."""
    assert vllm_counts["offload-reservation"][0] == [0, 2, 1]
    assert any(deferred > 0 for steps in vllm_counts.values() for _, _, deferred in steps)
