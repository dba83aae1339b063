"""The proxy hop's aiohttp client (``services/router/engine_client.py``) against a real HTTP server on
127.0.0.1: headers before the body, streamed bytes unchanged, connection reuse, a refused connection
as :class:`EngineUnreachable`, and an unfinished answer's close reaching the engine as a disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web

from services.router.engine_client import AiohttpEngineClient, EngineUnreachable, mid_answer_failure


@contextlib.asynccontextmanager
async def engine(seen: dict[str, object]) -> AsyncIterator[str]:
    peers: set[object] = set()
    seen["peers"] = peers
    seen["disconnected"] = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        seen["body"] = await request.read()
        seen["request_id"] = request.headers.get("x-request-id")
        if request.query.get("slow"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: {}\n\n")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen["disconnected"].set()  # type: ignore[attr-defined]
                raise
            return response
        return web.json_response({"ok": True}, status=201)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_post_streams_the_answer_and_reuses_the_connection() -> None:
    seen: dict[str, object] = {}
    client = AiohttpEngineClient(8, 2.0, 10.0)
    async with engine(seen) as url:
        for _ in range(3):
            response = await client.post(url + "/v1/completions", b'{"a": 1}', [("x-request-id", "r1"), ("content-type", "application/json")])
            assert response.status_code == 201 and response.content_type.startswith("application/json")
            assert response.headers.get("Content-Type") == response.content_type
            body = b"".join([chunk async for chunk in response.aiter_bytes()])
            await response.aclose()
            assert body == b'{"ok": true}' and response.is_closed
        assert seen["body"] == b'{"a": 1}' and seen["request_id"] == "r1"
        assert len(seen["peers"]) == 1  # type: ignore[arg-type]  # one persistent connection for all three
    await client.aclose()


async def test_refused_connection_is_engine_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        client = AiohttpEngineClient(8, 2.0, 10.0)
        with pytest.raises(EngineUnreachable) as info:
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", [])
        assert isinstance(info.value.__cause__, OSError)
        await client.aclose()


async def test_closing_an_unfinished_answer_disconnects_the_engine() -> None:
    seen: dict[str, object] = {}
    client = AiohttpEngineClient(8, 2.0, 10.0)
    async with engine(seen) as url:
        response = await client.post(url + "/v1/completions?slow=1", b"{}", [])
        chunks = response.aiter_bytes()
        assert await anext(chunks) == b"data: {}\n\n"
        await response.aclose()
        disconnected = seen["disconnected"]
        assert isinstance(disconnected, asyncio.Event)
        await asyncio.wait_for(disconnected.wait(), 5)
    await client.aclose()


@pytest.mark.parametrize(("exc", "words"), [
    (aiohttp.ClientPayloadError("Response payload is not completed"), "closed the connection mid-stream"),
    (aiohttp.ServerDisconnectedError(), "closed the connection mid-stream"),
    (ConnectionResetError(104, "Connection reset by peer"), "closed the connection mid-stream"),
    (httpx.ReadError("peer closed connection"), "closed the connection mid-stream"),
    (httpx.RemoteProtocolError("incomplete chunked read"), "closed the connection mid-stream"),
    (TimeoutError(), "timed out mid-stream"),
    (aiohttp.SocketTimeoutError(), "timed out mid-stream"),
    (httpx.ReadTimeout("read timed out"), "timed out mid-stream"),
    (ValueError("odd bytes"), "failed mid-stream"),
])
def test_mid_answer_failure_is_said_in_plain_words(exc: BaseException, words: str) -> None:
    """An answer that broke after it started is described by what happened, never by the HTTP client's class
    name (a user read ``failed mid-stream (ClientPayloadError)``), for both HTTP clients the router can use."""
    said = mid_answer_failure(exc)
    assert said == words
    assert type(exc).__name__ not in said
