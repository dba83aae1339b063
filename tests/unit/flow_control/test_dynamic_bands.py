"""Client-chosen priorities and fairness ids cannot grow flow_control's bands or /metrics without limit.

Priorities are client input (``x-kvmesh-priority``, the gRPC ``priority`` field, a numeric
``x-gateway-inference-objective``). GIE (``pkg/epp/flowcontrol/registry``) creates a band from
``defaultPriorityBand`` for an unknown priority and garbage-collects it after
``priorityBandGCTimeout`` idle; kvmesh does both and also caps how many exist at once
(``max_dynamic_bands``), mapping priorities past the cap to the nearest existing band.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.clock import ManualClock
from services.flow_control.bands import BandConfig
from services.flow_control.config import FlowControlConfig
from services.flow_control.controller import ControllerLimits, FlowController, TicketState
from services.flow_control.metrics import ControllerCollector, PrometheusObserver
from services.flow_control.types import AdmissionRequest, QueueOutcome

CONFIGURED = (BandConfig(10, "interactive"), BandConfig(-10, "batch"))


def _controller(
    clock: ManualClock, registry: CollectorRegistry, *, max_dynamic_bands: int = 16, idle: float = 300.0,
    max_flow_labels: int = 1000, max_in_flight: int = 100_000, bands: tuple[BandConfig, ...] = CONFIGURED,
) -> FlowController:
    observer = PrometheusObserver(registry, max_flow_labels=max_flow_labels)
    limits = ControllerLimits(max_in_flight, 30.0, 10_000, bands=bands, max_dynamic_bands=max_dynamic_bands,
                              dynamic_band_idle_seconds=idle)
    controller = FlowController(limits, clock, observer=observer)
    observer.band_label = controller.band_label
    observer.before_scrape = controller.collect_idle_bands
    registry.register(ControllerCollector(controller, observer.flow_label))
    return controller


def _priorities(controller: FlowController) -> list[int]:
    return [b.priority for b in controller.stats().bands]


def test_dynamic_bands_are_capped_and_configured_bands_do_not_count() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=3)
    for priority in range(1, 9):
        controller.release(controller.enqueue(AdmissionRequest(f"r{priority}", priority=priority, flow_id="t")))
    assert _priorities(controller) == [10, 3, 2, 1, -10]  # 2 configured + the first 3 dynamic
    assert controller.stats().dynamic_bands == 3
    assert registry.get_sample_value("kvmesh_flow_control_dynamic_bands") == 3
    # priorities 4..8 had no band: each joined band 3 (the nearest at or below it)
    assert registry.get_sample_value("kvmesh_flow_control_band_overflow_total", {"band": "3"}) == 5
    assert registry.get_sample_value(
        "kvmesh_flow_control_band_outcome_total", {"band": "3", "outcome": "dispatched"}) == 6
    for priority in range(4, 9):
        assert registry.get_sample_value(
            "kvmesh_flow_control_band_outcome_total", {"band": str(priority), "outcome": "dispatched"}) is None


def test_a_priority_past_the_cap_joins_the_nearest_band_never_a_higher_one_and_keeps_its_sheddability() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=2, max_in_flight=1)
    blocker = controller.enqueue(AdmissionRequest("blocker", priority=10))  # fills max_in_flight
    controller.enqueue(AdmissionRequest("five", priority=5))  # dynamic band 5 (queued)
    controller.enqueue(AdmissionRequest("one", priority=1))  # dynamic band 1 (queued); the cap is reached
    assert _priorities(controller) == [10, 5, 1, -10]
    cases = {7: 5, 100: 10, 3: 1, 5: 5, -3: -10, -20: -10}
    for asked, joined in cases.items():
        ticket = controller.enqueue(AdmissionRequest(f"p{asked}", priority=asked))
        assert ticket.request.priority == joined, asked
        assert ticket.band is not None and ticket.band.priority == joined
        if joined < 0:  # a sheddable priority stays sheddable: shed while requests are in flight at the limit
            assert ticket.decision is not None and ticket.decision.outcome is QueueOutcome.SHED
        else:
            assert ticket.state is TicketState.QUEUED
    assert _priorities(controller) == [10, 5, 1, -10]
    overflow = {b: registry.get_sample_value("kvmesh_flow_control_band_overflow_total", {"band": b})
                for b in ("interactive", "5", "1", "batch")}
    assert overflow == {"interactive": 1, "5": 1, "1": 1, "batch": 2}
    # priority 0 (what requests naming none get) always has its own band, beyond the cap
    assert controller.enqueue(AdmissionRequest("default", priority=0)).request.priority == 0
    assert _priorities(controller) == [10, 5, 1, 0, -10]
    assert controller.stats().dynamic_bands == 3
    controller.release(blocker)


def test_only_sheddable_bands_left_a_non_sheddable_priority_joins_the_lowest_band() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=0, bands=(BandConfig(-5), BandConfig(-1)))
    ticket = controller.enqueue(AdmissionRequest("x", priority=3))
    assert ticket.request.priority == -1  # the nearest below is the highest band there is
    assert _priorities(controller) == [-1, -5]


def test_no_band_configured_and_no_dynamic_bands_allowed_still_serves_requests() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=0, bands=())
    first = controller.enqueue(AdmissionRequest("a", priority=4))
    second = controller.enqueue(AdmissionRequest("b", priority=9))
    assert first.state is second.state is TicketState.DISPATCHED
    assert _priorities(controller) == [4]


def test_idle_dynamic_bands_are_removed_with_their_label_sets() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=4, idle=60.0, max_in_flight=1)
    busy = controller.enqueue(AdmissionRequest("busy", priority=3, flow_id="tenant-a"))  # in flight
    queued = controller.enqueue(AdmissionRequest("queued", priority=2, flow_id="tenant-b"))  # waits
    done = controller.enqueue(AdmissionRequest("done", priority=10, flow_id="tenant-c"))  # configured, queued
    assert busy.state is TicketState.DISPATCHED and queued.state is TicketState.QUEUED
    value = registry.get_sample_value
    assert value("kvmesh_flow_control_band_outcome_total", {"band": "3", "outcome": "dispatched"}) == 1
    assert value("kvmesh_flow_control_flow_queue_wait_seconds_count", {"band": "3", "flow": "tenant-a"}) == 1

    clock.advance(600.0)  # far past the idle time, but band 3 has a request in flight, band 2 one queued
    controller.release(queued)
    assert _priorities(controller) == [10, 3, 2, -10]  # band 2 was just touched by the release
    controller.release(busy)  # the configured-band request waited past its TTL: evicted
    controller.release(done)
    clock.advance(59.0)
    assert _priorities(controller) == [10, 3, 2, -10]
    clock.advance(1.0)
    generate_latest(registry)  # a scrape collects idle bands
    assert _priorities(controller) == [10, -10]
    assert value("kvmesh_flow_control_bands_removed_total") == 2
    assert value("kvmesh_flow_control_dynamic_bands") == 0
    assert value("kvmesh_flow_control_band_outcome_total", {"band": "3", "outcome": "dispatched"}) is None
    assert value("kvmesh_flow_control_band_outcome_total", {"band": "2", "outcome": "evicted_cancelled"}) is None
    assert value("kvmesh_flow_control_flow_queue_wait_seconds_count", {"band": "3", "flow": "tenant-a"}) is None
    assert value("kvmesh_flow_control_band_outcome_total", {"band": "interactive", "outcome": "evicted_ttl"}) == 1
    text = generate_latest(registry).decode()
    assert 'band="3"' not in text and 'band="2"' not in text
    # the priority comes back: a fresh band
    controller.release(controller.enqueue(AdmissionRequest("again", priority=3, flow_id="tenant-a")))
    assert _priorities(controller) == [10, 3, -10]
    assert value("kvmesh_flow_control_band_outcome_total", {"band": "3", "outcome": "dispatched"}) == 1


def test_a_new_priority_at_the_cap_first_removes_idle_bands() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_dynamic_bands=2, idle=30.0)
    for priority in (1, 2):
        controller.release(controller.enqueue(AdmissionRequest(f"r{priority}", priority=priority)))
    clock.advance(31.0)
    ticket = controller.enqueue(AdmissionRequest("r7", priority=7))  # no scrape in between
    assert ticket.request.priority == 7
    assert _priorities(controller) == [10, 7, -10]
    assert registry.get_sample_value("kvmesh_flow_control_band_overflow_total", {"band": "2"}) is None


def test_band_flow_label_pairs_are_bounded_in_all() -> None:
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_flow_labels=5, max_dynamic_bands=4)
    for i in range(40):
        controller.release(controller.enqueue(AdmissionRequest(f"r{i}", priority=i % 4, flow_id=f"t{i}")))
    pairs = {(s.labels["band"], s.labels["flow"])
             for m in registry.collect() if m.name == "kvmesh_flow_control_flow_queue_wait_seconds"
             for s in m.samples if s.name.endswith("_count")}
    assert len([p for p in pairs if p[1] != "_other"]) == 5
    assert {p for p in pairs if p[1] == "_other"} == {(str(b), "_other") for b in range(4)}


def _metric_lines(registry: CollectorRegistry) -> int:
    return generate_latest(registry).decode().count("\n")


def test_metrics_stay_bounded_after_3000_distinct_priorities_and_fairness_ids() -> None:
    """The user's case: 3,200 priorities took /metrics to 73,865 lines. With the defaults the
    series stop growing once the caps are reached; a second 3,000 adds nothing."""
    defaults = FlowControlConfig()
    clock, registry = ManualClock(), CollectorRegistry()
    controller = _controller(clock, registry, max_flow_labels=defaults.max_flow_labels,
                             max_dynamic_bands=defaults.max_dynamic_bands, idle=defaults.dynamic_band_idle_seconds,
                             bands=())
    baseline = _metric_lines(registry)

    def burst(start: int) -> None:
        held = []
        for i in range(start, start + 3000):
            held.append(controller.enqueue(AdmissionRequest(f"r{i}", priority=i - 1500, flow_id=f"tenant-{i}")))
            if len(held) > 50:  # some in flight, some queued at any time
                controller.release(held.pop(0))
        for ticket in held:
            controller.release(ticket)

    burst(0)
    after_3000 = _metric_lines(registry)
    burst(3000)
    after_6000 = _metric_lines(registry)
    assert len(controller.stats().bands) <= defaults.max_dynamic_bands + 1  # + priority 0's
    assert after_6000 == after_3000
    # per (band, flow) pair, at most max_flow_labels + 16 of them: the wait summary's count + sum + created
    # (3 lines; was an 18-line histogram); the histograms are per band (17 bands, 18 lines each)
    assert after_3000 - baseline <= 3 * (defaults.max_flow_labels + 16) + 18 * 17 + 2 * (defaults.max_flow_labels + 1)
    assert after_3000 < 4_000  # was 18,248
    # the rest goes with the bands once they idle out
    clock.advance(defaults.dynamic_band_idle_seconds)
    assert _metric_lines(registry) <= baseline + 50
    assert controller.stats().bands == ()


def test_max_dynamic_bands_is_a_documented_config_field() -> None:
    config = FlowControlConfig.model_validate({"max_dynamic_bands": 4, "dynamic_band_idle_seconds": 90})
    limits = config.limits()
    assert (limits.max_dynamic_bands, limits.dynamic_band_idle_seconds) == (4, 90.0)
    assert FlowControlConfig().max_dynamic_bands == 16
