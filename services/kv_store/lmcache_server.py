"""The ``lm://`` listener: LMCache 0.5.6's remote-server protocol over TCP, served from the BlockStore.

An adapter (asyncio + sockets) around the pure codec :mod:`services.kv_store.lmcache_protocol`;
an LMCache engine configured with ``remote_url: lm://HOST:PORT`` (``LMCACHE_REMOTE_URL``) uses
kv_store as its remote cache with no code of ours in the engine. Values put here live in the same
tiers as gRPC's, under ``lmcache/<CacheEngineKey string>`` with LMCache's metadata in a 32-byte
envelope (both in the codec's docstring), so a value is visible over both protocols.

**Connections.** One :class:`asyncio.BufferedProtocol` per connection reads straight into the
buffer of the frame in progress: the 186-byte header, then (``PUT``) segments of envelope plus
payload allocated as the bytes arrive (:data:`FIRST_SEGMENT_BYTES`, doubling), each charged to the
put byte budget shared with the gRPC servicer (``max_inflight_put_bytes``) before it is allocated:
the memory a ``PUT`` commits stays within twice what arrived, whatever its header announced, and
one ``join`` hands the value to the store (the one copy). When the budget has no room, reading
pauses until it has (first come first served), at most ``budget_wait_s``; then the rest of that
``PUT`` is read and dropped (``reason="busy"``). A payload that stops arriving for
``idle_timeout_s`` closes its connection (``stalled``). At most ``max_connections`` connections are
open; one more is accepted and closed at once (``too_many_connections``). Requests on a connection
are served in order, one at a time (reading pauses while the store works), as the LMCache client
expects (it holds a lock across each exchange); the store operation runs in its own task
(:class:`~services.kv_store.flow.Detached`), so a request cancelled at shutdown never cuts a tier
move short. A ``GET`` the first (CPU) tier holds is answered at once in the read callback
(:meth:`~services.kv_store.store.BlockStore.get_nowait`: no task, nothing to move or wait for).
Replies have write back-pressure: while the transport buffers more than
:data:`WRITE_HIGH_WATER_BYTES` (``pause_writing``) the connection reads no request, so a client that
pipelines ``GET``s and never reads cannot grow the server. Replies
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

**Bad input.** LMCache's ``LMCServerConnector`` never reconnects, so a closed connection disables
that engine's remote cache for good: a connection is closed only when the stream can no longer be
followed (an unknown command, a negative length, a ``PUT`` announcing more than
:data:`DISCARD_LIMIT_BYTES`, a stalled payload). A request whose framing is intact is refused and
the connection kept: a ``PUT`` larger than the first tier (``oversize``) or with an unknown format,
dtype or location (``bad_field``) or an unparsable key (``bad_key``) has its ``length`` payload bytes
read and dropped; a ``GET``, ``EXIST``, ``HEALTH`` or ``LIST`` with a bad field or key is answered
``FAIL``. ``kvmesh_kv_store_lmcache_protocol_errors_total`` counts each by reason, with a
rate-limited warning naming the peer; other connections and the gRPC service carry on. A ``PUT`` the
store cannot take (first tier unavailable or full) is logged and counted (``result="error"``): the
protocol has no reply to a ``PUT``, so the connection stays open and a later ``GET`` is a miss.

Limits: a connection buffers at most one value (up to the first tier's capacity, committed as its
bytes arrive); puts over ``lm://`` carry no vLLM
``BlockStored`` description, so they are stored and served but not published as KV events (an
LMCache chunk hash is no vLLM block hash and a put carries no token ids: docs/kv-store.md, "LMCache").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.errors import KvmeshError
from kvmesh.logging import RateLimitedLog
from services.kv_store.errors import KeyNotFound, StorageFull, TierUnavailable, ValueTooLarge
from services.kv_store.flow import ByteBudget, Detached
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
    request_framing,
    split_envelope,
)
from services.kv_store.store import LATENCY_BUCKETS_S, BlockStore, Histogram, StoredValue

log = logging.getLogger(__name__)
SEND_BUFFER_BYTES = 4 * 1024 * 1024
"""SO_SNDBUF of each connection: a 2 MiB chunk leaves in one non-blocking write instead of a write, a
wait for the socket to drain and more writes (a blocking server thread would sleep inside ``sendall``)."""
FIRST_SEGMENT_BYTES = 64 * 1024
"""A PUT payload is received into segments allocated as its bytes arrive: the first (envelope and
payload start) of at most this size, each next one as large as all before it (at most
:data:`MAX_SEGMENT_BYTES`), so memory committed for a PUT stays within twice what arrived, whatever
its header announced; one ``join`` makes the value (the one copy)."""
MAX_SEGMENT_BYTES = 4 * 1024 * 1024
DISCARD_LIMIT_BYTES = 1 << 30
"""A refused PUT (oversize, a bad field or key) announcing up to this many payload bytes is read and
dropped, keeping the connection; beyond it the framing is taken as lost and the connection closed."""
DISCARD_CHUNK_BYTES = 256 * 1024
WRITE_HIGH_WATER_BYTES = 4 * 1024 * 1024
"""Replies buffered in a connection's transport beyond this pause its reading until they drain below
a quarter of it (asyncio's ``pause_writing``): a client that pipelines GETs and never reads holds at
most this plus one reply in the server."""
DEFAULT_BUDGET_BYTES = 1024 * 1024 * 1024
"""In-flight PUT bytes of a listener built without the servicer's budget (``max_inflight_put_bytes``' default)."""
STOP_DRAIN_S = 5.0
SMALL_REPLY_BYTES = 64 * 1024
"""A hit up to this size is written as one joined buffer; larger ones as header and stored bytes (writelines)."""


@dataclass(slots=True)
class LmcacheStats:
    """Counters of the ``lm://`` listener, read by :class:`LmcacheCollector` at scrape time."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(command, result) -> requests; results: put ``stored``/``error``, get and exist ``hit``/``miss``,
    health and list ``ok``, any command ``refused`` (bad input on a connection that stays open)."""
    protocol_errors: dict[str, int] = field(default_factory=dict)
    """reason -> bad input: refused with the connection kept (``oversize``, ``bad_field``, ``bad_key``,
    ``busy``) or closed (``bad_command``, ``bad_length``, ``stalled``, ``truncated``,
    ``too_many_connections``); see the module docstring."""
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


class _Mode(enum.Enum):
    HEADER = 1
    PAYLOAD = 2
    DISCARD = 3


class _Connection(asyncio.BufferedProtocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: LmcacheServer) -> None:
        self._server = server
        self._store = server.store
        self._stats = server.stats
        self._budget = server.budget
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._refused = False
        self._header = bytearray(REQUEST_BYTES)
        self._filled = 0
        """Header bytes received."""
        self._mode = _Mode.HEADER
        self._request: LmRequest | None = None
        self._segments: list[bytearray] = []
        self._segment = self._header
        self._seg_filled = 0
        self._allocated = 0
        self._remaining = 0
        """PAYLOAD/DISCARD: payload bytes still to come."""
        self._held = 0
        """Budget bytes held by the PUT being received (handed to its task at dispatch)."""
        self._task: asyncio.Task[None] | None = None
        self._budget_task: asyncio.Task[None] | None = None
        self._write_paused = False
        self._last_data = 0.0
        self._idle_handle: asyncio.TimerHandle | None = None
        self._sock: Any = None

    # --- asyncio callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is no asyncio.Transport subclass
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if len(self._server.connections) >= self._server.max_connections:
            self._refused = True
            self._stats.protocol_error("too_many_connections")
            self._server.error_log.log(
                logging.WARNING, "too_many_connections", "lm:// %s: refused, %d connections open (lmcache_max_connections)",
                self._peer, len(self._server.connections),
            )
            self._transport.abort()
            return
        self._sock = transport.get_extra_info("socket")
        if self._sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError, AttributeError):  # capped by net.core.wmem_max
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        self._server.connections.add(self)
        self._stats.connections_open += 1
        self._stats.connections_total += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._server.connections.discard(self)
        self._stats.connections_open -= 1
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._budget_task is not None:
            self._budget_task.cancel()
        if self._task is None and (self._mode is not _Mode.HEADER or self._filled):
            what = "header" if self._mode is _Mode.HEADER else "payload"
            self._stats.protocol_error("truncated")
            log.warning("lm:// %s: connection closed inside a %s", self._peer, what)
        self._drop_payload()

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: read no request until it drains."""
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._mode is _Mode.PAYLOAD:
            return memoryview(self._segment)[self._seg_filled :]
        if self._mode is _Mode.DISCARD:
            return memoryview(self._server.scratch)[: self._remaining]
        return memoryview(self._header)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._stats.bytes_received += nbytes
        mode = self._mode
        if mode is _Mode.PAYLOAD:
            self._seg_filled += nbytes
            self._remaining -= nbytes
            self._last_data = self._server.clock()
            if not self._remaining:
                self._finish_put()
            elif self._seg_filled == len(self._segment):
                self._grow()
            return
        if mode is _Mode.DISCARD:
            self._remaining -= nbytes
            self._last_data = self._server.clock()
            if not self._remaining:
                self._mode = _Mode.HEADER
            return
        self._filled += nbytes
        if self._filled < REQUEST_BYTES:
            return
        self._filled = 0
        try:
            request = decode_request(self._header)
        except LmProtocolError as exc:
            self._refuse(exc)
            return
        if request.command is LmCommand.PUT:
            self._start_payload(request)
        else:
            self._dispatch(request, b"", 0)

    # --- frames ---
    def _start_payload(self, request: LmRequest) -> None:
        length = request.meta.length
        if ENVELOPE_BYTES + length > self._store.max_value_bytes:
            self._refuse_put(
                LmProtocolError("oversize", f"PUT of {length} bytes exceeds the first tier's {self._store.max_value_bytes}"),
                length,
            )
            return
        self._quick_ack()
        self._request = request
        self._remaining = length
        self._allocated = 0
        self._mode = _Mode.PAYLOAD
        if not length:
            self._add_segment(ENVELOPE_BYTES, 0)
            self._finish_put()
            return
        self._arm_idle()
        self._grow()

    def _grow(self) -> None:
        """Room for the next bytes of the payload: a segment of the size below, charged to the budget
        (now, or after a wait with reading paused)."""
        if not self._segments:  # the envelope and the payload's start
            size = min(ENVELOPE_BYTES + self._remaining, FIRST_SEGMENT_BYTES)
        else:  # doubling: committed memory stays within twice what arrived
            size = min(self._remaining, max(FIRST_SEGMENT_BYTES, self._allocated), MAX_SEGMENT_BYTES)
        charge = min(size, self._budget.limit - self._held)
        if not charge or self._budget.try_acquire(charge):
            self._add_segment(size, charge)
            return
        assert self._transport is not None
        self._transport.pause_reading()
        self._budget_task = asyncio.get_running_loop().create_task(self._wait_budget(size, charge))

    async def _wait_budget(self, size: int, charge: int) -> None:
        try:
            await self._budget.acquire(charge, self._server.budget_wait_s)
        except TimeoutError:
            self._budget_task = None
            request = self._request
            assert request is not None
            self._drop_payload()
            self._stats.protocol_error("busy")
            self._stats.count(LmCommand.PUT, "refused")
            self._server.error_log.log(
                logging.WARNING, "busy", "lm:// %s: PUT %s discarded: no room in max_inflight_put_bytes=%d within %s s",
                self._peer, request.key.canonical(), self._budget.limit, self._server.budget_wait_s,
            )
            self._start_discard(self._remaining)
            self._maybe_resume()
            return
        self._budget_task = None
        if self._transport is None or self._transport.is_closing() or self._mode is not _Mode.PAYLOAD:
            self._budget.release_now(charge)
            return
        self._add_segment(size, charge)
        self._last_data = self._server.clock()
        self._maybe_resume()

    def _add_segment(self, size: int, charge: int) -> None:
        self._held += charge
        segment = bytearray(size)
        if self._segments:
            self._seg_filled = 0
        else:
            assert self._request is not None
            segment[:ENVELOPE_BYTES] = encode_envelope(self._request.meta)
            self._seg_filled = ENVELOPE_BYTES
        self._segments.append(segment)
        self._segment = segment
        self._allocated += size

    def _finish_put(self) -> None:
        request = self._request
        assert request is not None
        self._quick_ack()
        segments = self._segments
        value = bytes(segments[0]) if len(segments) == 1 else b"".join(segments)  # the one copy
        held = self._held
        self._segments, self._segment, self._request, self._held = [], self._header, None, 0
        self._mode = _Mode.HEADER
        self._dispatch(request, value, held)

    def _drop_payload(self) -> None:
        """Forget the PUT being received and give back its budget (nothing of it is stored)."""
        self._segments, self._segment, self._request = [], self._header, None
        if self._held:
            self._budget.release_now(self._held)
            self._held = 0
        self._mode = _Mode.HEADER

    def _start_discard(self, length: int) -> None:
        """Read and drop the ``length`` payload bytes of a refused PUT: the next request starts after them."""
        if length:
            self._mode, self._remaining = _Mode.DISCARD, length
            self._last_data = self._server.clock()
            self._arm_idle()

    def _refuse(self, exc: LmProtocolError) -> None:
        """A header :func:`decode_request` refused: keep the connection when its framing is intact."""
        command, length = request_framing(self._header)
        if command == LmCommand.PUT and 0 <= length <= DISCARD_LIMIT_BYTES:
            self._refuse_put(exc, length)
        elif command in LmCommand._value2member_map_ and command != LmCommand.PUT:  # no payload follows
            self._stats.protocol_error(exc.reason)
            self._stats.count(LmCommand(command), "refused")
            self._server.error_log.log(
                logging.WARNING, exc.reason, "lm:// %s: %s refused (FAIL): %s", self._peer, LmCommand(command).name, exc
            )
            assert self._transport is not None
            self._send(self._transport, encode_reply(LmReturnCode.FAIL))
        else:
            self._fail(exc)

    def _refuse_put(self, exc: LmProtocolError, length: int) -> None:
        if length > DISCARD_LIMIT_BYTES:
            self._fail(exc)
            return
        self._quick_ack()
        self._stats.protocol_error(exc.reason)
        self._stats.count(LmCommand.PUT, "refused")
        self._server.error_log.log(
            logging.WARNING, exc.reason, "lm:// %s: PUT refused, its %d payload bytes discarded: %s",
            self._peer, length, exc,
        )
        self._start_discard(length)

    def _arm_idle(self) -> None:
        self._last_data = self._server.clock()
        if self._idle_handle is None:
            self._idle_handle = asyncio.get_running_loop().call_later(self._server.idle_timeout_s, self._idle_check)

    def _idle_check(self) -> None:
        """A PUT payload that stops arriving for ``idle_timeout_s`` closes its connection (it holds budget)."""
        self._idle_handle = None
        if self._mode is _Mode.HEADER or self._transport is None or self._transport.is_closing():
            return
        now = self._server.clock()
        if self._budget_task is not None or self._write_paused:  # we are the ones not reading
            self._last_data = now
        idle = now - self._last_data
        if idle >= self._server.idle_timeout_s:
            self._fail(LmProtocolError("stalled", f"no PUT payload byte for {idle:.1f} s ({self._remaining} to come)"))
            return
        self._idle_handle = asyncio.get_running_loop().call_later(
            self._server.idle_timeout_s - idle, self._idle_check
        )

    def _quick_ack(self) -> None:
        """Send the pending ACK now. The LMCache client sends with Nagle on, so after a ``PUT`` header
        it holds a payload shorter than a segment, and after a payload its next request, until this
        ACK, which Linux's delayed ACK would hold up to 40 ms (setting TCP_QUICKACK sends it)."""
        if self._sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def _dispatch(self, request: LmRequest, value: bytes, held: int) -> None:
        assert self._transport is not None
        if request.command is LmCommand.GET and self._task is None and self._get_now(request):
            return
        self._transport.pause_reading()  # one request at a time, in order
        self._task = asyncio.get_running_loop().create_task(self._serve(request, value, held))

    def _maybe_resume(self) -> None:
        """Read again unless a request is served, the budget is awaited or the replies are not drained."""
        transport = self._transport
        if (
            transport is None or transport.is_closing() or self._task is not None
            or self._budget_task is not None or self._write_paused
        ):
            return
        transport.resume_reading()

    def _fail(self, exc: LmProtocolError) -> None:
        """The stream cannot be followed any more (framing lost, a stalled payload): close the connection."""
        self._stats.protocol_error(exc.reason)
        log.warning("lm:// %s: closing the connection: %s", self._peer, exc)
        self._filled = 0
        self._drop_payload()
        if self._transport is not None:
            self._transport.abort()

    # --- requests ---
    async def _serve(self, request: LmRequest, value: bytes, held: int) -> None:
        start = self._server.clock()
        transport = self._transport
        assert transport is not None
        try:
            await self._handle(request, value, transport)
        except asyncio.CancelledError:  # shutdown: the store operation carries on (Detached), the client is gone
            transport.abort()
            raise
        except Exception:
            log.exception("lm:// %s: %s failed; closing the connection", self._peer, request.command.name)
            transport.abort()
            return
        finally:
            self._task = None
            if held:
                self._budget.release_now(held)
        self._stats.observe(request.command, self._server.clock() - start)
        self._maybe_resume()

    async def _handle(self, request: LmRequest, value: bytes, transport: asyncio.Transport) -> None:
        key = request.key.store_key()
        command = request.command
        detached = self._server.detached
        if command is LmCommand.PUT:
            try:
                await detached.run(self._store.put(key, value))  # a shutdown never cuts the store's moves short
                self._stats.count(command, "stored")
            except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                self._stats.count(command, "error")
                log.warning("lm:// %s: PUT %s not stored: %s", self._peer, key, exc)
        elif command is LmCommand.GET:
            try:
                stored = await detached.run(self._store.get(key))
            except KeyNotFound:
                self._stats.count(command, "miss")
                self._send(transport, encode_reply(LmReturnCode.FAIL))
                return
            self._reply_value(stored, transport)
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

    def _get_now(self, request: LmRequest) -> bool:
        """Answer a ``GET`` that the first tier holds at once, with no task and no read pause (a CPU
        hit: nothing to move or wait for); ``False`` leaves it to :meth:`_serve`."""
        start = self._server.clock()
        try:
            stored = self._store.get_nowait(request.key.store_key())
        except KvmeshError:
            return False  # a bad key: _serve answers it as every other request
        if stored is None:
            return False
        assert self._transport is not None
        self._reply_value(stored, self._transport)
        self._stats.observe(LmCommand.GET, self._server.clock() - start)
        return True

    def _reply_value(self, stored: StoredValue, transport: asyncio.Transport) -> None:
        meta, payload = split_envelope(stored.value)
        self._stats.count(LmCommand.GET, "hit")
        header = encode_reply(LmReturnCode.SUCCESS, meta)
        if len(payload) <= SMALL_REPLY_BYTES:
            self._send(transport, header + payload)
        else:  # one vectored write under uvloop (header and the stored bytes, no copy)
            transport.writelines([header, payload])
            self._stats.bytes_sent += len(header) + len(payload)

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
        clock: seconds for the latency histogram and the stalled-payload timer.
        budget: the in-flight put byte budget, shared with the gRPC servicer (``max_inflight_put_bytes``);
            None: a budget of its own of :data:`DEFAULT_BUDGET_BYTES`.
        max_connections: open connections at most; one more is accepted and closed at once
            (``protocol_errors{reason="too_many_connections"}``).
        budget_wait_s: longest wait of a PUT's next segment for budget; then the rest of it is discarded.
        idle_timeout_s: a PUT payload (or a refused one being discarded) that stops arriving for this
            long closes its connection.
    """

    def __init__(
        self,
        store: BlockStore,
        stats: LmcacheStats | None = None,
        clock: Callable[[], float] = time.perf_counter,
        *,
        budget: ByteBudget | None = None,
        max_connections: int = 1024,
        budget_wait_s: float = 30.0,
        idle_timeout_s: float = 60.0,
    ) -> None:
        self.store = store
        self.stats = stats or LmcacheStats()
        self.clock = clock
        self.budget = budget or ByteBudget(DEFAULT_BUDGET_BYTES)
        self.max_connections = max_connections
        self.budget_wait_s = budget_wait_s
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[_Connection] = set()
        self.detached = Detached("lm://")
        """Store operations that finish after their connection or the server went."""
        self.scratch = bytearray(DISCARD_CHUNK_BYTES)
        """Where refused PUT payloads are read to and dropped (all connections; one loop)."""
        self.error_log = RateLimitedLog(log, 10.0)
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
        await self.detached.drain(STOP_DRAIN_S)  # puts and promotions in flight land before the store goes


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
            "lm:// bad input (a refused request, or a connection closed), by reason.",
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
