"""The multiplexed pick stream (``EndpointPicker.PickMany``, issue 10): the router's ``PickerClient``
against the real epp servicer and scheduler on a real gRPC server (loopback), the shared interceptor
chain included.

One stream carries every pick (batched per write) and the ``Completed`` reports; each entry's
error reads exactly as the unary ``Pick``'s status would (same domain class, same message); a
malformed entry is answered for itself and the stream goes on; an entry's deadline holds on both
sides; epp restarted is used again by the next pick; an older epp without ``PickMany`` is asked
with unary calls.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.clock import ManualClock
from kvmesh.interceptors import server_interceptors
from kvmesh.types import CompletionOutcome, Endpoint, EndpointId, RequestCompletion
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import PluginHandle, PrefixMatch
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from services.epp.servicer import SERVICE_NAME, EndpointPickerServicer, error_to_proto
from services.router.clients import PickerClient, PickQuery, _entry_error
from services.router.degraded import PickerUnreachable

ENDPOINTS = [Endpoint(id=EndpointId(f"127.0.0.1:{9000 + i}"), url=f"http://127.0.0.1:{9000 + i}", model="m")
             for i in range(4)]


class _Index:
    """kv_indexer stand-in for the precise profile: answers after ``delay`` seconds (0: at once) and
    counts the scores cancelled under it (a pick whose deadline passed)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.cancelled = 0

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        if self.delay:
            try:
                await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return PrefixMatch(len(token_ids) // 64, {})


def _scheduler(config: str = "load-only", index: _Index | None = None) -> tuple[Scheduler, Datastore]:
    datastore = Datastore(ManualClock())
    source, data = resolve_scheduling_config(config)
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=index), source)
    datastore.set_endpoints({e.id: e for e in ENDPOINTS})
    for e in ENDPOINTS:
        datastore.record_scrape(e.id, ScrapeSample(0, 0, 0.0))
    return Scheduler(datastore, profile, LiveEndpointFilter("live")), datastore


class CountingServicer(EndpointPickerServicer):
    """The real servicer, counting calls per method and the entries of each ``PickMany`` write."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.streams = self.unary_picks = self.unary_completed = 0
        self.batch_sizes: list[int] = []
        self.writes: list[tuple[int, int]] = []
        """(entries, completions) of each ``PickMany`` write received."""

    async def Pick(self, request: epp_pb2.PickRequest, context: grpc.aio.ServicerContext) -> epp_pb2.PickResponse:
        self.unary_picks += 1
        return await super().Pick(request, context)

    async def Completed(self, request: epp_pb2.CompletedBatch, context: grpc.aio.ServicerContext) -> epp_pb2.CompletedReply:
        self.unary_completed += 1
        return await super().Completed(request, context)

    async def PickMany(self, request_iterator: AsyncIterator[epp_pb2.PickBatch], context: grpc.aio.ServicerContext) -> None:
        self.streams += 1

        async def counted() -> AsyncIterator[epp_pb2.PickBatch]:
            async for batch in request_iterator:
                self.batch_sizes.append(len(batch.entries))
                self.writes.append((len(batch.entries), len(batch.completed)))
                yield batch

        await super().PickMany(counted(), context)


async def _serve(servicer: EndpointPickerServicer, port: int = 0, *, old: bool = False) -> tuple[grpc.aio.Server, int]:
    """A gRPC server with the shared interceptors; ``old``: only the RPCs an epp before PickMany had."""
    server = grpc.aio.server(interceptors=server_interceptors())
    if old:
        handlers = {
            "Pick": grpc.unary_unary_rpc_method_handler(
                servicer.Pick, epp_pb2.PickRequest.FromString, epp_pb2.PickResponse.SerializeToString),
            "GetPickerInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetPickerInfo, epp_pb2.GetPickerInfoRequest.FromString, epp_pb2.PickerInfo.SerializeToString),
            "Completed": grpc.unary_unary_rpc_method_handler(
                servicer.Completed, epp_pb2.CompletedBatch.FromString, epp_pb2.CompletedReply.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    else:
        epp_pb2_grpc.add_EndpointPickerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def _client(port: int, *, multiplexed: bool = True, timeout: float = 5.0,
                  completed_flush_seconds: float = 0.0) -> PickerClient:
    client = PickerClient(f"127.0.0.1:{port}", timeout_seconds=timeout, multiplexed=multiplexed,
                          completed_flush_seconds=completed_flush_seconds)
    await client.connect()
    return client


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms (epp reads the stream in its own time); TimeoutError after ``timeout``."""
    async with asyncio.timeout(timeout):
        for _ in iter(int, 1):
            if predicate():
                return
            await asyncio.sleep(0.01)


