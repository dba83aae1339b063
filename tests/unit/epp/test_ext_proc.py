"""epp's ext_proc adapter in process: the messages it answers per Envoy body mode (GIE endpoint-picker
protocol v1.0.0 over Envoy 1.40's ``envoy.service.ext_proc.v3``; protos from ``xds-protos`` 1.85.0).

A real :class:`Scheduler` (``load-only`` profile) over a real :class:`Datastore` with two scraped
endpoints; the servicer's ``Process`` is driven with the message sequences Envoy sends in each mode
(tests/integration/test_envoy.py checks the same through a real Envoy). What is pinned here is what the
per-request fast path must not change: which replies, in which order, with which mutation, and that the
prebuilt empty replies are never mutated.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2

from kvmesh.clock import ManualClock
from kvmesh.prefix_index import PackedTokenIds
from kvmesh.types import Endpoint, EndpointId
from services.epp import ext_proc
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.ext_proc import ExternalProcessorServicer, scheduling_request
from services.epp.framework.interfaces import PluginHandle
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler

Mode = processing_mode_pb2.ProcessingMode
ENDPOINTS = [Endpoint(id=EndpointId(f"127.0.0.1:{p}"), url=f"http://127.0.0.1:{p}", model="m") for p in (8001, 8002)]
BODY = json.dumps({"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 1}).encode()


@pytest.fixture
def servicer() -> ExternalProcessorServicer:
    ds = Datastore(ManualClock())
    ds.set_endpoints({e.id: e for e in ENDPOINTS})
    ds.record_scrape(ENDPOINTS[0].id, ScrapeSample(0, 0, 0.0, 16))
    ds.record_scrape(ENDPOINTS[1].id, ScrapeSample(5, 5, 0.5, 16))  # busier: load-only picks 8001
    source, data = resolve_scheduling_config("load-only")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0)), source)
    return ExternalProcessorServicer(Scheduler(ds, profile, LiveEndpointFilter("live")), rng=random.Random(0))


def headers(extra: dict[str, str] | None = None, end_of_stream: bool = False) -> ext_pb2.HttpHeaders:
    pairs = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r1", **(extra or {})}
    return ext_pb2.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end_of_stream,
    )


def protocol(request_mode: int, response_mode: int) -> ext_pb2.ProtocolConfiguration:
    return ext_pb2.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)


async def _iterate(messages: list[ext_pb2.ProcessingRequest]) -> AsyncIterator[ext_pb2.ProcessingRequest]:
    for m in messages:
        yield m


def run(servicer: ExternalProcessorServicer, messages: list[ext_pb2.ProcessingRequest]) -> list[ext_pb2.ProcessingResponse]:
    async def collect() -> list[ext_pb2.ProcessingResponse]:
        return [r async for r in servicer.Process(_iterate(messages), None)]

    return asyncio.run(collect())


def routed(reply: ext_pb2.ProcessingResponse, phase: str) -> tuple[dict[str, str], str]:
    """(set headers, metadata destination) of a routing reply in ``phase``."""
    common = getattr(reply, phase).response
    assert common.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    return set_headers, meta


def test_full_duplex_pick_on_the_last_body_chunk(servicer: ExternalProcessorServicer) -> None:
    replies = run(servicer, [
        ext_pb2.ProcessingRequest(request_headers=headers(), protocol_config=protocol(Mode.FULL_DUPLEX_STREAMED,
                                                                                     Mode.FULL_DUPLEX_STREAMED)),
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY[:10])),
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY[10:], end_of_stream=True)),
        ext_pb2.ProcessingRequest(response_headers=ext_pb2.HttpHeaders()),
        ext_pb2.ProcessingRequest(response_body=ext_pb2.HttpBody(body=b"data: 1\n\n")),
        ext_pb2.ProcessingRequest(response_body=ext_pb2.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)),
    ])
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body", "response_body"]
    set_headers, meta = routed(replies[0], "request_headers")
    assert set_headers == {"x-gateway-destination-endpoint": "127.0.0.1:8001", "content-length": str(len(BODY))}
    assert meta == "127.0.0.1:8001"  # header and metadata carry the same value (the protocol's MUST)
    back = replies[1].request_body.response.body_mutation.streamed_response
    assert back.body == BODY and back.end_of_stream
    echoed = [r.response_body.response.body_mutation.streamed_response for r in replies[3:]]
    assert [(e.body, e.end_of_stream) for e in echoed] == [(b"data: 1\n\n", False), (b"data: [DONE]\n\n", True)]
    assert replies[2] == ext_pb2.ProcessingResponse(response_headers=ext_pb2.HeadersResponse())


def test_full_duplex_trailers_end_the_body(servicer: ExternalProcessorServicer) -> None:
    replies = run(servicer, [
        ext_pb2.ProcessingRequest(request_headers=headers()),  # no protocol_config: full duplex, GIE's default
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY)),
        ext_pb2.ProcessingRequest(request_trailers=ext_pb2.HttpTrailers()),
        ext_pb2.ProcessingRequest(response_trailers=ext_pb2.HttpTrailers()),
    ])
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers", "request_body", "request_trailers", "response_trailers"]
    assert routed(replies[0], "request_headers")[1] == "127.0.0.1:8001"
    assert not replies[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_buffered_mutation_rides_the_body_response(servicer: ExternalProcessorServicer) -> None:
    replies = run(servicer, [
        ext_pb2.ProcessingRequest(request_headers=headers(), protocol_config=protocol(Mode.BUFFERED, Mode.NONE)),
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY, end_of_stream=True)),
        ext_pb2.ProcessingRequest(response_headers=ext_pb2.HttpHeaders()),
    ])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "response_headers"]
    assert replies[0] == ext_pb2.ProcessingResponse(request_headers=ext_pb2.HeadersResponse())
    set_headers, meta = routed(replies[1], "request_body")
    assert set_headers["x-gateway-destination-endpoint"] == meta == "127.0.0.1:8001"


def test_prebuilt_replies_stay_empty(servicer: ExternalProcessorServicer) -> None:
    """The shared empty replies go to every stream: nothing may have been written into them."""
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        run(servicer, [
            ext_pb2.ProcessingRequest(request_headers=headers(), protocol_config=protocol(mode, Mode.NONE)),
            ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY, end_of_stream=True)),
            ext_pb2.ProcessingRequest(request_trailers=ext_pb2.HttpTrailers()),
            ext_pb2.ProcessingRequest(response_headers=ext_pb2.HttpHeaders()),
            ext_pb2.ProcessingRequest(response_body=ext_pb2.HttpBody(body=b"x", end_of_stream=True)),
            ext_pb2.ProcessingRequest(response_trailers=ext_pb2.HttpTrailers()),
        ])
    for name in ("REQUEST_HEADERS", "REQUEST_TRAILERS", "RESPONSE_HEADERS", "RESPONSE_BODY", "RESPONSE_TRAILERS"):
        reply = getattr(ext_proc, f"_EMPTY_{name}")
        assert reply.ByteSize() == 2, f"{name}: {reply}"  # the oneof tag and a zero length, nothing else


def test_errors_are_immediate_responses(servicer: ExternalProcessorServicer) -> None:
    def status(body: bytes, extra: dict[str, str] | None = None) -> tuple[int, str]:
        replies = run(servicer, [
            ext_pb2.ProcessingRequest(request_headers=headers(extra)),
            ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=body, end_of_stream=True)),
        ])
        assert [r.WhichOneof("response") for r in replies] == ["immediate_response"]
        immediate = replies[0].immediate_response
        return immediate.status.code, json.loads(immediate.body)["error"]["message"]

    code, message = status(b'{"model": "m", "prompt": ')
    assert code == 400 and "not valid JSON" in message
    assert status(b'{"prompt": "hi"}')[0] == 400
    assert status(b'{"model": "nope", "prompt": "hi"}')[0] == 404
    code, message = status(BODY, {"x-gateway-destination-endpoint-subset": "10.0.0.1:1"})
    assert code == 503 and "subset" in message


def test_subset_hint_restricts_the_pick(servicer: ExternalProcessorServicer) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "add_special_tokens": False}).encode()
    replies = run(servicer, [
        ext_pb2.ProcessingRequest(request_headers=headers({"x-gateway-destination-endpoint-subset": "127.0.0.1:8002"})),
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=body, end_of_stream=True)),
    ])
    common = replies[0].request_headers.response
    assert routed(replies[0], "request_headers")[1] == "127.0.0.1:8002"  # the busier one: the only one allowed
    assert list(common.header_mutation.remove_headers) == ["x-gateway-destination-endpoint-subset"]


def test_scheduling_request_reads_what_json_reads() -> None:
    ids = list(range(3, 300))
    request = scheduling_request(json.dumps({"model": "m", "prompt": ids}).encode(), "r", ENDPOINTS)
    assert isinstance(request.token_ids, PackedTokenIds) and list(request.token_ids) == ids
    # ids outside uint32 stay a tuple (the scheduler reads both)
    big = scheduling_request(json.dumps({"model": "m", "prompt": [1, 2**40]}).encode(), "r", ENDPOINTS)
    assert big.token_ids == (1, 2**40)
    # bools are not token ids (as before: the prompt is then not routed on)
    assert scheduling_request(b'{"model": "m", "prompt": [true, false]}', "r", ENDPOINTS).token_ids == ()
    # what msgspec refuses and Python's json accepts still reads (NaN in a sampling field)
    nan = scheduling_request(b'{"model": "m", "prompt": "x", "temperature": NaN}', "r", ENDPOINTS)
    assert nan.prompt == "x"
    chat = scheduling_request(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]},
    ]}).encode(), "r", ENDPOINTS)
    assert [(m.role, m.content) for m in chat.messages] == [("user", "a\nb")]  # text parts joined with a newline (vLLM 0.32, as the router)
