"""The TTFT breakdown of ``kvmesh compare`` (issue 9): histogram deltas, quantiles from cumulative buckets,
and the per-column keys built from scrapes of the engines' and the router's ``/metrics``.

Quantiles follow Prometheus' ``histogram_quantile`` (linear inside the bucket holding the rank, the first bucket
from 0, a rank in ``+Inf`` answers the highest finite bound); the histograms are vLLM 0.32's names and buckets
as the engine simulator exposes them (``engine_simulator/metrics.py``).
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine_simulator.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from kvmesh_cli.report import (
    BREAKDOWN_KEYS,
    ENGINE_HISTOGRAMS,
    ROUTER_STAGE_HISTOGRAM,
    Hist,
    compare_document,
    hist_quantile,
    merge_hists,
    parse_histograms,
    summarize,
    summary_table,
    ttft_breakdown,
)
from kvmesh_cli.timeline import FLOW_CONTROL_QUEUE, sum_samples

INF = math.inf


def hist(*buckets: tuple[float, float], total: float = 0.0) -> Hist:
    return Hist(tuple(buckets), total, buckets[-1][1])


def test_quantile_interpolates_inside_the_bucket_holding_the_rank() -> None:
    h = hist((1.0, 2), (2.0, 4), (INF, 4))
    assert hist_quantile(h, 0.5) == (1.0, 0.0, 1.0)  # rank 2: the top of the first bucket, from 0
    assert hist_quantile(h, 0.75) == (1.5, 1.0, 2.0)  # rank 3: halfway through (1, 2]
    assert hist_quantile(h, 0.25) == (0.5, 0.0, 1.0)


def test_quantile_skips_empty_buckets_and_caps_at_the_highest_finite_bound() -> None:
    h = hist((0.3, 0), (0.5, 0), (0.8, 10), (INF, 10))
    value, lo, hi = hist_quantile(h, 0.5) or (0, 0, 0)
    assert (lo, hi) == (0.5, 0.8) and value == pytest.approx(0.65)
    tail = hist((0.3, 1), (0.5, 1), (INF, 4))
    assert hist_quantile(tail, 0.9) == (0.5, 0.5, INF)  # in +Inf: Prometheus answers the last finite bound


def test_quantile_of_nothing_is_none_and_q_is_checked() -> None:
    assert hist_quantile(None, 0.5) is None
    assert hist_quantile(hist((1.0, 0), (INF, 0)), 0.5) is None
    with pytest.raises(ValueError, match="quantile"):
        hist_quantile(hist((1.0, 1), (INF, 1)), 50)


def test_minus_is_the_increase_and_a_reset_counts_from_zero() -> None:
    before = Hist(((1.0, 2), (INF, 3)), 4.0, 3)
    after = Hist(((1.0, 5), (INF, 9)), 10.0, 9)
    d = after.minus(before)
    assert d == Hist(((1.0, 3), (INF, 6)), 6.0, 6) and d.mean == pytest.approx(1.0)
    assert after.minus(None) is after
    restarted = Hist(((1.0, 1), (INF, 1)), 0.5, 1)
    assert restarted.minus(before) is restarted
    assert Hist(((INF, 0),), 0.0, 0).mean is None
    merged = merge_hists([d, Hist(((1.0, 1), (INF, 2)), 3.0, 2)])
    assert merged == Hist(((1.0, 4), (INF, 8)), 9.0, 8) and merge_hists([]) is None


def _engine(values_queue: list[float], values_prefill: list[float]) -> tuple[str, CollectorRegistry]:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    ttft = Histogram(ENGINE_HISTOGRAMS[0], "ttft", labels, buckets=TTFT_BUCKETS, registry=reg)
    queue = Histogram(ENGINE_HISTOGRAMS[1], "queue", labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg)
    prefill = Histogram(ENGINE_HISTOGRAMS[2], "prefill", labels, buckets=REQUEST_LATENCY_BUCKETS, registry=reg)
    for q, p in zip(values_queue, values_prefill, strict=True):
        queue.labels("m", "0").observe(q)
        prefill.labels("m", "0").observe(p)
        ttft.labels("m", "0").observe(q + p)
    return generate_latest(reg).decode(), reg


def test_parse_histograms_reads_the_simulators_exposition_and_the_delta_matches_what_was_observed() -> None:
    text0, _ = _engine([5.0], [5.0])  # before the run: one slow request, not part of the delta
    text1, _ = _engine([5.0, 0.1, 0.2, 0.4, 0.6, 0.9], [5.0, 0.05, 0.05, 0.1, 0.2, 0.35])
    before, after = parse_histograms(text0, ENGINE_HISTOGRAMS), parse_histograms(text1, ENGINE_HISTOGRAMS)
    assert set(after) == set(ENGINE_HISTOGRAMS)
    queue = after[ENGINE_HISTOGRAMS[1]].minus(before[ENGINE_HISTOGRAMS[1]])
    assert queue.count == 5 and queue.mean == pytest.approx((0.1 + 0.2 + 0.4 + 0.6 + 0.9) / 5)
    assert [le for le, _ in queue.buckets][:3] == [0.3, 0.5, 0.8] and queue.buckets[-1][0] == INF
    value, lo, hi = hist_quantile(queue, 0.5) or (0, 0, 0)  # rank 2.5 of 5: two under 0.3, one in (0.3, 0.5]
    assert (lo, hi) == (0.3, 0.5) and value == pytest.approx(0.3 + 0.2 * 0.5)


def _router(admission: list[float], pick: list[float], pre_dispatch: list[float] | None = None) -> str:
    reg = CollectorRegistry()
    h = Histogram(ROUTER_STAGE_HISTOGRAM, "stages", ["stage"], buckets=(0.001, 0.002, 0.005, 0.01, 0.1), registry=reg)
    for v in admission:
        h.labels("admission").observe(v)
    for v in pick:
        h.labels("pick").observe(v)
    for v in pre_dispatch or ():
        h.labels("pre_dispatch").observe(v)
    h.labels("proxy").observe(1.0)
    return generate_latest(reg).decode()


def test_breakdown_scales_the_routers_wall_seconds_and_keeps_the_engines_model_seconds() -> None:
    e0, _ = _engine([], [])
    e1, _ = _engine([0.1, 0.2, 0.4, 0.6], [0.05, 0.1, 0.2, 0.3])
    e2, _ = _engine([0.2, 0.2], [0.2, 0.2])
    engines_before = {"a": parse_histograms(e0, ENGINE_HISTOGRAMS), "b": parse_histograms(e0, ENGINE_HISTOGRAMS)}
    engines_after = {"a": parse_histograms(e1, ENGINE_HISTOGRAMS), "b": parse_histograms(e2, ENGINE_HISTOGRAMS)}
    r0 = parse_histograms(_router([], []), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    r1 = parse_histograms(_router([0.001] * 6, [0.002] * 6), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    assert set(r1) == {"admission", "pick", "proxy"}
    out = ttft_breakdown(engines_before, engines_after, r0, r1, time_scale=4.0, ttft_mean_s=1.0,
                         load=[(2.0, 1.0, 0.0), (4.0, 3.0, 2.0)])
    assert set(out) == set(BREAKDOWN_KEYS) - {"ttft_mean_s"}
    assert out["engine_queue_mean_s"] == pytest.approx(1.7 / 6)  # engine seconds, not scaled
    assert out["engine_prefill_mean_s"] == pytest.approx(1.05 / 6)
    assert out["engine_ttft_mean_s"] == pytest.approx(2.75 / 6)
    assert out["engine_queue_p50_bucket_s"] == [0.0, 0.3]  # 4 of 6 under 0.3 s: vLLM's buckets are that coarse
    assert 0 < out["engine_queue_p50_s"] <= 0.3  # type: ignore[operator]
    assert 0.5 < out["engine_queue_p90_s"] <= 0.8  # type: ignore[operator]  # rank 5.4 of 6: the 0.6 s one
    assert out["mesh_admission_mean_s"] == pytest.approx(0.004)  # router wall s x time scale
    assert out["mesh_pick_mean_s"] == pytest.approx(0.008)
    assert out["mesh_pre_dispatch_mean_s"] == pytest.approx(0.012)  # a router without pre_dispatch: the sum
    assert out["mesh_pre_dispatch_p50_s"] is None and out["mesh_stage_overlap_mean_s"] is None
    assert out["ttft_unaccounted_mean_s"] == pytest.approx(1.0 - 2.75 / 6 - 0.012)
    assert (out["engine_running_mean"], out["engine_waiting_mean"], out["flow_control_queue_mean"]) == (3.0, 2.0, 1.0)


def test_pre_dispatch_is_the_routers_measured_stage_not_the_sum_of_overlapping_stages() -> None:
    """With the router's early pick the Pick runs beside admission: admission 4 ms and pick 4 ms
    took 5 ms together (the ``pre_dispatch`` stage, arrival to the first POST). The breakdown reports
    the 5 ms measured, not 8 ms, and the 3 ms overlap; the TTFT rest is not under-reported."""
    e0, _ = _engine([], [])
    e1, _ = _engine([0.001] * 4, [0.001] * 4)
    engines_before, engines_after = {"a": parse_histograms(e0, ENGINE_HISTOGRAMS)}, {"a": parse_histograms(e1, ENGINE_HISTOGRAMS)}
    r0 = parse_histograms(_router([], [], []), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    r1 = parse_histograms(_router([0.004] * 4, [0.004] * 4, [0.005] * 4), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    out = ttft_breakdown(engines_before, engines_after, r0, r1, time_scale=2.0, ttft_mean_s=0.02)
    assert out["mesh_admission_mean_s"] == pytest.approx(0.008) and out["mesh_pick_mean_s"] == pytest.approx(0.008)
    assert out["mesh_pre_dispatch_mean_s"] == pytest.approx(0.010)  # measured, x time scale; the sum was 0.016
    assert 0.004 < out["mesh_pre_dispatch_p50_s"] <= 0.010  # type: ignore[operator]  # the (2 ms, 5 ms] bucket x 2
    assert out["mesh_stage_overlap_mean_s"] == pytest.approx(0.006)
    assert out["engine_ttft_mean_s"] == pytest.approx(0.002)  # engine seconds, not scaled
    assert out["ttft_unaccounted_mean_s"] == pytest.approx(0.02 - 0.002 - 0.010)  # with the sum: 0.002
    # Only the run's own observations count: a stage seen before the run is subtracted.
    later = parse_histograms(_router([0.004] * 8, [0.004] * 8, [0.005] * 4 + [0.004] * 4), (ROUTER_STAGE_HISTOGRAM,),
                             by_label="stage")
    out = ttft_breakdown(engines_after, engines_after, r1, later, time_scale=1.0)
    assert out["mesh_pre_dispatch_mean_s"] == pytest.approx(0.004) and out["mesh_stage_overlap_mean_s"] == pytest.approx(0.004)


def test_a_peer_has_engine_parts_and_no_mesh_part() -> None:
    e0, _ = _engine([], [])
    e1, _ = _engine([0.1], [0.2])
    out = ttft_breakdown({"a": parse_histograms(e0, ENGINE_HISTOGRAMS)}, {"a": parse_histograms(e1, ENGINE_HISTOGRAMS)},
                         None, None, time_scale=2.0, ttft_mean_s=0.5, load=[(1.0, 0.0, None)])
    assert out["mesh_pre_dispatch_mean_s"] is None and out["mesh_pick_p50_s"] is None
    assert out["engine_queue_mean_s"] == pytest.approx(0.1)
    assert out["ttft_unaccounted_mean_s"] == pytest.approx(0.5 - 0.3)  # the peer router's own time is in here
    assert out["flow_control_queue_mean"] is None
    empty = ttft_breakdown({}, {}, None, None, time_scale=1.0)
    assert all(v is None for v in empty.values())


def test_load_gauges_sum_label_sets_and_ignore_the_rest() -> None:
    """The load sampler's one-pass read (kvmesh_cli.timeline.sum_samples) of the gauges the breakdown averages."""
    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0\n'
            'kvmesh_flow_control_queue_size 4.0\n')
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", FLOW_CONTROL_QUEUE)
    assert sum_samples(text, names) == {"vllm:num_requests_running": 3.0, "vllm:num_requests_waiting": 2.0,
                                        "kvmesh_flow_control_queue_size": 4.0}
    with pytest.raises(ValueError, match="unparsable"):
        sum_samples("vllm:num_requests_running{} x\n", names)


