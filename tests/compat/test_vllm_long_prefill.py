"""The simulator's ``long_prefill_token_threshold[_adaptive]`` against vLLM 0.32.0's own ``Scheduler``, step by step.

vLLM's v1 scheduler (``vllm/v1/core/sched/scheduler.py``) is driven in process by
``tests/compat/vllm_long_prefill_schedule.py`` in the vLLM venv (no model runs, nothing is downloaded; the tiny
model's ``config.json`` from ``make model`` feeds ``ModelConfig``); the same scenarios run on the simulator's
``EngineCore``, and every step's scheduled tokens per request must be equal. Scenarios: the hand-derived cases
of ``tests/unit/engine_simulator/test_long_prefill_threshold.py`` plus seeded random mixes (arrivals over time,
prompts of 1-300 tokens, shared prefixes, thresholds 0-64, adaptive on and off, a pool small enough to preempt,
``scheduler_reserve_full_isl`` on (vLLM's default) and off: the simulator's default is off, see
``SchedulerConfig``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
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
                     max_num_seqs=rng.choice([1, 2, 8]), num_blocks=rng.choice([40, 256]),
                     reserve_full_isl=rng.random() < 0.5)


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
}


def _simulate(scenario: dict[str, Any]) -> list[list[tuple[str, int]]]:
    core = EngineCore(SchedulerConfig(
        max_num_seqs=scenario["max_num_seqs"], max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_model_len=scenario["max_model_len"], long_prefill_token_threshold=scenario["long_prefill_token_threshold"],
        long_prefill_token_threshold_adaptive=scenario["long_prefill_token_threshold_adaptive"],
        scheduler_reserve_full_isl=scenario["scheduler_reserve_full_isl"],
    ), PrefixCache(scenario["num_blocks"], scenario["block_size"]))
    pending = sorted(scenario["requests"], key=lambda r: r[0])
    steps: list[list[tuple[str, int]]] = []
    for step in range(scenario["steps"]):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            core.add_request(Request(rid, list(prompt), max_tokens=max_tokens, ignore_eos=True,
                                     arrival_time=float(step)))
        out = core.schedule(float(step))
        core.update(out)
        steps.append([(r.request_id, n) for r, n in out.scheduled])
    return steps


@pytest.fixture(scope="module")
def vllm_schedules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[tuple[str, int]]]]:
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
    return {name: [[(rid, n) for rid, n in step] for step in steps]
            for name, steps in zip(SCENARIOS, reply["results"], strict=True)}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulator_schedules_like_vllm(name: str, vllm_schedules: dict[str, list[list[tuple[str, int]]]]) -> None:
    """Per step, the same requests get the same number of tokens (order: running first, then new)."""
    expected = vllm_schedules[name]
    got = _simulate(SCENARIOS[name])
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert dict(have) == dict(want), f"step {i}: simulator {have} vs vLLM {want}"
    assert any(expected), "the scenario scheduled nothing"


def test_the_threshold_changes_vllms_schedule(vllm_schedules: dict[str, list[list[tuple[str, int]]]]) -> None:
    """A guard that the vLLM side really ran with the threshold: B starts in the step after it arrives."""
    assert vllm_schedules["newcomer-beside-long-prefill"][1] == [("a", 16), ("b", 16)]
    assert vllm_schedules["lone-long-prefill"][0] == [("a", 64)]
