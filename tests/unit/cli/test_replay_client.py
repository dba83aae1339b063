"""The replay client's one request (``kvmesh_cli.replay.send_one``) against a scripted router answer:
events decoded by httpx-sse, chunks parsed by kvmesh.openai_stream."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from kvmesh.openai_stream import DONE_EVENT, sse_event
from kvmesh_cli.replay import send_one
from kvmesh_cli.workloads import WorkloadRequest

REQUEST = WorkloadRequest(index=3, arrival_s=0.0, segments=(), max_tokens=2)


def chunk(text: str, usage: dict[str, object] | None = None) -> bytes:
    body: dict[str, object] = {"id": "c", "choices": [{"text": text, "finish_reason": None}]}
    if usage is not None:
        body["usage"] = usage
    return sse_event(json.dumps(body).encode())


def router(status: int, body: bytes, content_type: str = "text/event-stream") -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        return httpx.Response(status, content=body, headers={"content-type": content_type})

    return answer


async def send(answer: Callable[[httpx.Request], httpx.Response]):
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        return await send_one(client, "http://router", "tiny", REQUEST, seed=0)


async def test_usage_and_ttft_from_the_stream() -> None:
    usage = {"prompt_tokens": 8, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}
    result = await send(router(200, chunk("a") + chunk("b") + chunk("", usage) + DONE_EVENT))
    assert result.ok and result.status == 200 and result.ttft_s is not None and result.e2e_s is not None
    assert (result.output_tokens, result.prompt_tokens, result.cached_tokens) == (2, 8, 4)


async def test_text_chunks_stand_in_for_missing_usage() -> None:
    result = await send(router(200, b"".join(chunk(t) for t in "abc") + DONE_EVENT))
    assert result.ok and result.output_tokens == 3


async def test_in_stream_error_fails_the_request() -> None:
    error = sse_event(b'{"error": {"message": "engine died", "type": "service_unavailable", "code": 503}}')
    result = await send(router(200, chunk("a") + error + DONE_EVENT))
    assert not result.ok and result.error is not None and "engine died" in result.error


@pytest.mark.parametrize(("status", "content_type"), [(429, "application/json"), (200, "application/json")],
                         ids=["rejected", "not-an-event-stream"])
async def test_non_stream_answers_fail(status: int, content_type: str) -> None:
    result = await send(router(status, b'{"error": {"message": "busy"}}', content_type))
    assert not result.ok and result.error
