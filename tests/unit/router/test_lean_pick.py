"""A router's Pick asks for only what it uses (issue 10): packed token ids, a bounded candidate
list, no per-candidate breakdown. The real epp servicer and scheduler on a real gRPC server
(loopback, the shared interceptor chain), a real kv_indexer ``InMemoryIndex`` as the prefix index
(so a pick depends on the prompt's actual block keys), raw stubs and the router's ``PickerClient``.

* ``PickRequest.prompt_token_ids_packed`` (little-endian uint32) gives exactly the picks, fallbacks
  and breakdowns of the repeated ``prompt_token_ids``; the scheduler gets a ``PackedTokenIds``;
  both set, or a length not a multiple of 4, is INVALID_ARGUMENT (unary and per ``PickMany`` entry).
* ``max_endpoints`` caps target + fallbacks (0: all, the order unchanged); ``omit_breakdown`` drops
  the breakdowns; neither set: the response as before (grpcurl users, tests reading breakdowns).
* The router's ``PickerClient`` sends packed ids only to an epp whose ``PickerInfo`` says it reads
  them (an older epp gets the repeated field), ``max_endpoints`` = the router's attempts, no breakdown.
"""

from __future__ import annotations

import asyncio
import random
import struct
from array import array
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.clock import ManualClock
from kvmesh.interceptors import server_interceptors
from kvmesh.kv_events import BlockStored
from kvmesh.prefix_index import PackedTokenIds
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import PluginHandle, PrefixMatch
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from services.epp.servicer import EndpointPickerServicer
from services.kv_indexer.index.in_memory import InMemoryIndex
from services.router.clients import PickerClient, PickQuery, pack_token_ids

BLOCK = 16
ENDPOINTS = [Endpoint(id=EndpointId(f"127.0.0.1:{9100 + i}"), url=f"http://127.0.0.1:{9100 + i}", model="m",
                      block_size_tokens=BLOCK) for i in range(6)]
DOCS = [[random.Random(d).randrange(150_000) for _ in range(BLOCK * 20)] for d in range(3)]


class RecordingIndex:
    """kv_indexer's in-memory index (endpoint ``i`` caches the first ``i + 2`` blocks of ``DOCS[i % 3]``),
    recording the token-id objects each score got."""

    def __init__(self) -> None:
        self.index = InMemoryIndex()
        self.seen: list[Sequence[int]] = []
        for n, ep in enumerate(ENDPOINTS):
            self.index.register_endpoint(ep)
            held = n + 2
            self.index.apply(ep.id, BlockStored(block_hashes=list(range(n << 32, (n << 32) + held)),
                                                parent_block_hash=None, token_ids=DOCS[n % 3][: held * BLOCK],
                                                block_size=BLOCK))

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        self.seen.append(token_ids)
        result = self.index.score(model, token_ids, [EndpointId(e) for e in endpoint_ids])
        return PrefixMatch(result.total_blocks, {s.endpoint_id: s.matched_blocks for s in result.scores})


def _scheduler(index: RecordingIndex) -> Scheduler:
    datastore = Datastore(ManualClock())
    source, data = resolve_scheduling_config("precise-prefix")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=index), source)
    datastore.set_endpoints({e.id: e for e in ENDPOINTS})
    for n, e in enumerate(ENDPOINTS):
        datastore.record_scrape(e.id, ScrapeSample(n % 3, n % 2, 0.1 * n, block_size_tokens=BLOCK))
    return Scheduler(datastore, profile, LiveEndpointFilter("live"))


class OldInfoServicer(EndpointPickerServicer):
    """An epp from before the packed field: its ``PickerInfo`` does not say it reads packed ids."""

    async def GetPickerInfo(self, request: epp_pb2.GetPickerInfoRequest,
                            context: grpc.aio.ServicerContext) -> epp_pb2.PickerInfo:
        return epp_pb2.PickerInfo(needs_prompt=True, profiles=["default"])


