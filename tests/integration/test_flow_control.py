"""flow_control as a process: the limit, FCFS queueing, release on close and on cancel, TTL, bad input;
bands, fairness, quotas, shedding, saturation read from a real epp, a restart under load (issue 12)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as pb
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_grpc_healthy
from tests.integration.test_epp import engines  # noqa: F401 (the fixture: real /metrics servers in etcd)
from tests.support import service_ports, wait_until_async

pytestmark = pytest.mark.integration


def metrics_url(proc) -> str:
    return f"http://127.0.0.1:{service_ports(proc)['metrics']}/metrics"


def enqueue(request_id: str, **kw: Any) -> pb.AdmitRequest:
    kw.setdefault("model", "m")
    return pb.AdmitRequest(enqueue=pb.Enqueue(request_id=request_id, prompt_tokens=10, **kw))


async def admit(stub: pb_grpc.FlowControlStub, request_id: str) -> grpc.aio.StreamStreamCall:
    call = stub.Admit()
    await call.write(enqueue(request_id))
    return call


async def stats_become(stub: pb_grpc.FlowControlStub, *, in_flight: int, queued: int, timeout: float = 10.0) -> None:
    """Wait until Stats reports ``(in_flight, queued)``; the failure names the last pair seen."""

    async def observed() -> tuple[int, int]:
        s = await stub.Stats(pb.StatsRequest())
        return s.in_flight, s.queued

    want = (in_flight, queued)
    await wait_until_async(observed, timeout, f"(in_flight, queued) == {want}", until=want.__eq__, interval=0.02)


async def test_limit_queue_release_and_cancel(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "2", "--queue-ttl-seconds", "30")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        a, b = await admit(stub, "a"), await admit(stub, "b")
        assert (await a.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        assert (await b.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        c = await admit(stub, "c")
        await stats_become(stub, in_flight=2, queued=1)

        # Normal close of a: send Complete, half-close, the server ends the stream and releases.
        await a.write(pb.AdmitRequest(complete=pb.Complete(success=True, completion_tokens=5)))
        await a.done_writing()
        assert await a.read() == grpc.aio.EOF
        assert await a.code() == grpc.StatusCode.OK
        reply = await c.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_DISPATCHED
        assert reply.queue_seconds > 0
        await stats_become(stub, in_flight=2, queued=0)

        # A queued client that cancels leaves the queue.
        d = await admit(stub, "d")
        await stats_become(stub, in_flight=2, queued=1)
        d.cancel()
        await stats_become(stub, in_flight=2, queued=0)

        # Dispatched clients that cancel mid-way give their slots back.
        b.cancel()
        c.cancel()
        await stats_become(stub, in_flight=0, queued=0)
        final = await stub.Stats(pb.StatsRequest())
        assert (final.dispatched_total, final.rejected_total, final.max_in_flight) == (3, 0, 2)


async def test_queue_ttl_rejects_with_reason(start_service) -> None:
    proc, address = start_service("flow_control", "--max-in-flight", "1", "--queue-ttl-seconds", "0.3")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = await admit(stub, "holder")
        assert (await holder.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        late = await admit(stub, "late")
        reply = await late.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_EVICTED_TTL
        assert "queue_ttl_seconds=0.3" in reply.reason
        assert reply.queue_seconds >= 0.3
        assert await late.read() == grpc.aio.EOF  # the server ends a rejected stream
        holder.cancel()
        await stats_become(stub, in_flight=0, queued=0)
        assert (await stub.Stats(pb.StatsRequest())).rejected_total == 1
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(metrics_url(proc))).text
    assert 'kvmesh_flow_control_outcome_total{outcome="evicted_ttl"} 1.0' in text
    assert 'kvmesh_flow_control_outcome_total{outcome="dispatched"} 1.0' in text
    assert "kvmesh_flow_control_in_flight 0.0" in text
    assert "kvmesh_flow_control_queue_size 0.0" in text
    assert 'kvmesh_flow_control_queue_duration_seconds_count{outcome="evicted_ttl"} 1.0' in text


async def test_queue_full_rejects(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "1", "--max-queue-size", "0")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = await admit(stub, "holder")
        assert (await holder.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        rejected = await admit(stub, "rejected")
        reply = await rejected.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_REJECTED_CAPACITY
        assert "max_queue_size=0" in reply.reason
        await holder.done_writing()
        assert await holder.read() == grpc.aio.EOF
        await stats_become(stub, in_flight=0, queued=0)


BAD_FIRST_MESSAGES = {
    "complete-first": pb.AdmitRequest(complete=pb.Complete()),
    "empty-message": pb.AdmitRequest(),
    "no-message": None,
    "enqueue-without-request-id": pb.AdmitRequest(enqueue=pb.Enqueue(model="m")),
}


async def test_bad_first_message_is_invalid_argument(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "1")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        for name, first in BAD_FIRST_MESSAGES.items():
            call = stub.Admit()
            if first is not None:
                await call.write(first)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await call.read()
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            # The service keeps serving, and the bad stream held no slot.
            ok = await admit(stub, "ok")
            assert (await ok.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED, name
            await ok.done_writing()
            assert await ok.read() == grpc.aio.EOF
            await stats_become(stub, in_flight=0, queued=0)
        # A second enqueue after dispatch is a protocol error; the slot is still released.
        twice = await admit(stub, "twice")
        assert (await twice.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        await twice.write(enqueue("twice"))
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await twice.read()
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stats_become(stub, in_flight=0, queued=0)


async def test_admit_stream_protocol_errors_are_answered(start_service) -> None:
    """The Admit protocol (the proto: an Enqueue, one answer, at most one Complete, half-close): a
    second Enqueue is INVALID_ARGUMENT (while queued: at once, the request leaves the queue; after
    dispatch: at once, the slot is released), as is a second Complete; a Complete sent ahead of the decision (grpcurl's two messages) is applied after dispatch."""
    _, address = start_service("flow_control", "--max-in-flight", "1", "--queue-ttl-seconds", "30")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = await admit(stub, "holder")
        assert (await holder.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED

        queued = await admit(stub, "queued")
        await stats_become(stub, in_flight=1, queued=1)
        await queued.write(enqueue("queued-again"))
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await asyncio.wait_for(queued.read(), 5)  # answered while still queued, not at dispatch
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "second enqueue" in (exc_info.value.details() or "")
        await stats_become(stub, in_flight=1, queued=0)

        rejected = stub.Admit()  # both messages at once, as grpcurl sends them; the first would be rejected
        await rejected.write(enqueue("short-ttl", ttl_seconds=2.0))
        await rejected.write(enqueue("short-ttl-again"))
        await rejected.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await asyncio.wait_for(rejected.read(), 5)  # the second enqueue is seen while the first waits
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        ahead = stub.Admit()  # enqueue + complete + half-close while the slot is taken
        await ahead.write(enqueue("ahead"))
        await ahead.write(pb.AdmitRequest(complete=pb.Complete(success=True, completion_tokens=3)))
        await ahead.done_writing()
        await stats_become(stub, in_flight=1, queued=1)
        holder.cancel()
        assert (await ahead.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        assert await ahead.read() == grpc.aio.EOF
        assert await ahead.code() == grpc.StatusCode.OK
        await stats_become(stub, in_flight=0, queued=0)

        twice = await admit(stub, "twice")
        assert (await twice.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        await twice.write(pb.AdmitRequest(complete=pb.Complete(success=True)))
        await twice.write(pb.AdmitRequest(complete=pb.Complete(success=True)))
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await twice.read()
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "second complete" in (exc_info.value.details() or "")
        await stats_become(stub, in_flight=0, queued=0)
        # The service keeps serving.
        ok = await admit(stub, "ok")
        assert (await ok.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        await ok.done_writing()
        assert await ok.read() == grpc.aio.EOF


async def _decisions(call: grpc.aio.StreamStreamCall, want: set[int]) -> dict[int, pb.AdmitDecision]:
    got: dict[int, pb.AdmitDecision] = {}
    while not want <= got.keys():
        message = await asyncio.wait_for(call.read(), 5)
        assert message is not grpc.aio.EOF, got
        got.update((d.ticket, d) for d in message.decisions)
    return got


async def test_admit_many_answers_every_refused_entry_with_an_error_and_goes_on(start_service) -> None:
    """Every AdmitMany entry flow_control refuses gets an ``AdmitDecision.error`` (status and class
    from kvmesh/errors.py's table, the shape of epp's PickMany ``PickError``) for its ticket alone;
    the stream and the tickets it holds go on."""
    _, address = start_service("flow_control", "--max-in-flight", "4")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        call = stub.AdmitMany()
        await call.write(pb.AdmitBatch(entries=[pb.AdmitEntry(ticket=1, enqueue=pb.Enqueue(request_id="a", model="m")),
                                                pb.AdmitEntry(ticket=3, enqueue=pb.Enqueue(request_id="c", model="m"))]))
        first = await _decisions(call, {1, 3})
        assert first[1].WhichOneof("outcome") == "response"
        assert first[1].response.outcome == pb.QUEUE_OUTCOME_DISPATCHED
        bad = [
            pb.AdmitEntry(ticket=3, enqueue=pb.Enqueue(request_id="dup", model="m")),  # duplicate ticket (releases 3)
            pb.AdmitEntry(ticket=0, enqueue=pb.Enqueue(request_id="zero", model="m")),  # zero ticket
            pb.AdmitEntry(ticket=97, enqueue=pb.Enqueue(request_id="long", model="m", flow_id="x" * 257)),
            pb.AdmitEntry(ticket=96, enqueue=pb.Enqueue(request_id="nan", model="m", ttl_seconds=float("nan"))),
            pb.AdmitEntry(ticket=99, complete=pb.Complete()),  # completion for an unknown ticket
            pb.AdmitEntry(ticket=95, release=pb.Release()),  # release of an unknown ticket
            pb.AdmitEntry(ticket=98),  # no body
        ]
        await call.write(pb.AdmitBatch(entries=bad))
        got = await _decisions(call, {0, 3, 95, 96, 97, 98, 99})
        expected = {3: "INVALID_ARGUMENT", 0: "INVALID_ARGUMENT", 97: "INVALID_ARGUMENT", 96: "INVALID_ARGUMENT",
                    99: "NOT_FOUND", 95: "NOT_FOUND", 98: "INVALID_ARGUMENT"}
        for ticket, code in expected.items():
            decision = got[ticket]
            assert decision.WhichOneof("outcome") == "error", decision
            classes = {"INVALID_ARGUMENT": "InvalidRequest", "NOT_FOUND": "NotFound"}
            assert (decision.error.code, decision.error.error_class) == (code, classes[code]), decision
            assert decision.error.message
        assert "ticket 99" in got[99].error.message and "ticket 98" in got[98].error.message
        # The stream goes on: ticket 1 is still held (its Complete is not answered), ticket 3 is not (its
        # duplicate's error released it), new tickets are admitted.
        stats = await stub.Stats(pb.StatsRequest())
        assert (stats.in_flight, stats.queued) == (1, 0)
        await call.write(pb.AdmitBatch(entries=[
            pb.AdmitEntry(ticket=1, complete=pb.Complete(success=True)),
            pb.AdmitEntry(ticket=2, enqueue=pb.Enqueue(request_id="b", model="m")),
        ]))
        later = await _decisions(call, {2})
        assert set(later) == {2} and later[2].response.outcome == pb.QUEUE_OUTCOME_DISPATCHED
        await stats_become(stub, in_flight=1, queued=0)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await stats_become(stub, in_flight=0, queued=0)


async def test_admit_many_duplicate_ticket_leaves_nothing_held_and_released_ids_are_reused(start_service) -> None:
    """An error for a ticket means the stream holds nothing under it (the proto's AdmitError
    contract; the router drops a ticket on any error): an Enqueue under a ticket still queued, or
    dispatched and not yet released, is refused and releases the earlier admission too (no
    decision comes later for the queued one; the dispatched one's slot is freed). An id the stream
    no longer holds (completed, released, errored) is accepted again."""
    _, address = start_service("flow_control", "--max-in-flight", "1", "--queue-ttl-seconds", "30")

    def enq(ticket: int, request_id: str) -> pb.AdmitEntry:
        return pb.AdmitEntry(ticket=ticket, enqueue=pb.Enqueue(request_id=request_id, model="m"))

    def complete(ticket: int) -> pb.AdmitEntry:
        return pb.AdmitEntry(ticket=ticket, complete=pb.Complete(success=True))

    async def next_decisions() -> dict[int, pb.AdmitDecision]:
        message = await asyncio.wait_for(call.read(), 5)
        assert message is not grpc.aio.EOF
        return {d.ticket: d for d in message.decisions}

    def dispatched(decision: pb.AdmitDecision) -> bool:
        return decision.WhichOneof("outcome") == "response" and decision.response.outcome == pb.QUEUE_OUTCOME_DISPATCHED

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        call = stub.AdmitMany()
        await call.write(pb.AdmitBatch(entries=[enq(1, "a")]))
        assert dispatched((await next_decisions())[1])
        await call.write(pb.AdmitBatch(entries=[enq(2, "b")]))  # queued behind ticket 1
        await stats_become(stub, in_flight=1, queued=1)
        # A duplicate of the queued ticket: one error, and the queued request leaves the queue.
        await call.write(pb.AdmitBatch(entries=[enq(2, "b-again")]))
        got = await next_decisions()
        assert set(got) == {2} and got[2].WhichOneof("outcome") == "error", got
        assert (got[2].error.code, got[2].error.error_class) == ("INVALID_ARGUMENT", "InvalidRequest")
        assert "already in use" in got[2].error.message and "(queued)" in got[2].error.message
        await stats_become(stub, in_flight=1, queued=0)
        # Ticket 1's slot goes to ticket 3, not to the released ticket 2: no decision for 2 ever comes
        # (decisions are written in order, so a dispatch of 2 would come first and 3 would queue).
        await call.write(pb.AdmitBatch(entries=[complete(1), enq(3, "c")]))
        got = await next_decisions()
        assert set(got) == {3} and dispatched(got[3]), got
        await stats_become(stub, in_flight=1, queued=0)
        # A duplicate of a dispatched ticket: the error frees its slot; its later Complete is NOT_FOUND.
        await call.write(pb.AdmitBatch(entries=[enq(3, "c-again")]))
        got = await next_decisions()
        assert got[3].WhichOneof("outcome") == "error" and "(dispatched)" in got[3].error.message, got
        await stats_become(stub, in_flight=0, queued=0)
        await call.write(pb.AdmitBatch(entries=[complete(3)]))
        got = await next_decisions()
        assert got[3].error.code == "NOT_FOUND", got
        # Ids the stream no longer holds are free: 2 (errored), 3 (errored), 1 (completed).
        for ticket in (2, 3, 1):
            await call.write(pb.AdmitBatch(entries=[enq(ticket, f"reuse-{ticket}")]))
            got = await next_decisions()
            assert set(got) == {ticket} and dispatched(got[ticket]), got
            await call.write(pb.AdmitBatch(entries=[complete(ticket)]))
            await stats_become(stub, in_flight=0, queued=0)
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await stats_become(stub, in_flight=0, queued=0)


async def test_admit_many_duplicate_on_credit_ticket_leaves_nothing_held(start_service) -> None:
    """The credit sibling: an ``on_credit`` Enqueue (recorded as dispatched, no decision) under a
    ticket the stream holds is answered with an error and both admissions are gone (the duplicate
    spent its credit, the earlier one's slot is freed), as for a decided ticket."""
    _, address = start_service("flow_control", "--max-in-flight", "4")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        call = stub.AdmitMany()
        await call.write(pb.AdmitBatch(entries=[pb.AdmitEntry(credit_request=pb.CreditRequest(max_credits=2))]))
        message = await asyncio.wait_for(call.read(), 5)
        assert message.credits.grant >= 2, message
        on_credit = pb.AdmitEntry(ticket=5, enqueue=pb.Enqueue(request_id="a", model="m"), on_credit=True)
        await call.write(pb.AdmitBatch(entries=[on_credit]))
        await stats_become(stub, in_flight=1, queued=0)
        await call.write(pb.AdmitBatch(entries=[on_credit]))  # the same ticket again, on a second credit
        got = await _decisions(call, {5})  # past any credit top-up
        assert got[5].WhichOneof("outcome") == "error" and "(dispatched)" in got[5].error.message, got
        await stats_become(stub, in_flight=0, queued=0)
        await call.done_writing()
        while (await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
            pass


async def test_router_admission_client_reads_the_entry_error(start_service) -> None:
    """The router (AdmitMany's client) turns an ``AdmitDecision.error`` into the domain error of its
    class (a malformed enqueue: InvalidRequest -> HTTP 400), and its stream keeps admitting."""
    from kvmesh import errors
    from services.router.clients import AdmissionClient, AdmitQuery

    _, address = start_service("flow_control", "--max-in-flight", "4")
    client = AdmissionClient(address, admission_timeout_seconds=5, close_timeout_seconds=1)
    await client.connect()
    try:
        with pytest.raises(errors.InvalidRequest, match="at most 256") as exc_info:
            await client.admit(AdmitQuery("r1", "x" * 300, 0, 10, 10, "m"))
        assert type(exc_info.value) is errors.InvalidRequest
        ticket = await client.admit(AdmitQuery("r2", "f", 0, 10, 10, "m"))
        await ticket.close()
    finally:
        await client.close()


def test_reflection_lists_methods(start_service) -> None:
    _, address = start_service("flow_control")
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        service = DescriptorPool(database).FindServiceByName("kvmesh.flow_control.v1.FlowControl")
        assert {m.name for m in service.methods} == {"Admit", "AdmitMany", "Stats"}


async def test_many_streams_with_random_cancels_release_every_slot(start_service) -> None:
    """Concurrent clients that finish, cancel while dispatched or cancel while queued."""
    _, address = start_service("flow_control", "--max-in-flight", "3")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)

        async def client(i: int) -> None:
            call = await admit(stub, f"r{i}")
            if i % 5 == 4:
                await asyncio.sleep(0.01 * (i % 3))
                call.cancel()  # may be queued or dispatched by now
                return
            reply = await call.read()
            assert reply.outcome == pb.QUEUE_OUTCOME_DISPATCHED
            if i % 3 == 0:
                call.cancel()
            else:
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF

        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, (await stub.Stats(pb.StatsRequest())).in_flight)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(40))), 30)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await stats_become(stub, in_flight=0, queued=0)
        assert 1 <= peak <= 3


# -- issue 12: bands, fairness, quotas, shedding, saturation from epp, restart ---------------------


async def _dispatched(call: grpc.aio.StreamStreamCall) -> bool:
    return (await call.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED


async def test_bands_then_round_robin_over_grpc(start_service) -> None:
    proc, address = start_service("flow_control", "--max-in-flight", "1", "--fairness-policy", "round-robin-fairness-policy")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = stub.Admit()
        await holder.write(enqueue("hold"))
        assert await _dispatched(holder)
        calls = {}
        for rid, flow, prio in [("a0", "a", 0), ("a1", "a", 0), ("a2", "a", 0), ("b0", "b", 0), ("hi", "c", 5)]:
            call = stub.Admit()
            await call.write(enqueue(rid, flow_id=flow, priority=prio))
            calls[rid] = call
        await stats_become(stub, in_flight=1, queued=5)
        stats = await stub.Stats(pb.StatsRequest())
        assert [(b.priority, b.queued) for b in stats.bands] == [(5, 1), (0, 4)]
        assert {(f.flow_id, f.priority, f.queued) for f in stats.flows} >= {("a", 0, 3), ("b", 0, 1), ("c", 5, 1)}
        order: list[str] = []
        current = holder
        reads = {rid: asyncio.ensure_future(c.read()) for rid, c in calls.items()}  # one read per stream
        for _ in range(5):
            await current.done_writing()
            pending = [f for r, f in reads.items() if r not in order]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED, timeout=10)
            await asyncio.sleep(0.2)  # a wrongly freed second slot would show up here
            (rid,) = [r for r, f in reads.items() if r not in order and f.done()]
            assert reads[rid].result().outcome == pb.QUEUE_OUTCOME_DISPATCHED
            order.append(rid)
            current = calls[rid]
        assert order == ["hi", "a0", "b0", "a1", "a2"]  # strict band order, then one turn per flow
        await current.done_writing()
        await stats_become(stub, in_flight=0, queued=0)
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(metrics_url(proc))).text
    assert 'kvmesh_flow_control_band_outcome_total{band="5",outcome="dispatched"} 1.0' in text
    assert 'kvmesh_flow_control_flow_queue_wait_seconds_count{band="0",flow="a"} 3.0' in text
    assert "kvmesh_flow_control_jain_index" in text


