"""Admission credits in the core (``FlowController.open_credits`` and the methods beside it; issue 10).

Credits are lent only while a request of the lending band would be dispatched at once, count as
requests in flight for every other admission, are revoked as soon as anything queues or the pool
saturates, and a request spent on one is recorded exactly as any dispatch. ``ManualClock``, no I/O.
"""

from __future__ import annotations

from kvmesh.clock import ManualClock
from services.flow_control.bands import BandConfig
from services.flow_control.controller import ControllerLimits, FlowController
from services.flow_control.credits import CreditAccount, CreditUpdate
from services.flow_control.saturation import EndpointLoad, PoolSnapshot, SaturationDetector
from services.flow_control.types import AdmissionRequest, FlowQuota, QueueOutcome, ServedTokens


class Events:
    """Observer recording outcomes and credit events."""

    def __init__(self) -> None:
        self.credits: list[tuple[str, int, str]] = []
        self.outcomes: list[QueueOutcome] = []
        self.notified = 0

    def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
        self.outcomes.append(outcome)

    def on_state(self, queued: int, in_flight: int) -> None:
        pass

    def on_credits(self, event: str, credits: int, reason: str = "") -> None:
        self.credits.append((event, credits, reason))

    def notify(self) -> None:
        self.notified += 1

    def total(self, event: str) -> int:
        return sum(n for e, n, _ in self.credits if e == event)


def make(max_in_flight: int = 64, credits: int = 4, detector: SaturationDetector | None = None,
         bands: tuple[BandConfig, ...] = ()) -> tuple[FlowController, ManualClock, Events]:
    clock = ManualClock(100.0)
    events = Events()
    limits = ControllerLimits(max_in_flight, 10.0, 100, admission_credits=credits, bands=bands)
    return FlowController(limits, clock, observer=events, detector=detector), clock, events


def req(i: int, priority: int = 0, flow: str = "t", quota: FlowQuota | None = None) -> AdmissionRequest:
    return AdmissionRequest(request_id=str(i), flow_id=flow, priority=priority, prompt_tokens=10, max_tokens=5,
                            model="m", quota=quota or FlowQuota())


def pool(now: float, waiting: float = 0.0, kv: float = 0.1, endpoints: int = 1, age: float = 0.0) -> PoolSnapshot:
    return PoolSnapshot(tuple(EndpointLoad(f"e{i}", "m", waiting, kv, age) for i in range(endpoints)), now)


def test_a_client_that_asks_is_lent_up_to_the_server_limit_and_told_once() -> None:
    controller, _, events = make(credits=4)
    account = controller.open_credits(8, events.notify)
    assert (account.want, account.lent, controller.credits_lent) == (4, 4, 4)
    assert events.notified == 1
    assert account.take_update() == CreditUpdate(4, False, 0)
    assert account.take_update() is None
    assert events.total("lent") == 4
    assert controller.stats().credits_lent == 4


def test_no_credits_when_the_server_lends_none_or_the_client_asks_none() -> None:
    controller, _, events = make(credits=0)
    assert controller.open_credits(8, events.notify).lent == 0
    controller, _, events = make(credits=4)
    assert controller.open_credits(0, events.notify).lent == 0
    assert events.notified == 0


def test_a_spent_credit_is_an_exact_dispatch_and_is_topped_up_at_half() -> None:
    controller, _, events = make(credits=4)
    account = controller.open_credits(4, events.notify)
    account.take_update()
    first = controller.enqueue_on_credit(req(1), account)
    assert first.decision is not None and first.decision.outcome is QueueOutcome.DISPATCHED
    stats = controller.stats()
    assert (stats.in_flight, stats.dispatched_total, account.lent) == (1, 1, 3)
    assert [(f.flow_id, f.in_flight) for f in stats.flows] == [("t", 1)]
    assert account.take_update() is None  # 3 held > 4 // 2: no top-up yet
    controller.enqueue_on_credit(req(2), account)
    assert account.lent == 4 and account.take_update() == CreditUpdate(2, False, 0)  # down to half: +2
    assert events.total("spent") == 2 and events.outcomes == [QueueOutcome.DISPATCHED] * 2
    controller.complete(first, ServedTokens(10, 5))
    assert controller.release(first)
    assert controller.stats().flows[0].served_tokens == 15
    assert controller.stats().in_flight == 1


