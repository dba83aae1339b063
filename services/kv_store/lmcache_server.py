"""The ``lm://`` listener: LMCache 0.5.6's remote-server protocol over TCP, served from the BlockStore.

An adapter (asyncio + sockets) around the pure codec :mod:`services.kv_store.lmcache_protocol`;
an LMCache engine configured with ``remote_url: lm://HOST:PORT`` (``LMCACHE_REMOTE_URL``) uses
kv_store as its remote cache with no code of ours in the engine. Values put here live in the same
tiers as gRPC's, under ``lmcache/<CacheEngineKey string>`` with LMCache's metadata in a 32-byte
envelope (both in the codec's docstring), so a value is visible over both protocols.

**Connections.** One :class:`asyncio.BufferedProtocol` per connection reads straight into the
buffer of the frame in progress: the 186-byte header, then (``PUT``) a buffer of envelope plus
payload, so the kernel copies a payload once into its final place and one ``bytes`` copy hands it
to the store. Requests on a connection are served in order, one at a time (reading pauses while
the store works), as the LMCache client expects (it holds a lock across each exchange). Replies
are written with ``TCP_NODELAY`` set (asyncio's default, set again explicitly); a hit's header
and payload leave together (joined for small values, one vectored write of the stored bytes for
large ones). After a ``PUT``'s header and after its payload the socket gets ``TCP_QUICKACK``, which
sends the pending ACK at once: the LMCache client sends with Nagle on, so a short payload and the
next request wait for that ACK, which Linux's delayed ACK would otherwise hold for up to 40 ms. ``SO_SNDBUF`` is raised to 4 MiB
(:data:`SEND_BUFFER_BYTES`) so a large hit is handed to the kernel in one write.

**LIST.** lmcache 0.5.6 defines the command code (4) but implements it on neither side: its server's
``match`` has no ``LIST`` case (the request is read and **no reply is sent**; a client waiting for
one hangs) and ``LMCServerConnector.list()`` is an empty stub that sends nothing. The only upstream
definition of the reply is the server's commented-out ``TODO(Jiayi): Implement List``: a
``SUCCESS`` header whose ``length`` is the byte length of the keys joined by ``"\n"``, followed by
those bytes. kv_store answers exactly that (the header's other fields as in every payload-less
reply, :data:`~services.kv_store.lmcache_protocol.MISS_META`): the canonical ``CacheEngineKey``
strings of the ``lm://`` values this instance's tiers hold (:meth:`BlockStore.keys`; values put over
gRPC are not LMCache keys and are not listed; a Mooncake or shared-FS tier contributes what this
instance wrote, read or rescanned). No upstream client sends ``LIST``, so no upstream exchange changes.

**Bad input** (unknown command, format, dtype or location, an unparsable or non-UTF-8 key, a
negative length, a ``PUT`` larger than the first tier, a connection closed inside a frame) closes
that connection with a warning naming the peer and ``kvmesh_kv_store_lmcache_protocol_errors_total``
counts it by reason; other connections and the gRPC service carry on. A ``PUT`` the store cannot
take (first tier unavailable or full) is logged and counted (``result="error"``): the protocol has
no reply to a ``PUT``, so the connection stays open and a later ``GET`` is a miss.

Limits: a connection buffers at most one value (up to the first tier's capacity; a large one in
an anonymous mapping whose memory is committed only as its bytes arrive); puts over ``lm://`` carry no vLLM
``BlockStored`` description, so they are stored and served but not published as KV events (an
LMCache chunk hash is no vLLM block hash and a put carries no token ids: docs/kv-store.md, "LMCache").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.kv_store.errors import KeyNotFound, StorageFull, TierUnavailable, ValueTooLarge
from services.kv_store.lmcache_protocol import (
    ENVELOPE_BYTES,
    KEY_PREFIX,
    MISS_META,
    REQUEST_BYTES,
    LmCommand,
    LmProtocolError,
    LmRequest,
    LmReturnCode,
    decode_request,
    encode_envelope,
    encode_reply,
    list_reply_payload,
    split_envelope,
)
from services.kv_store.store import LATENCY_BUCKETS_S, BlockStore, Histogram

log = logging.getLogger(__name__)
SEND_BUFFER_BYTES = 4 * 1024 * 1024
"""SO_SNDBUF of each connection: a 2 MiB chunk leaves in one non-blocking write instead of a write, a
wait for the socket to drain and more writes (a blocking server thread would sleep inside ``sendall``)."""
LAZY_BUFFER_BYTES = 8 * 1024 * 1024
"""PUT payloads from this size are received into an anonymous ``mmap`` (committed as bytes arrive);
smaller ones into a ``bytearray`` (its zeroing is cheaper than page faults at these sizes)."""
SMALL_REPLY_BYTES = 64 * 1024
"""A hit up to this size is written as one joined buffer; larger ones as header and stored bytes (writelines)."""


@dataclass(slots=True)
class LmcacheStats:
    """Counters of the ``lm://`` listener, read by :class:`LmcacheCollector` at scrape time."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(command, result) -> requests; results: put ``stored``/``error``, get and exist ``hit``/``miss``,
    health and list ``ok``."""
    protocol_errors: dict[str, int] = field(default_factory=dict)
    """reason -> connections closed for bad input (``bad_command``, ``bad_key``, ``bad_length``,
    ``bad_field``, ``oversize``, ``truncated``)."""
    bytes_received: int = 0
    bytes_sent: int = 0
    connections_open: int = 0
    connections_total: int = 0
    latency: dict[str, Histogram] = field(default_factory=dict)
    """command -> seconds from a complete request (header and payload) to its reply written (put: stored)."""

    def count(self, command: LmCommand, result: str) -> None:
        key = (command.name.lower(), result)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe(self, command: LmCommand, seconds: float) -> None:
        self.latency.setdefault(command.name.lower(), Histogram()).observe(seconds)

    def protocol_error(self, reason: str) -> None:
        self.protocol_errors[reason] = self.protocol_errors.get(reason, 0) + 1


class _Connection(asyncio.BufferedProtocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: LmcacheServer) -> None:
        self._server = server
        self._store = server.store
        self._stats = server.stats
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._header = bytearray(REQUEST_BYTES)
        self._buffer: bytearray | mmap.mmap = self._header
        self._filled = 0
        self._request: LmRequest | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: Any = None

    # --- asyncio callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is no asyncio.Transport subclass
        self._sock = transport.get_extra_info("socket")
        if self._sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError, AttributeError):  # capped by net.core.wmem_max
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._server.connections.add(self)
        self._stats.connections_open += 1
        self._stats.connections_total += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._stats.connections_open -= 1
        if self._filled and self._task is None:  # an in-flight request finishes; its reply goes nowhere
            what = "payload" if self._request is not None else "header"
            self._fail(LmProtocolError("truncated", f"connection closed inside a {what} ({self._filled} bytes read)"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self._stats.bytes_received += nbytes
        if self._filled < len(self._buffer):
            return
        try:
            if self._request is None:
                request = decode_request(self._header)
                if request.command is LmCommand.PUT:
                    self._start_payload(request)
                    if self._filled < len(self._buffer):
                        return
            else:
                request = self._request
        except LmProtocolError as exc:
            self._fail(exc)
            return
        self._dispatch(request)

    # --- frames ---
    def _start_payload(self, request: LmRequest) -> None:
        total = ENVELOPE_BYTES + request.meta.length
        if total > self._store.max_value_bytes:
            raise LmProtocolError(
                "oversize", f"PUT of {request.meta.length} bytes exceeds the first tier's {self._store.max_value_bytes}"
            )
        self._quick_ack()
        self._request = request
        # a large payload's buffer is an anonymous mapping: memory is committed as bytes arrive, so a
        # header announcing a large PUT that never comes costs nothing (bytearray(n) would zero n bytes)
        self._buffer = mmap.mmap(-1, total) if total >= LAZY_BUFFER_BYTES else bytearray(total)
        self._buffer[:ENVELOPE_BYTES] = encode_envelope(request.meta)
        self._filled = ENVELOPE_BYTES

    def _quick_ack(self) -> None:
        """Send the pending ACK now. The LMCache client sends with Nagle on, so after a ``PUT`` header
        it holds a payload shorter than a segment, and after a payload its next request, until this
        ACK, which Linux's delayed ACK would hold up to 40 ms (setting TCP_QUICKACK sends it)."""
        if self._sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def _dispatch(self, request: LmRequest) -> None:
        assert self._transport is not None
        if request.command is LmCommand.PUT:
            self._quick_ack()
        # (a mapping is unmapped when freed: the loop still holds a view of it during this call)
        value = bytes(self._buffer) if request.command is LmCommand.PUT else b""
        self._buffer, self._filled, self._request = self._header, 0, None
        self._transport.pause_reading()  # one request at a time, in order
        self._task = asyncio.get_running_loop().create_task(self._serve(request, value))

    def _fail(self, exc: LmProtocolError) -> None:
        self._stats.protocol_error(exc.reason)
        log.warning("lm:// %s: closing the connection: %s", self._peer, exc)
        self._filled = 0
        if self._transport is not None:
            self._transport.abort()

    # --- requests ---
    async def _serve(self, request: LmRequest, value: bytes) -> None:
        start = self._server.clock()
        transport = self._transport
        assert transport is not None
        try:
            await self._handle(request, value, transport)
        except Exception:
            log.exception("lm:// %s: %s failed; closing the connection", self._peer, request.command.name)
            transport.abort()
            return
        finally:
            self._task = None
        self._stats.observe(request.command, self._server.clock() - start)
        if not transport.is_closing():
            transport.resume_reading()

    async def _handle(self, request: LmRequest, value: bytes, transport: asyncio.Transport) -> None:
        key = request.key.store_key()
        command = request.command
        if command is LmCommand.PUT:
            try:
                await self._store.put(key, value)
                self._stats.count(command, "stored")
            except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                self._stats.count(command, "error")
                log.warning("lm:// %s: PUT %s not stored: %s", self._peer, key, exc)
        elif command is LmCommand.GET:
            try:
                stored = await self._store.get(key)
            except KeyNotFound:
                self._stats.count(command, "miss")
                self._send(transport, encode_reply(LmReturnCode.FAIL))
                return
            meta, payload = split_envelope(stored.value)
            self._stats.count(command, "hit")
            header = encode_reply(LmReturnCode.SUCCESS, meta)
            if len(payload) <= SMALL_REPLY_BYTES:
                self._send(transport, header + payload)
            else:  # one vectored write under uvloop (header and the stored bytes, no copy)
                transport.writelines([header, payload])
                self._stats.bytes_sent += len(header) + len(payload)
        elif command is LmCommand.EXIST:
            (present,) = await self._store.contains([key])
            self._stats.count(command, "hit" if present else "miss")
            self._send(transport, encode_reply(LmReturnCode.SUCCESS if present else LmReturnCode.FAIL))
        elif command is LmCommand.HEALTH:
            self._stats.count(command, "ok")
            self._send(transport, encode_reply(LmReturnCode.SUCCESS))
        else:  # LIST: upstream's reply shape (see the module docstring)
            listing = list_reply_payload(self._store.keys(KEY_PREFIX))
            self._stats.count(command, "ok")
            self._send(transport, encode_reply(LmReturnCode.SUCCESS, replace(MISS_META, length=len(listing))) + listing)

    def _send(self, transport: asyncio.Transport, data: bytes | memoryview) -> None:
        transport.write(data)
        self._stats.bytes_sent += len(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class LmcacheServer:
    """The ``lm://`` listener over a :class:`BlockStore`: ``await start(host, port)``, ``await stop()``.

    Args:
        store: the tiered store the values live in.
        stats: counters for ``/metrics`` (:func:`register_lmcache_metrics`).
        clock: seconds for the latency histogram.
    """

    def __init__(
        self, store: BlockStore, stats: LmcacheStats | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.store = store
        self.stats = stats or LmcacheStats()
        self.clock = clock
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("lm:// (LMCache 0.5.6 remote protocol) serving on %s:%d", host, bound)
        return bound

    async def stop(self) -> None:
        """Stop listening and close every connection; safe to call twice."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None


class LmcacheCollector(Collector):
    """Exports :class:`LmcacheStats` (metric table in ``services/kv_store/README.md``)."""

    def __init__(self, stats: LmcacheStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        requests = CounterMetricFamily(
            "kvmesh_kv_store_lmcache_requests",
            "lm:// requests served, by command and result.",
            labels=["command", "result"],
        )
        for (command, result), count in sorted(s.requests.items()):
            requests.add_metric([command, result], count)
        yield requests
        errors = CounterMetricFamily(
            "kvmesh_kv_store_lmcache_protocol_errors",
            "lm:// connections closed for bad input, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(s.protocol_errors.items()):
            errors.add_metric([reason], count)
        yield errors
        moved = CounterMetricFamily(
            "kvmesh_kv_store_lmcache_bytes", "Bytes read from and written to lm:// clients.", labels=["direction"]
        )
        moved.add_metric(["received"], s.bytes_received)
        moved.add_metric(["sent"], s.bytes_sent)
        yield moved
        yield GaugeMetricFamily(
            "kvmesh_kv_store_lmcache_connections", "Open lm:// connections.", value=s.connections_open
        )
        yield CounterMetricFamily(
            "kvmesh_kv_store_lmcache_connections_accepted", "lm:// connections accepted.", value=s.connections_total
        )
        latency = HistogramMetricFamily(
            "kvmesh_kv_store_lmcache_request_seconds",
            "Seconds from a complete lm:// request to its reply written (put: stored), by command.",
            labels=["command"],
        )
        for command, hist in sorted(s.latency.items()):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), hist.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([command], buckets, hist.total)
        yield latency


def register_lmcache_metrics(stats: LmcacheStats, registry: CollectorRegistry = REGISTRY) -> LmcacheCollector:
    collector = LmcacheCollector(stats)
    registry.register(collector)
    return collector
