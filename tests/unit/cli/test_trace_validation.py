"""Trace rows out of range are refused with file and line (or file and call), as malformed rows are.

What each field may legitimately be comes from the traces' own documentation
(``../shared/data/traces/README.md``: Mooncake FAST'25 release, kv-cache-tester's README): lengths of
prompts >= 1 token, outputs >= 0 tokens (kv-cache-tester records calls that generated nothing: replayed as
1 token, the least an engine generates), times and block ids >= 0. The CLI reads these two formats; the
Azure CSV is read only by ``bench/flow_control_fairness.py`` from its fixed file, ServeGen by nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvmesh_cli import main as cli
from kvmesh_cli.workloads import mooncake_workload, parse_agentic, read_agentic, read_mooncake

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("input_length", -5, "input_length -5 is below 1"),
        ("input_length", 0, "input_length 0 is below 1"),
        ("output_length", -1, "output_length -1 is below 0"),
        ("timestamp", -1, "timestamp -1 is below 0"),
        ("hash_ids", [0, -3], r"hash_ids\[1\] -3 is below 0"),
        ("hash_ids", 7, "hash_ids 7 is not a list"),
        ("input_length", 5.5, "input_length 5.5 is not a whole number"),
        ("output_length", True, "output_length True is not a whole number"),
        ("timestamp", "0", "timestamp '0' is not a whole number"),
    ],
)
def test_a_mooncake_row_out_of_range_names_file_line_and_field(
    tmp_path: Path, field: str, value: object, says: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, field: value}) + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: not a Mooncake trace row \({says}\)"):
        read_mooncake(trace)


def test_a_recorded_empty_output_and_whole_floats_are_legal(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({**GOOD, "output_length": 0, "timestamp": 12.0}) + "\n")
    rows = read_mooncake(trace)
    assert (rows[0].timestamp_ms, rows[0].output_length) == (12, 0)
    assert mooncake_workload(rows).requests[0].max_tokens == 1


def test_compare_and_replay_refuse_the_fresh_users_row_naming_file_and_line(tmp_path: Path) -> None:
    """The reported case: exit 0 and a table of nothing before; now the usage error (exit 2) naming the row."""
    trace = tmp_path / "f.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": -5, "output_length": 0, "hash_ids": []}\n')
    runner = CliRunner()
    for argv in (["compare", "--trace", str(trace), "--run-dir", str(tmp_path / "run")],
                 ["replay", "--trace", str(trace), "--router", "http://127.0.0.1:1"]):
        result = runner.invoke(cli.app, argv)
        text = " ".join(result.output.replace("│", "").split())
        assert result.exit_code == 2, (argv, text)
        assert re.search(r"f\.jsonl:1: not a Mooncake trace row \(input_length -5 is below 1\)", text), text
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*.log"))


def agentic_doc(**call: object) -> dict[str, object]:
    base = {"t": 0.0, "in": 640, "out": 10, "hash_ids": [1, 2], "think_time": 0.5, "api_time": 1.0}
    return {"block_size": 64, "requests": [base, {**base, **call}]}


@pytest.mark.parametrize(
    ("call", "says"),
    [
        ({"in": 0}, r"requests\[1\]\.in 0 is below 1"),
        ({"in": -5}, r"requests\[1\]\.in -5 is below 1"),
        ({"out": -1}, r"requests\[1\]\.out -1 is below 0"),
        ({"t": -1.0}, r"requests\[1\]\.t -1\.0 is not a time >= 0 s"),
        ({"t": None}, r"requests\[1\]\.t None is not a time >= 0 s"),
        ({"think_time": -2}, r"requests\[1\]\.think_time -2 is not a time >= 0 s"),
        ({"api_time": float("inf")}, r"requests\[1\]\.api_time inf is not a time >= 0 s"),
        ({"hash_ids": [1, -1]}, r"requests\[1\]\.hash_ids\[1\] -1 is below 0"),
    ],
)
def test_an_agentic_call_out_of_range_names_file_and_call(call: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=rf"trace_0001: not a kv-cache-tester trace \({says}\)"):
        parse_agentic(agentic_doc(**call), "trace_0001")


def test_an_agentic_subagent_out_of_range_names_its_call() -> None:
    sub = {"type": "subagent", "t": 5.0, "requests": [{"t": 0.0, "in": 64, "out": -3, "hash_ids": [1]}]}
    doc = {"block_size": 64, "requests": [{"t": 0.0, "in": 64, "out": 1, "hash_ids": [1]}, sub]}
    with pytest.raises(ValueError, match=r"requests\[1\]\.requests\[0\]\.out -3 is below 0"):
        parse_agentic(doc, "x")
    with pytest.raises(ValueError, match=r"requests\[1\]\.t -5\.0 is not a time"):
        parse_agentic({**doc, "requests": [doc["requests"][0], {**sub, "t": -5.0}]}, "x")  # type: ignore[index]


def test_recorded_agentic_calls_with_no_output_and_null_times_are_legal(tmp_path: Path) -> None:
    doc = agentic_doc(out=0, think_time=None, api_time=None)
    (tmp_path / "trace_0001.json").write_text(json.dumps(doc))
    session = read_agentic(tmp_path / "trace_0001.json")[0]
    assert [(c.output_tokens, c.think_s, c.api_s) for c in session.calls] == [(10, 0.5, 1.0), (0, 0.0, 0.0)]


def test_the_shared_traces_pass_when_present() -> None:
    """The real files (when the checkout has ../shared) satisfy every rule: none of it is too strict."""
    root = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "traces"
    if not (root / "conversation_trace.jsonl").exists():
        pytest.skip("no ../shared/data/traces here")
    assert len(read_mooncake(root / "conversation_trace.jsonl")) == 12031
    assert len(read_agentic(root / "kv-cache-tester_agentic_traces_first100.tar.gz")) == 100
