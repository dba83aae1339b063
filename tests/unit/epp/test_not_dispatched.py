"""Picks the router received but never dispatched (``COMPLETION_OUTCOME_NOT_DISPATCHED``): epp drops that
pick's load (active prompt tokens, pending and unprefilled counts, ``picks_total``) without touching any
engine's running count or the picks before it; a re-pick of the same request supersedes its earlier
pick the same way. The wire's translation, an older epp's reading of the new value included.

The datastore is ``test_completions``'s (A and B), each engine with one request of its own running."""

from __future__ import annotations

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2
from kvmesh.types import CompletionOutcome, RequestCompletion
from kvmesh.wire import completion_from_proto, completion_to_proto
from services.epp.datastore import ScrapeSample
from tests.unit.epp.test_completions import A, B, _m, _store


def test_not_dispatched_frees_only_that_pick_and_leaves_running_alone() -> None:
    _, ds = _store(running=1)
    for rid, tokens in (("r1", 100), ("r2", 200), ("r3", 300)):
        ds.note_pick(A.id, tokens, rid, prompt_tokens=tokens)
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens, m.active_prompt_tokens) == (3, 3, 600, 600)
    assert ds.note_completed("r2", "", dispatched=False)
    m = _m(ds, A)
    # r1 is not taken as delivered (a dispatched completion of r2 would free it too): only r2 goes
    assert (m.pending_picks, m.unprefilled_requests, m.queued_prefill_tokens, m.active_prompt_tokens) == (2, 2, 400, 400)
    assert m.num_requests_running == 1  # no engine counted it: the scraped figure stands
    assert ds.picks_total(A.id) == 2
    assert not ds.note_completed("r2", "", dispatched=False)  # twice: nothing more
    # a scrape where the engine received r1 and r3 only: nothing pending is left over for r2
    ds.record_scrape(A.id, ScrapeSample(0, 3, 0.0, 64, 10, 10))
    assert _m(ds, A).pending_picks == 0
    assert ds.note_completed("r3", A.id) and ds.note_completed("r1", A.id)
    assert _m(ds, A).active_prompt_tokens == 0


def test_not_dispatched_of_an_unknown_or_unpicked_request_changes_nothing() -> None:
    _, ds = _store(running=1)
    ds.note_pick(A.id, 100, "r1", prompt_tokens=100)
    before = _m(ds, A)
    assert not ds.note_completed("never-picked", A.id, dispatched=False)
    assert _m(ds, A) == before


def test_a_re_pick_supersedes_the_earlier_pick_of_the_request() -> None:
    """The router picked the request early, it then queued in flow_control and was picked again at dispatch
    (same endpoint or another), or it was re-picked after a failed attempt: only the latest pick counts."""
    _, ds = _store(running=1)
    ds.note_pick(A.id, 100, "q1", prompt_tokens=100)
    ds.note_pick(A.id, 100, "q1", prompt_tokens=100)  # the same endpoint again
    m = _m(ds, A)
    assert (m.pending_picks, m.unprefilled_requests, m.active_prompt_tokens) == (1, 1, 100)
    assert ds.picks_total(A.id) == 1
    ds.note_pick(B.id, 100, "q1", prompt_tokens=100)  # another endpoint
    assert (_m(ds, A).pending_picks, _m(ds, A).active_prompt_tokens, ds.picks_total(A.id)) == (0, 0, 0)
    assert (_m(ds, B).pending_picks, _m(ds, B).active_prompt_tokens) == (1, 100)
    assert ds.note_completed("q1", B.id)
    assert _m(ds, B).active_prompt_tokens == 0


def test_phantom_picks_no_longer_crowd_out_real_active_entries() -> None:
    """The reviewer's case: an older real request holds KV while a burst of newer picks is refused by
    admission; with the refusals reported the cap ``ceil(running + waiting) + pending`` keeps the real one."""
    _, ds = _store(running=1)
    ds.note_pick(A.id, 1000, "real", prompt_tokens=1000)
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.0, 64, 10, 11))  # the engine runs it
    for i in range(5):
        ds.note_pick(A.id, 50, f"refused-{i}", prompt_tokens=50)
    for i in range(5):
        ds.note_completed(f"refused-{i}", "", dispatched=False)
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.0, 64, 10, 11))
    assert _m(ds, A).active_prompt_tokens == 1000


def test_wire_translates_not_dispatched_and_reads_unknown_outcomes_as_error() -> None:
    """The new value round-trips; an outcome this build does not know (a newer router's) reads as ERROR,
    which is how an epp before NOT_DISPATCHED reads 4 (proto3 open enums keep the number)."""
    completion = RequestCompletion("r", "", 10, 0, CompletionOutcome.NOT_DISPATCHED)
    message = completion_to_proto(completion)
    assert message.outcome == epp_pb2.COMPLETION_OUTCOME_NOT_DISPATCHED == 4
    assert completion_from_proto(epp_pb2.CompletedRequest.FromString(message.SerializeToString())) == completion
    future = epp_pb2.CompletedRequest(request_id="r")
    future.outcome = 9  # type: ignore[assignment]
    assert completion_from_proto(future).outcome is CompletionOutcome.ERROR