def test_the_breakdown_reaches_the_json_and_the_table() -> None:
    from kvmesh_cli.report import RequestResult

    results = [RequestResult(i, True, ttft_s=0.1 * (i + 1), e2e_s=1.0, output_tokens=4) for i in range(4)]
    breakdown = {k: None for k in BREAKDOWN_KEYS if k != "ttft_mean_s"} | {
        "engine_queue_mean_s": 0.2, "engine_queue_p50_s": 0.15, "engine_queue_p50_bucket_s": [0.0, 0.3],
        "engine_running_mean": 1.5, "engine_waiting_mean": 0.5}
    s = summarize(results, wall_duration_s=2.0, time_scale=2.0, prefix_hit_rate=0.5, breakdown=breakdown)
    assert s["ttft_mean_s"] == pytest.approx(0.5)  # (0.1 + 0.2 + 0.3 + 0.4) / 4 wall s x 2
    doc = compare_document("w", 1, 4, {"p": s})
    assert set(BREAKDOWN_KEYS) <= set(doc["policies"]["p"])  # type: ignore[arg-type]
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    Console(file=out, width=200).print(summary_table({"p": s}, "t"))
    text = out.getvalue()
    assert "engine queue mean / p50 (its bucket), s" in text
    assert "0.200 / <0.3" in text  # a p50 in the first bucket is only bounded, not interpolated from 0
    s["engine_prefill_mean_s"], s["engine_prefill_p50_s"], s["engine_prefill_p50_bucket_s"] = 0.6, 0.65, [0.5, 0.8]
    out = StringIO()
    Console(file=out, width=200).print(summary_table({"p": s}, "t"))
    assert "0.600 / 0.650 (0.5-0.8)" in out.getvalue()
    assert "1.5 / 0.5" in text and "pick mean" not in text  # a row nothing measured is left out


