"""epp's request ids on every RPC that carries one (``Pick``, ``PickMany`` entries, ``Completed`` and the
completions riding ``PickMany``), over the real servicer, scheduler and datastore on a real gRPC server
(loopback, the shared interceptor chain).

epp counts a pick's load (pending, unprefilled, active prompt tokens) under ``PickRequest.request_id``
until the ``CompletedRequest`` with that id frees it. The id is optional in the proto (grpcurl, a
GIE-style client), so a pick without one is counted under an id epp makes unique (a unary ``Pick``
returns it in the trailer ``kvmesh-pick-request-id``), where before every id-less pick went under
``""``: never tracked as active load and never freeable. A completion without an id frees nothing and
is refused (unary: ``INVALID_ARGUMENT`` naming the entry, nothing applied; on the stream: skipped);
an id over 1024 characters is ``INVALID_ARGUMENT`` everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import REGISTRY

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.interceptors import server_interceptors
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import ScrapeSample
from services.epp.servicer import MAX_REQUEST_ID_CHARS, PICK_REQUEST_ID_TRAILER, EndpointPickerServicer
from tests.unit.epp._support import real_scheduler

MODEL = "m"
ENDPOINTS = [Endpoint(id=EndpointId(f"127.0.0.1:{9100 + i}"), url=f"http://127.0.0.1:{9100 + i}", model=MODEL)
             for i in range(2)]
PROMPT = list(range(1, 41))  # 40 prompt tokens: counted active on the target while the pick is in flight
RUNNING = 2.0  # each engine's scraped running count (a completion the engine has not counted yet lowers it)


class _Epp:
    """The real servicer over a load-only scheduler on a loopback gRPC server, and a stub to it."""

    def __init__(self) -> None:
        scheduler, self.datastore = real_scheduler(ENDPOINTS, None, ScrapeSample(0, RUNNING, 0.0, 16),  # type: ignore[arg-type]
                                                   config="load-only")
        self.servicer = EndpointPickerServicer(scheduler)

    async def start(self) -> None:
        self.server = grpc.aio.server(interceptors=server_interceptors())
        epp_pb2_grpc.add_EndpointPickerServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = epp_pb2_grpc.EndpointPickerStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)

    def active(self) -> int:
        return sum(c.metrics.active_prompt_tokens for c in self.datastore.candidates(MODEL))

    def pending(self) -> int:
        return sum(c.metrics.pending_picks for c in self.datastore.candidates(MODEL))

    def running(self) -> dict[str, float]:
        return {c.id: c.metrics.num_requests_running for c in self.datastore.candidates(MODEL)}


@pytest.fixture
async def epp() -> AsyncIterator[_Epp]:
    running = _Epp()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def _unmatched() -> float:
    return REGISTRY.get_sample_value("kvmesh_epp_completions_total", {"result": "unmatched"}) or 0.0


async def _pick_with_trailer(stub: epp_pb2_grpc.EndpointPickerStub, request: epp_pb2.PickRequest,
                             x_request_id: str | None = None) -> tuple[epp_pb2.PickResponse, str | None]:
    call = stub.Pick(request, timeout=5, metadata=(("x-request-id", x_request_id),) if x_request_id else None)
    reply = await call
    trailers = dict(await call.trailing_metadata() or ())
    return reply, trailers.get(PICK_REQUEST_ID_TRAILER)


async def test_unary_picks_without_a_request_id_get_unique_ids_that_a_completion_frees(epp: _Epp) -> None:
    first, first_id = await _pick_with_trailer(epp.stub, epp_pb2.PickRequest(model=MODEL, prompt_token_ids=PROMPT),
                                               x_request_id="client-7")
    second, second_id = await _pick_with_trailer(epp.stub, epp_pb2.PickRequest(model=MODEL, prompt_token_ids=PROMPT))
    assert first.target.id and second.target.id
    assert first_id and second_id and first_id != second_id
    assert first_id.startswith("client-7~")  # the call's x-request-id kept as the prefix, for logs and spans
    # both counted, each under its own id (before: both under "", never active, never freeable)
    assert epp.active() == 2 * len(PROMPT) and epp.pending() == 2

    reply = await epp.stub.Completed(epp_pb2.CompletedBatch(requests=[epp_pb2.CompletedRequest(
        request_id=first_id, endpoint_id=first.target.id, outcome=epp_pb2.COMPLETION_OUTCOME_NOT_DISPATCHED)]), timeout=5)
    assert reply.matched == 1
    assert epp.active() == len(PROMPT) and epp.pending() == 1  # only the first pick's load left

    # a caller's own id is used as sent, and no trailer is added (the router's picks: nothing changes)
    _, none = await _pick_with_trailer(epp.stub, epp_pb2.PickRequest(request_id="r-1", model=MODEL, prompt_token_ids=PROMPT))
    assert none is None
    reply = await epp.stub.Completed(epp_pb2.CompletedBatch(requests=[epp_pb2.CompletedRequest(
        request_id="r-1", outcome=epp_pb2.COMPLETION_OUTCOME_NOT_DISPATCHED)]), timeout=5)
    assert reply.matched == 1 and epp.active() == len(PROMPT)


async def test_pick_many_entries_without_a_request_id_are_counted_apart(epp: _Epp) -> None:
    call = epp.stub.PickMany()
    await call.write(epp_pb2.PickBatch(entries=[
        epp_pb2.PickEntry(id=i, request=epp_pb2.PickRequest(model=MODEL, prompt_token_ids=PROMPT)) for i in (1, 2, 3)]))
    results: dict[int, epp_pb2.PickResult] = {}
    async with asyncio.timeout(5):
        while len(results) < 3:
            batch = await call.read()
            results.update({r.id: r for r in batch.results})
    await call.done_writing()
    assert all(r.WhichOneof("outcome") == "response" for r in results.values()), results
    # three picks, three ids: none superseded another, each one's prompt counted as active load
    assert epp.active() == 3 * len(PROMPT) and epp.pending() == 3


async def test_completed_with_an_empty_request_id_is_invalid_argument_and_applies_nothing(epp: _Epp) -> None:
    reply, _ = await _pick_with_trailer(epp.stub, epp_pb2.PickRequest(request_id="kept", model=MODEL, prompt_token_ids=PROMPT))
    target = reply.target.id
    batch = epp_pb2.CompletedBatch(requests=[
        epp_pb2.CompletedRequest(request_id="kept", endpoint_id=target),
        epp_pb2.CompletedRequest(request_id="", endpoint_id=target),
    ])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await epp.stub.Completed(batch, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "'requests[1].request_id' is empty" in details and PICK_REQUEST_ID_TRAILER in details
    assert dict(caught.value.trailing_metadata() or ()).get("kvmesh-error-class") == "InvalidRequest"
    # nothing of the batch applied: the valid entry's pick is still counted, no running count lowered
    assert epp.active() == len(PROMPT) and epp.running()[target] == RUNNING

    ok = await epp.stub.Completed(epp_pb2.CompletedBatch(requests=[batch.requests[0]]), timeout=5)
    assert ok.matched == 1 and epp.active() == 0


async def test_stream_completions_with_an_empty_request_id_are_skipped(epp: _Epp) -> None:
    reply, _ = await _pick_with_trailer(epp.stub, epp_pb2.PickRequest(request_id="s-1", model=MODEL, prompt_token_ids=PROMPT))
    target = reply.target.id
    other = next(e.id for e in ENDPOINTS if e.id != target)
    unmatched = _unmatched()
    call = epp.stub.PickMany()
    await call.write(epp_pb2.PickBatch(completed=[
        epp_pb2.CompletedRequest(request_id="", endpoint_id=other),  # frees nothing: skipped
        epp_pb2.CompletedRequest(request_id="s-1", endpoint_id=target, outcome=epp_pb2.COMPLETION_OUTCOME_SUCCESS),
    ]))
    await call.done_writing()
    async with asyncio.timeout(5):  # the stream ends once epp read (and applied) every batch
        assert await call.read() == grpc.aio.EOF  # nothing is answered for completions
        assert await call.code() == grpc.StatusCode.OK  # and a skipped one is no stream error
    assert epp.active() == 0  # the valid completion freed its pick
    assert epp.running() == {target: RUNNING - 1, other: RUNNING}  # before: ``other`` lost a running request too
    assert _unmatched() == unmatched + 1


async def test_an_oversized_request_id_is_invalid_argument_on_every_rpc(epp: _Epp) -> None:
    long_id = "x" * (MAX_REQUEST_ID_CHARS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await epp.stub.Pick(epp_pb2.PickRequest(request_id=long_id, model=MODEL), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'request_id' is {MAX_REQUEST_ID_CHARS + 1} characters: at most {MAX_REQUEST_ID_CHARS}" in (
        caught.value.details() or "")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await epp.stub.Completed(epp_pb2.CompletedBatch(requests=[epp_pb2.CompletedRequest(request_id=long_id)]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'requests[0].request_id' is" in (caught.value.details() or "")

    call = epp.stub.PickMany()
    await call.write(epp_pb2.PickBatch(entries=[
        epp_pb2.PickEntry(id=1, request=epp_pb2.PickRequest(request_id=long_id, model=MODEL)),
        epp_pb2.PickEntry(id=2, request=epp_pb2.PickRequest(request_id="x" * MAX_REQUEST_ID_CHARS, model=MODEL)),
    ]))
    results: dict[int, epp_pb2.PickResult] = {}
    async with asyncio.timeout(5):
        while len(results) < 2:
            results.update({r.id: r for r in (await call.read()).results})
    await call.done_writing()
    assert results[1].error.code == "INVALID_ARGUMENT" and results[1].error.error_class == "InvalidRequest"
    assert "'request_id' is 1025 characters" in results[1].error.message
    assert results[2].WhichOneof("outcome") == "response"  # the longest accepted id picks
    assert epp.pending() == 1

