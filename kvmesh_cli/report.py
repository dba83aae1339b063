"""Replay results -> summary numbers, JSON and rich tables (pure; no I/O besides rendering).

Times are measured in wall seconds and reported in *model* seconds: multiplied by the replay's
``time_scale`` (the engines' simulated clock runs that many times faster than the wall clock).
Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method).
The prefix-cache hit rate is measured at the engines: the sum over engines of the
``vllm:prefix_cache_hits_total`` delta divided by the sum of ``vllm:prefix_cache_queries_total``
deltas (both count tokens), between a scrape before and one after the replay: the GPU pool's hits,
as vLLM counts them. Tokens loaded from an offloaded tier (vLLM's KV connector: ``--offload cpu`` /
``cpu+kv_store``) are counted apart, by ``vllm:external_prefix_cache_hits_total`` (vLLM 0.32's connector
prefix-cache stats, ``vllm/v1/metrics/loggers.py``); ``offload_hit_rate`` is their delta over the same
prompt tokens, so GPU + offload is the share of prompt tokens not recomputed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table

BREAKDOWN_KEYS = (
    "ttft_mean_s", "mesh_admission_mean_s", "mesh_admission_p50_s", "mesh_pick_mean_s", "mesh_pick_p50_s",
    "mesh_pre_dispatch_mean_s", "mesh_pre_dispatch_p50_s", "mesh_stage_overlap_mean_s", "engine_ttft_mean_s", "engine_ttft_p50_s", "engine_queue_mean_s",
    "engine_queue_p50_s", "engine_queue_p50_bucket_s", "engine_queue_p90_s", "engine_prefill_mean_s",
    "engine_prefill_p50_s", "engine_prefill_p50_bucket_s", "engine_prefill_p90_s", "ttft_unaccounted_mean_s", "engine_running_mean", "engine_waiting_mean",
    "flow_control_queue_mean",
)
"""Where TTFT goes, per column (issue 9; :func:`ttft_breakdown`): measured from histogram deltas over the run."""
SUMMARY_KEYS = (
    "requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s",
    "output_tokens_per_s", "prefix_hit_rate",
)
"""Keys of one policy's entry in ``kvmesh compare --json-out`` (fixed by the spine issue)."""
EXTRA_KEYS = (
    "itl_p50_s", "itl_p90_s", "e2e_p90_s", "requests_per_s", "goodput_rps", "slo_ttft_s", "oracle_hit_rate",
    "oracle_fraction", "load_imbalance", "engine_requests", "engine_prefill_tokens",
    "offload", "offload_hit_rate", "total_hit_rate", "oracle_fraction_total",
    "ttft_first_call_p50_s", "ttft_follow_up_p50_s", "ttft_follow_up_p90_s",
    *BREAKDOWN_KEYS,
)
"""Keys added by issue 9 (after :data:`SUMMARY_KEYS`, which keep their meaning).

``goodput_rps``: requests per model second that finished with TTFT at most ``slo_ttft_s``
(DistServe's goodput, per run); ``oracle_hit_rate``: one infinite prefix cache serving the same
requests in the order they were sent (:func:`kvmesh_cli.workloads.oracle_hits`), ``oracle_fraction``
the engines' measured hit rate over it; ``load_imbalance``: max / mean of the engines' prefill
tokens (prompt tokens not served from cache: ``queries - hits`` deltas), 1.0 = even;
``engine_requests`` / ``engine_prefill_tokens``: per engine, in engine order.

Offload (issue 9, per column): ``offload`` is the engines' offload mode of the run (``off``, ``cpu``,
``cpu+kv_store``); ``offload_hit_rate`` the prompt tokens loaded from offloaded tiers over all prompt tokens
(``vllm:external_prefix_cache_hits_total`` delta over ``vllm:prefix_cache_queries_total`` delta);
``total_hit_rate`` GPU + offloaded (``prefix_hit_rate`` stays the GPU pool's alone);
``oracle_fraction_total`` = ``total_hit_rate`` over the oracle (``oracle_fraction`` counts GPU hits only).
Prefill tokens of the imbalance are those computed: queries - GPU hits - offloaded hits.

Closed-loop sessions (agentic traces, built-in multi-turn): ``ttft_first_call_p50_s`` is the TTFT p50 of the
calls that open a session (nothing before them to reuse: a cold prefill for every policy and the oracle),
``ttft_follow_up_p50_s`` / ``_p90_s`` of the calls sent after an earlier answer of their session (what
routing can make warm); ``None`` for open-loop traces.

TTFT breakdown (:data:`BREAKDOWN_KEYS`, :func:`ttft_breakdown`; model seconds; ``None`` where not measured, e.g.
the mesh's stages behind a peer router): ``ttft_mean_s`` the client's TTFT mean (means add up, percentiles do
not); ``mesh_admission_*`` / ``mesh_pick_*`` the router's ``kvmesh_router_stage_duration_seconds{stage}``
(admission: arrival to flow_control's DISPATCHED; pick: the epp Pick); ``mesh_pre_dispatch_*`` the router's
``pre_dispatch`` stage (arrival to the first POST to an engine, measured: with the router's early pick the Pick
runs beside admission, so the two stages overlap and their sum over-counts), ``mesh_stage_overlap_mean_s`` =
admission mean + pick mean - pre-dispatch mean, clamped at 0 (how much of the two ran at once; about the pick mean
when every pick was early; 0 when they ran one after the other, pre-dispatch then also holding the router's own
work around them). A router without the ``pre_dispatch`` stage (before wave 9): ``mesh_pre_dispatch_mean_s`` is the
sum of the two means (an upper bound) and the other two are None;
``engine_ttft_*`` vLLM's ``vllm:time_to_first_token_seconds`` (arrival at the engine to first token),
``engine_queue_*`` ``vllm:request_queue_time_seconds`` (WAITING: queued to first scheduled),
``engine_prefill_*`` ``vllm:request_prefill_time_seconds`` (first scheduled to first token), all over every
engine; ``*_p50_s`` are histogram quantiles (:func:`hist_quantile`) and ``*_p50_bucket_s`` the ``[lower, upper]``
bucket the p50 lies in: vLLM's request-latency buckets start at 0.3 s, so a p50 under 0.3 s is an interpolation
inside ``[0, 0.3]`` and only the mean is exact; ``engine_queue_p90_s`` / ``engine_prefill_p90_s`` the same estimate
of the tail. ``ttft_unaccounted_mean_s`` = ``ttft_mean_s`` -
``mesh_pre_dispatch_mean_s`` - ``engine_ttft_mean_s``: proxying, HTTP and the client's own lag.
``engine_running_mean`` / ``engine_waiting_mean``: ``vllm:num_requests_running`` / ``_waiting`` per engine,
averaged over engines and the replay's periodic samples; ``flow_control_queue_mean``:
``kvmesh_flow_control_queue_size`` over the same samples."""


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
    itl_s: float | None = None
    """Mean inter-token latency: (last text chunk - first) / (output tokens - 1)."""
    sent_at: float | None = None
    """``time.monotonic()`` at send (orders requests for the oracle)."""


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
EXTERNAL_HITS_METRIC = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES_METRIC = "vllm:external_prefix_cache_queries_total"

