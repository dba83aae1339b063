"""vLLM 0.32's ``long_prefill_token_threshold`` and ``long_prefill_token_threshold_adaptive`` in the simulator.

Matches vLLM 0.32.0 (``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``; ``vllm/config/scheduler.py``;
``vllm/engine/arg_utils.py`` for the flag names). The rule, read from there:

* once per step, before anything is scheduled: ``n = len(running) + len(waiting) + len(kv_holding_waiting)``;
  the cap is the threshold when ``n > 1``, else 0 (a lone request is not capped);
* adaptive: a non-zero cap is raised to ``max_num_batched_tokens // n`` (the whole step's budget);
* the cap applies to RUNNING and WAITING requests alike, before the remaining budget:
  ``if 0 < cap < num_new_tokens: num_new_tokens = cap``, then ``min(num_new_tokens, budget)``;
* validation: the threshold is ``>= 0`` (0 = off, the default) and ``<= max_model_len``.

Every schedule below is derived by hand from that rule, with a 64-token step budget and 4-token blocks; each
step's ``(request id, tokens)`` list is what ``EngineCore.schedule`` must return.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_simulator.config import SimulatorConfig
from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh.config import load_config
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored

B = 4
BUDGET = 64


def _core(threshold: int = 0, adaptive: bool = False, max_num_seqs: int = 8, blocks: int = 256,
          offload: OffloadManager | None = None, block_size: int = B) -> EngineCore:
    return EngineCore(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET, max_model_len=512,
                        long_prefill_token_threshold=threshold, long_prefill_token_threshold_adaptive=adaptive),
        PrefixCache(blocks, block_size, offload=offload),
    )


def _req(rid: str, prompt_len: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [base + 10 + i for i in range(prompt_len)], max_tokens=max_tokens, ignore_eos=True)


def _step(core: EngineCore, now: float = 0.0) -> list[tuple[str, int]]:
    """One step: schedule, apply, and return what was scheduled."""
    step = core.schedule(now)
    core.update(step)
    return [(r.request_id, n) for r, n in step.scheduled]


def test_a_lone_long_prefill_is_not_capped() -> None:
    """One request (running + waiting = 1): vLLM sets the cap to 0, the prefill takes the whole budget."""
    core = _core(threshold=16)
    core.add_request(_req("a", 150))
    assert [_step(core) for _ in range(5)] == [[("a", 64)], [("a", 64)], [("a", 22)], [("a", 1)], [("a", 1)]]


def test_a_newcomer_beside_a_long_running_prefill_starts_at_once_and_both_are_capped() -> None:
    """A 150-token prefill runs alone (64), then B (40 tokens) arrives: from then on both get 16-token chunks
    (A as RUNNING, B as WAITING admitted in the same step), B's first token comes 3 steps later; without the
    threshold B waits for A's prefill to end (FCFS chunked prefill: A takes all 64, then its last 22)."""
    capped = _core(threshold=16)
    capped.add_request(_req("a", 150))
    assert _step(capped) == [("a", 64)]
    b = _req("b", 40, base=1000)
    capped.add_request(b)
    assert [_step(capped) for _ in range(7)] == [
        [("a", 16), ("b", 16)],
        [("a", 16), ("b", 16)],
        [("a", 16), ("b", 8)],  # B's prefill ends: first token sampled
        [("a", 16), ("b", 1)],  # B decodes (1 token, never cut)
        [("a", 16), ("b", 1)],
        [("a", 6), ("b", 1)],  # A's prefill ends (64 + 5 x 16 + 6 = 150); B's 4th token ends it
        [("a", 1)],  # alone again: uncapped (a decode anyway)
    ]
    assert len(b.output_token_ids) == 4

    fcfs = _core()
    fcfs.add_request(_req("a", 150))
    assert _step(fcfs) == [("a", 64)]
    fcfs.add_request(_req("b", 40, base=1000))
    assert [_step(fcfs) for _ in range(3)] == [[("a", 64)], [("a", 22), ("b", 40)], [("a", 1), ("b", 1)]]


def test_the_cap_comes_before_the_remaining_budget() -> None:
    """Threshold 48: A gets 48, B gets min(48, what is left) = 16; a third request gets nothing this step."""
    core = _core(threshold=48)
    for rid, n, base in (("a", 150, 0), ("b", 100, 1000), ("c", 30, 2000)):
        core.add_request(_req(rid, n, base=base))
    assert _step(core) == [("a", 48), ("b", 16)]
    assert _step(core) == [("a", 48), ("b", 16)]
    assert _step(core) == [("a", 48), ("b", 16)]
    assert _step(core) == [("a", 6), ("b", 48), ("c", 10)]


