"""HttpServer: uvicorn embedded in a process's own event loop (the router's API, the simulator's engine API).

uvicorn normally owns the process: it installs SIGTERM/SIGINT handlers and configures logging.
Embedded, it does neither: the process owns the signals (:class:`kvmesh.server.GrpcService` or the
simulator's run loop) and logging (:func:`kvmesh.logging.setup_logging`; uvicorn's records go
through the root handler), and uvicorn runs as one task of the running loop.

Lifecycle: ``await start()`` returns once the socket is bound (``port`` then holds the bound port,
also when 0 asked for a free one). ``await stop()`` stops accepting, lets open requests finish
for ``grace_seconds`` (uvicorn's ``timeout_graceful_shutdown``, rounded up to whole seconds),
then cancels what is left; a server still not down one second later is force-closed. A request
still without a response when ``grace_seconds`` run out is answered ``503`` with an OpenAI-shaped
error body and ``retry-after: 1`` (its handler cancelled, its clean-up run), not the bare
``text/plain`` 500 uvicorn sends for a task it cancels; one whose response already started (a
stream) ends as uvicorn ends it.
``await wait()`` returns when the server ends on its own (a crash, or after ``stop``).

Slow clients: with ``header_timeout_seconds`` a connection whose request headers are not complete
that long after the request's first byte (or after it opened) is closed; uvicorn alone bounds only
idle keep-alive connections, so a client dripping header bytes held one forever.

Binding: the socket is bound here (:func:`bind_tcp`) before uvicorn starts, so an address that cannot
be bound is a :class:`ListenError` from ``start()`` (one line at the process's exit), never uvicorn's
``sys.exit`` from inside its task.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import Generator
from typing import Literal

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from kvmesh.listen import ListenError, bind_tcp

__all__ = ["HttpServer", "ListenError", "bind_tcp"]

_DRAIN_MARGIN_SECONDS = 0.2
"""How long before uvicorn's own cancel (``ceil(grace_seconds)``) the unanswered requests get their 503."""
_DRAINED_BODY = (b'{"error": {"message": "the server is shutting down; retry the request", '
                 b'"type": "service_unavailable", "param": null, "code": 503}}')