def test_stages_one_after_the_other_show_no_overlap_never_a_negative_one() -> None:
    """No early pick: pre_dispatch (2.1 ms) is the two stages (1 ms each) plus the router's own work between
    them, so admission + pick - pre_dispatch is -0.1 ms; the overlap is 0 and the table says 0.000, not -0.000."""
    e0, _ = _engine([], [])
    e1, _ = _engine([0.001] * 4, [0.001] * 4)
    engines_before, engines_after = {"a": parse_histograms(e0, ENGINE_HISTOGRAMS)}, {"a": parse_histograms(e1, ENGINE_HISTOGRAMS)}
    r0 = parse_histograms(_router([], [], []), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    r1 = parse_histograms(_router([0.001] * 4, [0.001] * 4, [0.0021] * 4), (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    out = ttft_breakdown(engines_before, engines_after, r0, r1, time_scale=1.0, ttft_mean_s=0.02)
    assert out["mesh_stage_overlap_mean_s"] == 0.0


@pytest.mark.parametrize(("value", "kind", "text"), [
    (-0.0001, "s", "0.000"), (-0.00004, "ms", "0.0"), (-0.0004, "pct", "0.0 %"), (-0.004, "rate2", "0.00"),
    (-0.002, "s", "-0.002"), (0.0, "s", "0.000"), (-1e-9, "x", "0.00"),
])
def test_a_cell_never_shows_a_negative_zero(value: float, kind: str, text: str) -> None:
    from kvmesh_cli.report import fmt

    assert fmt(value, kind) == text