def test_half_the_free_room_is_lent_so_arrivals_still_find_room_and_full_credits_are_revoked() -> None:
    controller, _, events = make(max_in_flight=4, credits=3)
    account = controller.open_credits(3, events.notify)
    assert account.take_update() == CreditUpdate(2, False, 0)  # 4 free: half of it
    a, b = controller.enqueue(req(1)), controller.enqueue(req(2))
    assert a.decision is not None and b.decision is not None  # both would go without credits: they go
    assert account.revoking and events.credits[-1] == ("revoked", 1, "max_in_flight")  # 2 lent fill the 2 free
    c = controller.enqueue(req(3))
    assert c.decision is None  # the lent credits hold the last slots until the client answers
    assert account.take_update() == CreditUpdate(0, True, 0)
    controller.credits_returned(account, 2)
    assert c.decision is not None and c.decision.outcome is QueueOutcome.DISPATCHED
    assert controller.credits_lent == 0 and account.take_update() is None  # 1 free: half is nothing
    assert controller.stats().in_flight + controller.credits_lent <= 4


def test_anything_queued_revokes_and_lending_resumes_once_the_queue_drains() -> None:
    controller, _, events = make(credits=3)
    account = controller.open_credits(3, events.notify)
    account.take_update()
    quota = FlowQuota(max_concurrency=1)
    first = controller.enqueue(req(1, flow="acme", quota=quota))
    second = controller.enqueue(req(2, flow="acme", quota=quota))  # behind acme's concurrency quota
    assert second.decision is None and account.revoking
    assert events.credits[-1] == ("revoked", 1, "queued")
    assert account.take_update() == CreditUpdate(0, True, 0)
    # the client spent one before it read the revoke: still honoured, then it returns the other two
    spent = controller.enqueue_on_credit(req(3), account)
    assert spent.decision is not None and spent.decision.outcome is QueueOutcome.DISPATCHED
    controller.credits_returned(account, 2)
    assert account.lent == 0 and not account.revoking and controller.credits_lent == 0
    assert account.take_update() is None  # nothing lent while anything waits
    controller.release(first)
    assert second.decision is not None and second.decision.outcome is QueueOutcome.DISPATCHED
    assert account.take_update() == CreditUpdate(3, False, 0)  # the queue drained: lent again
    assert events.total("returned") == 2 and events.total("spent") == 1


def test_a_revoke_before_the_grant_was_sent_drops_the_grant_silently() -> None:
    controller, _, events = make(max_in_flight=2, credits=2)
    account = controller.open_credits(2, events.notify)  # granted, not taken
    controller.enqueue(req(1))
    controller.enqueue(req(2))  # queues: more lent than room
    assert account.lent == 0 and not account.revoking
    assert account.take_update() is None  # the client never heard of them: nothing to revoke
    assert controller.stats().in_flight == 2 and controller.stats().queued == 0


def test_saturation_caps_lending_at_the_headroom_and_revokes() -> None:
    detector = SaturationDetector(queue_depth_threshold=5.0, kv_cache_util_threshold=0.8)
    controller, clock, events = make(credits=8, detector=detector)
    controller.update_pool(pool(clock.now()))  # one endpoint, queue allowance 5: headroom 5
    account = controller.open_credits(8, events.notify)
    assert account.take_update() == CreditUpdate(2, False, 0)  # half the headroom
    regular = controller.enqueue(req(1))  # headroom 5 > 2 lent: it goes
    assert regular.decision is not None and regular.decision.outcome is QueueOutcome.DISPATCHED
    assert account.lent == 2 and not account.revoking  # headroom 4: still 2 lent
    clock.advance(0.1)
    controller.update_pool(pool(clock.now(), waiting=5.0))  # the engine's queue is full: saturated
    assert account.revoking and events.credits[-1] == ("revoked", 1, "saturated")
    assert account.take_update() == CreditUpdate(0, True, 0)
    controller.credits_returned(account, 2)
    assert account.lent == 0 and account.take_update() is None  # no lending while saturated
    clock.advance(0.1)
    controller.update_pool(pool(clock.now()))
    assert account.lent > 0  # room again: lent again


def test_stale_metrics_fail_open_for_credits_as_for_any_dispatch() -> None:
    detector = SaturationDetector(metrics_staleness_seconds=1.0)
    controller, clock, events = make(max_in_flight=6, credits=4, detector=detector)
    controller.update_pool(pool(clock.now(), waiting=5.0))
    account = controller.open_credits(4, events.notify)
    assert account.lent == 0  # fresh and saturated
    clock.advance(2.0)
    controller.refresh()  # the poll failed: stale
    assert account.lent == 3  # max_in_flight alone: half of 6


