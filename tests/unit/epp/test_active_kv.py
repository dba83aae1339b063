"""Active prompt tokens (Dynamo's active blocks) in epp's datastore, and ``prefill-cost-scorer``'s
``active_weight`` term / the ``dynamo-cost`` config that reads them (issue 9)."""

from __future__ import annotations

import random

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2
from kvmesh.clock import ManualClock
from kvmesh.types import CompletionOutcome, Endpoint, EndpointId, RequestCompletion
from kvmesh.wire import completion_from_proto, completion_to_proto
from services.epp.datastore import OUTPUT_TOKENS_EWMA_ALPHA, Datastore, ScrapeSample
from services.epp.framework.interfaces import Candidate, EndpointMetrics, PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.plugins.scorers.prefill_cost import prefill_costs
from services.epp.scheduler import Scheduler
from tests.unit.epp.test_plugins import FakeIndex

A = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m")
B = Endpoint(id=EndpointId("127.0.0.1:2"), url="http://127.0.0.1:2", model="m")


def _store(*endpoints: Endpoint, ttl: float = 600.0) -> tuple[ManualClock, Datastore]:
    clock = ManualClock()
    ds = Datastore(clock, active_ttl_seconds=ttl)
    ds.set_endpoints({e.id: e for e in endpoints})
    return clock, ds


def _metrics(ds: Datastore, endpoint: Endpoint = A) -> EndpointMetrics:
    return next(c.metrics for c in ds.candidates("m") if c.id == endpoint.id)


def test_active_tokens_count_until_completion() -> None:
    _, ds = _store(A)
    ds.record_scrape(A.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    ds.note_pick(A.id, 100, "r1", prompt_tokens=16000)
    ds.note_pick(A.id, 9000, "r2", prompt_tokens=9000)
    ds.note_pick(A.id, 50, "", prompt_tokens=5000)  # no request id: nothing could free it, not counted
    assert _metrics(ds).active_prompt_tokens == 25000
    assert ds.note_completed("r1")
    assert _metrics(ds).active_prompt_tokens == 9000
    ds.note_completed("r1")  # twice: nothing more
    ds.note_completed("r2", endpoint_id=str(B.id))  # served elsewhere (a fallback): still freed where picked
    assert _metrics(ds).active_prompt_tokens == 0


def test_a_lost_completion_stops_counting_after_the_ttl() -> None:
    clock, ds = _store(A, ttl=30.0)
    ds.note_pick(A.id, 0, "lost", prompt_tokens=8000)
    clock.advance(20.0)
    ds.note_pick(A.id, 0, "young", prompt_tokens=1000)
    assert _metrics(ds).active_prompt_tokens == 9000
    clock.advance(11.0)
    assert _metrics(ds).active_prompt_tokens == 1000


def test_active_tokens_are_clamped_to_what_the_engine_holds() -> None:
    """At most the newest ceil(running + waiting) + pending picks count: completions lost while the engine
    shows fewer requests do not hold load."""
    _, ds = _store(A)
    for i, tokens in enumerate((1000, 2000, 3000)):
        ds.note_pick(A.id, 0, f"r{i}", prompt_tokens=tokens)
    # Received count 3 (all delivered, no pending): one running, none waiting -> only the newest counts.
    ds.record_scrape(A.id, ScrapeSample(0, 1, 0.5, 64, 2, 3))
    m = _metrics(ds)
    assert (m.pending_picks, m.active_prompt_tokens) == (0, 3000)
    ds.record_scrape(A.id, ScrapeSample(1, 1, 0.5, 64, 1, 3))
    assert _metrics(ds).active_prompt_tokens == 5000


def test_re_picked_request_id_counts_once() -> None:
    _, ds = _store(A, B)
    ds.note_pick(A.id, 0, "r", prompt_tokens=4000)
    ds.note_pick(A.id, 0, "r", prompt_tokens=4500)  # a retry under the same id
    assert _metrics(ds, A).active_prompt_tokens == 4500


def _cand(port: int, *, active: int = 0) -> Candidate:
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="m")
    return Candidate(endpoint, EndpointMetrics(block_size_tokens=64, age_seconds=0.0, active_prompt_tokens=active))


def test_active_weight_zero_is_the_old_cost_and_one_adds_active_plus_prompt() -> None:
    cands = [_cand(1, active=20000), _cand(2)]
    match = PrefixMatch(10, {cands[0].id: 9})
    assert prefill_costs(cands, 640, match, 1.0) == {cands[0].id: 64.0, cands[1].id: 640.0}
    assert prefill_costs(cands, 640, match, 1.0, 1.0) == {cands[0].id: 64.0 + 20000 + 640, cands[1].id: 640.0 + 640}
    assert prefill_costs(cands, 640, match, 1.0, 0.5) == {cands[0].id: 64.0 + 10320, cands[1].id: 640.0 + 320}


