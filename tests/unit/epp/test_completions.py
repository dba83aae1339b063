"""Pending-picks accounting with router-reported completions (issue 9 item 4): completion frees, FCFS,
fallback endpoints, running netted until a scrape counts the finish, and TTL expiry without any scrape."""

from __future__ import annotations

from kvmesh.clock import ManualClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import (
    DEFAULT_PENDING_PICK_TTL_SECONDS,
    DEFAULT_PREFILL_TTL_SECONDS,
    Datastore,
    ScrapeSample,
)
from services.epp.framework.interfaces import EndpointMetrics

A = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
B = Endpoint(id=EndpointId("127.0.0.1:2"), url="http://127.0.0.1:2", model="m")


def _store(running: int = 0) -> tuple[ManualClock, Datastore]:
    """A and B, each scraped once: ``running`` requests running, 10 finished (block size 64)."""
    clock = ManualClock()
    ds = Datastore(clock)
    ds.set_endpoints({A.id: A, B.id: B})
    for e in (A, B):
        ds.record_scrape(e.id, ScrapeSample(0, running, 0.0, 64, 10, 10))
    return clock, ds


def _m(ds: Datastore, endpoint: Endpoint) -> EndpointMetrics:
    return next(c.metrics for c in ds.candidates("m") if c.id == endpoint.id)


def test_completion_frees_the_pick_and_the_ones_before_it() -> None:
    _, ds = _store()
    for rid, tokens in (("r1", 1000), ("r2", 2000), ("r3", 3000)):
        ds.note_pick(A.id, tokens, rid)
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (3, 3, 6000)
    assert ds.note_completed("r2", A.id)  # FCFS: r1 was prefilled before r2
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (1, 1, 3000)
    assert ds.note_completed("r3", A.id)
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (0, 0, 0)
    assert not ds.note_completed("r3", A.id)  # reported twice: the pick is gone, nothing more to free
    assert not ds.note_completed("never-picked", A.id)


def test_completion_nets_running_until_the_engine_counts_it() -> None:
    _, ds = _store()
    ds.note_pick(A.id, 500, "r1")
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.0, 64, 10, 11))  # running, first token out
    assert _m(ds, A).num_requests_running == 1
    ds.note_completed("r1", A.id)
    assert _m(ds, A).num_requests_running == 0  # at once, not at the next scrape
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.0, 64, 10, 11))  # a scrape rendered before the finish
    assert _m(ds, A).num_requests_running == 0
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.0, 64, 11, 12))  # finished counted; another one running
    assert _m(ds, A).num_requests_running == 1  # never below the engine's own figure


def test_completion_on_a_fallback_endpoint() -> None:
    """Picked to A, served by B after A failed: A's pick is freed, B's running count drops."""
    _, ds = _store()
    ds.note_pick(A.id, 800, "r1")
    ds.record_scrape(B.id, ScrapeSample(0, 1, 0.0, 64, 10, 10))
    assert ds.note_completed("r1", B.id)
    assert (_m(ds, A).pending_picks, _m(ds, A).queued_prefill_tokens) == (0, 0)
    assert _m(ds, B).num_requests_running == 0
    # an unknown id still counts where it ran (the router's local pick while epp was away)
    ds.record_scrape(B.id, ScrapeSample(0, 2, 0.0, 64, 11, 10))  # r1's finish counted, 2 others running
    assert not ds.note_completed("local-pick", B.id)
    assert _m(ds, B).num_requests_running == 1


def test_ttl_expiry_without_scrapes_or_completions() -> None:
    """A lost completion does not leak load: pending picks stop counting after the pending TTL, their
    queued prefill after the prefill TTL, and a completion the engine never counts stops netting
    its running figure after the pending TTL, all at read time (no scrape in between)."""
    clock, ds = _store()
    ds.note_pick(A.id, 1000, "lost")
    clock.advance(DEFAULT_PENDING_PICK_TTL_SECONDS / 2)
    ds.note_pick(A.id, 2000, "late")
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (2, 2, 3000)
    clock.advance(DEFAULT_PENDING_PICK_TTL_SECONDS / 2 + 0.01)
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (1, 2, 3000)
    clock.advance(DEFAULT_PREFILL_TTL_SECONDS)
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens) == (0, 0, 0)
    ds.record_scrape(B.id, ScrapeSample(0, 3, 0.0, 64, 10, 10))
    ds.note_completed("elsewhere", B.id)
    assert _m(ds, B).num_requests_running == 2
    clock.advance(DEFAULT_PENDING_PICK_TTL_SECONDS + 0.01)
    assert _m(ds, B).num_requests_running == 3


def test_in_flight_ids_are_bounded() -> None:
    from services.epp import datastore as module

    _, ds = _store()
    for i in range(module._IN_FLIGHT_IDS + 10):
        ds.note_pick(A.id, 0, f"r{i}")
    assert not ds.note_completed("r0", A.id)  # forgotten (oldest first)
    assert ds.note_completed(f"r{module._IN_FLIGHT_IDS + 9}", A.id)
