"""The saturation detector (GIE utilization-detector thresholds + in-flight accounting) and the controller over it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvmesh.clock import ManualClock
from services.flow_control.controller import ControllerLimits, FlowController
from services.flow_control.metrics import ControllerCollector, PrometheusObserver
from services.flow_control.saturation import EndpointLoad, PoolSnapshot, SaturationDetector
from services.flow_control.types import AdmissionRequest, QueueOutcome


def pool(now: float, *loads: tuple[float, float], age: float | None = 0.0, model: str = "m") -> PoolSnapshot:
    return PoolSnapshot(tuple(EndpointLoad(f"e{i}", model, w, kv, age) for i, (w, kv) in enumerate(loads)), now)


def make() -> tuple[FlowController, ManualClock, SaturationDetector]:
    clock = ManualClock(10.0)
    detector = SaturationDetector(queue_depth_threshold=2, kv_cache_util_threshold=0.8, metrics_staleness_seconds=1.0,
                                  dispatch_visibility_seconds=0.0)
    controller = FlowController(ControllerLimits(100, 30.0, 100), clock, detector=detector)
    return controller, clock, detector


@pytest.mark.parametrize(
    ("loads", "saturated", "headroom"),
    [
        ([(0, 0.1), (0, 0.1)], False, 4),
        ([(2, 0.1), (5, 0.1)], True, 0),
        ([(0, 0.9), (1, 0.1)], False, 1),
        ([(0, 0.85), (0, 0.95)], True, 0),
    ],
    ids=["idle", "queues-full", "one-kv-full", "kv-full"],
)
def test_thresholds(loads: list[tuple[float, float]], saturated: bool, headroom: float) -> None:
    detector = SaturationDetector(2, 0.8, 1.0)
    detector.update(pool(0.0, *loads))
    state = detector.state(0.0)
    assert (state.saturated, state.stale, state.headroom) == (saturated, False, headroom)


def test_dispatches_since_the_scrape_count_against_the_room() -> None:
    controller, clock, detector = make()
    controller.update_pool(pool(clock.now(), (0, 0.1), (1, 0.1)))  # room for 3
    tickets = [controller.enqueue(AdmissionRequest(str(i), model="m")) for i in range(5)]
    assert [t.decision.outcome if t.decision else None for t in tickets] == [QueueOutcome.DISPATCHED] * 3 + [None, None]
    assert detector.state(clock.now()).unseen_dispatches == 3
    # The next scrape shows them (taken after the dispatches): room is what the engines report.
    clock.advance(0.1)
    controller.update_pool(pool(clock.now(), (1, 0.1), (1, 0.1)))  # 2 waiting of 4: room for 2 more
    assert [t.decision.outcome if t.decision else None for t in tickets[3:]] == [QueueOutcome.DISPATCHED] * 2
    assert controller.stats().queued == 0


def test_sample_older_than_the_dispatches_does_not_free_room() -> None:
    controller, clock, _ = make()
    controller.update_pool(pool(clock.now(), (1, 0.1)))  # room for 1
    first = controller.enqueue(AdmissionRequest("a", model="m"))
    second = controller.enqueue(AdmissionRequest("b", model="m"))
    assert first.decision is not None and second.decision is None
    clock.advance(0.2)
    controller.update_pool(pool(clock.now(), (1, 0.1), age=0.5))  # sampled before "a" was dispatched
    assert second.decision is None


def test_stale_metrics_fail_open() -> None:
    controller, clock, detector = make()
    controller.update_pool(pool(clock.now(), (9, 0.99)))  # saturated
    held = controller.enqueue(AdmissionRequest("held", model="m"))
    assert held.decision is None
    clock.advance(1.5)  # past metrics_staleness_seconds, no new snapshot (epp down)
    state = detector.state(clock.now())
    assert state.stale and not state.saturated
    assert controller.enqueue(AdmissionRequest("open", model="m")).decision is not None
    never_scraped = SaturationDetector()
    never_scraped.update(pool(0.0, (9, 0.99), age=None))
    assert never_scraped.state(0.0).stale


def test_no_endpoint_for_the_model_rejects_at_once_and_at_expiry() -> None:
    controller, clock, _ = make()
    controller.update_pool(pool(clock.now(), (9, 0.99), model="other"))
    ticket = controller.enqueue(AdmissionRequest("x", model="m"))
    assert ticket.decision is not None and ticket.decision.outcome is QueueOutcome.REJECTED_NO_ENDPOINTS
    controller.update_pool(pool(clock.now(), (9, 0.99), model="m"))
    waiting = controller.enqueue(AdmissionRequest("y", model="m"))
    assert waiting.decision is None
    clock.advance(0.5)
    controller.update_pool(pool(clock.now(), model="m"))  # the pool scaled to zero
    clock.advance(30.0)
    controller.update_pool(pool(clock.now(), model="m"))
    assert waiting.decision is not None and waiting.decision.outcome is QueueOutcome.REJECTED_NO_ENDPOINTS


def test_shedding_uses_saturation() -> None:
    controller, clock, _ = make()
    controller.update_pool(pool(clock.now(), (0, 0.1)))
    assert controller.enqueue(AdmissionRequest("b0", priority=-5, model="m")).decision.outcome is QueueOutcome.DISPATCHED  # type: ignore[union-attr]
    controller.update_pool(pool(clock.now(), (5, 0.1)))
    shed = controller.enqueue(AdmissionRequest("b1", priority=-5, model="m"))
    assert shed.decision is not None and shed.decision.outcome is QueueOutcome.SHED
    assert "pool saturated" in shed.decision.reason


def test_collector_exports_band_flow_and_saturation() -> None:
    registry = CollectorRegistry()
    controller, clock, _ = make()
    observer = PrometheusObserver(registry, max_flow_labels=1)
    controller._observer = observer
    registry.register(ControllerCollector(controller, observer.flow_label))
    controller.update_pool(pool(clock.now(), (5, 0.1)))
    controller.enqueue(AdmissionRequest("a", flow_id="t1", priority=3, model="m", byte_size=7))
    controller.enqueue(AdmissionRequest("b", flow_id="t2", priority=3, model="m"))
    value = registry.get_sample_value
    assert value("kvmesh_flow_control_band_queue_size", {"band": "3"}) == 2
    assert value("kvmesh_flow_control_band_queue_bytes", {"band": "3"}) == 7
    assert value("kvmesh_flow_control_flow_queue_size", {"band": "3", "flow": "t1"}) == 1
    assert value("kvmesh_flow_control_flow_queue_size", {"band": "3", "flow": "_other"}) == 1
    assert value("kvmesh_flow_control_saturated") == 1
    assert value("kvmesh_flow_control_saturation_stale") == 0
    assert value("kvmesh_flow_control_jain_index") == 1


def test_room_counts_free_sequences_before_the_kv_threshold() -> None:
    """An engine with 4 running at 40% KV (10% each) under a 0.8 threshold has room for 4 more, plus its queue allowance."""
    detector = SaturationDetector(queue_depth_threshold=2, kv_cache_util_threshold=0.8, metrics_staleness_seconds=1.0)
    detector.update(PoolSnapshot((EndpointLoad("e0", "m", 0, 0.4, 0.0, 4),), 0.0))
    assert detector.state(0.0).headroom == pytest.approx(2 + 4)
    for _ in range(6):
        detector.note_dispatch(0.01)
    state = detector.state(0.02)
    assert state.saturated and state.unseen_dispatches == 6
    # GIE's roofline on the projection: 4 run (KV 0.4 -> 0.8: ratio 1.0), 2 wait (2 / 2: ratio 1.0).
    assert state.saturation == pytest.approx(1.0)


async def test_a_finished_request_stops_counting_against_the_room() -> None:
    """Requests that finish before any sample shows them free their room at release (issue 10: a fast
    pool looked saturated by requests already gone until the next poll), and only once each."""
    controller, clock, detector = make()
    controller.update_pool(pool(clock.now(), (0, 0.1)))  # one endpoint: room for 2 (queue allowance)
    first = controller.enqueue(AdmissionRequest("r1", "f", 0, 10, 10, "m"))
    second = controller.enqueue(AdmissionRequest("r2", "f", 0, 10, 10, "m"))
    assert (await first.wait()).outcome is QueueOutcome.DISPATCHED
    assert (await second.wait()).outcome is QueueOutcome.DISPATCHED
    assert detector.state(clock.now()).saturated  # 2 unseen dispatches fill the room
    controller.release(first)
    state = detector.state(clock.now())
    assert not state.saturated and state.unseen_dispatches == 1
    controller.release(first)  # idempotent: the room is not freed twice
    assert detector.state(clock.now()).unseen_dispatches == 1
    third = controller.enqueue(AdmissionRequest("r3", "f", 0, 10, 10, "m"))
    assert (await third.wait()).outcome is QueueOutcome.DISPATCHED  # at once, no new sample needed


# -- unseen dispatches against the engines' running capacity (issue 10: engine-bound throughput) --------


def load(running: float, waiting: float = 0.0, kv: float = 0.05, eid: str = "e0", age: float = 0.0) -> EndpointLoad:
    return EndpointLoad(eid, "m", waiting, kv, age, running)


def detector_with(max_num_seqs: int = 0, q: float = 5.0) -> SaturationDetector:
    return SaturationDetector(queue_depth_threshold=q, kv_cache_util_threshold=0.8, metrics_staleness_seconds=1.0,
                              dispatch_visibility_seconds=0.0, max_num_seqs=max_num_seqs)


@pytest.mark.parametrize(
    ("running", "waiting", "kv", "headroom", "saturated"),
    [
        (64, 0, 0.3, 5, False),     # at max_num_seqs: only the queue allowance is left
        (64, 4, 0.3, 1, False),     # ... 4 of it already waiting
        (64, 5, 0.3, 0, True),      # GIE: the waiting queue reached the threshold
        (10, 3, 0.05, 56, False),   # room: 54 free slots, the 3 waiting take 3 of them (an engine step away)
        (10, 7, 0.05, 5 + 54 - 7, False),  # 7 waiting but 54 free slots: they start at the next step
        (64, 6, 0.3, 0, True),      # at max_num_seqs, 6 waiting: GIE's threshold, no room
        (10, 0, 0.79, 5 + 0.01 / 0.079, False),  # KV bound below max_num_seqs: the sequences that fit under 0.8
        (10, 0, 0.8, 0, True),      # KV at its threshold
    ],
    ids=["at-max-num-seqs", "at-max-queue-filling", "at-max-queue-full", "room", "transient-queue-with-free-slots", "queue-over-threshold",
         "kv-bound", "kv-full"],
)
def test_room_is_free_running_slots_plus_the_queue_allowance(
    running: float, waiting: float, kv: float, headroom: float, saturated: bool,
) -> None:
    detector = detector_with(max_num_seqs=64)
    detector.update(PoolSnapshot((load(running, waiting, kv),), 0.0))
    state = detector.state(0.0)
    assert state.headroom == pytest.approx(headroom)
    assert state.saturated is saturated and not state.stale
    assert state.running_capacity == 64


def test_many_unseen_dispatches_fill_free_slots_before_the_queue() -> None:
    """The issue's case: 64 clients in front of an engine with max_num_seqs 64 that shows a transient
    queue of 3 (arrivals between two engine steps). GIE's queue threshold alone allowed 2 more; the
    engine can start 54 more and queue 5 before its queue is full."""
    detector = detector_with(max_num_seqs=64)
    detector.update(PoolSnapshot((load(10, 3),), 0.0))
    for _ in range(54):
        detector.note_dispatch(0.01)
    state = detector.state(0.02)
    assert not state.saturated and state.headroom == pytest.approx(2) and state.unseen_dispatches == 54
    # the 3 waiting and 51 of them start (KV 0.05 + 54 x 0.005 = 0.32: ratio 0.4), 3 wait (ratio 0.6)
    assert state.saturation == pytest.approx(3 / 5)
    for _ in range(2):
        detector.note_dispatch(0.01)
    state = detector.state(0.02)
    assert state.saturated and state.saturation == pytest.approx(5 / 5)  # 5 wait: GIE's full queue
    detector.note_done(0.01)  # one finished before any sample showed it
    assert not detector.state(0.03).saturated


def test_admitted_dispatches_are_not_counted_twice() -> None:
    """Dispatches a later sample shows (running) stop counting as unseen: the room is what is left."""
    detector = detector_with(max_num_seqs=16)
    detector.update(PoolSnapshot((load(0),), 0.0))
    for _ in range(12):
        detector.note_dispatch(0.01)
    assert detector.state(0.02).headroom == pytest.approx(16 + 5 - 12)
    detector.update(PoolSnapshot((load(12, 0, 0.12),), 0.1))  # sampled after the dispatches: all 12 running
    state = detector.state(0.1)
    assert state.unseen_dispatches == 0 and state.headroom == pytest.approx(4 + 5)


def test_stale_metrics_fail_open_whatever_the_capacity() -> None:
    detector = detector_with(max_num_seqs=8)
    detector.update(PoolSnapshot((load(8, 9, 0.5, age=2.0),), 0.0))  # sampled 2 s ago: stale
    state = detector.state(0.0)
    assert state.stale and not state.saturated and state.headroom == float("inf") and state.running_capacity == 0
    detector.update(PoolSnapshot((load(8, 9, 0.5),), 5.0))
    assert detector.state(5.0).saturated
    assert detector.state(6.5).stale  # no new snapshot within metrics_staleness_seconds


def test_learned_capacity_slow_start_then_ceiling() -> None:
    """No max_num_seqs configured: the high-water mark of running, doubled while probing; the ceiling
    is where requests wait while running stays at the mark over three samples (a transient queue while
    running still moves does not count)."""
    detector = detector_with(max_num_seqs=0)
    detector.update(PoolSnapshot((load(0, kv=0.0),), 0.0))
    assert detector.state(0.0).headroom == 5  # nothing known: GIE's queue allowance
    detector.update(PoolSnapshot((load(5, 0, 0.01),), 0.1))
    assert detector.state(0.1).headroom == pytest.approx(5 + 5)  # slow start: up to twice the mark (10)
    assert detector.running_capacity("e0") is None and detector.state(0.1).running_capacity == 0
    for t, (running, waiting) in enumerate([(10, 2), (12, 1)], start=2):  # transient queues while it grows
        detector.update(PoolSnapshot((load(running, waiting, 0.001 * running),), t * 0.1))
    assert detector.running_capacity("e0") is None
    assert detector.state(0.3).headroom == pytest.approx(5 + 12 - 1)  # 2 x 12 - 12 free, 1 of them taken
    detector.update(PoolSnapshot((load(12, 4, 0.012),), 0.4))  # still 12 running, still waiting
    assert detector.running_capacity("e0") is None
    detector.update(PoolSnapshot((load(12, 4, 0.012),), 0.5))  # a third sample pinned at 12: the ceiling
    assert detector.running_capacity("e0") == 12
    state = detector.state(0.5)
    assert state.headroom == pytest.approx(5 - 4) and state.running_capacity == 12
    detector.update(PoolSnapshot((load(14, 0, 0.014),), 0.6))  # it ran more after all: the mark follows
    assert detector.running_capacity("e0") == 14
    detector.update(PoolSnapshot((), 0.7))  # the endpoint left: forgotten
    assert detector.running_capacity("e0") is None


def test_a_resampled_snapshot_is_not_a_second_sample() -> None:
    detector = detector_with(max_num_seqs=0)
    detector.update(PoolSnapshot((load(6, 0, 0.006),), 0.0))
    detector.update(PoolSnapshot((load(6, 2, 0.006, age=0.0),), 0.1))
    detector.update(PoolSnapshot((load(6, 2, 0.006, age=0.05),), 0.15))  # epp's same scrape, read again
    assert detector.running_capacity("e0") is None
    detector.update(PoolSnapshot((load(6, 2, 0.006),), 0.2))
    assert detector.running_capacity("e0") is None  # two samples so far
    detector.update(PoolSnapshot((load(6, 2, 0.006),), 0.3))
    assert detector.running_capacity("e0") == 6


def test_configured_max_num_seqs_is_a_floor_of_what_was_seen() -> None:
    detector = detector_with(max_num_seqs=8)
    detector.update(PoolSnapshot((load(12, 0, 0.12),), 0.0))  # it runs 12: the configured 8 was too low
    assert detector.running_capacity("e0") == 12
    with pytest.raises(ValueError, match="max_num_seqs"):
        SaturationDetector(max_num_seqs=-1)


def test_pool_room_sums_endpoints_and_skips_full_ones() -> None:
    detector = detector_with(max_num_seqs=32)
    detector.update(PoolSnapshot((load(32, 1, 0.4, "a"), load(20, 0, 0.2, "b"), load(32, 6, 0.4, "c")), 0.0))
    state = detector.state(0.0)
    assert state.headroom == pytest.approx((5 - 1) + (5 + 12)) and state.running_capacity == 96
    # GIE's roofline mean: a and c are full (nothing starts), b has 12 free
    assert state.saturation == pytest.approx((max(1 / 5, 0.5) + max(0, 0.25) + max(6 / 5, 0.5)) / 3)


def test_sampled_requests_that_finish_free_their_room_until_the_next_sample() -> None:
    """A request the last sample shows (running) and that finishes after it frees its slot at once: its
    replacement is not counted twice (once in the sample's running, once as unseen)."""
    clock = ManualClock(10.0)
    detector = SaturationDetector(queue_depth_threshold=5, kv_cache_util_threshold=0.8, metrics_staleness_seconds=1.0,
                                  dispatch_visibility_seconds=0.0, max_num_seqs=8)
    controller = FlowController(ControllerLimits(100, 30.0, 100), clock, detector=detector)
    controller.update_pool(PoolSnapshot((load(0),), clock.now()))
    first = [controller.enqueue(AdmissionRequest(f"a{i}", model="m")) for i in range(13)]  # 8 slots + 5 queue
    assert all(t.decision is not None for t in first)
    clock.advance(0.1)
    controller.update_pool(PoolSnapshot((load(8, 5, 0.08),), clock.now()))  # the sample shows all 13
    assert detector.state(clock.now()).saturated
    late = controller.enqueue(AdmissionRequest("late", model="m"))
    assert late.decision is None
    clock.advance(0.05)
    controller.release(first[0])  # it finished after the sample: one slot of the sample is free
    assert late.decision is not None and late.decision.outcome is QueueOutcome.DISPATCHED
    state = detector.state(clock.now())
    assert state.saturated and state.unseen_dispatches == 1
    controller.release(first[0])  # idempotent
    assert detector.state(clock.now()).headroom == 0
    clock.advance(0.1)
    controller.update_pool(PoolSnapshot((load(8, 5, 0.08),), clock.now()))  # the next sample: 12 left + late
    state = detector.state(clock.now())
    assert state.unseen_dispatches == 0 and state.headroom == 0
    clock.advance(0.01)
    for ticket in first[1:5]:
        controller.release(ticket)
    assert detector.state(clock.now()).headroom == 4  # 8 running + 1 waiting of 8 + 5
    clock.advance(0.1)
    controller.update_pool(PoolSnapshot((load(8, 9, 0.08),), clock.now()))  # 4 over the threshold
    clock.advance(0.01)
    for ticket in first[5:10]:
        controller.release(ticket)
    assert detector.state(clock.now()).headroom == 1  # the first 4 that finish bring it back to 5 waiting