async def test_shed_rate_quota_and_bad_enqueue(start_service) -> None:
    _, address = start_service("flow_control", "--max-in-flight", "1")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        holder = stub.Admit()
        await holder.write(enqueue("hold", flow_id="q", rate_per_second=1.0, burst=1))
        assert await _dispatched(holder)
        shed = stub.Admit()
        await shed.write(enqueue("batch", priority=-10))
        reply = await shed.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_SHED and "sheddable" in reply.reason
        limited = stub.Admit()
        await limited.write(enqueue("again", flow_id="q", rate_per_second=1.0, burst=1))
        reply = await limited.read()
        assert reply.outcome == pb.QUEUE_OUTCOME_REJECTED_RATE_LIMITED
        assert 0 < reply.retry_after_seconds <= 1.0
        for bad in (enqueue("long", flow_id="x" * 257), enqueue("ttl", ttl_seconds=-1.0)):
            call = stub.Admit()
            await call.write(bad)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await call.read()
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await holder.done_writing()
        await stats_become(stub, in_flight=0, queued=0)


async def test_saturation_from_epp_scrapes_and_fails_open(start_service, engines) -> None:  # noqa: F811
    """Real epp scraping a vLLM-format /metrics; flow_control reads it through ListEndpoints."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    engine, _ = await engines(model, waiting=9, running=4, usage=0.5)  # over the queue-depth threshold: saturated
    epp_proc, epp_address = start_service("epp", "--scheduling-config", "load-only", "--metrics-scrape-interval-seconds", "0.05")
    proc, address = start_service(
        "flow_control", "--max-in-flight", "50", "--epp-address", epp_address, "--queue-depth-threshold", "4",
        "--metrics-staleness-seconds", "1.0", "--engine-max-num-seqs", "4",  # the engine runs 4: at its max_num_seqs
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)

        async def saturation() -> pb.Saturation:
            return (await stub.Stats(pb.StatsRequest())).saturation

        await wait_until_async(saturation, 15, "saturated", until=lambda s: s.saturated, interval=0.05)
        held = stub.Admit()
        await held.write(enqueue("held", model=model))
        await stats_become(stub, in_flight=0, queued=1)
        # Unknown model while the pool is known: 503-class rejection at once.
        nobody = stub.Admit()
        await nobody.write(enqueue("nobody", model="no-such-model"))
        assert (await nobody.read()).outcome == pb.QUEUE_OUTCOME_REJECTED_NO_ENDPOINTS
        engine.waiting = 2  # room for 2 (threshold 4): the queued one goes, then 1 more, then saturated again
        assert (await held.read()).outcome == pb.QUEUE_OUTCOME_DISPATCHED
        more = [stub.Admit() for _ in range(3)]
        for i, call in enumerate(more):
            await call.write(enqueue(f"more{i}", model=model))
        await stats_become(stub, in_flight=2, queued=2)  # in-flight accounting: no overshoot before the next scrape
        # epp goes away: metrics go stale, dispatch fails open.
        epp_proc.stop()
        await wait_until_async(saturation, 10, "stale", until=lambda s: s.stale and not s.saturated, interval=0.05)
        await stats_become(stub, in_flight=4, queued=0)
        for call in (held, *more):
            call.cancel()
        await stats_become(stub, in_flight=0, queued=0)
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(metrics_url(proc))).text
    assert "kvmesh_flow_control_saturation_stale 1.0" in text
    assert 'kvmesh_flow_control_pool_poll_total{result="error"}' in text


async def test_unseen_dispatches_take_free_running_slots_over_grpc(start_service, engines) -> None:  # noqa: F811
    """Issue 10 (engine-bound throughput): an engine with free running slots and a transient queue takes
    dispatches up to its free slots plus the queue allowance before the next scrape, not just the
    allowance; at its max_num_seqs only the allowance is left. Real epp scraping a vLLM-format
    /metrics, flow_control over gRPC, GIE's default thresholds (queue 5, KV 0.8)."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    engine, _ = await engines(model, waiting=2, running=10, usage=0.05)  # 54 free of 64; 2 arrived between steps
    _, epp_address = start_service("epp", "--scheduling-config", "load-only", "--metrics-scrape-interval-seconds", "0.05")
    _, address = start_service(
        "flow_control", "--max-in-flight", "500", "--epp-address", epp_address, "--engine-max-num-seqs", "64",
        "--metrics-staleness-seconds", "1.0", "--dispatch-visibility-seconds", "10",  # no sample shows these calls
    )
    calls: list[grpc.aio.StreamStreamCall] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)

        async def saturation() -> pb.Saturation:
            return (await stub.Stats(pb.StatsRequest())).saturation

        await wait_until_async(saturation, 15, "a fresh sample", until=lambda s: s.enabled and not s.stale, interval=0.05)
        assert (await saturation()).headroom == pytest.approx(5 + 54 - 2)  # GIE's rule alone: 3
        for i in range(60):
            call = stub.Admit()
            await call.write(enqueue(f"r{i}", model=model))
            calls.append(call)
        await stats_become(stub, in_flight=57, queued=3)  # free slots + allowance, then it holds
        sat = await saturation()
        assert sat.saturated and sat.unseen_dispatches == 57
        assert sat.saturation == pytest.approx(1.0)  # 52 start (KV 0.05 -> 0.31), 5 wait: GIE's full queue
        engine.running, engine.waiting = 64, 4  # at max_num_seqs: 1 left of the allowance (unseen still count)
        # the new sample: nothing starts, all 57 unseen would wait on top of 4: (4 + 57) / 5
        await wait_until_async(saturation, 10, "the engine at max_num_seqs", interval=0.05,
                               until=lambda s: s.saturated and s.saturation == pytest.approx(61 / 5))
        for call in calls[:57]:  # they finish: released before any sample showed them
            await call.done_writing()
        await stats_become(stub, in_flight=1, queued=2)  # the room of one sample: 5 - 4 waiting
        engine.running, engine.waiting = 0, 0
        await stats_become(stub, in_flight=3, queued=0)
        for call in calls[57:]:
            call.cancel()
        await stats_become(stub, in_flight=0, queued=0)