class _DrainOnShutdown:
    """ASGI middleware: the HTTP requests in flight, and at :meth:`drain` a 503 for each one whose
    response has not started (its handler task cancelled; the cancellation reaches the app's own
    clean-up first). One dict entry and one ``send`` wrapper per request; no task."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._open: dict[asyncio.Task[object], list[bool]] = {}  # request task -> [response started]
        self._drained: set[asyncio.Task[object]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        started = [False]

        async def send_marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        self._open[task] = started
        try:
            await self.app(scope, receive, send_marked)
        except asyncio.CancelledError:
            if task not in self._drained or started[0]:
                raise
            task.uncancel()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": _DRAINED_BODY})
        finally:
            self._open.pop(task, None)
            self._drained.discard(task)

    def drain(self) -> int:
        """Cancel every open request whose response has not started (each is answered 503); their count."""
        count = 0
        for task, started in list(self._open.items()):
            if not started[0] and not task.done():
                self._drained.add(task)
                task.cancel()
                count += 1
        return count


def _header_deadline(protocol: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """``protocol`` (uvicorn's httptools or h11 connection) with a deadline on receiving a request's
    headers: a connection that opened, or finished its last answer and sent a byte of the next request,
    and has not completed that request's headers ``seconds`` later is closed (uvicorn bounds only an
    *idle* keep-alive connection; a slowloris client dripping header bytes held one forever).
    nginx's ``client_header_timeout`` (60 s) does the same."""

    class HeaderDeadline(protocol):  # type: ignore[valid-type,misc]
        _deadline: asyncio.TimerHandle | None = None
        _armed_for: object = None

        def _arm(self) -> None:
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # a request is in progress: its headers completed (in the data just parsed): drop the
                # timer now rather than leave one per keep-alive request in the loop's heap until it fires
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
                return
            if self._deadline is not None and self._armed_for is cycle:
                return
            if self._deadline is not None:
                self._deadline.cancel()
            self._armed_for = cycle
            self._deadline = self.loop.call_later(seconds, self._expired, cycle)

        def _expired(self, cycle: object) -> None:
            self._deadline = None
            if self.cycle is cycle and not self.transport.is_closing():  # no request's headers completed since
                self.transport.close()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return HeaderDeadline


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` as a task of the running loop.

    Args:
        app: the ASGI application (lifespan events are not sent).
        host: interface to bind.
        port: port to bind; 0 picks a free one (read :attr:`port` after :meth:`start`).
        grace_seconds: on :meth:`stop`, how long open requests may finish (>= 0).
        log_level: level of uvicorn's own loggers (``"warning"`` quiets its start-up lines);
            None leaves them at the root level.
        name: name of the serving task (shows in task dumps and errors).
        sock: an already bound socket (:func:`bind_tcp`) to serve on instead of binding
            ``host:port``; its port is known before :meth:`start` (the simulator names itself by it).
        http: uvicorn's HTTP/1.1 implementation: ``"httptools"`` (C parser), ``"h11"`` (pure
            Python) or ``"auto"`` (httptools when installed).
        header_timeout_seconds: close a connection whose request headers are not complete this long
            after its first byte (or after it opened); None: unbounded (uvicorn's own behaviour).
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        grace_seconds: float,
        *,
        log_level: str | None = None,
        name: str = "http",
        sock: socket.socket | None = None,
        http: Literal["auto", "h11", "httptools"] = "auto",
        header_timeout_seconds: float | None = None,
    ) -> None:
        self._drain = _DrainOnShutdown(app)
        protocol: Literal["auto", "h11", "httptools"] | type[asyncio.Protocol] = http
        if header_timeout_seconds is not None:
            protocol = _header_deadline(import_from_string(HTTP_PROTOCOLS[http]), header_timeout_seconds)
        config = uvicorn.Config(
            self._drain,
            host=host,
            port=port,
            lifespan="off",
            log_config=None,
            log_level=log_level,
            access_log=False,
            http=protocol,
            timeout_graceful_shutdown=math.ceil(grace_seconds),
        )
        self._server = _EmbeddedUvicorn(config)
        self._grace = grace_seconds
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._sock = sock
        self.host = host
        self.port = sock.getsockname()[1] if sock is not None else port

    async def start(self, timeout_seconds: float = 10.0) -> None:
        """Start serving; returns once the socket is bound.

        Raises:
            ListenError: ``host:port`` cannot be bound (in use, no such interface).
            OSError: when uvicorn could not start within ``timeout_seconds``.
        """
        if self._sock is None:  # bound here, not by uvicorn (which logs and calls sys.exit inside its task)
            try:
                self._sock = bind_tcp(self.host, self.port)
            except OSError as exc:
                raise ListenError("http", self.host, self.port, exc.strerror or str(exc)) from None
        sockets = [self._sock]
        self._task = asyncio.create_task(self._server.serve(sockets=sockets), name=self._name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while not self._server.started:
            if self._task.done() or loop.time() > deadline:
                raise OSError(f"{self._name} HTTP server could not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def wait(self) -> None:
        """Return when the server task ends (at once when it never started)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Drain and stop (see the module docstring); safe to call twice or before :meth:`start`.

        Raises:
            Exception: whatever ended the server task with an error (it is not hidden).
        """
        if self._task is None:
            return
        self._server.should_exit = True
        drain_at = max(0.0, min(self._grace, math.ceil(self._grace) - _DRAIN_MARGIN_SECONDS))
        with contextlib.suppress(TimeoutError):  # the server went down within the grace: nothing to drain
            await asyncio.wait_for(asyncio.shield(self._task), drain_at)
        if not self._task.done():
            self._drain.drain()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), math.ceil(self._grace) - drain_at + 1.0)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 2.0)
        finally:
            self._task = None
