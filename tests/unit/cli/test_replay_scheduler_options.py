"""``kvmesh replay`` takes the engines' scheduler options of ``up`` and ``compare`` for the mesh it starts.

``--long-prefill-token-threshold``, ``--long-prefill-token-threshold-adaptive`` and
``--[no-]scheduler-reserve-full-isl`` (vLLM 0.32's engine arguments) are the shared option definitions of
``kvmesh_cli/options.py``, checked by the same ``engine_scheduler`` helper against the engines' context, and reach
every engine through ``MeshSpec``; with ``--router`` (engines already running) they are refused.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import kvmesh_cli.main as cli_main
from kvmesh_cli.main import app, compare, replay_cmd, up
from kvmesh_cli.mesh import MeshSpec
from kvmesh_cli.options import LongPrefillAdaptiveOpt, LongPrefillOpt, ReserveFullIslOpt

FLAGS = {"long_prefill_token_threshold": LongPrefillOpt,
         "long_prefill_token_threshold_adaptive": LongPrefillAdaptiveOpt,
         "scheduler_reserve_full_isl": ReserveFullIslOpt}


def test_replay_shares_up_and_compares_option_definitions() -> None:
    """The same ``Annotated`` option objects on all three commands (one definition, no copy); ``--help`` lists them."""
    for command in (replay_cmd, up, compare):
        hints = typing.get_type_hints(command, include_extras=True)
        for name, opt in FLAGS.items():
            assert hints[name] == opt, (command.__name__, name)
            assert typing.get_args(hints[name])[1] is typing.get_args(opt)[1]
    text = CliRunner().invoke(app, ["replay", "--help"], env={"COLUMNS": "240"}).output
    for flag in ("--long-prefill-token-threshold", "--long-prefill-token-threshold-adaptive",
                 "--scheduler-reserve-full-isl", "--no-scheduler-reserve-full-isl"):
        assert flag in text


def test_replay_refuses_a_threshold_above_the_engines_context() -> None:
    """9 blocks of 64 tokens (the simulator's default block): an 8-block context, 512 tokens; 600 is refused before
    a mesh starts, as ``up`` and ``compare`` refuse it (vLLM will not start with it)."""
    result = CliRunner().invoke(app, ["replay", "--num-gpu-blocks", "9", "--requests", "2",
                                      "--long-prefill-token-threshold", "600"], env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert "long-prefill-token-threshold" in result.output and "512" in result.output


@pytest.mark.parametrize("flag", [["--long-prefill-token-threshold", "64"], ["--long-prefill-token-threshold-adaptive"],
                                  ["--no-scheduler-reserve-full-isl"], ["--scheduler-reserve-full-isl"]])
def test_replay_refuses_scheduler_options_with_router(flag: list[str]) -> None:
    """With ``--router`` the engines are someone else's: the option would do nothing, so it is an error (2), before
    the router is asked anything (port 1 would not answer)."""
    result = CliRunner().invoke(app, ["replay", "--router", "http://127.0.0.1:1", "--requests", "2", *flag],
                                env={"COLUMNS": "240"})
    assert result.exit_code == 2, result.output
    assert "already running" in result.output


class _Started(Exception):
    """Raised by the stand-in Mesh: the spec replay built is all this test needs."""


def _spec_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str]) -> tuple[MeshSpec, str]:
    specs: list[MeshSpec] = []

    def fake_mesh(spec: MeshSpec, *a: Any, **kw: Any) -> Any:
        specs.append(spec)
        raise _Started

    monkeypatch.setattr(cli_main, "Mesh", fake_mesh)
    result = CliRunner().invoke(app, ["replay", "--requests", "2", "--run-dir", str(tmp_path), *args],
                                env={"COLUMNS": "240"})
    assert isinstance(result.exception, _Started), result.output
    return specs[0], result.output


def test_replay_gives_its_mesh_the_scheduler_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The options reach ``MeshSpec`` (which passes them to every engine: tested in
    ``tests/unit/engine_simulator/test_long_prefill_threshold.py``) and the run says so; unset, none is passed
    (the engines' defaults: threshold off, full-ISL reservation on, as vLLM 0.32)."""
    spec, output = _spec_of(monkeypatch, tmp_path, ["--long-prefill-token-threshold", "256",
                                                    "--long-prefill-token-threshold-adaptive",
                                                    "--no-scheduler-reserve-full-isl"])
    assert spec.long_prefill_token_threshold == 256 and spec.long_prefill_token_threshold_adaptive is True
    assert spec.scheduler_reserve_full_isl is False
    assert "long_prefill_token_threshold 256 (adaptive), no scheduler_reserve_full_isl" in output
    spec, output = _spec_of(monkeypatch, tmp_path, [])
    assert spec.long_prefill_token_threshold is None and spec.long_prefill_token_threshold_adaptive is False
    assert spec.scheduler_reserve_full_isl is None and "long_prefill" not in output


def test_replay_json_records_the_engines_scheduler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--json`` of a replay on its own mesh records ``engine_scheduler`` as ``compare``'s JSON does."""
    from kvmesh_cli.replay import ReplayOutcome

    class FakeMesh:
        def __init__(self, spec: MeshSpec, *a: Any, **kw: Any) -> None:
            self.router_url = "http://127.0.0.1:1"
            self.engine_urls: list[str] = []

        def router_api_key(self) -> str | None:
            return None

        def __enter__(self) -> FakeMesh:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(cli_main, "Mesh", FakeMesh)
    monkeypatch.setattr(cli_main, "_run_replay", lambda *a, **kw: ReplayOutcome(results=[], wall_duration_s=1.0, counters_before={}, counters_after={}))
    out = tmp_path / "replay.json"
    result = CliRunner().invoke(app, ["replay", "--requests", "2", "--run-dir", str(tmp_path), "--json-out", str(out),
                                      "--long-prefill-token-threshold", "128"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["engine_scheduler"] == {
        "long_prefill_token_threshold": 128, "long_prefill_token_threshold_adaptive": False,
        "scheduler_reserve_full_isl": True}
