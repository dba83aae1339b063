"""An engine slow to accept connections, on real sockets (issue 14 item 1).

The engine's listen socket has a full accept queue (a loaded host: its event loop has not called
``accept()`` for a while), so the kernel drops the router's SYNs and the client's connect waits for
the SYN retransmits (1 s, then 3 s, ... on Linux). Two sides of the same kind:

* the queue never drains: the proxy hop's connect gives up after ``connect_timeout_seconds`` with
  :class:`EngineUnreachable` (nothing sent yet, so the request flow moves on to a fallback; see
  ``test_request_flow.py``), instead of hanging for the request timeout;
* the queue drains after 1.5 s: a connect timeout sized for a loaded host (the router's default is
  10 s) rides out the retransmits and the request is answered by that engine, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from services.router.engine_client import AiohttpEngineClient, EngineUnreachable


@contextlib.contextmanager
def full_accept_queue() -> Iterator[tuple[socket.socket, list[socket.socket]]]:
    """A listening socket on 127.0.0.1 whose accept queue is full; yields it and the connections filling it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers: list[socket.socket] = []
    try:
        while len(fillers) < 64:
            filler = socket.socket()
            filler.settimeout(0.3)
            try:
                filler.connect(listener.getsockname())
            except TimeoutError:
                filler.close()
                break  # this SYN was dropped: the queue is full
            fillers.append(filler)
        else:
            pytest.fail("the accept queue never filled")
        yield listener, fillers
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_connect_to_a_full_accept_queue_gives_up_after_the_connect_timeout() -> None:
    client = AiohttpEngineClient(8, 1.0, 30.0)
    with full_accept_queue() as (listener, _):
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(EngineUnreachable):
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", [])
        elapsed = time.monotonic() - started
    await client.aclose()
    assert 0.9 <= elapsed < 5.0, elapsed  # the connect bound, not the 30 s request timeout


async def test_an_engine_that_accepts_late_is_waited_for_and_answers_once() -> None:
    served: list[bytes] = []

    async def completions(request: web.Request) -> web.Response:
        served.append(await request.read())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    client = AiohttpEngineClient(8, 10.0, 30.0)
    with full_accept_queue() as (listener, fillers):
        port = listener.getsockname()[1]

        async def drain_then_serve() -> None:
            await asyncio.sleep(1.5)  # the host is busy; then its loop gets to accept()
            for filler in fillers:
                filler.close()
            listener.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    accepted, _ = listener.accept()
                    accepted.close()
            await web.SockSite(runner, listener).start()

        server = asyncio.create_task(drain_then_serve())
        started = time.monotonic()
        response = await client.post(f"http://127.0.0.1:{port}/v1/completions", b'{"p": 1}', [])
        body = b"".join([chunk async for chunk in response.aiter_bytes()])
        await response.aclose()
        elapsed = time.monotonic() - started
        await server
        await runner.cleanup()  # before the listener it serves on is closed
    await client.aclose()
    assert response.status_code == 200 and body == b'{"ok": true}'
    assert served == [b'{"p": 1}']  # answered once, by the slow engine itself
    assert 1.0 <= elapsed < 10.0, elapsed  # waited through at least one SYN retransmit
