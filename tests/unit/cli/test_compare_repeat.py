"""``kvmesh compare --repeat N``: each column's metrics are the median of its rounds, with the range beside them
(``kvmesh_cli.report.median_summary`` / ``spread_table``), and ``--repeat`` with ``--sweep`` is refused."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvmesh_cli.main import app
from kvmesh_cli.report import median_summary, spread_table


def _round(p50: float | None, goodput: float, engines: list[int], offload: str = "cpu") -> dict[str, object]:
    return {"ttft_p50_s": p50, "goodput_rps": goodput, "engine_requests": engines, "offload": offload,
            "requests": 960, "errors": 0, "load_imbalance": 1.0 + goodput / 100}


def test_numbers_are_medians_and_the_rest_is_the_first_round_s() -> None:
    rounds = [_round(0.30, 18.0, [1, 2]), _round(0.25, 19.5, [3, 4]), _round(0.28, 19.0, [5, 6])]
    got = median_summary(rounds)
    assert got["ttft_p50_s"] == pytest.approx(0.28) and got["goodput_rps"] == pytest.approx(19.0)
    assert got["requests"] == 960 and got["errors"] == 0  # equal in every round: itself
    assert got["engine_requests"] == [1, 2] and got["offload"] == "cpu"  # not numbers: the first round's
    # an even count: the mean of the middle two (statistics.median)
    assert median_summary(rounds[:2])["ttft_p50_s"] == pytest.approx(0.275)


def test_a_metric_is_the_median_of_the_rounds_that_measured_it() -> None:
    """A None in one round (e.g. no engine scrape) takes no part; a metric no round measured stays None."""
    got = median_summary([_round(None, 18.0, [1]), _round(0.25, 19.0, [1]), _round(0.35, 20.0, [1])])
    assert got["ttft_p50_s"] == pytest.approx(0.30) and got["goodput_rps"] == pytest.approx(19.0)
    assert median_summary([_round(None, 18.0, [1]), _round(None, 19.0, [1])])["ttft_p50_s"] is None
    assert median_summary([_round(0.2, 1.0, [1])]) == _round(0.2, 1.0, [1])  # one round: itself
    with pytest.raises(ValueError):
        median_summary([])


def test_spread_table_shows_median_and_range_per_column() -> None:
    table = spread_table({"a": [_round(0.30, 18.0, [1]), _round(0.25, 19.5, [1]), _round(0.28, 19.0, [1])],
                          "b": [_round(0.5, 10.0, [1])]}, "over 3 rounds")
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    text = out.getvalue()
    assert "0.280 (0.250-0.300)" in text and "19.00 (18.00-19.50)" in text
    assert "0.500 (0.500-0.500)" in text
    assert "TTFT p99" not in text  # no round measured it: no row


def test_repeat_with_sweep_is_refused_before_anything_starts(tmp_path: object) -> None:
    result = CliRunner().invoke(app, ["compare", "--sweep", "1,2", "--repeat", "2"])
    assert result.exit_code == 2
    assert "--repeat cannot be combined with --sweep" in result.output
    result = CliRunner().invoke(app, ["compare", "--repeat", "0"])
    assert result.exit_code == 2