async def test_restart_under_load_leaks_no_slot(start_service, etcd: str, run_dir) -> None:
    """flow_control killed with streams dispatched and queued: clients see UNAVAILABLE; a new process starts empty."""
    proc, address = start_service("flow_control", "--max-in-flight", "2")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        calls = []
        for i in range(4):
            call = stub.Admit()
            await call.write(enqueue(f"r{i}"))
            calls.append(call)
        await stats_become(stub, in_flight=2, queued=2)
        proc.kill()
        for call in calls:
            with contextlib.suppress(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert await call.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    port = address.rsplit(":", 1)[1]
    again = ManagedProcess(
        "flow_control",
        python_module("services.flow_control", "--grpc-port", port, "--metrics-port", str(free_port()),
                      "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", "--max-in-flight", "2"),
        run_dir / f"flow_control-restart-{port}.log",
    ).start()
    try:
        wait_grpc_healthy(address, 30.0)
        await _fresh_process_is_empty(address)
    finally:
        again.stop()


async def _fresh_process_is_empty(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        await stats_become(stub, in_flight=0, queued=0)
        fresh = stub.Admit()
        await fresh.write(enqueue("fresh"))
        assert await _dispatched(fresh)
        await fresh.done_writing()
        await stats_become(stub, in_flight=0, queued=0)
