"""``kvmesh.http_server.HttpServer``'s drain on stop (uvicorn 0.54, embedded): a request still unanswered
when the grace runs out gets an OpenAI-shaped 503 and its handler's clean-up runs; one answered in time,
and a stream already started, are left alone. A fresh user saw a router SIGTERM turn an in-flight
non-streamed chat completion into uvicorn's bare ``text/plain`` 500 after the grace.
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvmesh.http_server import HttpServer


class _App:
    def __init__(self) -> None:
        self.cleaned = 0
        self.entered = asyncio.Event()

    async def slow(self, request: Request) -> Response:
        self.entered.set()
        try:
            await asyncio.sleep(30)
        finally:
            self.cleaned += 1  # e.g. the router releasing its admission slot
        return JSONResponse({"late": True})

    async def quick(self, request: Request) -> Response:
        self.entered.set()
        await asyncio.sleep(0.2)
        return JSONResponse({"ok": True})

    async def stream(self, request: Request) -> Response:
        async def chunks():  # type: ignore[no-untyped-def]
            yield b"data: first\n\n"
            self.entered.set()
            await asyncio.sleep(30)
            yield b"data: never\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def starlette(self) -> Starlette:
        return Starlette(routes=[Route("/slow", self.slow, methods=["POST"]), Route("/quick", self.quick, methods=["POST"]),
                                 Route("/stream", self.stream, methods=["POST"])])


async def _serve(app: _App, grace: float) -> HttpServer:
    server = HttpServer(app.starlette(), "127.0.0.1", 0, grace_seconds=grace, log_level="warning")
    await server.start()
    return server


async def test_a_request_unanswered_when_the_grace_ends_gets_a_503_and_its_clean_up_runs() -> None:
    app = _App()
    server = await _serve(app, 0.6)
    async with httpx.AsyncClient(timeout=10) as client:
        pending = asyncio.create_task(client.post(f"http://127.0.0.1:{server.port}/slow", json={}))
        await asyncio.wait_for(app.entered.wait(), 5)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await server.stop()
        response = await pending
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json" and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable"
    assert app.cleaned == 1
    assert loop.time() - began < 2.5  # within ceil(grace) + the force-close second


async def test_a_request_answered_within_the_grace_is_left_alone() -> None:
    app = _App()
    server = await _serve(app, 2.0)
    async with httpx.AsyncClient(timeout=10) as client:
        pending = asyncio.create_task(client.post(f"http://127.0.0.1:{server.port}/quick", json={}))
        await asyncio.wait_for(app.entered.wait(), 5)
        await server.stop()
        response = await pending
    assert response.status_code == 200 and response.json() == {"ok": True}


async def test_a_started_stream_is_not_answered_twice() -> None:
    """A stream whose headers went out cannot become a 503: it ends as uvicorn ends it (the client sees
    the stream cut, never a second status line)."""
    app = _App()
    server = await _serve(app, 0.6)
    async with httpx.AsyncClient(timeout=10) as client, \
            client.stream("POST", f"http://127.0.0.1:{server.port}/stream", json={}) as response:
        assert response.status_code == 200
        await asyncio.wait_for(app.entered.wait(), 5)
        stopping = asyncio.create_task(server.stop())
        chunks = []
        try:
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
        except httpx.HTTPError:
            pass
        await stopping
    assert b"".join(chunks).startswith(b"data: first") and b"never" not in b"".join(chunks)
