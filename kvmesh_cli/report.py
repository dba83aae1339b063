"""Replay results -> summary numbers, JSON and rich tables (pure; no I/O besides rendering).

Times are measured in wall seconds and reported in *model* seconds: multiplied by the replay's
``time_scale`` (the engines' simulated clock runs that many times faster than the wall clock).
Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method).
The prefix-cache hit rate is measured at the engines: the sum over engines of the
``vllm:prefix_cache_hits_total`` delta divided by the sum of ``vllm:prefix_cache_queries_total``
deltas (both count tokens), between a scrape before and one after the replay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

SUMMARY_KEYS = (
    "requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s",
    "output_tokens_per_s", "prefix_hit_rate",
)
"""Keys of one policy's entry in ``kvmesh compare --json-out`` (fixed by the spine issue)."""


@dataclass
class RequestResult:
    """Outcome of one replayed request; times in wall seconds from its send."""

    index: int
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: int | None = None
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values.

    Raises:
        ValueError: when ``q`` is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def parse_prometheus_counter(text: str, name: str) -> float:
    """Sum of all samples named ``name`` (any labels) in Prometheus text exposition; 0 if absent.

    Parsed with ``prometheus_client.parser`` (the same parser epp uses); ``name`` is the sample
    name as exposed, e.g. ``vllm:prefix_cache_hits_total``.

    Raises:
        ValueError: when ``text`` is not valid Prometheus text exposition.
    """
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


HITS_METRIC = "vllm:prefix_cache_hits_total"
QUERIES_METRIC = "vllm:prefix_cache_queries_total"
REQUESTS_METRIC = "vllm:request_success_total"


def hit_rate(
    before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]]
) -> float | None:
    """Engine-measured prefix hit rate from per-engine ``(hits, queries, ...)`` counters; None if no queries.

    Engines missing from ``before`` count from 0 (they joined during the replay).
    """
    hits = queries = 0.0
    for engine, (h1, q1, *_) in after.items():
        h0, q0, *_ = before.get(engine, (0.0, 0.0))
        hits += max(0.0, h1 - h0)
        queries += max(0.0, q1 - q0)
    return hits / queries if queries > 0 else None


def per_engine(
    before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]]
) -> dict[str, tuple[int, float | None]]:
    """``{engine: (requests finished, hit rate)}`` over the replay, from ``(hits, queries, requests)``."""
    out: dict[str, tuple[int, float | None]] = {}
    for engine, (h1, q1, r1) in after.items():
        h0, q0, r0 = before.get(engine, (0.0, 0.0, 0.0))
        out[engine] = (int(r1 - r0), (h1 - h0) / (q1 - q0) if q1 > q0 else None)
    return out


def summarize(
    results: Sequence[RequestResult],
    *,
    wall_duration_s: float,
    time_scale: float,
    prefix_hit_rate: float | None,
) -> dict[str, float | int | None]:
    """The summary of one replay, keys :data:`SUMMARY_KEYS`, times in model seconds.

    ``output_tokens_per_s`` is the output tokens of successful requests over the replay's
    makespan (first send to last completion), in model seconds.
    """
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * time_scale for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s * time_scale for r in ok if r.e2e_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    model_duration = wall_duration_s * time_scale
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "output_tokens_per_s": (out_tokens / model_duration) if model_duration > 0 else None,
        "prefix_hit_rate": prefix_hit_rate,
    }


def usage_cached_fraction(results: Sequence[RequestResult]) -> float | None:
    """Cached prompt tokens / prompt tokens as reported in responses' ``usage`` (client side)."""
    prompt = sum(r.prompt_tokens for r in results if r.ok)
    cached = sum(r.cached_tokens for r in results if r.ok)
    return cached / prompt if prompt else None


def compare_document(
    workload: str, engines: int, requests: int, policies: Mapping[str, Mapping[str, object]]
) -> dict[str, object]:
    """The ``kvmesh compare --json-out`` document."""
    return {
        "workload": workload,
        "engines": engines,
        "requests": requests,
        "policies": {name: {k: summary.get(k) for k in SUMMARY_KEYS} for name, summary in policies.items()},
    }


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "int"),
    ("errors", "errors", "int"),
    ("TTFT p50 (s)", "ttft_p50_s", "s"),
    ("TTFT p90 (s)", "ttft_p90_s", "s"),
    ("TTFT p99 (s)", "ttft_p99_s", "s"),
    ("end-to-end p50 (s)", "e2e_p50_s", "s"),
    ("output tokens/s", "output_tokens_per_s", "rate"),
    ("prefix-cache hit rate", "prefix_hit_rate", "pct"),
)


def fmt(value: object, kind: str) -> str:
    """One table cell: ``-`` for missing values."""
    if value is None:
        return "-"
    if not isinstance(value, int | float) or kind not in ("int", "s", "rate", "pct"):
        return str(value)
    if kind == "int":
        return str(int(value))
    if kind == "s":
        return f"{float(value):.3f}"
    if kind == "rate":
        return f"{float(value):.1f}"
    return f"{100 * float(value):.1f} %"


def summary_table(columns: Mapping[str, Mapping[str, object]], title: str) -> Table:
    """Metrics as rows, one column per summary (a policy, or a single replay)."""
    table = Table(title=title)
    table.add_column("metric (model time)")
    for name in columns:
        table.add_column(name, justify="right")
    for label, key, kind in _ROWS:
        table.add_row(label, *(fmt(summary.get(key), kind) for summary in columns.values()))
    return table
