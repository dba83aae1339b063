"""Workload generators: determinism, shared prefixes for shared hash ids, lengths, ordering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh_cli.workloads import (
    FIRST_TOKEN_ID,
    MOONCAKE_BLOCK_TOKENS,
    VOCAB_SIZE,
    MultiTurnParams,
    builtin_workload,
    cap_workload,
    mooncake_workload,
    multi_turn_workload,
    prompt_tokens,
    read_mooncake,
    spread_timestamps,
)

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1030, "output_length": 0, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 4]},
    {"timestamp": 6000, "input_length": 512, "output_length": 7, "hash_ids": [5]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_lengths_and_shared_prefixes(trace: Path) -> None:
    wl = mooncake_workload(read_mooncake(trace))
    prompts = [prompt_tokens(r, wl.seed) for r in wl.requests]
    assert [len(p) for p in prompts] == [r["input_length"] for r in ROWS]
    # rows 0 and 1 share hash ids [0, 1] -> exactly 1024 shared tokens (block 2 vs 3 differ)
    assert common_prefix(prompts[0], prompts[1]) == 2 * MOONCAKE_BLOCK_TOKENS
    # rows 0 and 2 share [0]
    assert common_prefix(prompts[0], prompts[2]) == MOONCAKE_BLOCK_TOKENS
    # row 3 shares nothing with row 0
    assert common_prefix(prompts[0], prompts[3]) < 4
    for p in prompts:
        assert all(FIRST_TOKEN_ID <= t < VOCAB_SIZE for t in p)
    assert [r.max_tokens for r in wl.requests] == [10, 1, 5, 7]  # output 0 -> 1


def test_mooncake_deterministic_and_seeded(trace: Path) -> None:
    rows = read_mooncake(trace)
    a = [prompt_tokens(r, 0) for r in mooncake_workload(rows, seed=0).requests]
    b = [prompt_tokens(r, 0) for r in mooncake_workload(rows, seed=0).requests]
    c = [prompt_tokens(r, 1) for r in mooncake_workload(rows, seed=1).requests]
    assert a == b
    assert a[0] != c[0]


def test_mooncake_caps_keep_prefix(trace: Path) -> None:
    rows = read_mooncake(trace)
    full = mooncake_workload(rows)
    capped = mooncake_workload(rows, max_input_tokens=700, max_output_tokens=6)
    for f, c in zip(full.requests, capped.requests, strict=True):
        pf, pc = prompt_tokens(f, 0), prompt_tokens(c, 0)
        assert len(pc) == min(700, len(pf))
        assert pf[: len(pc)] == pc
        assert c.max_tokens == min(6, f.max_tokens)


def test_read_mooncake_limit_and_errors(trace: Path, tmp_path: Path) -> None:
    assert len(read_mooncake(trace, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_mooncake(bad)


@pytest.mark.parametrize(
    ("stamps", "expected"),
    [
        ([0, 0, 0, 3000], [0.0, 1.0, 2.0, 3.0]),
        ([0, 1000, 1000], [0.0, 1.0, 2.5]),
        ([0, 0, 60000], [0.0, 1.5, 60.0]),
        ([], []),
    ],
    ids=["quantised-step", "last-group-cap", "long-gap-capped", "empty"],
)
def test_spread_timestamps(stamps: list[int], expected: list[float]) -> None:
    assert spread_timestamps(stamps, 3.0) == pytest.approx(expected)


def test_multi_turn_deterministic_count_and_order() -> None:
    a = multi_turn_workload(50, seed=3)
    b = multi_turn_workload(50, seed=3)
    c = multi_turn_workload(50, seed=4)
    assert len(a.requests) == 50
    assert [(r.arrival_s, r.segments, r.max_tokens) for r in a.requests] == [
        (r.arrival_s, r.segments, r.max_tokens) for r in b.requests
    ]
    assert [r.segments for r in a.requests] != [r.segments for r in c.requests]
    arrivals = [r.arrival_s for r in a.requests]
    assert arrivals == sorted(arrivals)
    assert [r.index for r in a.requests] == list(range(50))


def test_multi_turn_turns_extend_previous_prompt_and_answer() -> None:
    p = MultiTurnParams()
    wl = multi_turn_workload(80, seed=1, params=p)
    by_index = {r.index: r for r in wl.requests}
    followers = [r for r in wl.requests if r.after is not None]
    assert followers, "some conversation has a second turn"
    for r in followers:
        assert r.after is not None
        prev = by_index[r.after]
        assert prev.session == r.session and prev.index < r.index
        prev_prompt = prompt_tokens(prev, wl.seed)
        prompt = prompt_tokens(r, wl.seed)
        # previous prompt + its answer (max_tokens long) is a prefix of this prompt
        assert prompt[: len(prev_prompt)] == prev_prompt
        assert len(prompt) > len(prev_prompt) + prev.max_tokens
    for r in wl.requests:
        assert p.answer_tokens_min <= r.max_tokens <= p.answer_tokens_max
        assert r.segments[0].key.startswith("sys:") and r.segments[0].length == p.system_prompt_tokens


def test_multi_turn_system_prompts_are_shared_across_conversations() -> None:
    wl = multi_turn_workload(100, seed=0)
    firsts = [r for r in wl.requests if r.after is None]
    by_sys: dict[str, list[str | None]] = {}
    for r in firsts:
        by_sys.setdefault(r.segments[0].key, []).append(r.session)
    shared = [k for k, v in by_sys.items() if len(v) > 1]
    assert shared
    a, b = [r for r in firsts if r.segments[0].key == shared[0]][:2]
    pa, pb = prompt_tokens(a, 0), prompt_tokens(b, 0)
    assert common_prefix(pa, pb) >= MultiTurnParams().system_prompt_tokens


def test_builtin_unknown_and_invalid() -> None:
    with pytest.raises(ValueError, match="known: agentic, agentic-synthetic, multi-turn"):
        builtin_workload("nope", 10)
    with pytest.raises(ValueError):
        multi_turn_workload(0)


def test_cap_workload_truncates_prompt_and_output() -> None:
    wl = multi_turn_workload(40, seed=0)
    capped = cap_workload(wl, 1500, 40)
    for r, c in zip(wl.requests, capped.requests, strict=True):
        pr, pc = prompt_tokens(r, 0), prompt_tokens(c, 0)
        assert len(pc) == min(1500, len(pr)) and pr[: len(pc)] == pc
        assert c.max_tokens == min(40, r.max_tokens)
        assert (c.after, c.session, c.arrival_s) == (r.after, r.session, r.arrival_s)
