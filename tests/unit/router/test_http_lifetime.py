"""The HTTP front door over one session per request, driven as raw ASGI with a uvicorn-like ``receive``.

uvicorn reports ``http.disconnect`` as soon as a response is complete; a disconnect after the last
byte must not turn a served request into a cancelled one, and one before it must cancel the work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from kvmesh import errors
from services.router.http_app import RouterHttpApi
from services.router.request_flow import RequestFlow
from tests.support import wait_until_async
from tests.unit.router.fakes import CATALOG, CONFIG, JSON_BODY, SSE, FakeAdmission, FakePicker, in_flight, outcome_count


class Client:
    """One HTTP exchange: the request body, then (like uvicorn) a disconnect once the response is
    complete, or earlier when ``hang_up`` is set."""

    def __init__(self, body: dict[str, Any]) -> None:
        self._body = json.dumps(body).encode()
        self._sent_body = False
        self.hang_up = asyncio.Event()
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.hang_up.set()  # response complete: uvicorn's receive() now says disconnect

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def app_for(answer: Callable[[httpx.Request], httpx.Response], admission: FakeAdmission) -> Any:
    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    flow = RequestFlow(CONFIG, lambda: CATALOG, admission, FakePicker(), http)
    return RouterHttpApi(CONFIG, flow, lambda: CATALOG).app()


def scope() -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"req-1")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}


async def test_disconnect_after_a_whole_answer_is_still_success() -> None:
    admission = FakeAdmission()
    app = app_for(lambda r: httpx.Response(200, content=JSON_BODY, headers={"content-type": "application/json"}), admission)
    before, cancelled = outcome_count("success"), outcome_count("cancelled")
    client = Client({"model": "tiny", "prompt": "hi", "max_tokens": 2})
    await app(scope(), client.receive, client.send)
    assert client.status == 200 and client.body == JSON_BODY
    (ticket,) = admission.tickets
    assert len(ticket.reports) == 1 and ticket.reports[0] is not None and ticket.reports[0].success
    assert outcome_count("success") == before + 1 and outcome_count("cancelled") == cancelled


async def test_disconnect_mid_stream_cancels_once() -> None:
    gate = asyncio.Event()
    first_event = SSE.index(b"\n\n") + 2

    async def body() -> AsyncIterator[bytes]:
        yield SSE[:first_event]
        await gate.wait()  # the engine is slow; the client leaves meanwhile
        yield SSE[first_event:]

    admission = FakeAdmission()
    app = app_for(lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body()), admission)
    cancelled, gauge = outcome_count("cancelled"), in_flight()
    client = Client({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True})
    served = asyncio.create_task(app(scope(), client.receive, client.send))
    await wait_until_async(lambda: len(client.messages) >= 2, 5, "the headers and the first event to go out")
    client.hang_up.set()
    await asyncio.wait_for(served, 5)
    assert client.status == 200 and client.body == SSE[:first_event]
    (ticket,) = admission.tickets
    assert len(ticket.reports) == 1 and ticket.reports[0] is not None and not ticket.reports[0].success
    assert outcome_count("cancelled") == cancelled + 1 and in_flight() == gauge


async def test_disconnect_while_queued_cancels_admission() -> None:
    admission = FakeAdmission(delay=10)
    app = app_for(lambda r: httpx.Response(200, content=JSON_BODY), admission)
    cancelled, gauge = outcome_count("cancelled"), in_flight()
    client = Client({"model": "tiny", "prompt": "hi", "max_tokens": 2})
    served = asyncio.create_task(app(scope(), client.receive, client.send))
    await asyncio.sleep(0.05)
    client.hang_up.set()
    await asyncio.wait_for(served, 5)
    assert client.status == 499 and admission.tickets == []
    assert outcome_count("cancelled") == cancelled + 1 and in_flight() == gauge


async def test_rejection_before_the_answer_is_an_openai_error() -> None:
    app = app_for(lambda r: httpx.Response(200, content=JSON_BODY), FakeAdmission(reject=errors.QueueFull("rejected by admission: full")))
    rejected = outcome_count("rejected")
    client = Client({"model": "tiny", "prompt": "hi", "max_tokens": 2})
    await app(scope(), client.receive, client.send)
    assert client.status == 429 and json.loads(client.body)["error"]["type"] == "rate_limit_exceeded"
    assert outcome_count("rejected") == rejected + 1
