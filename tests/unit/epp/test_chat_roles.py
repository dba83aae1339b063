"""epp refuses the chat messages the router refuses, with the router's status and words (one rule:
:mod:`kvmesh.chat_messages`): a role that is not a non-empty string (a number, null, a list, an
object, absent, ``""``), malformed content parts in the verbatim ``render_json.messages``.
``INVALID_ARGUMENT`` from the unary ``Pick``, the same status and class from a ``PickMany`` entry (the
router's ``PickerClient``), ``InvalidRequest`` from ext_proc's reading of an OpenAI body. And every
role vLLM 0.32 serves is taken by all of them: OpenAI's five, and any other string, as vLLM 0.32's
``CustomChatCompletionMessageParam`` ("Enables custom roles", ``role: Required[str]``,
``vllm/renderers/chat_utils.py``) takes it: Llama 3.x's ``ipython`` tool results, OpenAI's legacy
``function``, a model's own role. The real epp servicer and scheduler on a loopback gRPC server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from services.epp.datastore import ScrapeSample
from services.epp.ext_proc import scheduling_request
from services.epp.servicer import EndpointPickerServicer
from services.router.clients import PickerClient, PickQuery
from services.router.validation import RequestKind, render_fields_json, validate_request
from tests.unit.epp._support import real_scheduler
from tests.unit.router.fakes import CATALOG, A, B
from tests.unit.router.test_pick_many import _client, _Index, _serve

BAD: dict[str, list[dict[str, Any]]] = {
    "number-role": [{"role": 5, "content": "hi"}],
    "null-role": [{"role": None, "content": "hi"}],
    "list-role": [{"role": ["user"], "content": "hi"}],
    "object-role": [{"role": {"name": "user"}, "content": "hi"}],
    "missing-role": [{"content": "hi"}],
    "empty-role": [{"role": "", "content": "hi"}],
    "second-message-empty-role": [{"role": "user", "content": "hi"}, {"role": "", "content": "there"}],
    "text-part-without-text": [{"role": "user", "content": [{"type": "text"}]}],
    "part-without-type": [{"role": "user", "content": [{"text": "hi"}]}],
    "content-number": [{"role": "user", "content": 5}],
    "rich-number-role": [{"role": 5, "content": [{"type": "text", "text": "hi"}]}],
    "rich-empty-role": [{"role": "", "content": [{"type": "text", "text": "hi"}]}],
}
ROLE_WORDS = {  # the words every service answers for the role cases
    **{case: "'messages[0].role' must be a non-empty string" for case in BAD if case.endswith("-role")},
    "second-message-empty-role": "'messages[1].role' must be a non-empty string",
}

CUSTOM_ROLES = ["ipython", "function", "observation", "tool_response"]
"""Roles outside OpenAI's five that vLLM 0.32 serves (``CustomChatCompletionMessageParam``): Llama 3.x's
``ipython`` tool results, OpenAI's legacy ``function``, and custom roles some models' templates define."""


@pytest.fixture
async def epp() -> AsyncIterator[tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient]]:
    scheduler, _ = real_scheduler((A, B), _Index(), ScrapeSample(0, 0, 0.0, 16, 0, 0))
    server, port = await _serve(EndpointPickerServicer(scheduler))
    client = await _client(port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield epp_pb2_grpc.EndpointPickerStub(channel), client
    finally:
        await client.close()
        await server.stop(0)


def _router_words(messages: list[dict[str, Any]]) -> str:
    """What the router answers for the same messages (its validation)."""
    with pytest.raises(errors.InvalidRequest) as refused:
        validate_request(RequestKind.CHAT, {"model": "tiny", "messages": messages}, CATALOG, 1024)
    return str(refused.value)


def _plain(messages: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` fit ``PickRequest.messages`` (string roles and contents), as the router sends plain ones."""
    return all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def _pick_request(messages: list[dict[str, Any]]) -> epp_pb2.PickRequest:
    """The router's PickRequest for ``messages``: plain string messages travel as ``messages``, rich
    ones (and, here, the ones a proto string cannot carry: a number, null or missing role) verbatim in
    ``render_json`` (``validation.render_fields_json``)."""
    plain = _plain(messages)
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
    assert words == ROLE_WORDS.get(case, words)  # a role's words name its path, never a list of roles
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Pick(_pick_request(messages), timeout=5)
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT and unary.value.details() == words
    if _plain(messages):  # the router's own picker client (PickMany)
        query = PickQuery(request_id="r2", model="tiny", messages=tuple((m["role"], m["content"]) for m in messages))
        with pytest.raises(errors.InvalidRequest) as many:
            await client.pick(query)
        assert str(many.value) == words
    with pytest.raises(errors.InvalidRequest) as ext_proc:  # epp's Envoy path reads the OpenAI body itself
        scheduling_request(json.dumps({"model": "tiny", "messages": messages}).encode(), "r3", [A, B])
    assert str(ext_proc.value) == words


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", *CUSTOM_ROLES])
async def test_every_role_vllm_serves_is_taken_by_router_epp_and_ext_proc(
    epp: tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient], role: str,
) -> None:
    """vLLM 0.32 takes any role string (``CustomChatCompletionMessageParam``) and hands it to the model's
    chat template: the router, epp's unary ``Pick`` and ``PickMany`` (plain and rich messages) and
    ext_proc take it too, and pass it on as sent."""
    stub, client = epp
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": role, "content": "4"}]
    routed = validate_request(RequestKind.CHAT, {"model": "tiny", "messages": messages}, CATALOG, 1024)
    assert routed.messages == (("user", "What is 2+2?"), (role, "4"))
    assert (await stub.Pick(_pick_request(messages), timeout=5)).target.id in (A.id, B.id)
    rich = [{"role": role, "content": [{"type": "text", "text": "4"}]}]
    assert (await stub.Pick(_pick_request(rich), timeout=5)).target.id in (A.id, B.id)
    reply = await client.pick(PickQuery(request_id=f"r-{role}", model="tiny",
                                        messages=tuple((m["role"], m["content"]) for m in messages)))
    assert reply.candidates[0].id in (A.id, B.id)
    enveloped = scheduling_request(json.dumps({"model": "tiny", "messages": messages}).encode(), "r3", [A, B])
    assert [(m.role, m.content) for m in enveloped.messages] == [("user", "What is 2+2?"), (role, "4")]


