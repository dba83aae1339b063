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
    assert state.saturation == pytest.approx(0.4 / 0.8 + 6 * 0.1 / 0.8)


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
