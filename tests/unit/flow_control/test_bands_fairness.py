"""Bands in strict order, fairness policies across flows, ordering policies inside a flow, TTLs, shedding, quotas."""

from __future__ import annotations

import pytest

from kvmesh.clock import ManualClock
from services.flow_control.bands import BandConfig
from services.flow_control.controller import ControllerLimits, FlowController, Ticket, TicketState
from services.flow_control.fairness.window import ServedWindow, jain_index
from services.flow_control.policies import fairness_policy, ordering_factory
from services.flow_control.types import AdmissionRequest, FlowQuota, QueueOutcome, ServedTokens


def make(max_in_flight: int = 1, **kw: object) -> tuple[FlowController, ManualClock]:
    clock = ManualClock(100.0)
    limits = ControllerLimits(max_in_flight, float(kw.pop("ttl", 60.0)), int(kw.pop("max_queue", 1000)), **kw)  # type: ignore[arg-type]
    return FlowController(limits, clock), clock


def req(rid: str, flow: str = "default", priority: int = 0, **kw: object) -> AdmissionRequest:
    return AdmissionRequest(request_id=rid, flow_id=flow, priority=priority, **kw)  # type: ignore[arg-type]


def outcome(ticket: Ticket) -> QueueOutcome | None:
    return ticket.decision.outcome if ticket.decision else None


def drain(controller: FlowController, holder: Ticket, tickets: list[Ticket]) -> list[str]:
    """Release the holder, then each newly dispatched ticket in turn; the dispatch order."""
    order: list[str] = []
    current = holder
    while True:
        controller.release(current)
        nxt = [t for t in tickets if t.state is TicketState.DISPATCHED and t.request.request_id not in order]
        if not nxt:
            return order
        current = nxt[0]
        order.append(current.request.request_id)


def test_bands_are_served_in_strict_priority_order() -> None:
    controller, _ = make()
    holder = controller.enqueue(req("hold"))
    tickets = [controller.enqueue(req(f"p{p}-{i}", priority=p)) for i in range(2) for p in (0, 5, -0, 10, 5)]
    order = drain(controller, holder, tickets)
    assert [int(r.split("-")[0][1:]) for r in order] == sorted((int(r.split("-")[0][1:]) for r in order), reverse=True)
    assert order[:2] == ["p10-0", "p10-1"]


def test_new_arrival_waits_behind_queued_higher_or_equal_band() -> None:
    controller, _ = make()
    holder = controller.enqueue(req("hold"))
    queued_high = controller.enqueue(req("high", priority=5))
    controller.release(holder)
    assert outcome(queued_high) is QueueOutcome.DISPATCHED
    low = controller.enqueue(req("low", priority=0))
    assert outcome(low) is None  # in-flight limit reached by "high"


def test_round_robin_alternates_flows() -> None:
    controller, _ = make(fairness_policy="round-robin-fairness-policy")
    holder = controller.enqueue(req("hold"))
    tickets = [controller.enqueue(req(f"a{i}", "a")) for i in range(4)] + [controller.enqueue(req(f"b{i}", "b")) for i in range(2)]
    assert drain(controller, holder, tickets) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_global_strict_is_fcfs_across_flows() -> None:
    controller, _ = make()
    holder = controller.enqueue(req("hold"))
    tickets = [controller.enqueue(req(f"{f}{i}", f)) for i in range(2) for f in "ab"]
    assert drain(controller, holder, tickets) == ["a0", "b0", "a1", "b1"]


def test_least_attained_service_counts_served_tokens() -> None:
    """Flow a was served 1000 output tokens; b (equal weight) goes first until it catches up."""
    controller, _ = make(fairness_policy="least-attained-service-fairness-policy")
    first = controller.enqueue(req("a-big", "a", prompt_tokens=10))
    tickets = [controller.enqueue(req(f"a{i}", "a", prompt_tokens=10)) for i in range(2)]
    tickets += [controller.enqueue(req(f"b{i}", "b", prompt_tokens=10)) for i in range(3)]
    controller.complete(first, ServedTokens(10, 1000))
    order = drain(controller, first, tickets)
    assert order[:3] == ["b0", "b1", "b2"]
    assert order[3:] == ["a0", "a1"]


