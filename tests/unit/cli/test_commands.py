"""Every command has --help; the workload a command builds follows its options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvmesh_cli.main import app, build_workload
from kvmesh_cli.plotting import write_plot
from kvmesh_cli.report import compare_document, summarize
from kvmesh_cli.workloads import DEFAULT_MAX_INPUT_TOKENS


@pytest.mark.parametrize("command", [[], ["up"], ["replay"], ["compare"]], ids=["root", "up", "replay", "compare"])
def test_help(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_build_workload_trace_caps_inputs_by_default(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i * 1000, "input_length": 40000, "output_length": 900, "hash_ids": list(range(79))}
            for i in range(3)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = build_workload(trace, "multi-turn", 2, 0, None, 512)
    assert len(wl.requests) == 2
    assert all(r.input_length == DEFAULT_MAX_INPUT_TOKENS and r.max_tokens == 512 for r in wl.requests)
    wl = build_workload(trace, "multi-turn", 5, 0, 1000, 100)
    assert len(wl.requests) == 3 and all(r.input_length == 1000 for r in wl.requests)


def test_build_workload_unknown_builtin() -> None:
    with pytest.raises(typer.BadParameter):
        build_workload(None, "nope", 10, 0, None, 100)


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    s = summarize([], wall_duration_s=1.0, time_scale=1.0, prefix_hit_rate=0.3)
    doc = compare_document("multi-turn", 2, 0, {"round-robin": s, "precise-prefix": s})
    out = tmp_path / "p.png"
    assert write_plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
