"""Prometheus metrics of flow_control: an observer for events, a collector for state read at scrape time.

Events (:class:`PrometheusObserver`, written as they happen):

| name | type | labels |
|---|---|---|
| ``kvmesh_flow_control_queue_size`` | gauge | |
| ``kvmesh_flow_control_in_flight`` | gauge | |
| ``kvmesh_flow_control_outcome_total`` | counter | ``outcome`` (:class:`QueueOutcome` values) |
| ``kvmesh_flow_control_queue_duration_seconds`` | histogram | ``outcome`` |
| ``kvmesh_flow_control_band_outcome_total`` | counter | ``band``, ``outcome`` |
| ``kvmesh_flow_control_band_queue_wait_seconds`` | histogram | ``band`` (wait of dispatched requests) |
| ``kvmesh_flow_control_flow_queue_wait_seconds`` | summary (``_count``, ``_sum``; no quantiles) | ``band``, ``flow`` (wait of dispatched requests) |
| ``kvmesh_flow_control_pool_poll_total`` | counter | ``result``: ok, error (epp ``ListEndpoints``) |
| ``kvmesh_flow_control_admission_credits_total`` | counter | ``event``: lent, spent, returned, freed, overdrawn |
| ``kvmesh_flow_control_admission_credit_revocations_total`` | counter | ``reason``: queued, saturated, max_in_flight |
| ``kvmesh_flow_control_band_overflow_total`` | counter | ``band``: requests whose priority had no band once ``max_dynamic_bands`` existed, by the band they joined |
| ``kvmesh_flow_control_bands_removed_total`` | counter | (idle dynamic bands removed, with their label sets) |

State (:class:`ControllerCollector`, computed from ``FlowController.stats()`` at each scrape):

| name | type | labels |
|---|---|---|
| ``kvmesh_flow_control_band_queue_size`` / ``_band_queue_bytes`` / ``_band_in_flight`` | gauge | ``band`` |
| ``kvmesh_flow_control_flow_queue_size`` / ``_flow_in_flight`` / ``_flow_oldest_wait_seconds`` | gauge | ``band``, ``flow`` |
| ``kvmesh_flow_control_flow_served_tokens`` / ``_flow_share`` | gauge | ``flow`` (over the fairness window) |
| ``kvmesh_flow_control_jain_index`` | gauge | (Jain's index of served tokens over the window) |
| ``kvmesh_flow_control_pool_saturation`` / ``_saturated`` / ``_saturation_stale`` / ``_saturation_headroom`` | gauge | |
| ``kvmesh_flow_control_pool_running_capacity`` / ``_saturation_unseen_dispatches`` | gauge | (max_num_seqs summed; dispatches not yet in a sample) |
| ``kvmesh_flow_control_admission_credits_lent`` | gauge | (credits lent, neither spent nor returned) |
| ``kvmesh_flow_control_dynamic_bands`` | gauge | (bands created from the default band that exist now) |

Every label value a client can choose is bounded. ``band``: the configured bands plus at most
``max_dynamic_bands`` dynamic ones (priorities past the cap join an existing band); a dynamic band
removed when idle takes its label sets with it (``remove``). ``flow``: the fairness id for the first
``max_flow_labels`` ids seen, then ``_other``; and a ``(band, flow)`` pair gets its own series only
while fewer than ``max_flow_labels`` pairs exist, all bands together, else ``(band, _other)``. So
the per-flow series are at most ``max_flow_labels + bands`` per family.

What a flow label costs: distributions are per band only (a histogram is 18 lines a series: 14
buckets, ``+Inf``, ``_count``, ``_sum``, ``_created``); per ``(band, flow)`` the wait is a summary
without quantiles, 3 lines (``_count``, ``_sum``, ``_created``: the mean wait per flow is
``rate(_sum) / rate(_count)``), and the state gauges exist only for flows with something queued or
in flight (3 lines) or served within the fairness window (2 lines). GIE's
``flow_control_request_queue_duration_seconds`` is a histogram per ``fairness_id``, ``priority`` and
``outcome``, unbounded. With the defaults, 3,000 distinct priorities and fairness ids give ~3,500
lines (was ~18,200 with a histogram per flow), ~7,600 while every labelled flow is active.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.flow_control.types import AdmissionRequest, QueueOutcome

if TYPE_CHECKING:
    from services.flow_control.controller import FlowController

QUEUE_DURATION_BUCKETS_SECONDS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OTHER_FLOWS = "_other"


class FlowLabels:
    """Bounded flow label values: the first ``limit`` fairness ids, then ``_other``; and bounded
    ``(band, flow)`` pairs (:meth:`pair`): at most ``limit`` in all, then ``(band, _other)``."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self._known: set[str] = set()
        self._pairs: dict[str, set[str]] = {}
        self._pair_count = 0

    def pair(self, band: str, flow_id: str) -> str:
        """The ``flow`` label of ``flow_id`` in band ``band``."""
        flow = self(flow_id)
        known = self._pairs.setdefault(band, set())
        if flow in known or flow == OTHER_FLOWS:
            return flow
        if self._pair_count < self.limit:
            known.add(flow)
            self._pair_count += 1
            return flow
        return OTHER_FLOWS

    def forget_band(self, band: str) -> set[str]:
        """Band ``band`` is gone: its pairs are free again; returns its flow labels."""
        known = self._pairs.pop(band, set())
        self._pair_count -= len(known)
        return known | {OTHER_FLOWS}

    def __call__(self, flow_id: str) -> str:
        if flow_id in self._known:
            return flow_id
        if len(self._known) < self.limit:
            self._known.add(flow_id)
            return flow_id
        return OTHER_FLOWS