class RecordingServicer(EndpointPickerServicer):
    """The real servicer, keeping each ``PickRequest`` it got (unary and on the stream)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.requests: list[epp_pb2.PickRequest] = []

    async def Pick(self, request: epp_pb2.PickRequest, context: grpc.aio.ServicerContext) -> epp_pb2.PickResponse:
        self.requests.append(request)
        return await super().Pick(request, context)

    async def PickMany(self, request_iterator: AsyncIterator[epp_pb2.PickBatch],
                       context: grpc.aio.ServicerContext) -> None:
        async def recorded() -> AsyncIterator[epp_pb2.PickBatch]:
            async for batch in request_iterator:
                self.requests.extend(e.request for e in batch.entries)
                yield batch

        await super().PickMany(recorded(), context)


async def _serve(servicer: EndpointPickerServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=server_interceptors())
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _prompts() -> list[list[int]]:
    rnd = random.Random(7)
    out = []
    for i in range(24):
        doc = DOCS[i % 3]
        cut = rnd.randrange(BLOCK, len(doc))
        tail = [rnd.randrange(2**32) for _ in range(rnd.randrange(0, 5))]  # ids up to uint32 max
        out.append(doc[:cut] + tail)
    return out


def test_pack_token_ids_is_little_endian_uint32() -> None:
    ids = [0, 1, 255, 256, 70_000, 2**32 - 1]
    assert pack_token_ids(ids) == struct.pack("<6I", *ids)
    assert pack_token_ids(()) == b""
    with pytest.raises(OverflowError):
        pack_token_ids([2**32])


async def test_packed_ids_give_the_same_picks_as_repeated_ids() -> None:
    """Two epps in the same state, one asked with repeated ids and one with packed: every response
    (target, fallbacks, breakdown, prompt_tokens) is equal, and the packed side's scheduler got
    ``PackedTokenIds`` equal to the ids."""
    index_a, index_b = RecordingIndex(), RecordingIndex()
    server_a, port_a = await _serve(EndpointPickerServicer(_scheduler(index_a)))
    server_b, port_b = await _serve(EndpointPickerServicer(_scheduler(index_b)))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port_a}") as ca, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port_b}") as cb:
            a, b = epp_pb2_grpc.EndpointPickerStub(ca), epp_pb2_grpc.EndpointPickerStub(cb)
            info = await b.GetPickerInfo(epp_pb2.GetPickerInfoRequest(), timeout=5)
            assert info.packed_token_ids and info.needs_prompt
            targets = set()
            spread = False
            for i, ids in enumerate(_prompts()):
                ra = await a.Pick(epp_pb2.PickRequest(request_id=f"r{i}", model="m", prompt_token_ids=ids), timeout=5)
                rb = await b.Pick(epp_pb2.PickRequest(request_id=f"r{i}", model="m",
                                                      prompt_token_ids_packed=array("I", ids).tobytes()), timeout=5)
                assert ra == rb
                assert len(ra.breakdown) == len(ENDPOINTS) and len(ra.fallbacks) == len(ENDPOINTS) - 1
                targets.add(ra.target.id)
                spread |= len({round(x.scores["prefix"], 9) for x in ra.breakdown}) > 1
    finally:
        await server_a.stop(None)
        await server_b.stop(None)
    assert len(targets) > 1, "the prompts should steer picks to different endpoints"
    assert all(isinstance(s, tuple) for s in index_a.seen)
    assert all(isinstance(s, PackedTokenIds) for s in index_b.seen)
    assert [list(s) for s in index_a.seen] == [s.tolist() for s in index_b.seen]  # type: ignore[attr-defined]
    assert spread, "prefix scores should differ between endpoints (matched on the ids' real block keys)"


@pytest.mark.parametrize("bad", [b"\x01", b"\x01\x00", b"\x01\x00\x00", b"\x01\x00\x00\x00\x02"])
async def test_packed_length_not_a_multiple_of_4_is_invalid_argument(bad: bytes) -> None:
    server, port = await _serve(EndpointPickerServicer(_scheduler(RecordingIndex())))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Pick(epp_pb2.PickRequest(model="m", prompt_token_ids_packed=bad), timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"prompt_token_ids_packed is {len(bad)} bytes" in (caught.value.details() or "")
            assert "little-endian uint32" in (caught.value.details() or "")
            # the service stays up: a good pick right after
            ok = await stub.Pick(epp_pb2.PickRequest(model="m", prompt_token_ids_packed=bad[: len(bad) // 4 * 4]),
                                 timeout=5)
            assert ok.target.url
    finally:
        await server.stop(None)


async def test_both_token_id_forms_set_is_invalid_argument_unary_and_per_entry() -> None:
    server, port = await _serve(EndpointPickerServicer(_scheduler(RecordingIndex())))
    both = epp_pb2.PickRequest(model="m", prompt_token_ids=[1, 2], prompt_token_ids_packed=pack_token_ids([1, 2]))
    odd = epp_pb2.PickRequest(model="m", prompt_token_ids_packed=b"\x00" * 6)
    good = epp_pb2.PickRequest(model="m", prompt_token_ids_packed=pack_token_ids(DOCS[0][:64]))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Pick(both, timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not both" in (caught.value.details() or "")
            call = stub.PickMany()
            await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=1, request=both),
                                                        epp_pb2.PickEntry(id=2, request=odd),
                                                        epp_pb2.PickEntry(id=3, request=good)]))
            results: dict[int, epp_pb2.PickResult] = {}
            async with asyncio.timeout(5):
                while len(results) < 3:
                    for r in (await call.read()).results:
                        results[r.id] = r
            await call.done_writing()
            assert results[1].error.code == "INVALID_ARGUMENT" and "not both" in results[1].error.message
            assert results[1].error.error_class == "InvalidRequest"
            assert results[2].error.code == "INVALID_ARGUMENT" and "6 bytes" in results[2].error.message
            assert results[3].HasField("response") and results[3].response.target.url
    finally:
        await server.stop(None)


async def test_max_endpoints_and_omit_breakdown_shape_only_the_response() -> None:
    """Unary and on the stream: ``max_endpoints`` keeps the ranked order's head, ``omit_breakdown``
    empties the breakdown; the defaults answer everything (as before)."""
    server, port = await _serve(EndpointPickerServicer(_scheduler(RecordingIndex())))
    ids = pack_token_ids(DOCS[1][: BLOCK * 9])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            shapes = [(0, False), (1, False), (3, True), (len(ENDPOINTS) + 5, True), (0, True), (2, False)]
            unary = []
            for n, (cap, omit) in enumerate(shapes):
                reply = await stub.Pick(epp_pb2.PickRequest(
                    request_id=f"u{n}", model="m", prompt_token_ids_packed=ids, max_endpoints=cap,
                    omit_breakdown=omit), timeout=5)
                unary.append(reply)  # the pick's load leaves at once: every pick sees the same state
                await stub.Completed(epp_pb2.CompletedBatch(requests=[epp_pb2.CompletedRequest(
                    request_id=f"u{n}", endpoint_id=reply.target.id)]), timeout=5)
            call = stub.PickMany()
            streamed = []
            for n, (cap, omit) in enumerate(shapes):
                await call.write(epp_pb2.PickBatch(entries=[epp_pb2.PickEntry(id=n + 1, request=epp_pb2.PickRequest(
                    request_id=f"s{n}", model="m", prompt_token_ids_packed=ids, max_endpoints=cap,
                    omit_breakdown=omit))]))
                async with asyncio.timeout(5):
                    (result,) = (await call.read()).results
                assert result.id == n + 1
                streamed.append(result.response)
                await call.write(epp_pb2.PickBatch(completed=[epp_pb2.CompletedRequest(
                    request_id=f"s{n}", endpoint_id=result.response.target.id)]))
            await call.done_writing()
    finally:
        await server.stop(None)
    full = unary[0]
    ranked = [full.target.id, *(e.id for e in full.fallbacks)]
    assert len(ranked) == len(ENDPOINTS) and [b.endpoint_id for b in full.breakdown] == ranked
    for replies in (unary, streamed):
        for reply, (cap, omit) in zip(replies, shapes, strict=True):
            want = len(ENDPOINTS) if cap == 0 else min(cap, len(ENDPOINTS))
            assert [reply.target.id, *(e.id for e in reply.fallbacks)] == ranked[:want]  # the ranking's head
            assert list(reply.breakdown) == ([] if omit else list(full.breakdown))
            assert reply.profile == full.profile and reply.prompt_tokens == full.prompt_tokens


@pytest.mark.parametrize("multiplexed", [True, False])
async def test_router_client_sends_packed_ids_bounded_and_without_breakdown(multiplexed: bool) -> None:
    servicer = RecordingServicer(_scheduler(RecordingIndex()))
    server, port = await _serve(servicer)
    client = PickerClient(f"127.0.0.1:{port}", timeout_seconds=5, multiplexed=multiplexed, max_endpoints=3)
    await client.connect()
    ids = tuple(DOCS[2][: BLOCK * 7 + 3])
    try:
        reply = await client.pick(PickQuery("r1", "m", prompt_token_ids=ids))
        short = await client.pick(PickQuery("r2", "m"))  # no ids: nothing packed
    finally:
        await client.close()
        await server.stop(None)
    assert len(reply.candidates) == 3 and len(short.candidates) == 3
    sent, empty = servicer.requests
    assert sent.prompt_token_ids_packed == pack_token_ids(ids) and not sent.prompt_token_ids
    assert sent.max_endpoints == 3 and sent.omit_breakdown
    assert not empty.prompt_token_ids_packed and not empty.prompt_token_ids


@pytest.mark.parametrize("multiplexed", [True, False])
async def test_router_client_sends_repeated_ids_to_an_epp_without_the_packed_field(multiplexed: bool) -> None:
    scheduler = _scheduler(RecordingIndex())
    servicer = OldInfoServicer(scheduler)
    recorder = RecordingServicer(scheduler)
    recorder.GetPickerInfo = servicer.GetPickerInfo  # type: ignore[method-assign]
    server, port = await _serve(recorder)
    client = PickerClient(f"127.0.0.1:{port}", timeout_seconds=5, multiplexed=multiplexed)
    await client.connect()
    ids = tuple(DOCS[0][: BLOCK * 5])
    try:
        reply = await client.pick(PickQuery("r1", "m", prompt_token_ids=ids))
    finally:
        await client.close()
        await server.stop(None)
    assert len(reply.candidates) == len(ENDPOINTS)  # max_endpoints 0: every candidate, as before
    (sent,) = recorder.requests
    assert tuple(sent.prompt_token_ids) == ids and not sent.prompt_token_ids_packed
    assert sent.max_endpoints == 0 and sent.omit_breakdown