def test_the_lending_band_over_its_max_saturation_lends_nothing() -> None:
    detector = SaturationDetector(queue_depth_threshold=5.0, kv_cache_util_threshold=0.8)
    controller, clock, events = make(credits=4, detector=detector, bands=(BandConfig(0, "std", max_saturation=0.5),))
    controller.update_pool(pool(clock.now(), waiting=3.0))  # saturation 0.6, headroom 2
    account = controller.open_credits(4, events.notify)
    assert account.lent == 0
    controller.update_pool(pool(clock.now(), waiting=1.0))  # saturation 0.2, headroom 4
    assert account.lent == 2


def test_the_stream_end_frees_every_credit_and_a_queued_request_goes() -> None:
    controller, _, events = make(max_in_flight=2, credits=2)
    account = controller.open_credits(2, events.notify)
    assert account.take_update() == CreditUpdate(1, False, 0)
    assert controller.enqueue(req(1)).decision is not None  # then the 1 lent fills the 1 free: revoked
    waiting = controller.enqueue(req(2))
    assert waiting.decision is None and account.revoking
    controller.close_credits(account)  # the stream ended before its answer
    controller.close_credits(account)  # idempotent
    assert account.closed and controller.credits_lent == 0 and events.total("freed") == 1
    assert waiting.decision is not None and waiting.decision.outcome is QueueOutcome.DISPATCHED


def test_a_request_on_a_credit_not_held_is_dispatched_and_counted_overdrawn() -> None:
    controller, _, events = make(max_in_flight=1, credits=0)
    ticket = controller.enqueue_on_credit(req(1), None)
    assert ticket.decision is not None and ticket.decision.outcome is QueueOutcome.DISPATCHED
    assert events.total("overdrawn") == 1
    assert controller.enqueue(req(2)).decision is None  # the limit counts it
    assert controller.release(ticket)


def test_tenant_usage_of_credit_requests_counts_for_its_quota() -> None:
    controller, _, events = make(credits=2)
    account = controller.open_credits(2, events.notify)
    account.take_update()
    spent = controller.enqueue_on_credit(req(1, flow="acme"), account)
    limited = controller.enqueue(req(2, flow="acme", quota=FlowQuota(max_concurrency=1)))
    assert limited.decision is None  # the credit request holds acme's one slot
    controller.release(spent)
    assert limited.decision is not None and limited.decision.outcome is QueueOutcome.DISPATCHED


def test_a_revoke_answered_short_keeps_the_rest_lent_until_the_stream_ends() -> None:
    account = CreditAccount(4, 0, lambda: None)
    account._grant(4)
    assert account.take_update() == CreditUpdate(4, False, 0)
    assert account._revoke() == 0 and account.revoking
    assert account.take_update() == CreditUpdate(0, True, 0)
    assert account._returned(9) == 4  # never more than it holds
    assert account.lent == 0 and not account.revoking


def test_credit_events_reach_the_prometheus_counters_and_the_lent_gauge() -> None:
    from prometheus_client import CollectorRegistry

    from services.flow_control.metrics import ControllerCollector, PrometheusObserver

    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    controller = FlowController(ControllerLimits(4, 10.0, 10, admission_credits=2), ManualClock(0.0), observer=observer)
    registry.register(ControllerCollector(controller, observer.flow_label))
    account = controller.open_credits(2, lambda: None)
    account.take_update()
    controller.enqueue_on_credit(req(1), account)  # 2 lent (half of 4), 1 spent
    controller.enqueue(req(2))
    controller.enqueue(req(3))  # 3 in flight, 1 free, 1 lent: revoked
    controller.enqueue(req(4))  # 3 in flight + 1 lent = 4: queued until the answer
    controller.credits_returned(account, 1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvmesh_flow_control_admission_credits_total", event="lent") == 2
    assert value("kvmesh_flow_control_admission_credits_total", event="spent") == 1
    assert value("kvmesh_flow_control_admission_credits_total", event="returned") == 1
    assert value("kvmesh_flow_control_admission_credit_revocations_total", reason="max_in_flight") == 1
    assert value("kvmesh_flow_control_admission_credits_lent") == controller.credits_lent == 0
    assert controller.stats().in_flight == 4
