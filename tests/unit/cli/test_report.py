"""Report math: percentiles, Prometheus counter parsing, hit rate, summary and JSON shape."""

from __future__ import annotations

import json

import pytest

from kvmesh_cli.report import (
    EXTRA_KEYS,
    SUMMARY_KEYS,
    RequestResult,
    compare_document,
    fmt,
    hit_rate,
    parse_prometheus_counter,
    percentile,
    summarize,
    summary_table,
    usage_cached_fraction,
)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0], 50, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        (list(range(1, 101)), 90, 90.1),
        (list(range(1, 101)), 99, 99.01),
        ([5.0, 1.0, 3.0], 50, 3.0),
    ],
    ids=["single", "median-even", "min", "max", "p90", "p99", "unsorted"],
)
def test_percentile_linear(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_empty_and_bounds() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


METRICS = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 64.0
vllm:prefix_cache_hits_totalx 999
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total 512.0
vllm:prefix_cache_queries_created 1.7e9
"""


def test_parse_prometheus_counter() -> None:
    assert parse_prometheus_counter(METRICS, "vllm:prefix_cache_hits_total") == 192.0
    assert parse_prometheus_counter(METRICS, "vllm:prefix_cache_queries_total") == 512.0
    assert parse_prometheus_counter(METRICS, "vllm:absent_total") == 0.0


def test_hit_rate_from_deltas() -> None:
    before = {"a": (10.0, 100.0), "b": (0.0, 0.0)}
    after = {"a": (60.0, 200.0), "b": (30.0, 100.0), "c": (10.0, 100.0)}
    # deltas: a 50/100, b 30/100, c (new) 10/100
    assert hit_rate(before, after) == pytest.approx(90 / 300)
    assert hit_rate({}, {}) is None
    assert hit_rate(after, after) is None


def test_summarize_scales_to_model_time() -> None:
    results = [
        RequestResult(0, True, ttft_s=0.1, e2e_s=1.0, output_tokens=10, prompt_tokens=100, cached_tokens=50),
        RequestResult(1, True, ttft_s=0.3, e2e_s=2.0, output_tokens=30, prompt_tokens=100, cached_tokens=0),
        RequestResult(2, False, e2e_s=0.01, error="HTTP 503", status=503),
    ]
    s = summarize(results, wall_duration_s=4.0, time_scale=2.0, prefix_hit_rate=0.25)
    assert set(s) == set(SUMMARY_KEYS) | set(EXTRA_KEYS)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.4)  # (0.2 + 0.6) / 2
    assert s["ttft_p99_s"] == pytest.approx(0.2 + 0.4 * 0.99)
    assert s["e2e_p50_s"] == pytest.approx(3.0)
    assert s["output_tokens_per_s"] == pytest.approx(40 / 8.0)
    assert s["prefix_hit_rate"] == 0.25
    assert usage_cached_fraction(results) == pytest.approx(0.25)


def test_summarize_all_failed() -> None:
    s = summarize([RequestResult(0, False)], wall_duration_s=0.0, time_scale=1.0, prefix_hit_rate=None)
    assert s["errors"] == 1 and s["ttft_p50_s"] is None and s["output_tokens_per_s"] is None


def test_compare_document_shape_is_json() -> None:
    s = summarize([RequestResult(0, True, 0.1, 0.2, 5)], wall_duration_s=1.0, time_scale=1.0, prefix_hit_rate=0.5)
    doc = compare_document("multi-turn", 4, 1, {"round-robin": {**s, "extra": 1}, "precise-prefix": s})
    back = json.loads(json.dumps(doc))
    assert set(back) == {"workload", "engines", "requests", "policies"}
    assert back["engines"] == 4 and back["requests"] == 1 and back["workload"] == "multi-turn"
    assert list(back["policies"]) == ["round-robin", "precise-prefix"]
    for entry in back["policies"].values():
        assert set(SUMMARY_KEYS) <= set(entry) <= set(SUMMARY_KEYS) | set(EXTRA_KEYS)


def test_table_and_cells() -> None:
    assert fmt(None, "s") == "-"
    assert fmt(0.12345, "s") == "0.123"
    assert fmt(0.5, "pct") == "50.0 %"
    table = summary_table({"a": {"requests": 1}, "b": {"requests": 2}}, "t")
    assert len(table.columns) == 3 and table.row_count == len(SUMMARY_KEYS)  # rows nobody measured are left out