async def test_many_concurrent_picks_share_one_stream_and_completions_ride_it() -> None:
    scheduler, datastore = _scheduler()
    servicer = CountingServicer(scheduler)
    server, port = await _serve(servicer)
    client = await _client(port)
    try:
        replies = await asyncio.gather(*(client.pick(PickQuery(f"r{i}", "m")) for i in range(64)))
        assert all(r.candidates[0].id in {e.id for e in ENDPOINTS} for r in replies)
        assert all(r.profile == "default" for r in replies)
        targets = [r.candidates[0].id for r in replies]
        assert sorted(targets.count(e.id) for e in ENDPOINTS) == [16, 16, 16, 16]  # each pick saw the others'
        assert (servicer.streams, servicer.unary_picks) == (1, 0)
        assert sum(servicer.batch_sizes) == 64 and max(servicer.batch_sizes) > 1  # batched per write
        assert sum(c.metrics.pending_picks for c in datastore.candidates("m")) == 64
        for i, target in enumerate(targets):
            client.report_completed(RequestCompletion(f"r{i}", target, 10, 0, CompletionOutcome.SUCCESS))
        await _until(lambda: sum(c.metrics.pending_picks for c in datastore.candidates("m")) == 0)
        assert servicer.unary_completed == 0 and servicer.streams == 1  # on the pick stream's writes
        again = await client.pick(PickQuery("r-next", "m"))
        assert again.candidates and servicer.streams == 1
    finally:
        await client.close()
        await server.stop(0)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (PickQuery("r", "no-such-model"), errors.UnknownModel),
        (PickQuery("r", "m", exclude_endpoint_ids=tuple(e.id for e in ENDPOINTS)), errors.NoEndpointsAvailable),
        (PickQuery("r", ""), errors.InvalidRequest),
        (PickQuery("r", "m", prompt_token_ids=(1, 2, 3), render_json=b"{not json"), errors.InvalidRequest),
        (PickQuery("r", "m", prompt_token_ids=(1, 2, 3), render_json=b"[1]"), errors.InvalidRequest),
    ],
    ids=["unknown-model", "all-excluded", "empty-model", "render-not-json", "render-not-object"],
)
async def test_entry_errors_read_as_the_unary_call_reads_them(
    query: PickQuery, expected: type[errors.KvmeshError]
) -> None:
    scheduler, _ = _scheduler("precise-prefix", _Index())  # reads the prompt: render_json travels
    servicer = CountingServicer(scheduler)
    server, port = await _serve(servicer)
    stream_client, unary_client = await _client(port), await _client(port, multiplexed=False)
    try:
        with pytest.raises(expected) as on_stream:
            await stream_client.pick(query)
        with pytest.raises(expected) as unary:
            await unary_client.pick(query)
        assert type(on_stream.value) is type(unary.value)
        assert str(on_stream.value) == str(unary.value)
        assert (servicer.streams, servicer.unary_picks) == (1, 1)
        assert (await stream_client.pick(PickQuery("r-ok", "m", prompt_token_ids=tuple(range(128))))).candidates
        assert servicer.streams == 1  # the stream survived the failed entry
    finally:
        await stream_client.close()
        await unary_client.close()
        await server.stop(0)