def test_several_newcomers_each_get_a_capped_chunk_in_the_same_step() -> None:
    """Three waiting requests, threshold 20: 20 + 20 + 20 in the first step, each one's prefill started."""
    core = _core(threshold=20)
    for rid, base in (("a", 0), ("b", 1000), ("c", 2000)):
        core.add_request(_req(rid, 50, base=base))
    assert _step(core) == [("a", 20), ("b", 20), ("c", 20)]
    assert _step(core) == [("a", 20), ("b", 20), ("c", 20)]
    assert _step(core) == [("a", 10), ("b", 10), ("c", 10)]


def test_adaptive_floors_the_cap_at_a_fair_share_of_the_whole_budget() -> None:
    """Threshold 8, adaptive: 2 requests -> max(8, 64 // 2) = 32; 3 -> max(8, 21) = 21; a larger threshold
    (40) stays above the floor (32); the floor uses the step's whole budget, not what is left of it."""
    two = _core(threshold=8, adaptive=True)
    two.add_request(_req("a", 150))
    two.add_request(_req("b", 40, base=1000))
    assert _step(two) == [("a", 32), ("b", 32)]
    assert _step(two) == [("a", 32), ("b", 8)]

    three = _core(threshold=8, adaptive=True)
    for rid, base in (("a", 0), ("b", 1000), ("c", 2000)):
        three.add_request(_req(rid, 100, base=base))
    assert _step(three) == [("a", 21), ("b", 21), ("c", 21)]

    high = _core(threshold=40, adaptive=True)
    high.add_request(_req("a", 150))
    high.add_request(_req("b", 40, base=1000))
    assert _step(high) == [("a", 40), ("b", 24)]

    plain = _core(threshold=8)
    plain.add_request(_req("a", 150))
    plain.add_request(_req("b", 40, base=1000))
    assert _step(plain) == [("a", 8), ("b", 8)]


def test_adaptive_alone_changes_nothing() -> None:
    """Adaptive without a threshold: vLLM applies the floor only to a non-zero cap, so nothing is capped."""
    core = _core(threshold=0, adaptive=True)
    core.add_request(_req("a", 150))
    core.add_request(_req("b", 40, base=1000))
    assert _step(core) == [("a", 64)]


def test_waiting_requests_that_cannot_run_still_count() -> None:
    """vLLM counts every waiting request, admissible or not: with ``max_num_seqs`` 1 the second request cannot
    start, yet the running prefill is capped at 16 and 48 tokens of the step stay unused."""
    core = _core(threshold=16, max_num_seqs=1)
    core.add_request(_req("a", 40))
    core.add_request(_req("b", 40, base=1000))
    assert [_step(core) for _ in range(3)] == [[("a", 16)], [("a", 16)], [("a", 8)]]


def test_decode_steps_are_unaffected() -> None:
    """Threshold 1 (the smallest): prefills move 1 token per step, every decode still takes its 1 token."""
    core = _core(threshold=1)
    core.add_request(_req("a", 2, max_tokens=6))
    core.add_request(_req("b", 2, max_tokens=6, base=1000))
    assert [_step(core) for _ in range(6)] == [
        [("a", 1), ("b", 1)], [("a", 1), ("b", 1)],  # prefills, 1 token each
        [("a", 1), ("b", 1)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)],  # decodes
    ]
    step = core.schedule(0.0)
    assert step.decode_seqs == 2 and step.prefill_tokens == 0


@pytest.mark.parametrize("config", [
    {},
    {"long_prefill_token_threshold": 0},
    {"long_prefill_token_threshold": 0, "long_prefill_token_threshold_adaptive": True},
    {"long_prefill_token_threshold": BUDGET},  # a cap at the whole budget never binds
], ids=["default", "zero", "zero-adaptive", "at-budget"])
def test_threshold_zero_is_todays_fcfs_schedule_exactly(config: dict[str, object]) -> None:
    """Off (the default, as vLLM's): the FCFS chunked-prefill schedule, step by step, for a mix of a long
    prefill, a prefix hit (the repeat of ``a``'s first 64 tokens) and short requests arriving later."""
    core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=512,
                                      **config),  # type: ignore[arg-type]
                      PrefixCache(256, B))
    core.add_request(_req("a", 100, max_tokens=3))
    core.add_request(_req("b", 30, max_tokens=2, base=1000))
    steps = [_step(core), _step(core)]
    core.add_request(Request("c", [10 + i for i in range(64)] + [5000, 5001], max_tokens=2, ignore_eos=True))
    steps += [_step(core) for _ in range(3)]
    assert steps == [
        [("a", 64)],
        [("a", 36), ("b", 28)],  # b gets what is left of the budget
        [("a", 1), ("b", 2), ("c", 2)],  # c: 64 cached tokens (16 blocks), 2 to compute
        [("a", 1), ("b", 1), ("c", 1)],  # the last tokens of all three
        [],
    ]
    assert core.prefix_hits_tokens == 64