Counters = Mapping[str, Sequence[float]]
"""Per engine: ``(hits, queries, requests[, external hits, external queries])`` as
:func:`kvmesh_cli.replay.scrape_counters` gives them (missing trailing values count as 0)."""


@dataclass(frozen=True, slots=True)
class Hist:
    """One Prometheus histogram (summed over label sets): ``buckets`` as ``(le, cumulative count)`` in
    ascending ``le`` (``+Inf`` last), ``sum`` in the metric's unit, ``count`` observations."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def minus(self, before: Hist | None) -> Hist:
        """This histogram's increase since ``before`` (a scrape of the same series; None: since 0). Counts
        that went down (the process restarted) count from 0."""
        if before is None:
            return self
        old = dict(before.buckets)
        if self.count < before.count or any(c < old.get(le, 0.0) for le, c in self.buckets):
            return self
        return Hist(tuple((le, c - old.get(le, 0.0)) for le, c in self.buckets),
                    self.sum - before.sum, self.count - before.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


def parse_histograms(text: str, names: Sequence[str], by_label: str | None = None) -> dict[str, Hist]:
    """The histograms ``names`` (family names, without ``_bucket``) in Prometheus text exposition, each summed
    over its label sets; with ``by_label``, one per value of that label, keyed ``name{by_label=value}`` is
    shortened to the value alone (``{"admission": Hist, "pick": Hist}`` for the router's stages). Absent
    histograms are absent from the answer.

    Raises:
        ValueError: when ``text`` is not valid Prometheus text exposition.
    """
    wanted = set(names)
    acc: dict[str, tuple[dict[float, float], list[float]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted or family.type != "histogram":
            continue
        for sample in family.samples:
            key = family.name if by_label is None else sample.labels.get(by_label, "")
            buckets, totals = acc.setdefault(key, ({}, [0.0, 0.0]))
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                totals[0] += sample.value
            elif sample.name.endswith("_count"):
                totals[1] += sample.value
    return {k: Hist(tuple(sorted(b.items())), t[0], t[1]) for k, (b, t) in acc.items()}


def merge_hists(hists: Sequence[Hist]) -> Hist | None:
    """Several histograms with the same buckets as one (the engines' together); None for none."""
    if not hists:
        return None
    buckets: dict[float, float] = {}
    for h in hists:
        for le, c in h.buckets:
            buckets[le] = buckets.get(le, 0.0) + c
    return Hist(tuple(sorted(buckets.items())), sum(h.sum for h in hists), sum(h.count for h in hists))


def hist_quantile(h: Hist | None, q: float) -> tuple[float, float, float] | None:
    """``(value, lower, upper)``: the ``q``-quantile (0..1) of ``h`` the way Prometheus' ``histogram_quantile``
    estimates it (linear interpolation inside the bucket holding rank ``q * count``, the first bucket from 0;
    a rank in the ``+Inf`` bucket answers the highest finite bound), and that bucket's bounds. None for an
    empty histogram.

    Raises:
        ValueError: when ``q`` is outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if h is None or h.count <= 0 or not h.buckets:
        return None
    rank = q * h.count
    lower, below = 0.0, 0.0
    for le, cum in h.buckets:
        if cum >= rank and cum > below:
            if math.isinf(le):
                return lower, lower, le
            return lower + (le - lower) * (rank - below) / (cum - below), lower, le
        lower, below = (le if not math.isinf(le) else lower), cum
    return lower, lower, math.inf


ENGINE_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds")
"""vLLM 0.32's per-request histograms the TTFT breakdown reads from every engine (``vllm/v1/metrics/loggers.py``)."""
ROUTER_STAGE_HISTOGRAM = "kvmesh_router_stage_duration_seconds"
MESH_STAGES = ("admission", "pick")
"""The router's stages before the request is sent to its engine (services/router/metrics.py); they overlap
(the early pick runs beside admission): :data:`PRE_DISPATCH_STAGE` measures them together."""
PRE_DISPATCH_STAGE = "pre_dispatch"
"""The router's stage from arrival to the first POST to an engine (services/router/metrics.py)."""


def stage_means(before: Mapping[str, Hist] | None, after: Mapping[str, Hist], time_scale: float = 1.0) -> dict[str, float]:
    """Mean seconds per observation of each histogram in ``after`` (by key: the router's stages, ``ttft``) over
    its increase since ``before`` (None: since 0), times ``time_scale`` (wall to model seconds); a key without
    observations in between is left out. The router means of the TTFT breakdown (:func:`ttft_breakdown`) and of
    ``compare --timeline`` (:class:`kvmesh_cli.timeline.EngineSampler`'s first and last router samples)."""
    out: dict[str, float] = {}
    for key, h in after.items():
        mean = h.minus((before or {}).get(key)).mean
        if mean is not None:
            out[key] = mean * time_scale
    return out


def ttft_breakdown(
    engines_before: Mapping[str, Mapping[str, Hist]], engines_after: Mapping[str, Mapping[str, Hist]],
    router_before: Mapping[str, Hist] | None, router_after: Mapping[str, Hist] | None, *, time_scale: float,
    ttft_mean_s: float | None = None, load: Sequence[tuple[float, float, float | None]] = (),
) -> dict[str, object]:
    """:data:`BREAKDOWN_KEYS` (but ``ttft_mean_s``, the caller's) from scrapes before and after a run.

    ``engines_*``: per engine URL, :func:`parse_histograms` of :data:`ENGINE_HISTOGRAMS`, whose seconds are the
    engine's clock (model seconds for the simulator; a real vLLM runs at time scale 1); ``router_*``: the
    router's stages (:data:`ROUTER_STAGE_HISTOGRAM` by ``stage``) in wall seconds, times ``time_scale``; None
    without a kvmesh router (a peer). ``ttft_mean_s`` (model s) gives ``ttft_unaccounted_mean_s``. ``load``:
    samples of ``(running, waiting, flow_control queue or None)``, the first two per engine (averaged).
    """
    out: dict[str, object] = dict.fromkeys(BREAKDOWN_KEYS)
    out.pop("ttft_mean_s")
    deltas: dict[str, Hist | None] = {}
    for name in ENGINE_HISTOGRAMS:
        deltas[name] = merge_hists([after[name].minus(engines_before.get(url, {}).get(name))
                                    for url, after in engines_after.items() if name in after])
    for key, name in (("engine_ttft", ENGINE_HISTOGRAMS[0]), ("engine_queue", ENGINE_HISTOGRAMS[1]),
                      ("engine_prefill", ENGINE_HISTOGRAMS[2])):
        h = deltas[name]
        out[f"{key}_mean_s"] = h.mean if h is not None else None
        p50 = hist_quantile(h, 0.5)
        out[f"{key}_p50_s"] = p50[0] if p50 is not None else None
        if f"{key}_p50_bucket_s" in out:
            out[f"{key}_p50_bucket_s"] = [p50[1], p50[2] if math.isfinite(p50[2]) else None] if p50 else None
            p90 = hist_quantile(h, 0.9)
            out[f"{key}_p90_s"] = p90[0] if p90 is not None else None
    if router_after is not None:
        means = stage_means(router_before, {s: router_after[s] for s in MESH_STAGES if s in router_after}, time_scale)
        for stage in MESH_STAGES:
            h = router_after[stage].minus((router_before or {}).get(stage)) if stage in router_after else None
            p50 = hist_quantile(h, 0.5)
            out[f"mesh_{stage}_mean_s"] = means.get(stage)
            out[f"mesh_{stage}_p50_s"] = p50[0] * time_scale if p50 is not None else None
        pre = router_after[PRE_DISPATCH_STAGE].minus((router_before or {}).get(PRE_DISPATCH_STAGE)) \
            if PRE_DISPATCH_STAGE in router_after else None
        if pre is not None and pre.mean is not None:  # measured: admission and pick as they overlapped
            p50 = hist_quantile(pre, 0.5)
            out["mesh_pre_dispatch_mean_s"] = pre.mean * time_scale
            out["mesh_pre_dispatch_p50_s"] = p50[0] * time_scale if p50 is not None else None
            if len(means) == len(MESH_STAGES):
                # pre_dispatch also holds the router's own work around the two stages, so without overlap
                # the difference is a little below 0: clamped, 0 means the two ran one after the other
                out["mesh_stage_overlap_mean_s"] = max(0.0, sum(means.values(), 0.0) - pre.mean * time_scale)
        else:  # a router without the stage: the sum, an upper bound when the pick overlapped admission
            out["mesh_pre_dispatch_mean_s"] = sum(means.values(), 0.0)
    engine_ttft = out["engine_ttft_mean_s"]
    if ttft_mean_s is not None and isinstance(engine_ttft, float):
        out["ttft_unaccounted_mean_s"] = ttft_mean_s - engine_ttft - float(out["mesh_pre_dispatch_mean_s"] or 0.0)  # type: ignore[arg-type]
    if load:
        out["engine_running_mean"] = sum(s[0] for s in load) / len(load)
        out["engine_waiting_mean"] = sum(s[1] for s in load) / len(load)
        queues = [s[2] for s in load if s[2] is not None]
        out["flow_control_queue_mean"] = sum(queues) / len(queues) if queues else None
    return out


def _counter(values: Sequence[float] | None, i: int) -> float:
    return float(values[i]) if values is not None and len(values) > i else 0.0


def _delta(before: Counters, after: Counters, engine: str, i: int) -> float:
    return max(0.0, _counter(after.get(engine), i) - _counter(before.get(engine), i))


def hit_rate(before: Counters, after: Counters) -> float | None:
    """Engine-measured prefix hit rate (GPU pools) from per-engine ``(hits, queries, ...)`` counters; None
    if no queries.

    Engines missing from ``before`` count from 0 (they joined during the replay).
    """
    hits = sum(_delta(before, after, e, 0) for e in after)
    queries = sum(_delta(before, after, e, 1) for e in after)
    return hits / queries if queries > 0 else None


def offload_hit_rate(before: Counters, after: Counters) -> float | None:
    """Prompt tokens loaded from offloaded tiers (external hits) over all prompt tokens queried; None if no
    queries, or no engine exposes the external counters (an engine without a connector gives 0)."""
    if not any(len(v) > 3 for v in after.values()):
        return None
    hits = sum(_delta(before, after, e, 3) for e in after)
    queries = sum(_delta(before, after, e, 1) for e in after)
    return hits / queries if queries > 0 else None


def per_engine(before: Counters, after: Counters) -> dict[str, tuple[int, float | None]]:
    """``{engine: (requests finished, GPU hit rate)}`` over the replay, from ``(hits, queries, requests, ...)``."""
    out: dict[str, tuple[int, float | None]] = {}
    for engine in after:
        h, q = _delta(before, after, engine, 0), _delta(before, after, engine, 1)
        out[engine] = (int(_delta(before, after, engine, 2)), h / q if q > 0 else None)
    return out


def load_split(
    before: Counters, after: Counters, engines: Sequence[str] | None = None,
) -> tuple[list[int], list[float], float | None]:
    """``(requests per engine, prefill tokens per engine, imbalance)`` over a replay.

    Prefill tokens are the prompt tokens an engine computed (``queries - hits - external hits`` deltas);
    imbalance is their max over their mean (None when no engine prefilled anything). ``engines`` fixes
    the order and counts engines that answered no scrape as 0; default: the scraped ones, sorted.
    """
    names = list(engines) if engines is not None else sorted(after)
    reqs: list[int] = []
    prefill: list[float] = []
    for name in names:
        reqs.append(int(_delta(before, after, name, 2)))
        prefill.append(max(0.0, _delta(before, after, name, 1) - _delta(before, after, name, 0)
                           - _delta(before, after, name, 3)))
    mean = sum(prefill) / len(prefill) if prefill else 0.0
    return reqs, prefill, (max(prefill) / mean if mean > 0 else None)


def goodput_rps(results: Sequence[RequestResult], slo_ttft_s: float, model_duration_s: float,
                time_scale: float = 1.0) -> float | None:
    """Requests per model second that succeeded with TTFT <= ``slo_ttft_s`` (model seconds)."""
    if model_duration_s <= 0:
        return None
    good = sum(1 for r in results if r.ok and r.ttft_s is not None and r.ttft_s * time_scale <= slo_ttft_s)
    return good / model_duration_s


def summarize(
    results: Sequence[RequestResult],
    *,
    wall_duration_s: float,
    time_scale: float,
    prefix_hit_rate: float | None,
    slo_ttft_s: float | None = None,
    oracle_hit_rate: float | None = None,
    split: tuple[list[int], list[float], float | None] | None = None,
    offload: str | None = None,
    offload_hit_rate: float | None = None,
    first_calls: frozenset[int] | None = None,
    breakdown: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The summary of one replay: :data:`SUMMARY_KEYS` then :data:`EXTRA_KEYS`, times in model seconds.

    ``output_tokens_per_s`` and ``requests_per_s`` are over the replay's makespan (first send to
    last completion), successful requests only. ``split`` is :func:`load_split`'s answer; ``offload`` the
    engines' offload mode and ``offload_hit_rate`` :func:`offload_hit_rate`'s answer. ``first_calls``: the
    request indices that open a closed-loop session (the rest follow an answer); ``None`` for open loop.
    ``breakdown``: :func:`ttft_breakdown`'s answer (its keys are added; ``ttft_mean_s`` is always measured).
    """
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * time_scale for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s * time_scale for r in ok if r.e2e_s is not None]
    itls = [r.itl_s * time_scale for r in ok if r.itl_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    model_duration = wall_duration_s * time_scale
    reqs, prefill, imbalance = split if split is not None else (None, None, None)
    first: list[float] = []
    follow: list[float] = []
    if first_calls is not None:
        for r in ok:
            if r.ttft_s is not None:
                (first if r.index in first_calls else follow).append(r.ttft_s * time_scale)
    total = (prefix_hit_rate + (offload_hit_rate or 0.0)) if prefix_hit_rate is not None else None
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "output_tokens_per_s": (out_tokens / model_duration) if model_duration > 0 else None,
        "prefix_hit_rate": prefix_hit_rate,
        "itl_p50_s": percentile(itls, 50),
        "itl_p90_s": percentile(itls, 90),
        "e2e_p90_s": percentile(e2es, 90),
        "requests_per_s": (len(ok) / model_duration) if model_duration > 0 else None,
        "goodput_rps": goodput_rps(results, slo_ttft_s, model_duration, time_scale) if slo_ttft_s else None,
        "slo_ttft_s": slo_ttft_s,
        "oracle_hit_rate": oracle_hit_rate,
        "oracle_fraction": (prefix_hit_rate / oracle_hit_rate
                            if prefix_hit_rate is not None and oracle_hit_rate else None),
        "load_imbalance": imbalance,
        "engine_requests": reqs,
        "engine_prefill_tokens": prefill,
        "offload": offload,
        "offload_hit_rate": offload_hit_rate,
        "total_hit_rate": total,
        "oracle_fraction_total": (total / oracle_hit_rate if total is not None and oracle_hit_rate else None),
        "ttft_first_call_p50_s": percentile(first, 50) if first_calls is not None else None,
        "ttft_follow_up_p50_s": percentile(follow, 50) if first_calls is not None else None,
        "ttft_follow_up_p90_s": percentile(follow, 90) if first_calls is not None else None,
        **dict.fromkeys(BREAKDOWN_KEYS),
        **(breakdown or {}),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
    }


def usage_cached_fraction(results: Sequence[RequestResult]) -> float | None:
    """Cached prompt tokens / prompt tokens as reported in responses' ``usage`` (client side)."""
    prompt = sum(r.prompt_tokens for r in results if r.ok)
    cached = sum(r.cached_tokens for r in results if r.ok)
    return cached / prompt if prompt else None


def compare_document(
    workload: str, engines: int, requests: int, policies: Mapping[str, Mapping[str, object]],
    **extra: object,
) -> dict[str, object]:
    """The ``kvmesh compare --json-out`` document: today's keys, then ``extra`` (``rate_scale``, ``sweep`` ...)."""
    return {
        "workload": workload,
        "engines": engines,
        "requests": requests,
        "policies": {name: {k: summary.get(k) for k in (*SUMMARY_KEYS, *EXTRA_KEYS) if k in summary or
                            k in SUMMARY_KEYS} for name, summary in policies.items()},
        **extra,
    }


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "int"),
    ("errors", "errors", "int"),
    ("TTFT p50 (s)", "ttft_p50_s", "s"),
    ("TTFT p90 (s)", "ttft_p90_s", "s"),
    ("TTFT p99 (s)", "ttft_p99_s", "s"),
    ("TTFT p50, sessions' first calls (s)", "ttft_first_call_p50_s", "s"),
    ("TTFT p50, follow-up calls (s)", "ttft_follow_up_p50_s", "s"),
    ("TTFT p90, follow-up calls (s)", "ttft_follow_up_p90_s", "s"),
    ("TTFT mean (s)", "ttft_mean_s", "s"),
    ("  mesh before dispatch, mean / p50 (s)", "mesh_pre_dispatch", "mean_p50"),
    ("    admission wait mean / p50 (s)", "mesh_admission", "mean_p50"),
    ("    pick mean / p50 (s)", "mesh_pick", "mean_p50"),
    ("    admission and pick at once (early pick; 0: none), mean (s)", "mesh_stage_overlap_mean_s", "s"),
    ("  engine TTFT mean / p50 (s)", "engine_ttft", "mean_p50"),
    ("    engine queue mean / p50 (its bucket), s", "engine_queue", "mean_p50_bucket"),
    ("    engine queue p90 (s, from vLLM's buckets)", "engine_queue_p90_s", "s"),
    ("    engine prefill mean / p50 (its bucket), s", "engine_prefill", "mean_p50_bucket"),
    ("    engine prefill p90 (s, from vLLM's buckets)", "engine_prefill_p90_s", "s"),
    ("  rest (proxy, HTTP, client), mean (s)", "ttft_unaccounted_mean_s", "s"),
    ("engine running / waiting (mean per engine)", "engine_load", "load"),
    ("flow_control queue (mean)", "flow_control_queue_mean", "rate"),
    ("end-to-end p50 (s)", "e2e_p50_s", "s"),
    ("output tokens/s", "output_tokens_per_s", "rate"),
    ("offload (engines' KV connector)", "offload", "str"),
    ("prefix-cache hit rate (GPU)", "prefix_hit_rate", "pct"),
    ("offloaded-tier hits (loaded, of prompt)", "offload_hit_rate", "pct"),
    ("GPU + offload hit rate", "total_hit_rate", "pct"),
    ("end-to-end p90 (s)", "e2e_p90_s", "s"),
    ("ITL p50 (ms)", "itl_p50_s", "ms"),
    ("requests/s", "requests_per_s", "rate2"),
    ("goodput (req/s, TTFT <= SLO)", "goodput_rps", "rate2"),
    ("oracle hit rate (1 infinite cache)", "oracle_hit_rate", "pct"),
    ("captured of oracle (GPU hits)", "oracle_fraction", "pct"),
    ("captured of oracle (GPU + offload)", "oracle_fraction_total", "pct"),
    ("load imbalance (max/mean prefill)", "load_imbalance", "x"),
    ("requests per engine", "engine_requests", "list"),
)


