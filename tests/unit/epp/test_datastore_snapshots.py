"""Candidate snapshots are reused between picks (issue 10) but never hide a change of load."""

from __future__ import annotations

from kvmesh.clock import ManualClock
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import SNAPSHOT_REUSE_SECONDS, Datastore, ScrapeSample


def _datastore() -> tuple[Datastore, ManualClock, list[EndpointId]]:
    clock = ManualClock()
    store = Datastore(clock=clock)
    ids = [EndpointId(f"10.0.0.{i}:8000") for i in (3, 1, 2)]
    store.apply_membership({i: Endpoint(id=i, url=f"http://{i}", model="m", block_size_tokens=16) for i in ids}, {})
    for i in ids:
        store.record_scrape(i, ScrapeSample(num_requests_waiting=1, num_requests_running=2, kv_cache_usage_perc=0.5))
    return store, clock, ids


def test_snapshots_follow_every_change_and_age_at_most_the_reuse_window() -> None:
    store, clock, ids = _datastore()
    first = store.candidates("m")
    assert [c.id for c in first] == sorted(ids)
    assert store.candidates("m")[0] is first[0]  # unchanged and fresh: the same snapshot
    store.note_pick(first[0].id, 100)
    after_pick = store.candidates("m")
    assert after_pick[0].metrics.pending_picks == 1 and after_pick[0].metrics.queued_prefill_tokens == 100
    assert after_pick[1] is first[1]  # only the picked endpoint was rebuilt
    store.record_scrape(first[1].id, ScrapeSample(num_requests_waiting=7, num_requests_running=0, kv_cache_usage_perc=0.9))
    assert store.candidates("m")[1].metrics.num_requests_waiting == 7
    store.record_scrape_failure(first[2].id, "refused")
    assert store.candidates("m")[2].metrics.consecutive_failures == 1
    clock.advance(SNAPSHOT_REUSE_SECONDS * 2)
    aged = store.candidates("m")
    assert all(c.metrics.age_seconds == SNAPSHOT_REUSE_SECONDS * 2 for c in aged)  # rebuilt: age is exact again


def test_membership_changes_reorder_and_filter_by_model() -> None:
    store, _, ids = _datastore()
    assert len(store.candidates("m")) == 3 and store.candidates("other") == []
    new = EndpointId("10.0.0.0:8000")
    store.apply_membership({new: Endpoint(id=new, url="http://x", model="m", block_size_tokens=16)}, {ids[0]: store.endpoints()[0]})
    assert [c.id for c in store.candidates("m")] == sorted([new, ids[1], ids[2]])
    assert [c.id for c in store.candidates()] == sorted([new, ids[1], ids[2]])
