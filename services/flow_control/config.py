"""FlowControlConfig: every knob of the flow_control service (flags > env > file > defaults).

Bands and policies follow GIE's ``FlowControlConfig`` / ``PriorityBandConfig``; a YAML file
(``--config``) is the natural place for ``bands``::

    fairness_policy: round-robin-fairness-policy
    bands:
      - {priority: 10, name: interactive, ordering_policy: slo-deadline-ordering-policy}
      - {priority: 0, name: standard, max_requests: 5000}
      - {priority: -10, name: batch, ttl_seconds: 120}
      - {priority: 1, name: agents, max_saturation: 0.8}   # leaves headroom to higher bands
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig
from services.flow_control.bands import BandConfig
from services.flow_control.controller import ControllerLimits
from services.flow_control.policies import DEFAULT_FAIRNESS_POLICY, DEFAULT_ORDERING_POLICY
from services.flow_control.saturation import SaturationDetector


class BandSpec(BaseModel):
    """One priority band (GIE ``PriorityBandConfig``); limits of 0 mean "none"."""

    model_config = ConfigDict(extra="forbid")

    priority: int = Field(ge=-(2**31), le=2**31 - 1)
    name: str = Field("", max_length=64)
    max_requests: int = Field(0, ge=0)
    max_bytes: int = Field(0, ge=0)
    ttl_seconds: float = Field(0.0, ge=0, le=3600)
    fairness_policy: str = ""
    ordering_policy: str = ""
    max_saturation: float = Field(0.0, ge=0, le=10)

    def band(self) -> BandConfig:
        return BandConfig(self.priority, self.name, self.max_requests, self.max_bytes, self.ttl_seconds,
                          self.fairness_policy, self.ordering_policy, self.max_saturation)


class FlowControlConfig(GrpcServiceConfig):
    """Admission control: priority bands, fairness across flows, pool saturation, TTLs, shedding."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_FLOW_CONTROL_")

    max_in_flight: int = Field(256, ge=1, le=1_000_000)
    """Requests dispatched and not yet released, across all flows: a hard cap beside the saturation detector."""
    queue_ttl_seconds: float = Field(30.0, gt=0, le=3600)
    """Global queue TTL: a request waits at most min(this, its band's TTL, its own TTL), then EVICTED_TTL."""
    max_queue_size: int = Field(10_000, ge=0, le=10_000_000)
    """Requests that may wait at once, all bands; more are rejected (REJECTED_CAPACITY). 0 disables queueing."""
    max_queue_bytes: int = Field(0, ge=0)
    """Request-body bytes that may wait at once, all bands (GIE's global MaxBytes); 0 = no limit."""
    fairness_policy: str = DEFAULT_FAIRNESS_POLICY
    """Fairness policy of bands that name none: global-strict-fairness-policy, round-robin-fairness-policy,
    least-attained-service-fairness-policy."""
    ordering_policy: str = DEFAULT_ORDERING_POLICY
    """Ordering policy of bands that name none: fcfs-ordering-policy, edf-ordering-policy, slo-deadline-ordering-policy."""
    fairness_weights: dict[str, float] = Field(default_factory=dict)
    """Fairness id -> weight for least-attained-service-fairness-policy (default 1)."""
    bands: list[BandSpec] = Field(default_factory=list)
    """Configured priority bands; requests of other priorities get a band like default_band."""
    default_band: BandSpec = Field(default_factory=lambda: BandSpec.model_validate({"priority": 0}))
    """Template of bands created on first use (its priority and name are ignored)."""
    fairness_window_seconds: float = Field(10.0, gt=0, le=3600)
    """Window of each flow's served-token share and Jain's index (metrics, Stats)."""
    max_flow_labels: int = Field(1000, ge=1, le=100_000)
    """Distinct fairness ids given their own ``flow`` metric label; later ones share ``_other``. Also the
    most ``(band, flow)`` label pairs at once, all bands together: a pair past it is ``(band, _other)``.
    A label costs about 3 lines of ``/metrics`` (the wait's count and sum), up to 8 while the flow is
    active; histograms are per band only (docs/flow-control.md, "Observability")."""
    max_dynamic_bands: int = Field(16, ge=0, le=10_000)
    """Bands created on first use of a priority not in ``bands`` that may exist at once (configured bands
    never count). Priorities are client input (``x-kvmesh-priority``, the gRPC ``priority`` field): past
    the cap a request joins the nearest existing band at or below its priority with the same
    sheddability (``kvmesh_flow_control_band_overflow_total``). The bands of priority 0 (requests that
    name none) and ``admission_credit_priority`` never count and are always created. 0 = no other
    dynamic band (plus one when no band exists at all)."""
    dynamic_band_idle_seconds: float = Field(300.0, gt=0, le=86_400)
    """A dynamic band with nothing queued or in flight for this long is removed with its metric
    label sets (GIE's ``priorityBandGCTimeout``)."""
    epp_address: str = ""
    """host:port of epp, whose ListEndpoints gives the engines' scraped metrics (the saturation signal);
    empty = no pool signal (max_in_flight alone)."""
    pool_poll_interval_seconds: float = Field(0.1, gt=0, le=60)
    """How often epp's endpoint metrics are read (epp scrapes a busy engine every 0.1 s: reading faster
    only re-reads the same sample; docs/BENCHMARKS.md §3, idle cost)."""
    pool_idle_poll_interval_seconds: float = Field(1.0, gt=0, le=60)
    """How often epp is read while nothing is queued or in flight (capped at half of
    ``metrics_staleness_seconds``, so an idle pool's snapshot never goes stale and the first request
    after an idle spell is judged on fresh numbers). Epp scrapes an idle engine every 1 s, so reading
    it faster only re-reads the same samples; was 0.5 s (idle cost, docs/BENCHMARKS.md §3, issue 10)."""
    queue_depth_threshold: float = Field(5.0, gt=0, le=100_000)
    """An endpoint has room while vllm:num_requests_waiting is below this (GIE utilization-detector's QueueDepthThreshold)."""
    kv_cache_util_threshold: float = Field(0.8, gt=0, le=1)
    """... and vllm:kv_cache_usage_perc is below this (KVCacheUtilThreshold)."""
    metrics_staleness_seconds: float = Field(2.0, gt=0, le=600)
    """Metrics older than this are stale: dispatch fails open (MetricsStalenessThreshold). 2 s, as
    epp's ``max_metrics_age_seconds``: admission and the scheduler call the same samples fresh (an idle
    engine's, scraped every 1 s and read every 1 s, is up to ~2 s old). Was 1.0 s."""
    dispatch_visibility_seconds: float = Field(0.05, ge=0, le=10)
    """A dispatch counts against the pool's room until a sample taken this long after it arrives."""
    engine_max_num_seqs: int = Field(0, ge=0, le=1_000_000)
    """The engines' ``--max-num-seqs`` (most requests one runs at once): dispatches not yet visible in
    a sample take the running slots an engine can still start before they count against its
    queue-depth allowance. vLLM 0.32 exposes no metric for it (``vllm:cache_config_info`` carries
    KV sizes only), so 0 (the default) learns each endpoint's from the highest
    ``vllm:num_requests_running`` it reported (``saturation.py``); set it when every engine's is known."""
    admission_credits: int = Field(4, ge=0, le=1024)
    """Admission credits lent to each ``AdmitMany`` stream that asks (the router's): pre-admitted
    slots, lent while nothing is queued and the pool has room (at most half the free room in all),
    each counted as a request in flight;
    a request spent on one is dispatched by the router without waiting for a decision. Revoked as
    soon as anything queues or the pool saturates. 0 = lend none (docs/flow-control.md)."""
    admission_credit_priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    """The band whose requests credits are for (requests of other bands always wait for the decision)."""

    def limits(self) -> ControllerLimits:
        return ControllerLimits(
            max_in_flight=self.max_in_flight,
            queue_ttl_seconds=self.queue_ttl_seconds,
            max_queue_size=self.max_queue_size,
            max_queue_bytes=self.max_queue_bytes,
            bands=tuple(b.band() for b in self.bands),
            default_band=self.default_band.band(),
            fairness_policy=self.fairness_policy,
            ordering_policy=self.ordering_policy,
            fairness_weights=dict(self.fairness_weights),
            fairness_window_seconds=self.fairness_window_seconds,
            admission_credits=self.admission_credits,
            admission_credit_priority=self.admission_credit_priority,
            max_dynamic_bands=self.max_dynamic_bands,
            dynamic_band_idle_seconds=self.dynamic_band_idle_seconds,
        )

    def detector(self) -> SaturationDetector | None:
        """The saturation detector, or None without ``epp_address``."""
        if not self.epp_address:
            return None
        return SaturationDetector(self.queue_depth_threshold, self.kv_cache_util_threshold,
                                  self.metrics_staleness_seconds, self.dispatch_visibility_seconds,
                                  self.engine_max_num_seqs)