def test_an_unanswered_failure_reads_as_the_picker_failing() -> None:
    """A bug inside epp (unary: INTERNAL without the error-class trailer) and an entry past its
    deadline are the degraded mode's cue, as for the unary call; a domain error keeps its class."""
    assert isinstance(_entry_error(error_to_proto(RuntimeError("boom"))), PickerUnreachable)
    deadline = epp_pb2.PickError(code="DEADLINE_EXCEEDED", message="Deadline Exceeded")
    assert isinstance(_entry_error(deadline), PickerUnreachable)
    unknown = _entry_error(error_to_proto(errors.UnknownModel("model 'x'")))
    assert type(unknown) is errors.UnknownModel and str(unknown) == "model 'x'"


async def test_malformed_entries_are_answered_alone_and_the_stream_goes_on() -> None:
    scheduler, _ = _scheduler()
    server, port = await _serve(EndpointPickerServicer(scheduler))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = epp_pb2_grpc.EndpointPickerStub(channel).PickMany()
        good = epp_pb2.PickRequest(request_id="g", model="m")
        await call.write(epp_pb2.PickBatch(entries=[
            epp_pb2.PickEntry(id=0, request=good),  # zero id
            epp_pb2.PickEntry(id=1, request=good),
            epp_pb2.PickEntry(id=2, request=epp_pb2.PickRequest(model="m", render_json=b"{")),
            epp_pb2.PickEntry(id=3, request=epp_pb2.PickRequest(model="")),
            epp_pb2.PickEntry(id=5, request=epp_pb2.PickRequest(  # nested past msgspec's recursion limit
                model="m", render_json=b'{"messages":' + b"[" * 50000 + b"]" * 50000 + b"}")),
        ]))
        results: dict[int, epp_pb2.PickResult] = {}
        async with asyncio.timeout(5):
            while len(results) < 5:
                message = await call.read()
                results.update({r.id: r for r in message.results})
        assert results[0].error.code == "INVALID_ARGUMENT" and results[0].error.error_class == "InvalidRequest"
        assert results[1].response.target.url.startswith("http://127.0.0.1:")
        assert (results[2].error.code, results[2].error.error_class) == ("INVALID_ARGUMENT", "InvalidRequest")
        assert "render_json" in results[2].error.message
        assert (results[3].error.code, results[3].error.error_class) == ("INVALID_ARGUMENT", "InvalidRequest")
        assert (results[5].error.code, results[5].error.error_class) == ("INVALID_ARGUMENT", "InvalidRequest")
        assert "nested too deeply" in results[5].error.message
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=4, request=good)]))
        async with asyncio.timeout(5):
            message = await call.read()
        assert [r.id for r in message.results] == [4] and message.results[0].HasField("response")
        await call.done_writing()
        async with asyncio.timeout(5):
            assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await server.stop(0)


async def test_an_entry_deadline_holds_on_both_sides() -> None:
    index = _Index(delay=2.0)
    scheduler, _ = _scheduler("precise-prefix", index)
    server, port = await _serve(EndpointPickerServicer(scheduler))
    client = await _client(port, timeout=0.3)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        started = time.monotonic()
        with pytest.raises(PickerUnreachable, match="Deadline Exceeded"):
            await client.pick(PickQuery("slow", "m", prompt_token_ids=tuple(range(128))))
        assert time.monotonic() - started < 1.5
        await _until(lambda: index.cancelled == 1)  # the router's cancel (or the entry's deadline) stopped it
        # epp's side alone: an entry whose deadline passes is answered DEADLINE_EXCEEDED
        call = epp_pb2_grpc.EndpointPickerStub(channel).PickMany()
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(
            id=7, timeout_seconds=0.05, request=epp_pb2.PickRequest(model="m", prompt_token_ids=range(128)))]))
        async with asyncio.timeout(2):
            message = await call.read()
        assert [(r.id, r.error.code, r.error.error_class) for r in message.results] == [(7, "DEADLINE_EXCEEDED", "")]
        assert index.cancelled == 2
        call.cancel()
    finally:
        await channel.close()
        await client.close()
        await server.stop(0)