async def test_dynamo_cost_keeps_a_session_until_its_engine_kv_is_taken() -> None:
    """The case: a follow-up whose history is cached on A stays there while A's in-flight prompts leave
    room, and goes to B once A's pool is held by other requests' prompts (vLLM would make it wait there
    for their blocks); the llm-d-style prefill-cost config (no active term) keeps it on A."""
    _, ds = _store(A, B)
    for e in (A, B):
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 64, 0, 0))
    index = FakeIndex(PrefixMatch(100, {A.id: 90}))
    request = SchedulingRequest(model="m", token_ids=tuple(range(6400)), request_id="follow-up")

    async def pick(config: str) -> EndpointId:
        source, data = resolve_scheduling_config(config)
        profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=index), source)
        decision = await Scheduler(ds, profile, LiveEndpointFilter("live")).pick(request)
        ds.note_completed("follow-up")
        return decision.target.id

    assert await pick("dynamo-cost") == A.id  # 640 own + 6400 vs 6400 own + 6400
    ds.note_pick(A.id, 0, "other", prompt_tokens=3000)  # A holds a 3k-token prompt: still cheaper than a recompute
    assert await pick("dynamo-cost") == A.id
    ds.note_pick(A.id, 0, "another", prompt_tokens=20000)  # now 23k of A's KV is taken by others
    ds.record_scrape(A.id, ScrapeSample(0, 2, 0.35, 64, 0, 2))
    assert await pick("dynamo-cost") == B.id
    assert await pick("prefill-cost") == A.id
    ds.note_completed("another")  # finished: A is the place again
    assert await pick("dynamo-cost") == A.id


def test_a_re_pick_elsewhere_moves_the_active_tokens() -> None:
    """The router re-dispatches a request (its engine hung): the prompt no longer holds KV on the first
    endpoint, whose active count must not wait for the TTL (a stalled engine sends no scrape to clamp it)."""
    clock, ds = _store(A, B)
    ds.note_pick(A.id, 0, "r1", prompt_tokens=16000)
    ds.note_pick(B.id, 0, "r1", prompt_tokens=16000)
    assert (_metrics(ds, A).active_prompt_tokens, _metrics(ds, B).active_prompt_tokens) == (0, 16000)
    assert ds.note_completed("r1")
    clock.advance(1.0)
    assert (_metrics(ds, A).active_prompt_tokens, _metrics(ds, B).active_prompt_tokens) == (0, 0)


def test_mean_output_tokens_follow_the_routers_successful_completions() -> None:
    """The router's completions carry the output tokens (``CompletedRequest.completion_tokens``); epp keeps
    their exponentially weighted mean per model, for tier-cost's admission term. Failures, requests never
    dispatched and unknown counts (0) do not enter it; an endpoint of another model has its own. (Snapshots
    are reused for ``SNAPSHOT_REUSE_SECONDS``, hence the clock steps.)"""
    other = Endpoint(id=EndpointId("127.0.0.1:3"), url="http://127.0.0.1:3", model="other")
    clock, ds = _store(A, B, other)
    assert _metrics(ds).mean_output_tokens is None  # before the first completion: the scorer's prior
    ds.note_pick(A.id, 0, "r1", prompt_tokens=100)
    ds.note_completed("r1", output_tokens=64)
    clock.advance(0.01)
    assert _metrics(ds).mean_output_tokens == 64.0
    assert _metrics(ds, B).mean_output_tokens == 64.0  # the model's traffic, not one endpoint's
    ds.note_completed("r2", endpoint_id=str(B.id), output_tokens=264)
    clock.advance(0.01)
    assert _metrics(ds).mean_output_tokens == 64.0 + OUTPUT_TOKENS_EWMA_ALPHA * 200
    before = _metrics(ds).mean_output_tokens
    ds.note_completed("r3", endpoint_id=str(A.id), output_tokens=0)  # unknown
    ds.note_completed("r4", endpoint_id=str(A.id), dispatched=False, output_tokens=999)  # never dispatched
    clock.advance(0.01)
    assert _metrics(ds).mean_output_tokens == before
    assert next(c.metrics for c in ds.candidates("other")).mean_output_tokens is None


def test_completion_tokens_cross_the_wire() -> None:
    """``CompletedRequest.completion_tokens`` (field 6) round-trips, clamped to uint32; a message from a router
    before the field reads 0 (unknown)."""
    completion = RequestCompletion("r", "127.0.0.1:1", 100, 40, CompletionOutcome.SUCCESS, 64)
    message = completion_to_proto(completion)
    assert message.completion_tokens == 64
    assert completion_from_proto(epp_pb2.CompletedRequest.FromString(message.SerializeToString())) == completion
    assert completion_to_proto(RequestCompletion("r", "", completion_tokens=2**40)).completion_tokens == 0xFFFFFFFF
    assert completion_from_proto(epp_pb2.CompletedRequest(request_id="r")).completion_tokens == 0