def test_waiting_requests_loading_from_an_offloaded_tier_count() -> None:
    """A request loading its prefix from the CPU tier (vLLM's WAITING_FOR_REMOTE_KVS, held in
    ``kv_holding_waiting``) counts: the running prefill stays capped at 16 while the load is in flight."""
    bs = 16
    off = OffloadManager(OffloadConfig(mode=OffloadMode.CPU, cpu_capacity_blocks=64, bytes_per_block=1_000_000,
                                       pcie_bandwidth=1e9, load_latency_seconds=0.0), bs, "m")
    prefix = list(range(100, 100 + 4 * bs))
    hashes: list[int | bytes] = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(prefix, bs)]
    off.store(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=prefix, block_size=bs, medium="GPU",
                          extra_keys=[None] * len(hashes)))
    off.advance(1.0)
    core = _core(threshold=16, offload=off, block_size=bs, blocks=64)
    loaded = Request("l", [*prefix, 7, 8, 9], max_tokens=1, ignore_eos=True)
    core.add_request(loaded)
    core.add_request(_req("a", 150, base=5000))
    assert _step(core, 1.0) == [("a", 16)]  # l started its load (4 blocks, 4 ms), a was capped: 2 eligible
    assert core.loading == [loaded]
    assert _step(core, 1.001) == [("a", 16)]  # running a + loading l = 2: still capped
    assert _step(core, 1.01) == [("a", 16), ("l", 3)]  # load done: l computes its 3-token tail


def test_reserve_full_isl_admits_a_request_only_when_its_whole_prompt_fits() -> None:
    """vLLM 0.32's ``scheduler_reserve_full_isl`` (its default): a 30-block pool (29 usable), A (300 tokens, 19 blocks)
    prefilling; B (250 tokens, 16 blocks) arrives. First-chunk admission (``false``) starts B with the
    20 tokens left in step 5 (2 blocks free for its chunk); full-ISL admission waits until A has finished and
    freed its blocks (10 free < 16 needed before). Both schedules are vLLM 0.32's (tests/compat cross-check)."""
    def run(reserve: bool) -> list[list[tuple[str, int]]]:
        core = EngineCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=512,
                                          scheduler_reserve_full_isl=reserve), PrefixCache(30, 16))
        core.add_request(_req("a", 300, max_tokens=2))
        out = [_step(core)]
        core.add_request(_req("b", 250, max_tokens=2, base=1000))
        return out + [_step(core) for _ in range(6)]

    assert run(False) == [[("a", 64)]] * 4 + [[("a", 44), ("b", 20)], [("a", 1), ("b", 63)], [("b", 64)]]
    assert run(True) == [[("a", 64)]] * 4 + [[("a", 44)], [("a", 1)], [("b", 64)]]


