"""The proxy hop's HTTP client: one pooled, persistent client to the engines behind a small interface.

:class:`EngineClient` is what :class:`~services.router.request_flow.RequestFlow` forwards with:
``await post(url, body, headers)`` returns an :class:`EngineResponse` once the engine's response
headers arrived (status, content type, ``aiter_bytes()``, ``aclose()``), or raises
:class:`EngineUnreachable` (refused, reset, connect/read timeout *before* the headers: the request
flow moves on to the next candidate; ``__cause__`` is the transport's own error).

Two implementations, chosen by ``RouterConfig.engine_http_client`` (``docs/BENCHMARKS.md`` §3
compares them on the same benchmark):

* ``aiohttp`` (default): ``aiohttp.ClientSession`` over one ``TCPConnector`` sized by
  ``max_connections`` (keep-alive, no per-host cap). Its pool hands out an idle connection from a
  per-host deque in O(1); httpcore's pool (below) walks every pooled connection per request.
* ``httpx``: ``httpx.AsyncClient`` (httpcore); also what the unit tests drive through
  ``httpx.MockTransport``.

``aclose()`` on a response read to its end returns the connection to the pool; on an unfinished
one it closes the connection, so the engine sees the disconnect and aborts the request (vLLM and
SGLang abort on disconnect).
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import aiohttp
import httpx


class EngineUnreachable(Exception):
    """No response headers from the engine (transport error before the first byte); ``__cause__`` says why.

    The message is what the engine did, in words a client may read ("refused the connection"; the
    request flow prefixes ``engine <id> at <url>``): the HTTP client's own text (its exception class,
    aiohttp's ``ssl:default``) stays in ``__cause__`` for the log line. ``refused``: the connect was
    refused (nothing listens there: a dead engine), as opposed to a reset or a timeout."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def _is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is a refused TCP connect (``ECONNREFUSED``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionRefusedError) or (
                isinstance(current, OSError) and current.errno == errno.ECONNREFUSED):
            return True
        if isinstance(current, aiohttp.ClientConnectorError) and _is_refused(current.os_error):
            return True
        if isinstance(current, httpx.ConnectError) and "refused" in str(current).lower():
            return True
        current = current.__cause__ or current.__context__
    return False


def unreachable(exc: BaseException) -> EngineUnreachable:
    """The :class:`EngineUnreachable` for the transport error ``exc`` (raise it ``from exc``)."""
    if _is_refused(exc):
        return EngineUnreachable("refused the connection", refused=True)
    if isinstance(exc, aiohttp.ConnectionTimeoutError | httpx.ConnectTimeout):
        return EngineUnreachable("did not accept the connection in time (connect_timeout_seconds)")
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError | httpx.TimeoutException):
        return EngineUnreachable("did not answer in time")
    if isinstance(exc, aiohttp.ClientConnectorError | httpx.ConnectError):
        return EngineUnreachable("could not be connected to")
    return EngineUnreachable("closed or reset the connection before answering")


def mid_answer_failure(exc: BaseException) -> str:
    """What happened to an answer that had started, in words a client can act on (no HTTP client's class
    names): ``"closed the connection mid-stream"`` (the engine closed, reset or truncated the body),
    ``"timed out mid-stream"``, else ``"failed mid-stream"``."""
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError | httpx.TimeoutException):
        return "timed out mid-stream"
    if isinstance(exc, ConnectionError | aiohttp.ClientPayloadError | aiohttp.ClientConnectionError
                  | httpx.RemoteProtocolError | httpx.ReadError):
        return "closed the connection mid-stream"
    return "failed mid-stream"


class EngineResponse(Protocol):
    """An engine's answer whose headers arrived; the body is streamed."""

    status_code: int
    content_type: str
    headers: Mapping[str, str]
    """The response headers (case-insensitive names)."""

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`aclose` ran (or the transport closed the response)."""
        ...

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives (raises the transport's error when the connection fails mid-body)."""
        ...

    async def aclose(self) -> None:
        """Release the connection (back to the pool when the body was read, closed otherwise)."""
        ...


class EngineClient(Protocol):
    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]]) -> EngineResponse:
        """POST ``body`` with ``headers`` (name, value pairs; a name may repeat) and return once the
        response headers arrived.

        Raises:
            EngineUnreachable: refused, reset, or timed out before the headers.
        """
        ...

    async def aclose(self) -> None: ...


class _HttpxResponse:
    __slots__ = ("_response", "content_type", "headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code
        self.headers: Mapping[str, str] = response.headers
        self.content_type = response.headers.get("content-type", "application/json")

    @property
    def is_closed(self) -> bool:
        return self._response.is_closed

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxEngineClient:
    """:class:`EngineClient` over an ``httpx.AsyncClient`` (the caller's, e.g. one with a MockTransport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]]) -> EngineResponse:
        try:
            response = await self.client.send(self.client.build_request("POST", url, content=body, headers=headers), stream=True)
        except httpx.TransportError as exc:
            raise unreachable(exc) from exc
        return _HttpxResponse(response)

    async def aclose(self) -> None:
        await self.client.aclose()


class _AiohttpResponse:
    __slots__ = ("_closed", "_response", "content_type", "headers", "status_code")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._closed = False
        self.status_code = response.status
        self.headers: Mapping[str, str] = response.headers
        self.content_type = response.headers.get("content-type", "application/json")

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        self._closed = True
        response = self._response
        if response.content.at_eof():
            response.release()  # read to its end: the keep-alive connection goes back to the pool
        else:
            response.close()  # unfinished: drop the connection, the engine sees the disconnect


class AiohttpEngineClient:
    """:class:`EngineClient` over one ``aiohttp.ClientSession`` (created on first use, inside the loop).

    Args:
        max_connections: pool size (all engines together; idle connections are kept alive).
        connect_timeout_seconds: TCP connect bound (a failed connect moves on to a fallback).
        request_timeout_seconds: bound on waiting for each read (headers, then every body chunk).
    """

    def __init__(self, max_connections: int, connect_timeout_seconds: float, request_timeout_seconds: float) -> None:
        self._limit = max_connections
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_seconds,
                                              sock_read=request_timeout_seconds)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=60.0,
                                         use_dns_cache=True, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, trust_env=False,
                                              skip_auto_headers=("User-Agent",), raise_for_status=False)
        return self._session

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]]) -> EngineResponse:
        session = self._session or self._open()
        try:
            response = await session.post(url, data=body, headers=list(headers))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise unreachable(exc) from exc
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
