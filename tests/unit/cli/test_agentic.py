"""Agentic sessions (kv-cache-tester format), the synthetic generator, load scaling, the oracle hit rate and
the exact text form of prompts.

The trace fixture follows the kv-cache-tester schema (callanjfox/kv-cache-tester @ 94f6046d, ``traces/*.json``:
``block_size`` 64, requests with ``t``/``in``/``out``/``hash_ids``/``think_time``/``api_time``, ``type:
"subagent"`` entries nesting their own ``requests``)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine_simulator.tokenizer import ensure_tokenizer
from kvmesh_cli.workloads import (
    AgenticParams,
    Segment,
    Workload,
    WorkloadError,
    WorkloadRequest,
    agentic_workload,
    block_keys,
    load_workload,
    oracle_hits,
    prompt_tokens,
    read_agentic,
    request_text,
    request_token_ids,
    scale_load,
    synthetic_agentic_sessions,
    word_vocabulary,
)


def call(t: float, n_blocks: int, out: int, think: float, api: float, first_id: int = 1, tail: int = 10) -> dict:
    return {"t": t, "type": "n", "model": "m", "in": 64 * n_blocks + tail, "out": out,
            "hash_ids": list(range(first_id, first_id + n_blocks)), "think_time": think, "api_time": api}


TRACE = {
    "id": "trace_0001", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
    "requests": [
        call(0.0, 4, 20, 0.0, 5.0),
        {"t": 7.0, "type": "subagent", "agent_id": "a1", "requests": [call(0.0, 2, 8, 0.0, 1.0, first_id=100),
                                                                      call(3.0, 3, 8, 2.0, 1.0, first_id=100)]},
        call(10.0, 6, 30, 5.0, 4.0),
        call(20.0, 8, 40, 6.0, 3.0),
    ],
}


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    path = tmp_path / "traces.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, doc in (("traces/trace_0001.json", TRACE), ("traces/trace_0002.json", {**TRACE, "id": "t2"})):
            data = json.dumps(doc).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_read_agentic_from_archive_unpacks_once_under_run(archive: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sessions = read_agentic(archive)
    assert [s.name for s in sessions] == ["trace_0001", "trace_0002"]
    s = sessions[0]
    assert [c.t for c in s.calls] == [0.0, 10.0, 20.0] and s.calls[1].think_s == 5.0
    assert len(s.subagents) == 1 and s.subagents[0][:2] == (7.0, 0) and len(s.subagents[0][2]) == 2
    assert list((tmp_path / ".run" / "cache" / "traces").rglob("trace_0001.json"))
    assert read_agentic(archive, limit=1)[0].name == "trace_0001"  # the cached copy


def test_agentic_closed_loop_chain_and_subagent(archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    wl = agentic_workload(read_agentic(archive, limit=1), params=AgenticParams(block_tokens=16, session_gap_s=0))
    reqs = wl.requests
    assert len(reqs) == 5
    parents = [r for r in reqs if all(":s" not in s.key for s in r.segments)]
    # each parent call is closed loop on the previous one, with the recorded think time
    assert parents[0].after is None and parents[0].think_s is None
    assert [p.think_s for p in parents[1:]] == [5.0, 6.0]
    assert parents[1].after == parents[0].index and parents[2].after == parents[1].index
    # 64-token blocks became 16 tokens; the 10-token tail 2 (round(2.5))
    assert parents[0].input_length == 4 * 16 + 2
    # sub-agent: follows parent call 0, after its recorded gap (7 - 0 - 5 = 2 s), then its own think times
    subs = [r for r in reqs if r not in parents]
    assert subs[0].after == parents[0].index and subs[0].think_s == pytest.approx(2.0)
    assert subs[1].after == subs[0].index and subs[1].think_s == 2.0
    # a later call of the same agent extends the earlier one's prompt
    assert prompt_tokens(parents[1], 0)[: 4 * 16] == prompt_tokens(parents[0], 0)[: 4 * 16]
    assert all(r.after is None or r.after < r.index for r in reqs)


def test_not_a_trace_is_a_workload_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"requests": [{"t": 0}]}))
    with pytest.raises(WorkloadError) as err:
        load_workload(bad, "agentic", 10, 0, None, 64)
    assert err.value.option == "--trace" and "x" in str(err.value)


def test_synthetic_sessions_are_agentic_shaped_and_deterministic() -> None:
    a = synthetic_agentic_sessions(6, seed=1)
    assert a == synthetic_agentic_sessions(6, seed=1) and a != synthetic_agentic_sessions(6, seed=2)
    for s in a:
        lens = [c.input_tokens // 64 for c in s.calls]
        assert lens == sorted(lens) and lens[0] >= 250  # prompts only grow
        for prev, nxt in zip(s.calls, s.calls[1:], strict=False):
            assert nxt.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
    wl = load_workload(None, "agentic-synthetic", 200, 0, None, 256)
    assert len(wl.requests) == 200 and wl.name == "agentic-synthetic"
    hits, queries = oracle_hits(wl.requests, 64)
    assert 0.5 < hits / queries < 1.0


def test_scale_load_divides_arrivals_and_think() -> None:
    r0 = WorkloadRequest(0, 10.0, (Segment("a", 4),), 1, "s")
    r1 = WorkloadRequest(1, 20.0, (Segment("a", 8),), 1, "s", after=0, think_s=6.0)
    wl = scale_load(Workload("w", [r0, r1], 0), 2.0)
    assert [r.arrival_s for r in wl.requests] == [5.0, 10.0] and wl.requests[1].think_s == 3.0
    with pytest.raises(ValueError):
        scale_load(wl, 0)


def test_oracle_counts_prefix_blocks_once_and_never_the_last_token() -> None:
    a = WorkloadRequest(0, 0, (Segment("x", 127),), 1)  # 128 tokens with <s>: 2 blocks of 64
    b = WorkloadRequest(1, 0, (Segment("x", 127), Segment("y", 64)), 1)  # shares both, adds one
    c = WorkloadRequest(2, 0, (Segment("x", 127),), 1)  # all cached, but the last token is computed
    d = WorkloadRequest(3, 0, (Segment("z", 1), Segment("x", 126)), 1)  # same length, other first block
    assert oracle_hits([a], 64) == (0, 128)
    assert oracle_hits([a, b], 64) == (128, 128 + 192)
    assert oracle_hits([a, c], 64) == (64, 256)  # (128 - 1) // 64 = 1 block may hit
    assert oracle_hits([a, d], 64)[0] == 0
    assert block_keys(a, 64) == block_keys(c, 64) and block_keys(a, 64)[0] != block_keys(d, 64)[0]


def test_text_prompt_tokenizes_to_the_token_ids() -> None:
    tok = Tokenizer.from_file(str(ensure_tokenizer(None) / "tokenizer.json"))
    assert len(word_vocabulary()) > 500
    req = WorkloadRequest(0, 0, (Segment("sys", 300), Segment("user", 77)), 1)
    ids = request_token_ids(req, 5)
    assert ids[0] == 1 and len(ids) == req.input_length + 1
    assert tok.encode(request_text(req, 5)).ids == ids