async def test_epp_restart_next_pick_opens_a_new_stream() -> None:
    scheduler, _ = _scheduler()
    first = CountingServicer(scheduler)
    server, port = await _serve(first)
    client = await _client(port, timeout=1.0)
    try:
        assert (await client.pick(PickQuery("a", "m"))).candidates
        await server.stop(0)
        with pytest.raises(PickerUnreachable):
            await client.pick(PickQuery("b", "m"))  # epp gone: the degraded mode's cue
        # the ended stream leaves no task behind (a writer waiting forever is destroyed pending at exit)
        await _until(lambda: not [t for t in asyncio.all_tasks()
                                  if t.get_name().startswith("router-pick-many") and not t.done()])
        second = CountingServicer(scheduler)
        server, _ = await _serve(second, port)
        reply = None
        async with asyncio.timeout(10):
            while reply is None:
                try:
                    reply = await client.pick(PickQuery("c", "m"))
                except PickerUnreachable:
                    await asyncio.sleep(0.05)  # the channel's reconnect backoff (100 ms .. 1 s)
        assert reply.candidates
        # While the channel reconnects, a stream that ends before answering hands its pick to a unary
        # call: the restarted epp may have seen such a stream and call; once up, picks ride one stream.
        assert first.streams == 1 and second.streams >= 1
        streams, unary = second.streams, second.unary_picks
        for i in range(3):
            assert (await client.pick(PickQuery(f"d{i}", "m"))).candidates
        assert (second.streams, second.unary_picks) == (streams, unary)
    finally:
        await client.close()
        await server.stop(0)


async def test_an_old_epp_without_pick_many_is_asked_with_unary_calls() -> None:
    scheduler, _ = _scheduler()
    servicer = CountingServicer(scheduler)
    server, port = await _serve(servicer, old=True)
    client = await _client(port)
    try:
        replies = await asyncio.gather(*(client.pick(PickQuery(f"r{i}", "m")) for i in range(8)))
        assert all(r.candidates for r in replies)
        assert servicer.streams == 0  # UNIMPLEMENTED came from grpc itself: no such method
        assert servicer.unary_picks == 8
        assert (await client.pick(PickQuery("later", "m"))).candidates and servicer.unary_picks == 9
        for i, reply in enumerate(replies):
            client.report_completed(RequestCompletion(f"r{i}", reply.candidates[0].id, 10, 0, CompletionOutcome.SUCCESS))
        await _until(lambda: servicer.unary_completed >= 1)
        with pytest.raises(errors.UnknownModel):
            await client.pick(PickQuery("x", "no-such-model"))
    finally:
        await client.close()
        await server.stop(0)


class _UnansweringStreamServicer(CountingServicer):
    """An epp whose ``PickMany`` ends before answering anything, with a bare status (``code``): what an
    older epp's ``UNIMPLEMENTED`` reads as when a failed first write hides it, or an epp going down."""

    def __init__(self, scheduler: Scheduler, code: grpc.StatusCode) -> None:
        super().__init__(scheduler)
        self.code = code

    async def PickMany(self, request_iterator: AsyncIterator[epp_pb2.PickBatch], context: grpc.aio.ServicerContext) -> None:
        self.streams += 1
        await context.abort(self.code, "Internal error from Core")


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE])
async def test_a_stream_that_ends_before_answering_leaves_the_pick_to_a_unary_call(code: grpc.StatusCode) -> None:
    """Seen in the router's integration test against an epp without ``PickMany``: the stream failed
    INTERNAL, not UNIMPLEMENTED, and the router picked locally in degraded mode. A stream that ended
    before answering anything now hands its pick to one unary call (any epp serves it); the next
    pick tries the stream again; a stream that did answer and then failed is still the degraded cue."""
    scheduler, _ = _scheduler()
    servicer = _UnansweringStreamServicer(scheduler, code)
    server, port = await _serve(servicer)
    client = await _client(port)
    try:
        for i in range(3):
            assert (await client.pick(PickQuery(f"r{i}", "m"))).candidates
        assert servicer.unary_picks == 3 and servicer.streams == 3  # each pick tried the stream first
        with pytest.raises(errors.UnknownModel):  # the unary call's domain errors are kept
            await client.pick(PickQuery("x", "no-such-model"))
    finally:
        await client.close()
        await server.stop(0)