def _nothing() -> None:
    pass


class _BeforeScrape(Collector):
    """Registered before the observer's families: runs ``observer.before_scrape()``, yields nothing."""

    def __init__(self, observer: PrometheusObserver) -> None:
        self._observer = observer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self._observer.before_scrape()
        return iter(())


class PrometheusObserver:
    """A :class:`~services.flow_control.controller.ControllerObserver` that records metrics.

    ``band_label`` maps a priority to its band name (``FlowController.band_label``); set
    ``before_scrape`` to ``FlowController.collect_idle_bands``.
    """

    def __init__(
        self, registry: CollectorRegistry = REGISTRY, band_label: Callable[[int], str] = str, max_flow_labels: int = 1000,
    ) -> None:
        self.band_label = band_label
        self.flow_label = FlowLabels(max_flow_labels)
        self.before_scrape: Callable[[], object] = _nothing
        """Called first at each scrape (``FlowController.collect_idle_bands``): a band removed as idle is
        gone from that very scrape, since this runs before the families below are read."""
        registry.register(_BeforeScrape(self))
        self.queue_size = Gauge(
            "kvmesh_flow_control_queue_size", "Requests waiting in the admission queue.", registry=registry
        )
        self.in_flight = Gauge(
            "kvmesh_flow_control_in_flight", "Requests dispatched and not yet released.", registry=registry
        )
        self.outcomes = Counter(
            "kvmesh_flow_control_outcome", "Requests by admission outcome.", ["outcome"], registry=registry
        )
        self.queue_duration = Histogram(
            "kvmesh_flow_control_queue_duration_seconds",
            "Seconds a request waited before its outcome.",
            ["outcome"],
            buckets=QUEUE_DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        self.band_outcomes = Counter(
            "kvmesh_flow_control_band_outcome", "Requests by priority band and admission outcome.",
            ["band", "outcome"], registry=registry,
        )
        self.band_wait = Histogram(
            "kvmesh_flow_control_band_queue_wait_seconds", "Seconds dispatched requests waited, by band.",
            ["band"], buckets=QUEUE_DURATION_BUCKETS_SECONDS, registry=registry,
        )
        self.flow_wait = Summary(  # count and sum only: a histogram per flow label cost 18 lines, this 3
            "kvmesh_flow_control_flow_queue_wait_seconds", "Seconds dispatched requests waited, by band and flow "
            "(count and sum; the distribution is kvmesh_flow_control_band_queue_wait_seconds, per band).",
            ["band", "flow"], registry=registry,
        )
        self.pool_polls = Counter(
            "kvmesh_flow_control_pool_poll", "Reads of epp's endpoint metrics (the saturation signal).",
            ["result"], registry=registry,
        )
        self.credits = Counter(
            "kvmesh_flow_control_admission_credits", "Admission credits by event: lent to an AdmitMany stream, "
            "spent on a request, returned after a revoke, freed by the stream's end, overdrawn (a request on a "
            "credit its stream did not hold).", ["event"], registry=registry,
        )
        self.credit_revocations = Counter(
            "kvmesh_flow_control_admission_credit_revocations", "Revocations of a stream's admission credits, by reason.",
            ["reason"], registry=registry,
        )
        for outcome in QueueOutcome:  # export every series from the start
            self.outcomes.labels(outcome.value)
        for result in ("ok", "error"):
            self.pool_polls.labels(result)
        for event in ("lent", "spent", "returned", "freed", "overdrawn"):
            self.credits.labels(event)
        for reason in ("queued", "saturated", "max_in_flight"):
            self.credit_revocations.labels(reason)
        self.band_overflow = Counter(
            "kvmesh_flow_control_band_overflow", "Requests whose priority had no band once max_dynamic_bands "
            "dynamic bands existed, by the band they joined.", ["band"], registry=registry,
        )
        self.bands_removed = Counter(
            "kvmesh_flow_control_bands_removed", "Idle dynamic bands removed (dynamic_band_idle_seconds).",
            registry=registry,
        )

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        waited = max(queue_seconds, 0.0)
        band = self.band_label(request.priority)
        self.outcomes.labels(outcome.value).inc()
        self.queue_duration.labels(outcome.value).observe(waited)
        self.band_outcomes.labels(band, outcome.value).inc()
        if outcome is QueueOutcome.DISPATCHED:
            self.band_wait.labels(band).observe(waited)
            self.flow_wait.labels(band, self.flow_label.pair(band, request.flow_id)).observe(waited)

    def on_state(self, queued: int, in_flight: int) -> None:
        self.queue_size.set(queued)
        self.in_flight.set(in_flight)

    def on_band_mapped(self, priority: int, band: str) -> None:
        """A request of ``priority`` joined ``band`` (no band of its own: the cap was reached)."""
        self.band_overflow.labels(band).inc()

    def on_band_removed(self, band: str) -> None:
        """Idle dynamic band ``band`` was removed: drop every label set naming it."""
        self.bands_removed.inc()
        for outcome in QueueOutcome:
            self.band_outcomes.remove(band, outcome.value)
        self.band_overflow.remove(band)
        self.band_wait.remove(band)
        for flow in self.flow_label.forget_band(band):
            self.flow_wait.remove(band, flow)

    def pool_poll(self, result: str) -> None:
        self.pool_polls.labels(result).inc()

    def on_credits(self, event: str, credits: int, reason: str = "") -> None:
        """Admission credit events (:class:`~services.flow_control.controller.CreditObserver`)."""
        if event == "revoked":
            self.credit_revocations.labels(reason).inc(credits)
        else:
            self.credits.labels(event).inc(credits)


class ControllerCollector(Collector):
    """Per-band and per-flow state, fairness shares and saturation, read from the controller at scrape time."""

    def __init__(self, controller: FlowController, flow_label: Callable[[str], str]) -> None:
        self._controller = controller
        self._flow_label = flow_label
        pair = getattr(flow_label, "pair", None)  # a FlowLabels bounds (band, flow) pairs too
        self._pair_label: Callable[[str, str], str] = pair if pair is not None else lambda band, flow: flow_label(flow)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._controller.stats()
        p = "kvmesh_flow_control_"
        band_q = GaugeMetricFamily(p + "band_queue_size", "Requests waiting per band.", labels=["band"])
        band_b = GaugeMetricFamily(p + "band_queue_bytes", "Request bytes waiting per band.", labels=["band"])
        band_f = GaugeMetricFamily(p + "band_in_flight", "Requests in flight per band.", labels=["band"])
        names = {}
        for b in stats.bands:
            names[b.priority] = b.name
            band_q.add_metric([b.name], b.queued)
            band_b.add_metric([b.name], b.queued_bytes)
            band_f.add_metric([b.name], b.in_flight)
        flow_q = GaugeMetricFamily(p + "flow_queue_size", "Requests waiting per flow.", labels=["band", "flow"])
        flow_f = GaugeMetricFamily(p + "flow_in_flight", "Requests in flight per flow.", labels=["band", "flow"])
        flow_w = GaugeMetricFamily(p + "flow_oldest_wait_seconds", "Age of the oldest waiting request per flow.",
                                   labels=["band", "flow"])
        served: dict[str, float] = {}
        queued: dict[tuple[str, str], list[float]] = {}
        for f in stats.flows:
            band = names.get(f.priority, str(f.priority))
            key = (band, self._pair_label(band, f.flow_id))
            row = queued.setdefault(key, [0, 0, 0.0])
            row[0] += f.queued
            row[1] += f.in_flight
            row[2] = max(row[2], f.oldest_wait_seconds)
        for (band, flow), (q, inflight, wait) in queued.items():
            flow_q.add_metric([band, flow], q)
            flow_f.add_metric([band, flow], inflight)
            flow_w.add_metric([band, flow], wait)
        for f in stats.flows:
            label = self._flow_label(f.flow_id)
            served[label] = max(served.get(label, 0), f.served_tokens)
        whole = sum(served.values())
        tokens = GaugeMetricFamily(p + "flow_served_tokens", "Prompt + completion tokens served per flow over the "
                                   "fairness window.", labels=["flow"])
        share = GaugeMetricFamily(p + "flow_share", "Each flow's share of the tokens served over the fairness window.",
                                  labels=["flow"])
        for flow, value in served.items():
            tokens.add_metric([flow], value)
            share.add_metric([flow], value / whole if whole else 0.0)
        jain = GaugeMetricFamily(p + "jain_index", "Jain's fairness index of served tokens over the fairness window.",
                                 value=stats.jain_index)
        yield from (band_q, band_b, band_f, flow_q, flow_f, flow_w, tokens, share, jain)
        yield GaugeMetricFamily(p + "admission_credits_lent", "Admission credits lent and neither spent nor returned "
                                "(each counts as a request in flight).", value=stats.credits_lent)
        yield GaugeMetricFamily(p + "dynamic_bands", "Bands created from the default band that exist now "
                                "(at most max_dynamic_bands; idle ones are removed).", value=stats.dynamic_bands)
        sat = stats.saturation
        if sat is not None:
            yield GaugeMetricFamily(p + "pool_saturation", "Pool load vs the detector's thresholds (1 = full).",
                                    value=sat.saturation)
            yield GaugeMetricFamily(p + "saturated", "1 while the pool has no room (dispatch holds).",
                                    value=float(sat.saturated))
            yield GaugeMetricFamily(p + "saturation_stale", "1 while engine metrics are stale (dispatch fails open).",
                                    value=float(sat.stale))
            yield GaugeMetricFamily(p + "saturation_headroom", "Requests the pool can still take (capped at 1e9).",
                                    value=min(sat.headroom, 1e9))
            yield GaugeMetricFamily(p + "pool_running_capacity", "Requests the fresh endpoints can run at once "
                                    "(max_num_seqs, configured or learned; 0 while unknown).", value=sat.running_capacity)
            yield GaugeMetricFamily(p + "saturation_unseen_dispatches", "Dispatches the last engine sample cannot "
                                    "show yet (counted against the room).", value=float(sat.unseen_dispatches))