def test_least_attained_service_lifts_a_returning_flow() -> None:
    """An idle flow banks no credit: on return it starts at the smallest counter of the busy flows."""
    policy = fairness_policy("least-attained-service-fairness-policy")
    controller, _ = make(fairness_policy="least-attained-service-fairness-policy")
    holder = controller.enqueue(req("hold", "x"))
    for i in range(3):
        controller.enqueue(req(f"b{i}", "b", prompt_tokens=100))
    band = controller.band(0)
    lazy = band.fairness
    assert type(lazy) is type(policy)
    controller.release(holder)  # b0 dispatched: b's counter 100
    controller.enqueue(req("c0", "c", prompt_tokens=1))
    counters = lazy.counters  # type: ignore[attr-defined]
    assert counters["c"] == pytest.approx(counters["b"])


def test_weights_bias_least_attained_service() -> None:
    limits = dict(fairness_policy="least-attained-service-fairness-policy", fairness_weights={"gold": 3.0})
    controller, _ = make(**limits)
    holder = controller.enqueue(req("hold", "x"))
    tickets = [controller.enqueue(req(f"g{i}", "gold", prompt_tokens=30)) for i in range(6)]
    tickets += [controller.enqueue(req(f"s{i}", "silver", prompt_tokens=30)) for i in range(6)]
    order = drain(controller, holder, tickets)[:8]
    assert sum(r.startswith("g") for r in order) == 6


@pytest.mark.parametrize(
    ("ordering", "expected"),
    [
        ("fcfs-ordering-policy", ["r0", "r1", "r2"]),
        ("edf-ordering-policy", ["r2", "r1", "r0"]),
        ("slo-deadline-ordering-policy", ["r1", "r2", "r0"]),
    ],
)
def test_ordering_policies(ordering: str, expected: list[str]) -> None:
    controller, _ = make(ordering_policy=ordering)
    holder = controller.enqueue(req("hold"))
    tickets = [
        controller.enqueue(req("r0", ttl_seconds=30)),
        controller.enqueue(req("r1", ttl_seconds=20, ttft_slo_seconds=0.5)),
        controller.enqueue(req("r2", ttl_seconds=10, ttft_slo_seconds=2.0)),
    ]
    assert drain(controller, holder, tickets) == expected


def test_unknown_policy_names_fail_at_config() -> None:
    with pytest.raises(ValueError, match="unknown fairness policy"):
        ControllerLimits(1, 1.0, 1, fairness_policy="nope")
    with pytest.raises(ValueError, match="unknown ordering policy"):
        ordering_factory("nope")
    with pytest.raises(ValueError, match="duplicate band"):
        ControllerLimits(1, 1.0, 1, bands=(BandConfig(1), BandConfig(1)))


@pytest.mark.parametrize(
    ("band_ttl", "request_ttl", "expires_at"),
    [(0.0, 0.0, 60.0), (5.0, 0.0, 5.0), (5.0, 2.0, 2.0), (1.0, 9.0, 1.0)],
    ids=["global", "band", "request", "band-below-request"],
)
def test_effective_ttl_is_the_minimum(band_ttl: float, request_ttl: float, expires_at: float) -> None:
    controller, clock = make(bands=(BandConfig(0, "std", ttl_seconds=band_ttl),))
    controller.enqueue(req("hold"))
    waiting = controller.enqueue(req("w", ttl_seconds=request_ttl))
    assert controller.next_expiry() == pytest.approx(100.0 + expires_at)
    clock.advance(expires_at - 0.001)
    controller.expire_due()
    assert outcome(waiting) is None
    clock.advance(0.002)
    controller.expire_due()
    assert outcome(waiting) is QueueOutcome.EVICTED_TTL


def test_expired_request_is_never_dispatched() -> None:
    controller, clock = make(ordering_policy="edf-ordering-policy")
    holder = controller.enqueue(req("hold"))
    short = controller.enqueue(req("short", ttl_seconds=1.0))
    long = controller.enqueue(req("long", ttl_seconds=50.0))
    clock.advance(2.0)
    controller.release(holder)  # no sweep ran: dispatch finds "short" expired
    assert outcome(short) is QueueOutcome.EVICTED_TTL
    assert outcome(long) is QueueOutcome.DISPATCHED


def test_sheddable_band_is_shed_when_it_would_wait() -> None:
    controller, _ = make()
    assert outcome(controller.enqueue(req("batch0", priority=-1))) is QueueOutcome.DISPATCHED  # room: served
    shed = controller.enqueue(req("batch1", priority=-1))
    assert outcome(shed) is QueueOutcome.SHED
    assert shed.decision is not None and "sheddable" in shed.decision.reason
    assert outcome(controller.enqueue(req("std", priority=0))) is None  # non-sheddable waits
    assert controller.stats().queued == 1