async def test_a_half_closed_stream_answers_its_picks_in_flight_then_ends() -> None:
    """grpcurl and other clients send their entries and close their side: the answers still come."""
    scheduler, _ = _scheduler("precise-prefix", _Index(delay=0.1))
    server, port = await _serve(EndpointPickerServicer(scheduler))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = epp_pb2_grpc.EndpointPickerStub(channel).PickMany()
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(
            id=i, request=epp_pb2.PickRequest(model="m", prompt_token_ids=range(128))) for i in (1, 2)]))
        await call.done_writing()
        answered: list[int] = []
        async with asyncio.timeout(5):
            async for message in call:
                answered += [r.id for r in message.results if r.HasField("response")]
        assert sorted(answered) == [1, 2]
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_deferred_completion_rides_the_next_pick_or_goes_within_the_flush_time() -> None:
    """``completed_flush_seconds``: a finished request's report waits for the next pick's write
    (one write carries both, so epp frees the load just before it decides) and otherwise goes on
    its own within the flush time; nothing is lost either way."""
    scheduler, datastore = _scheduler()
    servicer = CountingServicer(scheduler)
    server, port = await _serve(servicer)
    client = await _client(port, completed_flush_seconds=0.5)
    try:
        first = await client.pick(PickQuery("r1", "m"))
        client.report_completed(RequestCompletion("r1", first.candidates[0].id, 10, 0, CompletionOutcome.SUCCESS))
        await asyncio.sleep(0.05)  # well inside the flush time: not written yet
        assert servicer.writes == [(1, 0)]
        second_pick = await client.pick(PickQuery("r2", "m"))
        assert servicer.writes == [(1, 0), (1, 1)]  # the completion rode the pick's write
        pending = {c.id: c.metrics.pending_picks for c in datastore.candidates("m")}
        assert sum(pending.values()) == 1  # r1 freed, r2 in flight
        second = servicer.writes[:]
        client.report_completed(RequestCompletion("r2", second_pick.candidates[0].id, 10, 0, CompletionOutcome.SUCCESS))
        started = time.monotonic()
        await _until(lambda: len(servicer.writes) > len(second))
        assert servicer.writes[-1] == (0, 1) and time.monotonic() - started >= 0.3  # alone, after the flush time
        assert servicer.unary_completed == 0 and servicer.streams == 1
    finally:
        await client.close()
        await server.stop(0)


async def test_a_duplicate_id_in_flight_is_its_one_answer_and_the_held_pick_is_dropped() -> None:
    """An entry reusing an id still in flight: one INVALID_ARGUMENT for the id, the held pick cancelled
    (no result under that id after the error), the stream goes on, and the id can be used again."""
    index = _Index(delay=1.0)
    scheduler, datastore = _scheduler("precise-prefix", index)
    server, port = await _serve(EndpointPickerServicer(scheduler))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = epp_pb2_grpc.EndpointPickerStub(channel).PickMany()
        slow = epp_pb2.PickRequest(request_id="s", model="m", prompt_token_ids=range(128))
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=5, request=slow)]))
        await asyncio.sleep(0.2)  # epp has the first entry, waiting on the index
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=5, request=slow)]))
        async with asyncio.timeout(5):
            message = await call.read()
        assert [(r.id, r.error.code) for r in message.results] == [(5, "INVALID_ARGUMENT")]
        assert "already in flight" in message.results[0].error.message
        await _until(lambda: index.cancelled == 1)  # the held pick was stopped, not left to answer later
        index.delay = 0.0
        await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=5, request=slow)]))
        async with asyncio.timeout(5):
            message = await call.read()
        assert [r.id for r in message.results] == [5] and message.results[0].HasField("response")
        assert sum(datastore.picks_total(e.id) for e in ENDPOINTS) == 1  # only the last entry was picked
        await call.done_writing()
        async with asyncio.timeout(5):
            assert await call.read() is grpc.aio.EOF
    finally:
        await channel.close()
        await server.stop(0)