def test_scheduler_config_validates_like_vllm() -> None:
    """``ge=0``; above ``max_model_len`` is refused with vLLM's message; equal is accepted."""
    with pytest.raises(ValueError, match="must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match=r"cannot be greater than the max_model_len \(512\)"):
        SchedulerConfig(max_model_len=512, long_prefill_token_threshold=513)
    assert SchedulerConfig(max_model_len=512, long_prefill_token_threshold=512).long_prefill_token_threshold == 512
    assert SchedulerConfig(64, 2048, 131072).long_prefill_token_threshold == 0  # positional limits unchanged


def test_simulator_flags_carry_vllms_names_defaults_and_validation(tmp_path: Path) -> None:
    """``--long-prefill-token-threshold`` and ``--long-prefill-token-threshold-adaptive`` (a true/false value here);
    off by default; a threshold above the effective ``max_model_len`` (cut to the KV pool) exits with usage 2."""
    from engine_simulator.app import build_service

    defaults = SimulatorConfig()
    assert defaults.long_prefill_token_threshold == 0 and defaults.long_prefill_token_threshold_adaptive is False
    assert defaults.scheduler_reserve_full_isl is True and SchedulerConfig().scheduler_reserve_full_isl is True
    cfg = load_config(SimulatorConfig, ["--long-prefill-token-threshold", "512",
                                        "--long-prefill-token-threshold-adaptive", "true",
                                        "--tokenizer-path", str(tmp_path), "--etcd-endpoints", ""])
    assert cfg.long_prefill_token_threshold == 512 and cfg.long_prefill_token_threshold_adaptive is True
    core = build_service(cfg).core
    assert core.config.long_prefill_token_threshold == 512 and core.config.long_prefill_token_threshold_adaptive
    for argv in (["--long-prefill-token-threshold", "-1"],
                 ["--max-model-len", "256", "--long-prefill-token-threshold", "257"],
                 ["--num-gpu-blocks", "9", "--block-size-tokens", "16", "--long-prefill-token-threshold", "129"]):
        with pytest.raises(SystemExit) as exc:
            load_config(SimulatorConfig, argv)
        assert exc.value.code == 2


def test_mesh_gives_every_simulated_engine_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MeshSpec.long_prefill_token_threshold[_adaptive]`` -> each engine's command line, which the simulator parses
    back to the same settings; unset, no flag is passed (the engine's defaults: threshold off, full-ISL reservation on,
    as vLLM 0.32)."""
    from kvmesh_cli.mesh import Mesh, MeshSpec

    monkeypatch.setattr(Mesh, "_spawn", lambda self, member, ports: None)

    def engine_config(spec: MeshSpec) -> SimulatorConfig:
        argv = Mesh(spec)._engine(0, "tcp://127.0.0.1:1", tmp_path).argv({})  # type: ignore[misc]
        assert argv[1:3] == ["-m", "engine_simulator"]
        return load_config(SimulatorConfig, argv[3:])

    on = engine_config(MeshSpec(run_dir=tmp_path, long_prefill_token_threshold=512,
                                long_prefill_token_threshold_adaptive=True, scheduler_reserve_full_isl=False))
    assert on.long_prefill_token_threshold == 512 and on.long_prefill_token_threshold_adaptive is True
    assert on.scheduler_reserve_full_isl is False
    off = engine_config(MeshSpec(run_dir=tmp_path))
    assert off.long_prefill_token_threshold == 0 and off.long_prefill_token_threshold_adaptive is False
    assert off.scheduler_reserve_full_isl is True  # vLLM 0.32's default (vllm/config/scheduler.py)


def test_real_vllm_gets_vllms_own_spelling(tmp_path: Path) -> None:
    """``--engine vllm``: ``--long-prefill-token-threshold N`` and the bare switch
    ``--long-prefill-token-threshold-adaptive`` (vLLM 0.32 ``arg_utils.py``: a BooleanOptionalAction)."""
    from kvmesh_cli.vllm_engine import VllmEngineSpec

    argv = VllmEngineSpec(port=1, run_dir=tmp_path, events_endpoint="", long_prefill_token_threshold=256,
                          long_prefill_token_threshold_adaptive=True, scheduler_reserve_full_isl=False).argv()
    assert argv[argv.index("--long-prefill-token-threshold") + 1] == "256"
    assert "--long-prefill-token-threshold-adaptive" in argv and "--no-scheduler-reserve-full-isl" in argv
    plain = VllmEngineSpec(port=1, run_dir=tmp_path, events_endpoint="").argv()
    assert not any(a.startswith(("--long-prefill", "--scheduler-reserve", "--no-scheduler")) for a in plain)


@pytest.mark.parametrize("command", ["up", "compare"])
def test_cli_takes_the_threshold_and_refuses_one_above_the_context(command: str) -> None:
    """``kvmesh up|compare --long-prefill-token-threshold`` is checked against the engines' context before a mesh
    starts (vLLM refuses to start with a threshold above ``max_model_len``)."""
    from typer.testing import CliRunner

    from kvmesh_cli.main import app, engine_scheduler, engine_scheduler_label

    result = CliRunner().invoke(app, [command, "--num-gpu-blocks", "9", "--block-size-tokens", "16",
                                      "--long-prefill-token-threshold", "200"])
    assert result.exit_code == 2 and "long-prefill-token-threshold" in result.output
    assert "--long-prefill-token-threshold-adaptive" in CliRunner().invoke(app, [command, "--help"],
                                                                           env={"COLUMNS": "240"}).output
    settings = engine_scheduler(512, True, 16_000)
    assert settings == {"long_prefill_token_threshold": 512, "long_prefill_token_threshold_adaptive": True,
                        "scheduler_reserve_full_isl": True}
    assert engine_scheduler_label(settings) == ", long_prefill_token_threshold 512 (adaptive)"
    assert engine_scheduler(None, False, 16_000)["long_prefill_token_threshold"] == 0
    assert engine_scheduler_label(engine_scheduler(None, False, 16_000)) == ""
    assert engine_scheduler_label(engine_scheduler(None, False, 16_000, True)) == ""
    assert engine_scheduler_label(engine_scheduler(None, False, 16_000, False)) == ", no scheduler_reserve_full_isl"