def test_a_responses_input_item_takes_any_role_and_refuses_a_bad_one_by_its_path() -> None:
    """``/v1/responses`` input items follow the same rule, their errors (role and content) naming ``input[i]``;
    an item of another type is the engine's to read."""
    ok = validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": [{"role": "ipython", "content": "4"}]},
                          CATALOG, 1024)
    assert ok.messages == (("ipython", "4"),)
    for role in (5, None, ""):
        with pytest.raises(errors.InvalidRequest, match=r"^'input\[0\]\.role' must be a non-empty string$"):
            validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": [{"role": role, "content": "hi"}]},
                             CATALOG, 1024)
    items: list[Any] = [{"type": "function_call_output", "call_id": "c1", "output": "4"},  # not a message: the engine's
                        {"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text"}]}]
    with pytest.raises(errors.InvalidRequest) as content:
        validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": items}, CATALOG, 1024)
    assert str(content.value) == "'input[2].content': a text part needs a string 'text'"  # its own path, not messages[2]
    with pytest.raises(errors.InvalidRequest, match=r"^'input\[0\]\.content' must be a string or a list of text parts$"):
        validate_request(RequestKind.RESPONSES, {"model": "tiny", "input": [{"role": "user", "content": 5}]}, CATALOG, 1024)


async def test_rich_content_is_picked(epp: tuple[epp_pb2_grpc.EndpointPickerStub, PickerClient]) -> None:
    stub, _ = epp
    rich = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert (await stub.Pick(_pick_request(rich), timeout=5)).target.id in (A.id, B.id)