SPREAD_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_first_call_p50_s", "ttft_follow_up_p50_s",
               "goodput_rps", "prefix_hit_rate", "oracle_fraction_total", "load_imbalance")
"""The metrics ``compare --repeat`` shows with their range over the rounds (:func:`spread_table`)."""


def _numbers(values: Iterable[object]) -> list[float]:
    """The numbers among ``values`` (bools and None left out)."""
    return [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def median_summary(rounds: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """One column's summary over repeated rounds of the same run (``compare --repeat``).

    Every number is the median of the rounds that measured it (``statistics.median``: the mean of the middle
    two for an even count); a key no round measured stays None; anything else (lists, strings, buckets) is the
    first round's. ``rounds`` must not be empty (ValueError)."""
    if not rounds:
        raise ValueError("median_summary needs at least one round")
    out: dict[str, object] = dict(rounds[0])
    for key in {k for r in rounds for k in r}:
        values = [r.get(key) for r in rounds]
        numbers = _numbers(values)
        if numbers:
            out[key] = statistics.median(numbers)
        elif key not in out:
            out[key] = next((v for v in values if v is not None), None)
    return out


def spread_table(columns: Mapping[str, Sequence[Mapping[str, object]]], title: str,
                 slo_ttft_s: float | None = None) -> Table:
    """``median (min-max)`` over each column's rounds for :data:`SPREAD_KEYS`, the row labels and units of
    :func:`summary_table` (goodput's with ``slo_ttft_s``); a metric no round of any column measured is left out."""
    table = Table(title=title)
    table.add_column("metric (model time), median (min-max)")
    for name in columns:
        table.add_column(name, justify="right")
    rows = {key: (label, kind) for label, key, kind in _ROWS}
    for key in SPREAD_KEYS:
        label, kind = rows[key]
        if key == "goodput_rps" and slo_ttft_s is not None:
            label = f"goodput (req/s, TTFT <= {slo_ttft_s:g} s)"
        cells = []
        for rounds in columns.values():
            values = _numbers(r.get(key) for r in rounds)
            cells.append("-" if not values else
                         f"{fmt(statistics.median(values), kind)} ({fmt(min(values), kind)}-{fmt(max(values), kind)})")
        if any(c != "-" for c in cells):
            table.add_row(label, *cells)
    return table


def fmt(value: object, kind: str) -> str:
    """One table cell: ``-`` for missing values."""
    if value is None:
        return "-"
    if kind == "list" and isinstance(value, list | tuple):
        return "/".join(str(int(v)) for v in value)
    if not isinstance(value, int | float) or kind not in ("int", "s", "ms", "rate", "rate2", "pct", "x"):
        return str(value)
    if kind == "int":
        return str(int(value))
    if kind == "s":
        text = f"{float(value):.3f}"
    elif kind == "ms":
        text = f"{1000 * float(value):.1f}"
    elif kind == "rate":
        text = f"{float(value):.1f}"
    elif kind in ("rate2", "x"):
        text = f"{float(value):.2f}"
    else:
        text = f"{100 * float(value):.1f} %"
    # a tiny negative rounds to "-0.000": no sign on a zero (a larger negative keeps its sign: it says something)
    return text[1:] if text.startswith("-") and float(text.split()[0]) == 0 else text


def _mean_p50(summary: Mapping[str, object], key: str) -> str:
    mean, p50 = summary.get(f"{key}_mean_s"), summary.get(f"{key}_p50_s")
    return "-" if mean is None and p50 is None else f"{fmt(mean, 's')} / {fmt(p50, 's')}"


def _mean_p50_bucket(summary: Mapping[str, object], key: str) -> str:
    """``mean / p50 (lower-upper)``, or ``mean / <upper`` when the p50 lies in the first bucket: an
    interpolation from 0 there says nothing (vLLM's request-latency buckets start at 0.3 s)."""
    cell = _mean_p50(summary, key)
    bucket = summary.get(f"{key}_p50_bucket_s")
    if cell == "-" or not isinstance(bucket, list | tuple) or len(bucket) != 2:
        return cell
    hi = "inf" if bucket[1] is None else f"{float(bucket[1]):g}"
    if float(bucket[0]) == 0.0:
        return f"{fmt(summary.get(f'{key}_mean_s'), 's')} / <{hi}"
    return f"{cell} ({float(bucket[0]):g}-{hi})"


def _load(summary: Mapping[str, object], _key: str) -> str:
    run, wait = summary.get("engine_running_mean"), summary.get("engine_waiting_mean")
    return "-" if run is None and wait is None else f"{fmt(run, 'rate')} / {fmt(wait, 'rate')}"


_COMPOSITE = {"mean_p50": _mean_p50, "mean_p50_bucket": _mean_p50_bucket, "load": _load}
"""Table cells built from several keys (the TTFT breakdown's mean / p50 pairs)."""


def summary_table(columns: Mapping[str, Mapping[str, object]], title: str) -> Table:
    """Metrics as rows, one column per summary (a policy, or a single replay)."""
    table = Table(title=title)
    table.add_column("metric (model time)")
    for name in columns:
        table.add_column(name, justify="right")
    for label, key, kind in _ROWS:
        if kind in _COMPOSITE:
            cells = [_COMPOSITE[kind](summary, key) for summary in columns.values()]
            if any(c != "-" for c in cells):
                table.add_row(label, *cells)
            continue
        if key not in SUMMARY_KEYS and all(summary.get(key) is None for summary in columns.values()):
            continue  # a row no column measured (a replay against a router without engines to scrape)
        if key == "goodput_rps":
            slo = next((s.get("slo_ttft_s") for s in columns.values() if s.get("slo_ttft_s")), None)
            label = f"goodput (req/s, TTFT <= {slo:g} s)" if isinstance(slo, int | float) else label
        table.add_row(label, *(fmt(summary.get(key), kind) for summary in columns.values()))
    return table


# ---------------------------------------------------------------------------------------------
# Sweeps: throughput against TTFT, and goodput at an SLO


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: the offered load and what it gave (model seconds)."""

    rate_scale: float
    requests_per_s: float
    ttft_p90_s: float | None
    ttft_p50_s: float | None = None
    output_tokens_per_s: float | None = None


def slo_throughput(points: Sequence[SweepPoint], slo_ttft_s: float) -> float | None:
    """Goodput of a sweep: the highest throughput (requests/s) whose TTFT p90 is within ``slo_ttft_s``.

    Points are taken in order of offered load; the curve is followed until TTFT p90 first crosses
    the SLO, and the crossing is interpolated linearly between the last point under it and the first
    over it (DistServe's "max rate under the SLO attainment", with p90 as the attainment). None when
    even the lightest point misses the SLO; the heaviest point's throughput when none does.
    """
    pts = sorted(points, key=lambda p: p.rate_scale)
    best: float | None = None
    prev: SweepPoint | None = None
    for p in pts:
        if p.ttft_p90_s is None:
            continue
        if p.ttft_p90_s <= slo_ttft_s:
            best = max(best or 0.0, p.requests_per_s)
            prev = p
            continue
        if prev is not None and prev.ttft_p90_s is not None and p.ttft_p90_s > prev.ttft_p90_s:
            frac = (slo_ttft_s - prev.ttft_p90_s) / (p.ttft_p90_s - prev.ttft_p90_s)
            best = max(best or 0.0, prev.requests_per_s + frac * (p.requests_per_s - prev.requests_per_s))
        break
    return best


def sweep_table(curves: Mapping[str, Sequence[SweepPoint]], slo_ttft_s: float, title: str) -> Table:
    """One row per (policy, load): throughput and TTFT; then each policy's goodput at the SLO."""
    table = Table(title=title)
    for col, justify in (("policy", "left"), ("rate scale", "right"), ("requests/s", "right"),
                         ("output tok/s", "right"), ("TTFT p50 (s)", "right"), ("TTFT p90 (s)", "right"),
                         (f"p90 <= {slo_ttft_s:g} s", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, pts in curves.items():
        for p in sorted(pts, key=lambda x: x.rate_scale):
            ok = p.ttft_p90_s is not None and p.ttft_p90_s <= slo_ttft_s
            table.add_row(name, f"{p.rate_scale:g}", fmt(p.requests_per_s, "rate2"),
                          fmt(p.output_tokens_per_s, "rate"), fmt(p.ttft_p50_s, "s"), fmt(p.ttft_p90_s, "s"),
                          "yes" if ok else "no")
    for name, pts in curves.items():
        good = fmt(slo_throughput(pts, slo_ttft_s), "rate2")
        crossed = slo_crossed(pts, slo_ttft_s)
        table.add_row(f"[bold]{name}[/bold]", "goodput", good if crossed else f">= {good}", "", "", "",
                      "" if crossed else "SLO never crossed: a lower bound")
    return table


def slo_crossed(points: Sequence[SweepPoint], slo_ttft_s: float) -> bool:
    """Whether some point's TTFT p90 exceeds the SLO (else :func:`slo_throughput` is only a lower bound)."""
    return any(p.ttft_p90_s is not None and p.ttft_p90_s > slo_ttft_s for p in points)
