"""``kvmesh compare``'s columns with an offload each (issue 9): ``--policies``/``--peers`` entries
``NAME[+OFFLOAD]``, their labels, the run each column gets, and the GPU / offloaded hit split reported
from vLLM 0.32's ``vllm:prefix_cache_*`` and ``vllm:external_prefix_cache_*`` counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import kvmesh_cli.main as main
from kvmesh_cli.checks import EPP_CONFIGS_DIR
from kvmesh_cli.main import Column, app, column_label, compare_columns, split_offload
from kvmesh_cli.report import (
    compare_document,
    hit_rate,
    load_split,
    offload_hit_rate,
    per_engine,
    summarize,
    summary_table,
)


@pytest.mark.parametrize(
    ("entry", "default", "expected"),
    [
        ("precise-prefix", "off", ("precise-prefix", "off")),
        ("precise-prefix", "cpu", ("precise-prefix", "cpu")),
        ("precise-prefix+cpu", "off", ("precise-prefix", "cpu")),
        ("tier-cost+cpu+kv_store", "off", ("tier-cost", "cpu+kv_store")),
        ("round-robin+off", "cpu", ("round-robin", "off")),
        ("vllm-router-cache-aware+cpu", "off", ("vllm-router-cache-aware", "cpu")),
    ],
)
def test_split_offload(entry: str, default: str, expected: tuple[str, str]) -> None:
    assert split_offload(entry, default) == expected


@pytest.mark.parametrize("entry", ["precise-prefix+nvme", "precise-prefix+", "+cpu", "a+kv_store"])
def test_split_offload_rejects_unknown_suffix(entry: str) -> None:
    with pytest.raises(ValueError, match="offload mode"):
        split_offload(entry, "off")


def test_columns_name_their_offload() -> None:
    cols = compare_columns("round-robin,round-robin+cpu,precise-prefix+cpu,tier-cost+cpu+kv_store", "", "off")
    assert cols == [
        Column("round-robin", "round-robin", None, "off"),
        Column("round-robin+cpu", "round-robin", None, "cpu"),
        Column("precise-prefix+cpu", "precise-prefix", None, "cpu"),
        Column("tier-cost+cpu+kv_store", "tier-cost", None, "cpu+kv_store"),
    ]
    # plain names keep --offload; an explicit +off overrides it
    cols = compare_columns("precise-prefix,round-robin+off", "", "cpu")
    assert [(c.name, c.offload) for c in cols] == [("precise-prefix+cpu", "cpu"), ("round-robin", "off")]
    assert column_label("x", "off") == "x" and column_label("x", "cpu+kv_store") == "x+cpu+kv_store"


def test_columns_errors() -> None:
    with pytest.raises(typer.BadParameter, match="offload mode"):
        compare_columns("precise-prefix+nvme", "", "off")
    with pytest.raises(typer.BadParameter, match="given twice"):
        compare_columns("round-robin,round-robin+off", "", "off")
    with pytest.raises(typer.BadParameter, match="neither a named scheduling config"):
        compare_columns("no-such-policy+cpu", "", "off")
    with pytest.raises(typer.BadParameter, match="no policy"):
        compare_columns(" , ", "", "off")
    with pytest.raises(typer.BadParameter, match="an empty entry"):  # a typo, not silently one column fewer
        compare_columns("round-robin,,precise-prefix", "", "off")
    with pytest.raises(typer.BadParameter, match="an empty entry"):
        compare_columns("round-robin", ",sglang-router", "off")
    for twice in ("round-robin+cpu+off", "round-robin+cpu+cpu", "precise-prefix+gpu+cpu"):
        with pytest.raises(typer.BadParameter, match="give one offload mode"):
            compare_columns(twice, "", "off")


def test_yaml_path_with_plus_is_kept_whole(tmp_path: Path) -> None:
    cfg = tmp_path / "mine+cpu.yaml"
    cfg.write_text((EPP_CONFIGS_DIR / "round-robin.yaml").read_text())  # a config epp accepts
    (col,) = compare_columns(str(cfg), "", "off")
    assert (col.policy, col.offload) == (str(cfg.resolve()), "off")
    (col,) = compare_columns(f"{cfg}+cpu", "", "off")
    assert (col.policy, col.offload, col.name) == (str(cfg.resolve()), "cpu", f"{cfg}+cpu")


def test_compare_runs_each_column_with_its_offload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One ``compare``: round-robin without offload beside precise-prefix and round-robin with CPU offload;
    every column's mesh gets its own mode, the JSON names the columns and their offload."""
    runs: list[tuple[str, str | None, str]] = []

    def fake_run_one(wl: object, rs: object, run_dir: Path, name: str, policy: str | None, peer: str | None,
                     label: str, offload: str = "off", timeline: Path | None = None) -> dict[str, object]:
        runs.append((name, policy, offload))
        assert timeline is None  # no --timeline given
        assert run_dir.name.endswith(column_label(policy or "", offload))
        return summarize([], wall_duration_s=1.0, time_scale=1.0, prefix_hit_rate=0.5, offload=offload,
                         offload_hit_rate=0.25 if offload != "off" else 0.0, oracle_hit_rate=0.8)

    monkeypatch.setattr(main, "_run_one", fake_run_one)
    out = tmp_path / "c.json"
    result = CliRunner().invoke(app, [
        "compare", "--workload", "multi-turn", "--requests", "4", "--run-dir", str(tmp_path / "run"),
        "--policies", "round-robin,precise-prefix+cpu,round-robin+cpu", "--json-out", str(out),
    ], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert runs == [("round-robin", "round-robin", "off"), ("precise-prefix+cpu", "precise-prefix", "cpu"),
                    ("round-robin+cpu", "round-robin", "cpu")]
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["round-robin", "precise-prefix+cpu", "round-robin+cpu"]
    assert doc["offload"] == {"round-robin": "off", "precise-prefix+cpu": "cpu", "round-robin+cpu": "cpu"}
    col = doc["policies"]["precise-prefix+cpu"]
    assert (col["offload"], col["prefix_hit_rate"], col["offload_hit_rate"], col["total_hit_rate"]) == \
        ("cpu", 0.5, 0.25, 0.75)
    assert col["oracle_fraction"] == pytest.approx(0.625) and col["oracle_fraction_total"] == pytest.approx(0.9375)
    assert "GPU + offload hit rate" in result.output and "precise-prefix+cpu" in result.output


def test_gpu_and_offloaded_hits_apart() -> None:
    """Counters as ``scrape_counters`` gives them: (GPU hits, queries, requests, external hits, external
    queries), tokens. Engine a: 1,000 prompt tokens, 300 GPU hits, 500 loaded from CPU; b: 1,000, 100, 0."""
    before = {"a": (0.0, 0.0, 0.0, 0.0, 0.0), "b": (10.0, 10.0, 1.0, 0.0, 0.0)}
    after = {"a": (300.0, 1000.0, 4.0, 500.0, 700.0), "b": (110.0, 1010.0, 3.0, 0.0, 900.0)}
    assert hit_rate(before, after) == pytest.approx(400 / 2000)
    assert offload_hit_rate(before, after) == pytest.approx(500 / 2000)
    reqs, prefill, imbalance = load_split(before, after, ["a", "b"])
    assert reqs == [4, 2] and prefill == [200.0, 900.0]  # loaded tokens are not prefilled
    assert imbalance == pytest.approx(900 / 550)
    assert per_engine(before, after) == {"a": (4, 0.3), "b": (2, 0.1)}
    # engines (or old recordings) without the external counters: no offload figure, GPU ones unchanged
    old = {"a": (300.0, 1000.0, 4.0)}
    assert offload_hit_rate({}, old) is None and hit_rate({}, old) == pytest.approx(0.3)
    assert load_split({}, old) == ([4], [700.0], 1.0)


def test_table_rows_and_document_keys() -> None:
    s = summarize([], wall_duration_s=1.0, time_scale=1.0, prefix_hit_rate=0.4, oracle_hit_rate=0.8,
                  offload="cpu", offload_hit_rate=0.3)
    assert s["total_hit_rate"] == pytest.approx(0.7) and s["oracle_fraction_total"] == pytest.approx(0.875)
    doc = compare_document("w", 2, 0, {"precise-prefix+cpu": s})
    entry = doc["policies"]["precise-prefix+cpu"]  # type: ignore[index]
    assert list(entry)[:8] == ["requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s",
                               "output_tokens_per_s", "prefix_hit_rate"]  # today's keys first, unchanged
    assert entry["offload"] == "cpu"
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(summary_table({"precise-prefix+cpu": s}, "t"))
    text = console.export_text()
    for row in ("offload (engines' KV connector)", "prefix-cache hit rate (GPU)", "offloaded-tier hits",
                "GPU + offload hit rate", "captured of oracle (GPU hits)", "captured of oracle (GPU + offload)"):
        assert row in text
    assert "70.0 %" in text and "87.5 %" in text and "cpu" in text


def test_parallel_runs_a_rates_columns_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--parallel``: every column of one rate runs at the same time (both are in flight together), the rates
    one after the other; the table and the sweep keep the columns' order; ``--timeline`` names a file per run."""
    import threading

    both_in_flight = threading.Barrier(2, timeout=10)
    runs: list[tuple[str, str]] = []

    def fake_run_one(wl: object, rs: main.RunSettings, run_dir: Path, name: str, policy: str | None,
                     peer: str | None, label: str, offload: str = "off", timeline: Path | None = None
                     ) -> dict[str, object]:
        assert rs.parallel
        assert timeline is not None and timeline.name == f"{run_dir.name}.jsonl"
        both_in_flight.wait()  # raises BrokenBarrierError unless the other column of this rate runs now
        runs.append((name, run_dir.name))
        return summarize([], wall_duration_s=1.0, time_scale=1.0, prefix_hit_rate=0.5 if policy == "round-robin" else 0.6)

    monkeypatch.setattr(main, "_run_one", fake_run_one)
    out = tmp_path / "c.json"
    result = CliRunner().invoke(app, [
        "compare", "--workload", "multi-turn", "--requests", "4", "--run-dir", str(tmp_path / "run"),
        "--policies", "round-robin,precise-prefix", "--sweep", "1,2", "--parallel", "--timeline", str(tmp_path / "tl"),
        "--json-out", str(out),
    ], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert sorted(runs[:2]) == [("round-robin x1", "0-0-round-robin"), ("precise-prefix x1", "0-1-precise-prefix")][::-1]
    assert {r[1] for r in runs[2:]} == {"1-0-round-robin", "1-1-precise-prefix"}
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["round-robin x1", "precise-prefix x1", "round-robin x2", "precise-prefix x2"]
    assert doc["policies"]["precise-prefix x2"]["prefix_hit_rate"] == 0.6
