"""epp refuses the chat messages the router refuses, with the router's status and words (one rule:
:mod:`kvmesh.chat_messages`): a role outside OpenAI's set, an empty role, malformed content parts in
the verbatim ``render_json.messages``. ``INVALID_ARGUMENT`` from the unary ``Pick``, the same status
and class from a ``PickMany`` entry (the router's ``PickerClient``), ``InvalidRequest`` from ext_proc's
reading of an OpenAI body. The real epp servicer and scheduler on a loopback gRPC server."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.clock import ManualClock
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.ext_proc import scheduling_request
from services.epp.framework.interfaces import PluginHandle
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from services.epp.servicer import EndpointPickerServicer
from services.router.clients import PickerClient, PickQuery
from services.router.validation import RequestKind, render_fields_json, validate_request
from tests.unit.router.fakes import CATALOG, A, B
from tests.unit.router.test_pick_many import _client, _Index, _serve

BAD = {
    "unknown-role": [{"role": "wizard", "content": "hi"}],
    "empty-role": [{"role": "", "content": "hi"}],
    "text-part-without-text": [{"role": "user", "content": [{"type": "text"}]}],
    "part-without-type": [{"role": "user", "content": [{"text": "hi"}]}],
    "content-number": [{"role": "user", "content": 5}],
    "rich-unknown-role": [{"role": "wizard", "content": [{"type": "text", "text": "hi"}]}],
}


class _Picker:
    def __init__(self) -> None:
        self.datastore = Datastore(ManualClock())
        source, data = resolve_scheduling_config("precise-prefix")
        profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=_Index()),
                                source)
        self.datastore.set_endpoints({A.id: A, B.id: B})
        for e in (A, B):
            self.datastore.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 16, 0, 0))
        self.scheduler = Scheduler(self.datastore, profile, LiveEndpointFilter("live"))


@pytest.fixture
async def epp() -> AsyncIterator[tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient]]:
    server, port = await _serve(EndpointPickerServicer(_Picker().scheduler))
    client = await _client(port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield epp_pb2_grpc.EndpointPickerStub(channel), client
    finally:
        await client.close()
        await server.stop(0)


def _router_words(messages: list[dict]) -> str:
    """What the router answers for the same messages (its validation)."""
    with pytest.raises(errors.InvalidRequest) as refused:
        validate_request(RequestKind.CHAT, {"model": "tiny", "messages": messages}, CATALOG, 1024)
    return str(refused.value)


def _pick_request(messages: list[dict]) -> epp_pb2.PickRequest:
    """The router's PickRequest for ``messages``: plain string messages travel as ``messages``, rich
    ones verbatim in ``render_json`` (``validation.render_fields_json``)."""
    plain = all(isinstance(m.get("content"), str) for m in messages)
    request = epp_pb2.PickRequest(request_id="r1", model="tiny")
    if plain:
        request.messages.extend(common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    request.render_json = render_fields_json(RequestKind.CHAT, {"model": "tiny", "messages": messages})
    return request


@pytest.mark.parametrize("case", list(BAD))
async def test_epp_refuses_what_the_router_refuses_with_its_words(
    epp: tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient], case: str,
) -> None:
    stub, client = epp
    messages = BAD[case]
    words = _router_words(messages)
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Pick(_pick_request(messages), timeout=5)
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT and unary.value.details() == words
    if all(isinstance(m.get("content"), str) for m in messages):  # the router's own picker client (PickMany)
        query = PickQuery(request_id="r2", model="tiny", messages=tuple((m["role"], m["content"]) for m in messages))
        with pytest.raises(errors.InvalidRequest) as many:
            await client.pick(query)
        assert str(many.value) == words
    with pytest.raises(errors.InvalidRequest) as ext_proc:  # epp's Envoy path reads the OpenAI body itself
        scheduling_request(json.dumps({"model": "tiny", "messages": messages}).encode(), "r3", [A, B])
    assert str(ext_proc.value) == words


async def test_every_role_the_router_accepts_is_picked(epp: tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient]) -> None:
    stub, _ = epp
    messages = [{"role": r, "content": "hi"} for r in ("system", "developer", "user", "assistant", "tool")]
    validate_request(RequestKind.CHAT, {"model": "tiny", "messages": messages}, CATALOG, 1024)
    reply = await stub.Pick(_pick_request(messages), timeout=5)
    assert reply.target.id in (A.id, B.id)
    rich = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert (await stub.Pick(_pick_request(rich), timeout=5)).target.id in (A.id, B.id)
