"""The simulator's ``/metrics``: vLLM 0.32's names, help texts, labels and buckets.

Every family carries ``engine="0"`` and ``model_name`` (vLLM's ``vllm/v1/metrics/loggers.py``),
lives in its own :class:`CollectorRegistry` (several engines may share a process in tests), and is
checked against ``shared/data/vllm-0.32-cpu/metrics_exposition.txt``. Times are model seconds from
the engine's clock (so ``--time-scale`` does not distort them). Written only through the
``record_*`` helpers below.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine_simulator.offload import OffloadManager

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


class EngineMetrics:
    """vLLM's metric families for one engine.

    Args:
        model_name: the served model name (label value).
        cache_info: labels of ``vllm:cache_config_info`` (string values).
        max_model_len: top of the token-count histograms' buckets.
    """

    def __init__(self, model_name: str, cache_info: dict[str, str], max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["engine", "model_name"]
        self._lv = {"engine": "0", "model_name": model_name}
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        )
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        )
        self.num_requests_waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            [*labels, "reason"],
            registry=r,
        )
        self.kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=r
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.external_prefix_cache_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
            labels,
            registry=r,
        )
        self.external_prefix_cache_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.",
            labels,
            registry=r,
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels,
            registry=r,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        info_names = sorted({"engine", *cache_info})
        self.cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info_names, registry=r
        )
        self.cache_config_info.labels(**{**cache_info, "engine": "0"}).set(1)
        # create the labelled children so every family shows up at 0, as vLLM's do
        for metric in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage_perc,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.external_prefix_cache_queries,
            self.external_prefix_cache_hits,
            self.num_preemptions,
            self.prompt_tokens,
            self.prompt_tokens_cached,
            self.generation_tokens,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.iteration_tokens,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.inference_time,
            self.prefill_time,
            self.decode_time,
        ):
            metric.labels(**self._lv)
        for reason in ("capacity", "deferred"):
            self.num_requests_waiting_by_reason.labels(**self._lv, reason=reason)
        for reason in FINISHED_REASONS:
            self.request_success.labels(**self._lv, finished_reason=reason)
        # bound children: cheap writes on the hot path
        lv = self._lv
        self._running = self.num_requests_running.labels(**lv)
        self._waiting = self.num_requests_waiting.labels(**lv)
        self._waiting_capacity = self.num_requests_waiting_by_reason.labels(**lv, reason="capacity")
        self._waiting_deferred = self.num_requests_waiting_by_reason.labels(**lv, reason="deferred")
        self._usage = self.kv_cache_usage_perc.labels(**lv)
        self._queries = self.prefix_cache_queries.labels(**lv)
        self._hits = self.prefix_cache_hits.labels(**lv)
        self._ext_queries = self.external_prefix_cache_queries.labels(**lv)
        self._ext_hits = self.external_prefix_cache_hits.labels(**lv)
        self._preemptions = self.num_preemptions.labels(**lv)
        self._prompt = self.prompt_tokens.labels(**lv)
        self._prompt_cached = self.prompt_tokens_cached.labels(**lv)
        self._generation = self.generation_tokens.labels(**lv)
        self._iteration = self.iteration_tokens.labels(**lv)
        self._ttft = self.ttft.labels(**lv)
        self._itl = self.itl.labels(**lv)
        # The simulator's own (not vLLM's): how faithfully the loop keeps model time on a busy host
        # (engine_simulator/engine.py's schedule).
        self.step_model_seconds = Counter(
            "kvmesh_sim_step_model_seconds", "Model seconds of the steps run (the latency model's durations).",
            registry=r,
        )
        self.step_lag_seconds = Gauge(
            "kvmesh_sim_step_lag_seconds",
            "Model seconds the last step ended behind its modelled end (the host starving the simulator; "
            "its tokens reach clients that much late).",
            registry=r,
        )
        self.step_lost_seconds = Counter(
            "kvmesh_sim_step_lost_seconds",
            "Model seconds of schedule given up because the loop ran more than the catch-up bound behind "
            "(capacity the latency model promised and the host did not deliver).",
            registry=r,
        )

    # -- record helpers ------------------------------------------------------------------
    def record_step(
        self,
        *,
        running: int,
        waiting: int,
        usage: float,
        step_tokens: int,
        new_preemptions: int,
        new_generation_tokens: int,
        deferred: int = 0,
    ) -> None:
        """After every engine step (vLLM 0.32's ``PrometheusStatLogger.record``, ``vllm/v1/metrics/loggers.py``).

        Args:
            running: ``vllm:num_requests_running``.
            waiting: ``vllm:num_requests_waiting``, every waiting request, deferred ones included
                (``EngineCore.num_waiting``).
            deferred: of those, the ones vLLM's ``deferred_waiting`` holds (``EngineCore.num_deferred``):
                ``vllm:num_requests_waiting_by_reason{reason="deferred"}``; ``reason="capacity"`` is
                ``waiting - deferred``, so the reasons sum to the gauge, as vLLM documents.
        """
        self._running.set(running)
        self._waiting.set(waiting)
        self._waiting_capacity.set(waiting - deferred)
        self._waiting_deferred.set(deferred)
        self._usage.set(usage)
        if step_tokens:
            self._iteration.observe(step_tokens)
        if new_preemptions:
            self._preemptions.inc(new_preemptions)
        if new_generation_tokens:
            self._generation.inc(new_generation_tokens)

    def record_step_time(self, *, model_seconds: float, lag_seconds: float) -> None:
        """After every non-empty step: its modelled duration and how far past its modelled end it finished."""
        self.step_model_seconds.inc(model_seconds)
        self.step_lag_seconds.set(max(0.0, lag_seconds))

    def record_lost_time(self, seconds: float) -> None:
        """Schedule debt beyond the catch-up bound, given up (model seconds)."""
        self.step_lost_seconds.inc(seconds)

    def record_scheduled(
        self, *, prompt_tokens: int, cached_tokens: int, external_queries: int = 0, external_hits: int = 0
    ) -> None:
        """When a request is scheduled for the first time (its prefix-cache lookup).

        ``external_*``: the offload connector's lookup after the GPU hit, as vLLM 0.32's scheduler records
        ``connector_prefix_cache_stats`` (queries = prompt tokens - GPU-hit tokens, hits = tokens loaded
        from the offloaded tiers; ``vllm:external_prefix_cache_*``); 0 without a connector.
        """
        self._queries.inc(prompt_tokens)
        self._hits.inc(cached_tokens)
        if external_queries:
            self._ext_queries.inc(external_queries)
        if external_hits:
            self._ext_hits.inc(external_hits)

    def record_first_token(self, *, ttft_seconds: float) -> None:
        self._ttft.observe(ttft_seconds)

    def record_token(self, *, itl_seconds: float) -> None:
        self._itl.observe(itl_seconds)

    def record_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        generation_tokens: int,
        e2e_seconds: float,
        queue_seconds: float,
        prefill_seconds: float,
        decode_seconds: float,
    ) -> None:
        """When a request ends (also aborted ones, as vLLM counts them)."""
        lv = self._lv
        self.request_success.labels(**lv, finished_reason=finish_reason).inc()
        self._prompt.inc(prompt_tokens)
        self._prompt_cached.inc(max(cached_tokens, 0))
        self.request_prompt_tokens.labels(**lv).observe(prompt_tokens)
        self.request_generation_tokens.labels(**lv).observe(generation_tokens)
        self.e2e.labels(**lv).observe(e2e_seconds)
        self.queue_time.labels(**lv).observe(queue_seconds)
        self.inference_time.labels(**lv).observe(prefill_seconds + decode_seconds)
        self.prefill_time.labels(**lv).observe(prefill_seconds)
        self.decode_time.labels(**lv).observe(decode_seconds)
        if generation_tokens > 1:
            self.tpot.labels(**lv).observe(decode_seconds / (generation_tokens - 1))

    def attach_offload(self, offload: OffloadManager) -> None:
        """Export the offload connector's counters (read at scrape time, :class:`OffloadCollector`)."""
        self.registry.register(OffloadCollector(offload, self._lv))

    def exposition(self) -> bytes:
        """The Prometheus text format of this engine's registry."""
        return generate_latest(self.registry)


class OffloadCollector(Collector):
    """The offload connector's ``/metrics`` families, read from :class:`~engine_simulator.offload.OffloadStats` at
    scrape time (labels ``engine``, ``model_name``).

    vLLM 0.32's names where its OffloadingConnector has one (``offloading/metrics.py``: counters
    ``vllm:kv_offload_load_bytes``, ``_load_time``, ``_store_bytes``, ``_store_time`` (seconds, the
    modeled link-busy time here) and ``vllm:kv_offload_allocation_failure``, store offers refused for room);
    ``kvmesh_sim_offload_*`` for the rest (blocks unless named otherwise): evicted blocks, loads and loaded
    blocks by source, store-skipped blocks, kv_store puts done/failed/skipped, kv_store lookups and their
    failures, blocks kv_store no longer held, deferrals, and gauges of the tiers' sizes.
    """

    def __init__(self, offload: OffloadManager, labels: dict[str, str]) -> None:
        self._offload = offload
        self._names = list(labels)
        self._values = [labels[n] for n in self._names]

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        off = self._offload
        st = off.stats
        bpb = off.config.bytes_per_block
        c = self._counter
        yield c("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.",
                (st.loaded_cpu_blocks + st.loaded_remote_blocks) * bpb)
        yield c("vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.",
                st.load_transfer_seconds)
        yield c("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.",
                st.stored_blocks * bpb)
        yield c("vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds.",
                st.store_seconds)
        yield c("vllm:kv_offload_allocation_failure", "Number of KV offload store allocation attempts that failed.",
                st.store_allocation_failures)
        yield c("kvmesh_sim_offload_evicted_blocks", "Blocks the CPU tier's LRU evicted.", st.evicted_blocks)
        yield c("kvmesh_sim_offload_loads", "Loads from the offloaded tiers (one per request load).", st.loads)
        loaded = CounterMetricFamily("kvmesh_sim_offload_loaded_blocks", "Blocks loaded to the GPU, by source tier.",
                                     labels=[*self._names, "source"])
        loaded.add_metric([*self._values, "cpu"], st.loaded_cpu_blocks)
        loaded.add_metric([*self._values, "kv_store"], st.loaded_remote_blocks)
        yield loaded
        yield c("kvmesh_sim_offload_store_skipped_blocks",
                "Blocks not offloaded: the CPU tier or the in-flight bound was full of blocks being stored.",
                st.store_skipped_blocks)
        yield c("kvmesh_sim_offload_puts_done", "kv_store puts acknowledged.", st.puts_done)
        yield c("kvmesh_sim_offload_puts_failed", "kv_store puts that failed (kv_store down or refusing).",
                st.puts_failed)
        yield c("kvmesh_sim_offload_puts_skipped", "Blocks not written to kv_store: too many puts pending.",
                st.puts_skipped)
        yield c("kvmesh_sim_offload_remote_lookups", "Batched kv_store Lookup RPCs answered.", st.remote_lookups)
        yield c("kvmesh_sim_offload_remote_lookup_failures",
                "kv_store Lookup RPCs that failed; their blocks were recomputed.", st.remote_lookup_failures)
        yield c("kvmesh_sim_offload_remote_missing_blocks",
                "Blocks believed in kv_store that kv_store no longer held (forgotten and recomputed).",
                st.remote_missing_blocks)
        yield c("kvmesh_sim_offload_remote_degraded_misses",
                "Lookups that counted a kv_store block a miss because kv_store failed recently.",
                st.remote_degraded_misses)
        yield c("kvmesh_sim_offload_deferrals",
                "Requests passed over for a step: kv_store confirming their blocks, or another request loading them.",
                st.remote_lookup_deferrals + st.load_deferrals)
        yield self._gauge("kvmesh_sim_offload_cpu_blocks", "Blocks in the CPU tier.", off.num_cpu_blocks)
        yield self._gauge("kvmesh_sim_offload_remote_blocks", "kv_store blocks the connector remembers.",
                          off.num_remote_blocks)