@pytest.mark.parametrize(
    ("limits", "sizes", "expected", "needle"),
    [
        ({"max_queue_bytes": 100}, [60, 60], [None, "rejected_capacity"], "max_queue_bytes=100"),
        ({"bands": (BandConfig(0, "std", max_requests=1),)}, [1, 1], [None, "rejected_capacity"], "max_requests=1"),
        ({"bands": (BandConfig(0, "std", max_bytes=50),)}, [40, 20], [None, "rejected_capacity"], "max_bytes=50"),
        ({"max_queue": 1}, [1, 1], [None, "rejected_capacity"], "max_queue_size=1"),
    ],
    ids=["global-bytes", "band-requests", "band-bytes", "global-requests"],
)
def test_capacity_limits(limits: dict[str, object], sizes: list[int], expected: list[str | None], needle: str) -> None:
    controller, _ = make(**limits)
    controller.enqueue(req("hold"))
    tickets = [controller.enqueue(req(f"r{i}", byte_size=s)) for i, s in enumerate(sizes)]
    assert [outcome(t) for t in tickets] == [QueueOutcome(e) if e else None for e in expected]
    assert needle in (tickets[-1].decision.reason if tickets[-1].decision else "")


def test_rate_quota_rejects_with_retry_hint() -> None:
    controller, clock = make(max_in_flight=100)
    quota = FlowQuota(rate_per_second=2.0, burst=2)
    got = [outcome(controller.enqueue(req(f"r{i}", "t", quota=quota))) for i in range(3)]
    assert got == [QueueOutcome.DISPATCHED, QueueOutcome.DISPATCHED, QueueOutcome.REJECTED_RATE_LIMITED]
    limited = controller.enqueue(req("r3", "t", quota=quota))
    assert limited.decision is not None and limited.decision.retry_after_seconds == pytest.approx(0.5)
    clock.advance(0.5)
    assert outcome(controller.enqueue(req("r4", "t", quota=quota))) is QueueOutcome.DISPATCHED
    assert outcome(controller.enqueue(req("other", "u", quota=quota))) is QueueOutcome.DISPATCHED


def test_concurrency_quota_holds_the_tenant_not_others() -> None:
    controller, _ = make(max_in_flight=10, fairness_policy="round-robin-fairness-policy")
    quota = FlowQuota(max_concurrency=2)
    tenant = [controller.enqueue(req(f"t{i}", "t", quota=quota)) for i in range(4)]
    other = controller.enqueue(req("o", "o"))
    assert [outcome(t) for t in tenant] == [QueueOutcome.DISPATCHED] * 2 + [None, None]
    assert outcome(other) is QueueOutcome.DISPATCHED  # another tenant is not held behind the quota
    controller.release(tenant[0])
    assert outcome(tenant[2]) is QueueOutcome.DISPATCHED and outcome(tenant[3]) is None


def test_cancel_queued_leaves_band_and_flow_accounting_exact() -> None:
    controller, _ = make(fairness_policy="round-robin-fairness-policy")
    holder = controller.enqueue(req("hold"))
    a = controller.enqueue(req("a", "a", priority=3, byte_size=10))
    controller.enqueue(req("b", "b", priority=3, byte_size=5))
    controller.release(a)
    stats = controller.stats()
    band = next(b for b in stats.bands if b.priority == 3)
    assert (band.queued, band.queued_bytes, stats.queued, stats.queued_bytes) == (1, 5, 1, 5)
    assert {f.flow_id for f in stats.flows if f.priority == 3} == {"b"}
    controller.release(holder)
    assert controller.stats().queued == 0


def test_jain_index_and_window() -> None:
    assert jain_index([]) == 1.0
    assert jain_index([5, 5]) == pytest.approx(1.0)
    assert jain_index([10, 0]) == pytest.approx(0.5)
    window = ServedWindow(10.0)
    window.record(0.0, "a", 100)
    window.record(5.0, "b", 100)
    assert window.jain_index(9.0) == pytest.approx(1.0)
    assert window.shares(12.0) == {"b": 1.0}  # a's tokens left the window


def test_stats_report_shares_per_flow() -> None:
    controller, _ = make(max_in_flight=10)
    a = controller.enqueue(req("a", "a"))
    b = controller.enqueue(req("b", "b"))
    controller.complete(a, ServedTokens(30, 70))
    controller.complete(b, ServedTokens(10, 10))
    stats = controller.stats()
    shares = {f.flow_id: f.share for f in stats.flows}
    assert shares == {"a": pytest.approx(100 / 120), "b": pytest.approx(20 / 120)}
    assert stats.jain_index == pytest.approx(jain_index([100, 20]))
