"""The transport-agnostic request path shared by the HTTP and gRPC front doors.

One construct owns a request's life, ``async with flow.session(request, meta) as session:``
(``docs/ARCHITECTURE.md``, "The request path")::

    enter  admission: open the flow_control stream, Enqueue, wait for DISPATCHED   (429 / 504 on rejection)
           late binding: epp Pick (the prompt only when epp's profiles read it)  (503 when nothing is live)
           forward the body to candidate.url + path; on a transport error before the
           response headers arrive, try the next candidate (the Pick's fallbacks, then a
           new Pick excluding every endpoint tried), at most ``max_fallback_attempts``
    body   the caller passes ``session.iter_events()`` (raw bytes and parsed pieces) or
           ``read_all()`` on to its client
    exit   close the engine response (cancels it when unfinished), send Complete(tokens, ttft,
           e2e, success), close the admission stream (slot freed), record the outcome, end the spans

The exit runs exactly once on every path and is the one place where a request's end is decided:

| how the ``async with`` body ends | outcome |
| --- | --- |
| normally, the engine answer read to its end, status < 400 | ``success`` (e2e recorded) |
| normally, an engine error status | that status's outcome (``invalid``, ``unavailable``, ...); an engine's 401/403/407, refusing the router's credentials: ``upstream_error`` (:func:`metrics.engine_outcome`) |
| normally but cut short, or any exception | ``upstream_error`` (or the status's outcome); the exception propagates |
| ``CancelledError``, ``GeneratorExit`` (a gRPC stream its client closed), :class:`ClientGone` | ``cancelled``; the engine request is cancelled |

When entering fails (rejected, nothing to pick, every engine refused, the client gone while
queued) the admission stream is closed if it was opened, ``cancelled`` is counted for a
cancellation, and the error propagates: the front door that answers it counts its outcome.

Tracing: one ``router.request`` span per request (parent: the caller's context) and one
``router.proxy`` CLIENT span per engine attempt whose W3C context goes to the engine in the HTTP
headers. Spans are started and ended explicitly: no context stays attached across the session's
``yield``, so the caller's code (and any task it starts) runs under its own context.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import httpx
import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvmesh import errors
from kvmesh.openai_stream import DONE, SseFramer, StreamPiece, Usage, parse_completion, parse_event
from kvmesh.tracing import inject_http_headers, tracer
from kvmesh.types import (
    DATA_PARALLEL_RANK_HEADER,
    CompletionOutcome,
    Endpoint,
    RequestCompletion,
    data_parallel_rank_of,
    pick_request_id,
)
from services.router import metrics
from services.router.catalog import ModelCatalog
from services.router.clients import AdmitOptions, AdmitQuery, CompletionReport, PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.degraded import (
    AdmissionTimedOut,
    DegradedLog,
    DependencyBreaker,
    FlowControlHung,
    FlowControlUnreachable,
    LocalAdmission,
    LocalPicker,
    PickerTimedOut,
    PickerUnreachable,
)
from services.router.engine_client import (
    AiohttpEngineClient,
    EngineClient,
    EngineResponse,
    EngineUnreachable,
    HttpxEngineClient,
    mid_answer_failure,
)
from services.router.headers import AUTHORIZATION, engine_authorization
from services.router.metrics import RequestOutcome
from services.router.response_affinity import PROFILE as AFFINITY_PROFILE
from services.router.response_affinity import pinned_endpoint
from services.router.validation import ModelUnavailable, RouterRequest, check_context, render_fields_json

logger = logging.getLogger(__name__)
_tracer = tracer("kvmesh.router")
_T = TypeVar("_T")

REQUEST_ID_HEADER = "x-request-id"
ENDPOINT_HEADER = "x-kvmesh-endpoint"


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Done callback of a task given up on: its outcome is read, so none is logged as never retrieved."""
    if not task.cancelled():
        task.exception()


class ClientGone(Exception):
    """The caller's client went away (e.g. writing to it failed): the session ends ``cancelled``."""


class EngineFailed(errors.NoEndpointsAvailable):
    """The engine failed after its answer started (reset, truncated body): 503 / ``UNAVAILABLE``.

    ``__cause__`` is the transport error.
    """


class EngineStalled(EngineFailed):
    """The engine stopped sending after its answer started: silent past
    ``engine_stream_idle_timeout_seconds``, or silent past ``engine_health_probe_after_seconds``
    (``engine_departed_idle_seconds`` once it left membership) with its ``/health`` failing too.
    The answer ends as a failed engine's: 503 / ``UNAVAILABLE``, an SSE stream with the in-stream
    error event and ``[DONE]``."""


SHUTDOWN_MESSAGE = "the server is shutting down; retry the request"


class ShuttingDown(EngineFailed):
    """The router is stopping and the request was still waiting on its engine (503 + ``retry-after``,
    or the in-stream error event when the answer had started)."""


class EngineStall(EngineUnreachable):
    """No first byte from the engine within ``engine_first_byte_timeout_seconds``, or its ``/health``
    failed while the request waited on it (past ``engine_health_probe_after_seconds``, or
    ``engine_departed_idle_seconds`` once it left membership): the request moves to the next
    candidate, as for a refused connection (the client has seen nothing; the abandoned engine
    request is cancelled: its connection is closed, and vLLM aborts it once its loop notices).
    ``reason``: ``first_byte_timeout``, ``health_probe_failed``, ``health_probe_timed_out`` or
    ``endpoint_left``; ``endpoint_id``, ``request_id`` and ``waited``
    (seconds without a byte) for the stall's count and log line, which wait until it is known
    whether another attempt starts (``redispatched``) or not (``abandoned``)."""

    def __init__(self, reason: str, message: str, endpoint_id: str = "", request_id: str = "",
                 waited: float = 0.0) -> None:
        super().__init__(message)
        self.reason, self.endpoint_id, self.request_id, self.waited = reason, endpoint_id, request_id, waited


def seconds_text(seconds: float) -> str:
    """A wait for a message: two significant digits below 10 s (``0.25s``, ``1.5s``), whole seconds
    above (``120s``); never ``0s`` for a wait that lasted."""
    if seconds >= 10:
        return f"{seconds:.0f}s"
    return f"{seconds:.2g}s" if seconds > 0 else "0s"


STALL_REASONS = ("first_byte_timeout", "idle_timeout", "endpoint_left", "health_probe_failed", "health_probe_timed_out")
"""``kvmesh_router_engine_stalled_total``'s reasons: a wait past the first-byte or idle limit, or
past the probe threshold (:meth:`RequestFlow._check`) on an endpoint whose ``/health`` failed, which
had left membership (``endpoint_left``) or not (``health_probe_failed``: refused, reset or not 2xx,
the lease alive; ``health_probe_timed_out``: its ``/health`` gave no answer, with no byte from the
endpoint on any request, for longer than ``engine_health_slow_fail_seconds`` within the wait)."""
_TIMED_OUT = "health_probe_timed_out"
_SHUTDOWN = "shutdown"


@dataclass(eq=False, slots=True)
class _EngineWatch:
    """One request's wait on its engine, seen by :meth:`RequestFlow._reap` (no timer per read).

    ``since`` is set while the request's task awaits the engine (headers, a body chunk), None
    otherwise (e.g. while writing to a slow client: that is not the engine's silence). Ending it
    sets ``reason`` and cancels the task *at that await*, where the cancellation is turned into
    :class:`EngineStall` (before the first byte), :class:`EngineStalled` or :class:`ShuttingDown`.
    """

    task: asyncio.Task[object] | None
    endpoint_id: str
    request_id: str
    limit: float
    on_stall: Callable[[_EngineWatch, str], None]
    first: bool = True
    since: float | None = None
    departed: bool = False
    reason: str | None = None
    waited: float = 0.0
    cancelled: bool = False
    url: str = ""
    """The endpoint's base URL (its ``/health`` is probed once the wait passed the probe threshold)."""
    probe: _Probe | None = None
    """The endpoint's probe state, shared by every watch on it: each piece of an answer counts in its
    ``heard`` (a probe that fails while another request to the endpoint receives bytes is no hang)."""
    slow: float = 0.0
    """Seconds the endpoint's ``/health`` had given no answer within this wait, at a ``health_probe_timed_out`` verdict."""

    def heard(self) -> None:
        """A piece of the engine's answer arrived (headers, a body chunk): the endpoint is alive."""
        if self.probe is not None:
            self.probe.heard += 1

    def owns_cancel(self) -> bool:
        """Whether the CancelledError being handled is this watch's own (then it is consumed)."""
        if not self.cancelled:
            return False
        task = asyncio.current_task()
        return task is None or task.uncancel() == 0

    def _why(self, timed_out: str) -> str:
        """Why the wait ended, for the error: the engine's failed ``/health`` probe, else ``timed_out``."""
        if self.reason == "endpoint_left":
            return "it left the pool and its /health does not answer"
        if self.reason == "health_probe_failed":
            return f"no data for {seconds_text(self.waited)} and its /health does not answer"
        if self.reason == _TIMED_OUT:
            return (f"no data for {seconds_text(self.waited)} and its /health gave no answer for "
                    f"{seconds_text(self.slow)}")
        return timed_out

    def failure(self) -> EngineFailed:
        """The error that ends an answer which started (counted and logged once, rate-limited)."""
        if self.reason == _SHUTDOWN:
            return ShuttingDown(SHUTDOWN_MESSAGE)
        self.on_stall(self, "ended")
        why = self._why(f"no data for {seconds_text(self.waited)}")
        return EngineStalled(f"engine {self.endpoint_id} stopped answering mid-stream ({why}); the answer is incomplete")

    def unreachable(self) -> Exception:
        """The error for an engine that gave no first byte: the next candidate is tried (not on shutdown).
        Not counted here: :meth:`RequestFlow._connect` counts it once it knows whether another attempt starts."""
        if self.reason == _SHUTDOWN:
            return ShuttingDown(SHUTDOWN_MESSAGE)
        why = self._why(f"no first byte within {seconds_text(self.waited)}")
        return EngineStall(self.reason or "first_byte_timeout", f"engine {self.endpoint_id} did not answer: {why}",
                           self.endpoint_id, self.request_id, self.waited)


Health = Literal["alive", "slow", "dead"]
"""A ``/health`` GET's verdict: ``alive`` (2xx, or a request to the endpoint received a byte while
it ran), ``slow`` (no answer within the GET's limit: an overloaded vLLM answers late, its handler
queued behind the API server's loop), ``dead`` (refused, reset, not 2xx)."""

Verdict = Literal["alive", "dead", "timed_out"]
"""What the probes say of an endpoint for one wait (:meth:`RequestFlow._answers`): ``alive``,
``dead`` (a fast verdict: refused, reset, not 2xx; or, once the endpoint left membership, a
``/health`` unanswered for ``engine_health_probe_timeout_seconds`` + ``engine_health_probe_interval_seconds``)
or ``timed_out`` (a ``/health`` unanswered, with no byte from the endpoint, for more than
``engine_health_slow_fail_seconds`` within the wait)."""


@dataclass(slots=True)
class _Probe:
    """An endpoint's liveness while requests are bound to it.

    ``task``: its ``GET /health`` running (one at a time per endpoint; it is never cancelled early:
    it runs up to ``engine_health_slow_fail_seconds`` + ``engine_health_probe_timeout_seconds``, so a
    late answer still counts), ``sent_at`` when it was sent; ``alive`` the last GET's verdict (True: 2xx or a byte heard while it ran,
    False: refused / reset / not 2xx, None: not known, or no answer within its limit),
    ``checked_at`` when it ended. ``heard``: pieces of answers received from the endpoint (by every
    request to it), ``heard_at_send`` its value when the GET was sent. ``slow_since``: the start of
    the current *slow run*, an unbroken stretch in which ``/health`` gave no answer past
    ``engine_health_probe_timeout_seconds`` (None: no run); ``run_heard`` the value of ``heard`` then
    (a byte heard since ends the run; so does an interval with no GET running: :meth:`RequestFlow._run`)."""

    task: asyncio.Task[None] | None = None
    alive: bool | None = None
    sent_at: float = 0.0
    checked_at: float | None = None
    heard: int = 0
    heard_at_send: int = 0
    slow_since: float | None = None
    run_heard: int = 0
    bound: int = 0
    """Requests bound to the endpoint (watches holding this probe): at 0, with no probe running, it is dropped."""


class _PrimedResponse:
    """An engine answer whose first body chunk was already read (to know the engine answers before
    the request is bound to it); yields that chunk, then the rest."""

    __slots__ = ("_first", "_inner", "_rest", "content_type", "headers", "primed_at", "status_code")

    def __init__(self, inner: EngineResponse, first: bytes, rest: AsyncIterator[bytes] | None, primed_at: float) -> None:
        self._inner, self._first, self._rest, self.primed_at = inner, first, rest, primed_at
        self.status_code = inner.status_code
        self.content_type = inner.content_type
        self.headers = inner.headers

    @property
    def is_closed(self) -> bool:
        return self._inner.is_closed

    def take(self) -> tuple[bytes, AsyncIterator[bytes] | None]:
        """The primed first chunk and the engine's own iterator of the rest (None: the answer ended),
        for :meth:`FlowSession.iter_events` to read directly (no generator step per chunk); once."""
        first, rest, self._first, self._rest = self._first, self._rest, b"", None
        return first, rest

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        first, self._first = self._first, b""
        if first:
            yield first
        if self._rest is not None:
            async for chunk in self._rest:
                yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


_CLIENT_GONE = (asyncio.CancelledError, GeneratorExit, ClientGone)

AFTER_WHOLE_SECONDS = 1.0
"""How long the router waits for an engine to close an answer that is already whole (``[DONE]`` passed,
the Content-Length read) before it closes the response itself, as a success (at most this plus a
reaper tick; a normal engine closes it at once: nothing waits)."""


def _whole(watch: _EngineWatch | None) -> bool:
    """The answer is whole: from now on a silent engine is waited for :data:`AFTER_WHOLE_SECONDS` only."""
    if watch is not None:
        watch.limit = min(watch.limit, AFTER_WHOLE_SECONDS)
    return True


def _content_length(response: EngineResponse | _PrimedResponse) -> int | None:
    """The body's length when the engine sent it unencoded with a ``content-length`` (None otherwise)."""
    headers = response.headers
    length = headers.get("content-length")
    if length is None or headers.get("content-encoding", "identity") != "identity":
        return None
    try:
        return int(length)
    except ValueError:
        return None


class Ticket(Protocol):
    """An admitted request's slot: flow_control's stream, or a local one in the degraded mode."""

    async def close(self, report: CompletionReport | None = None) -> None: ...


class SupportsAdmit(Protocol):
    async def admit(self, request: AdmitQuery) -> Ticket: ...


class LocalTicket:
    """A slot taken from :class:`~services.router.degraded.LocalAdmission` (flow_control unreachable)."""

    queue_seconds = 0.0

    def __init__(self, admission: LocalAdmission) -> None:
        self._admission = admission
        self._closed = False

    async def close(self, report: CompletionReport | None = None) -> None:
        if not self._closed:
            self._closed = True
            self._admission.release()


class SupportsPick(Protocol):
    async def pick(self, query: PickQuery) -> PickReply: ...


LIVENESS_FRESH_SECONDS = 1.0
"""How recent a sign of life must be to tell a busy flow_control from a hung one without asking it
(an answered admission call, or a liveness check's verdict, within this long before a timeout)."""

ANSWERED_HEALTH = frozenset({"SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", "UNIMPLEMENTED"})
"""grpc.health.v1 ``Check`` results that the server itself gave (it is responsive, whatever it says);
the others (``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ``NOT_CONNECTED``...) mean nothing came back."""


class _Liveness:
    """Is a dependency responsive? One grpc.health.v1 ``Check`` at a time (``check(timeout_seconds)``
    -> a status name, never raising: :func:`services.router.clients.check_health`), shared by every
    request that asks while it runs; its verdict is reused for :data:`LIVENESS_FRESH_SECONDS`.
    ``alive()`` -> True when the server answered the check (:data:`ANSWERED_HEALTH`) within
    ``timeout_seconds``; False when nothing came back (a SIGSTOPped or wedged process)."""

    def __init__(self, check: Callable[[float], Awaitable[str]], timeout_seconds: float,
                 clock: Callable[[], float]) -> None:
        self._check = check
        self._timeout = timeout_seconds
        self._clock = clock
        self._running: asyncio.Future[bool] | None = None
        self._verdict: tuple[float, bool] | None = None

    async def alive(self) -> bool:
        if self._verdict is not None and self._clock() - self._verdict[0] <= LIVENESS_FRESH_SECONDS:
            return self._verdict[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)  # a request that leaves does not cancel the others' check

    async def _run(self) -> bool:
        try:
            status = await self._check(self._timeout)
        except Exception:  # a check that failed is no sign of life
            status = "UNKNOWN"
        alive = status in ANSWERED_HEALTH
        self._verdict = (self._clock(), alive)
        return alive

    def cancel(self) -> None:
        if self._running is not None:
            self._running.cancel()


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who is asking: request id, flow (fairness id), priority band, and the caller's trace context.

    ``server_span`` makes the request span a SERVER span (HTTP); under gRPC the shared interceptor
    already opened the server span, so the request span is INTERNAL.
    """

    request_id: str
    flow_id: str
    priority: int
    trace_context: Context | None = None
    server_span: bool = False
    admit_options: AdmitOptions | None = None
    """Body size, TTL, TTFT objective and tenant quotas for flow_control (:mod:`services.router.tenants`)."""
    forward_headers: tuple[tuple[str, str], ...] = ()
    """The client's headers that go on to the engine (:func:`services.router.headers.forwarded_headers`)."""
    epp_request_id: str = ""
    """The id epp knows this router request by (``PickRequest.request_id`` of each of its picks and its
    ``CompletedRequest``): ``request_id`` plus ``~`` and a suffix unique to this request
    (:func:`kvmesh.types.pick_request_id`), given when empty. Clients may send one ``x-request-id`` on several
    requests (it is kept as sent for the engine, logs and the answer), but epp treats a second pick
    under one id as the same request picked again (superseding the first): a retry or re-pick of this
    router request does that, another request with the same client id must not. vLLM does alike: it
    keeps the client's id for its answer and makes its internal one unique with a random suffix."""

    def __post_init__(self) -> None:
        if not self.epp_request_id:
            object.__setattr__(self, "epp_request_id", pick_request_id(self.request_id))




@dataclass(frozen=True, slots=True)
class EngineChunk:
    """A piece of the engine's answer: bytes to pass on unchanged, and the stream chunks they hold.

    For a streamed request ``raw`` is whole SSE events (the last piece may be an unterminated
    remainder) and ``pieces`` their parsed chunks (``[DONE]`` and non-JSON events left out); for a
    non-streamed one ``raw`` is a slice of the JSON body and ``pieces`` is empty.
    """

    raw: bytes
    pieces: tuple[StreamPiece, ...] = ()


@dataclass
class FlowSession:
    """An admitted request with an open engine answer; valid inside :meth:`RequestFlow.session`."""

    request: RouterRequest
    meta: RequestMeta
    endpoint: Endpoint
    status_code: int
    content_type: str
    attempts: int
    _response: EngineResponse
    _clock: Callable[[], float]
    _started: float
    _first_byte_at: float | None = None
    _finished: bool = False
    _usage: Usage | None = None
    _chunks: int = 0
    _body: bytearray = field(default_factory=bytearray)
    _watch: _EngineWatch | None = None
    _ttft_recorded: bool = False

    @property
    def ttft_seconds(self) -> float:
        """Seconds from the request's arrival to the engine's first answer byte (0 before it)."""
        return (self._first_byte_at - self._started) if self._first_byte_at is not None else 0.0

    def engine_header(self, name: str) -> str | None:
        """A header of the engine's answer (``retry-after``, ...), None when absent."""
        return self._response.headers.get(name)

    @property
    def usage(self) -> Usage | None:
        """The answer's ``usage`` as seen so far (the last chunk carrying one), None when absent."""
        return self._usage

    async def iter_events(self) -> AsyncGenerator[EngineChunk, None]:
        """The engine's answer as :class:`EngineChunk` s, bytes unchanged (SSE when the request streams).

        A streamed answer is released in whole events only (up to the last blank line seen; the
        rest follows with the next chunk, or at the end), so an in-stream error event sent after an
        engine failure never lands inside a half-sent event. Usage and the number of content
        chunks are taken from the parsed pieces as they pass.

        Once the answer is whole (the framer passed ``data: [DONE]``; a non-streamed body reached its
        ``content-length``) the rest of the body is still read, so that the connection goes back to the
        pool, but the engine can no longer fail it: silence past :data:`AFTER_WHOLE_SECONDS` (a pause,
        a GC, SIGSTOP before it closed the body), a failed ``/health`` probe, the router stopping or a
        reset end it as a success (the response is closed by the session's exit), with nothing added.

        Raises:
            EngineFailed: the engine connection failed mid-answer (logged here).
            EngineStalled: the engine went silent past ``engine_stream_idle_timeout_seconds``, or past
                ``engine_health_probe_after_seconds`` (``engine_departed_idle_seconds`` once it left
                membership) with its ``/health`` failing, before the answer was whole.
            ShuttingDown: the router is stopping (before the answer was whole).
        """
        # an error answer is one JSON body even for a streamed request (vLLM answers 4xx before any event)
        framer = SseFramer() if self.request.stream and self.status_code < 400 else None
        response = self._response
        if isinstance(response, _PrimedResponse):  # its first chunk, then the engine's own iterator: no extra step
            pending, chunks = response.take()
        else:
            pending, chunks = b"", response.aiter_bytes()
        watch = self._watch
        # Whole once the framer passed ``[DONE]`` or a non-streamed body reached its Content-Length: the
        # body is still read to its end (the connection goes back to the pool), but silence, a probe
        # that fails, the router stopping or a reset from then on only ends it, as a success.
        whole = False
        expected = _content_length(response) if framer is None else None
        while True:
            if pending:
                chunk, pending = pending, b""
                if watch is not None and watch.reason is not None:
                    raise watch.failure()
            else:
                if chunks is None:
                    break
                if watch is not None:
                    if watch.reason is not None:  # ended while not waiting on the engine (the router stopping)
                        if whole:
                            break
                        raise watch.failure()
                    watch.since = _now()  # the one clock read per chunk
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if watch is None or not watch.owns_cancel():
                        raise
                    if whole:
                        self._ended_after_whole(watch.reason)
                        break
                    raise watch.failure() from None
                except Exception as exc:
                    if whole:
                        self._ended_after_whole(repr(exc))
                        break
                    logger.warning("engine failed mid-answer request_id=%s endpoint=%s error=%r",
                                   self.meta.request_id, self.endpoint.id, exc)
                    raise EngineFailed(f"engine {self.endpoint.id} {mid_answer_failure(exc)}") from exc
                finally:
                    if watch is not None:
                        watch.since = None
                if watch is not None:
                    watch.heard()
            if not chunk:
                continue
            if not self._ttft_recorded:
                self._ttft_recorded = True
                if self._first_byte_at is None:
                    self._first_byte_at = self._clock()
                metrics.record_ttft(self.request.model, self.ttft_seconds)
            if framer is None:
                self._body += chunk
                if expected is not None and not whole and len(self._body) >= expected:
                    whole = _whole(watch)
                yield EngineChunk(chunk)
                continue
            cut = framer.feed(chunk)
            pieces = tuple(piece for payload in cut.data if (piece := parse_event(payload)) is not None)
            for piece in pieces:
                if piece.text or piece.finish_reason:
                    self._chunks += 1
                if piece.usage is not None:
                    self._usage = piece.usage
            if not whole and len(pieces) < len(cut.data) and any(p.strip() == DONE for p in cut.data):
                whole = _whole(watch)
            if cut.raw:
                yield EngineChunk(cut.raw, pieces)
        if framer is not None and (rest := framer.flush()):
            yield EngineChunk(rest)
        self._finished = True
        if self._first_byte_at is not None:
            metrics.record_stage("proxy", self._clock() - self._first_byte_at)
        if framer is None:
            self._usage = parse_completion(bytes(self._body)).usage

    def _ended_after_whole(self, why: str | None) -> None:
        logger.debug("engine answer already whole, ended without its close request_id=%s endpoint=%s why=%s",
                     self.meta.request_id, self.endpoint.id, why)

    async def read_error(self, limit: int) -> tuple[bytes, bool]:
        """An error answer's body, at most ``limit`` bytes, and whether more was left unread (the rest is
        dropped when the session closes the engine response: a huge error body is never held whole).

        Raises:
            EngineFailed: the engine connection failed mid-answer.
            EngineStalled: the engine went silent before the body was whole (past
                ``engine_stream_idle_timeout_seconds``, or past the probe threshold with its ``/health`` failing).
            ShuttingDown: the router is stopping.
        """
        events = self.iter_events()
        try:
            async for _ in events:
                if len(self._body) > limit:
                    return bytes(self._body[:limit]), True
        finally:
            await events.aclose()
        return bytes(self._body), False

    async def read_all(self) -> bytes:
        """The whole body of a non-streamed answer or of an error answer (a streamed success is not kept: b"").

        Raises:
            EngineFailed: the engine connection failed mid-answer.
            EngineStalled: the engine went silent before the body was whole (past
                ``engine_stream_idle_timeout_seconds``, or past the probe threshold with its ``/health`` failing).
            ShuttingDown: the router is stopping.
        """
        async for _ in self.iter_events():
            pass
        return bytes(self._body)


def client_credentials_reach_engine(forward_headers: Iterable[tuple[str, str]], engine_key: str | None) -> bool:
    """Whether the engine saw the client's own ``authorization`` (open mode passes it on,
    :func:`services.router.headers.forwarded_headers`, and no engine key of the router's replaces it):
    then an engine's 401/403 refused the client's key, else the router's (:func:`metrics.engine_outcome`)."""
    return engine_key is None and any(name == AUTHORIZATION for name, _ in forward_headers)


@dataclass
class _Lifetime:
    """What one request holds from arrival to end; :meth:`close` releases it (once)."""

    request: RouterRequest
    meta: RequestMeta
    clock: Callable[[], float]
    started: float
    span: trace.Span
    ticket: Ticket | None = None
    on_end: Callable[[], None] | None = None
    """Called once when the request ends after an endpoint was chosen (the local picker's count)."""
    on_completed: Callable[[RequestCompletion], None] | None = None
    """Told once how a request ended (epp's ``Completed``; must not block): every request an engine
    answered, however it was picked (epp's pick, the local degraded pick, a pinned follow-up), with its
    outcome and serving endpoint: epp frees its pick, or, for an id it never picked, takes the request
    out of that endpoint's running count early (``Datastore.note_completed``). A request no engine
    answered: ``NOT_DISPATCHED`` when :attr:`picks_asked` (epp drops the pick's load), else nothing."""
    picks_asked: bool = False
    """epp may hold a pick of this request: it answered one (an early pick, or the dispatch's), or one
    was abandoned while epp had it (the client left), or one passed its deadline
    (:class:`~services.router.degraded.PickerTimedOut`: epp's own deadline starts later, and a cancel
    does nothing once the answer is on the wire). Gates only ``NOT_DISPATCHED`` (else the pick's active
    prompt tokens stay counted until epp's TTL). Not set by a pick that failed otherwise (epp
    unreachable, unknown model, epp's own error answer) nor a pinned one: epp holds nothing of those,
    and a ``NOT_DISPATCHED`` for them would only count as unmatched."""
    engine_key_for: Callable[[str], str | None] = lambda model: None
    """The key the router presents to a model's engines (``RouterConfig.engine_key_for``): tells whose
    credentials an engine's 401/403 refused (:func:`client_credentials_reach_engine`)."""
    proxy_span: trace.Span | None = None
    session: FlowSession | None = None
    exception: BaseException | None = None
    client_gone: bool = False
    shut_down: bool = False
    """Ended by the router's own shutdown (a cancel carrying :data:`SHUTDOWN_MESSAGE`), not by its client:
    counted ``unavailable``, the caller answers ``UNAVAILABLE`` / 503."""

    async def close(self) -> None:
        if self.session is None:
            await self._close_unopened()
        else:
            await self._close_opened(self.session)

    async def _close_unopened(self) -> None:
        """Entering failed: release the slot (if admitted), tell epp the pick it made was not
        dispatched (admission refused the request after an early pick, every attempt failed before
        its first byte, the client left first); the caller answers (and counts) the error."""
        try:
            if self.ticket is not None:
                e2e = self.clock() - self.started
                await self.ticket.close(CompletionReport(self.request.prompt_tokens_estimate, 0, 0.0, e2e, False))
        finally:
            if self.picks_asked and self.on_completed is not None:  # fire-and-forget, as for a dispatched one
                self.on_completed(RequestCompletion(self.meta.epp_request_id, "", self.request.prompt_tokens_estimate, 0,
                                                    CompletionOutcome.NOT_DISPATCHED))
            metrics.IN_FLIGHT.dec()
            if self.client_gone:
                metrics.record_outcome(RequestOutcome.CANCELLED)  # other errors are counted where they are answered
            elif self.shut_down:  # nobody answers it with a counted error: the call is ended from outside
                metrics.record_outcome(RequestOutcome.UNAVAILABLE)
            if self.exception is not None:
                self.span.record_exception(self.exception)
                self.span.set_status(Status(StatusCode.ERROR, type(self.exception).__name__))
            self.span.end()

    async def _close_opened(self, session: FlowSession) -> None:
        """Close the engine response (cancelling it when unfinished), report to flow_control, free the slot."""
        try:
            await session._response.aclose()
        except Exception:
            logger.debug("closing engine response failed request_id=%s", self.meta.request_id, exc_info=True)
        if self.on_end is not None:
            self.on_end()
        e2e = self.clock() - self.started
        success = session._finished and not self.client_gone and self.exception is None and session.status_code < 400
        if self.client_gone:
            outcome = RequestOutcome.CANCELLED
        elif self.shut_down:
            outcome = RequestOutcome.UNAVAILABLE
        elif success:
            outcome = RequestOutcome.SUCCESS
        elif session.status_code >= 400:  # the engine's error answer: its credential refusals are the router's
            outcome = metrics.engine_outcome(session.status_code, client_credentials_reach_engine(
                self.meta.forward_headers, self.engine_key_for(self.request.model)))
        else:
            outcome = RequestOutcome.UPSTREAM_ERROR
        usage = session.usage or Usage()
        report = CompletionReport(
            prompt_tokens=usage.prompt_tokens or self.request.prompt_tokens_estimate,
            completion_tokens=usage.completion_tokens or session._chunks,
            ttft_seconds=session.ttft_seconds,
            e2e_seconds=e2e,
            success=success,
        )
        try:
            if self.ticket is not None:
                closing = self.clock()
                await self.ticket.close(report)
                metrics.record_stage("release", self.clock() - closing)
        finally:
            if success:
                metrics.record_e2e(self.request.model, e2e)
            metrics.record_outcome(outcome)
            metrics.IN_FLIGHT.dec()
            if self.on_completed is not None:  # fire-and-forget, for every dispatched request: epp frees its load now (issue 9)
                self.on_completed(RequestCompletion(
                    self.meta.epp_request_id, session.endpoint.id, report.prompt_tokens, usage.cached_tokens,
                    CompletionOutcome.SUCCESS if success else
                    CompletionOutcome.CANCELLED if self.client_gone else CompletionOutcome.ERROR,
                    report.completion_tokens))
            if self.span is not None:  # what an operator looks for on the request's root span (issue 11)
                self.span.set_attributes({
                    "kvmesh.ttft_seconds": session.ttft_seconds, "kvmesh.e2e_seconds": e2e,
                    "kvmesh.queue_seconds": float(getattr(self.ticket, "queue_seconds", 0.0)),
                    "kvmesh.prompt_tokens": report.prompt_tokens, "kvmesh.completion_tokens": report.completion_tokens,
                })
            for span in (self.proxy_span, self.span):
                if span is None:
                    continue
                span.set_attribute("kvmesh.outcome", outcome.value)
                if not success:
                    span.set_status(Status(StatusCode.ERROR, outcome.value))
                span.end()
            logger.debug(
                "request done request_id=%s endpoint=%s outcome=%s ttft=%.4f e2e=%.4f",
                self.meta.request_id, session.endpoint.id, outcome.value, session.ttft_seconds, e2e,
            )


class RequestFlow:
    """Admit, pick, forward, complete: see the module docstring."""

    def __init__(
        self,
        config: RouterConfig,
        catalog: Callable[[], ModelCatalog],
        admission: SupportsAdmit,
        picker: SupportsPick,
        http: EngineClient | httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        endpoints: Callable[[str], Iterable[Endpoint]] = lambda model: (),
    ) -> None:
        """``endpoints(model)``: the live endpoints serving ``model`` from the router's own etcd
        view, for the local pick when epp is unreachable (none: that mode answers 503)."""
        self._config = config
        self._catalog = catalog
        self._admission = admission
        self._picker = picker
        self._http: EngineClient = HttpxEngineClient(http) if isinstance(http, httpx.AsyncClient) else http
        self._clock = clock
        self._endpoints = endpoints
        self.local_admission = LocalAdmission(config.degraded_max_in_flight, config.flow_control_failure_mode == "open")
        self.local_picker = LocalPicker()
        self._degraded_log = DegradedLog(clock)
        cool_down = config.dependency_breaker_cool_down_seconds
        self.breakers: dict[str, DependencyBreaker] = {
            name: DependencyBreaker(name, cool_down, clock, self._breaker_changed(name, timeout))
            for name, timeout in (("epp", config.pick_timeout_seconds), ("flow_control", config.admission_timeout_seconds))
        }
        """Circuit breakers of the per-request dependencies (docs/degraded-modes.md, "hung")."""
        health = getattr(admission, "health", None)
        self._flow_control_liveness = (_Liveness(health, config.health_check_timeout_seconds, clock)
                                       if health is not None else None)
        """Asked when an admission call timed out with no recent answer from flow_control: busy or hung?"""
        self._admitting_at_once = True
        """Whether the last admission dispatched without queueing (or was rejected): early picks go on."""
        self._watches: set[_EngineWatch] = set()
        self._refused: dict[str, str] = {}
        """Endpoints whose last connect was refused (id -> base URL): a dead engine whose lease lives on
        (:meth:`refused_endpoints`; ``/health`` does not count them as live)."""
        self._reaper: asyncio.Task[None] | None = None
        self._probes: dict[str, _Probe] = {}
        """Liveness of the endpoints that requests wait on past the probe threshold (endpoint id ->)."""
        self._probe_http: httpx.AsyncClient | None = http if isinstance(http, httpx.AsyncClient) else None
        self._own_probe_http = False
        self._reap_tick = max(0.05, min(1.0, config.engine_first_byte_timeout_seconds / 4,
                                        config.engine_stream_idle_timeout_seconds / 4,
                                        config.engine_departed_idle_seconds / 4,
                                        config.engine_health_probe_after_seconds / 4))

    # -- engines that stop answering (docs/degraded-modes.md, "an engine hung") --------------------

    def _watch(self, endpoint: Endpoint, request_id: str, stream: bool) -> _EngineWatch:
        first = self._config.engine_first_byte_timeout_seconds if stream else self._config.request_timeout_seconds
        probe = self._probes.get(endpoint.id)
        if probe is None:
            probe = self._probes[endpoint.id] = _Probe()
        probe.bound += 1
        watch = _EngineWatch(asyncio.current_task(), endpoint.id, request_id, first, self._stalled, url=endpoint.url,
                             probe=probe)
        self._watches.add(watch)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        return watch

    def _unwatch(self, watch: _EngineWatch | None) -> None:
        if watch is not None:
            watch.since = None
            if watch in self._watches:
                self._watches.remove(watch)
                probe = watch.probe
                if probe is not None:
                    probe.bound -= 1
                    self._forget(watch.endpoint_id, probe)

    def _forget(self, endpoint_id: str, probe: _Probe) -> None:
        """Drop ``probe`` once no request is bound to its endpoint and no probe runs."""
        if probe.bound <= 0 and probe.task is None and self._probes.get(endpoint_id) is probe:
            del self._probes[endpoint_id]

    def _stalled(self, watch: _EngineWatch, action: str) -> None:
        """Count and log an answer that started and is ended (``action="ended"``) because its engine stalled."""
        self._stall_seen(watch.reason or "idle_timeout", action, watch.endpoint_id, watch.request_id, watch.waited)

    def _stall_seen(self, reason: str, action: str, endpoint_id: str, request_id: str, waited: float,
                    outcome: str = "") -> None:
        metrics.record_engine_stalled(reason, action)
        self._degraded_log.warn("engine", "action=%s reason=%s endpoint=%s request_id=%s waited=%s%s",
                                action, reason, endpoint_id, request_id, seconds_text(waited), outcome, cause=reason)

    def _moved_on(self, failed: EngineUnreachable) -> None:
        """Another attempt starts after ``failed``: one retry, and a stall ``redispatched``."""
        metrics.record_retry()
        if isinstance(failed, EngineStall):
            self._stall_seen(failed.reason, "redispatched", failed.endpoint_id, failed.request_id, failed.waited)

    def _gave_up(self, failed: EngineUnreachable, exc: BaseException) -> None:
        """No attempt follows ``failed`` (no candidate left, the re-pick failed, the client went away):
        a stall is counted ``abandoned``, logged with the request's real outcome (``exc`` ends it)."""
        if not isinstance(failed, EngineStall):
            return
        if isinstance(exc, _CLIENT_GONE):
            outcome = f" outcome={RequestOutcome.CANCELLED.value}"
        else:
            status = errors.mapping_for(exc).http_status
            outcome = f" outcome={metrics.outcome_for_status(status).value} status={status}"
        self._stall_seen(failed.reason, "abandoned", failed.endpoint_id, failed.request_id, failed.waited, outcome)

    def _end(self, watch: _EngineWatch, reason: str, now: float) -> None:
        """End ``watch``'s wait: cancel its task at the engine await (a wait not in progress sees
        ``reason`` at its next read)."""
        watch.reason = reason
        if watch.since is not None:
            watch.waited = now - watch.since
            if watch.task is not None and not watch.task.done():
                watch.cancelled = True
                watch.task.cancel()

    async def _reap(self) -> None:
        """Every tick: end the waits past their limit (first byte, idle), and those past the probe
        threshold on an endpoint whose ``/health`` probe failed (:meth:`_check`)."""
        while self._watches:
            await asyncio.sleep(self._reap_tick)
            self._check()

    def _check(self) -> None:
        """End the waits on an engine that must end now. A wait without a byte past
        ``engine_health_probe_after_seconds`` (``engine_departed_idle_seconds`` once its endpoint
        left membership) has the endpoint's ``/health`` probed (:meth:`_answers`) and ends when the
        probes fail (``health_probe_failed`` / ``endpoint_left``, or ``health_probe_timed_out``
        when ``/health`` gave no answer past ``engine_health_slow_fail_seconds``); any wait past its own
        limit ends (``first_byte_timeout`` / ``idle_timeout``). One pass over the waits, no timer per
        request: a request answered before the threshold costs nothing here."""
        now = _now()
        config = self._config
        probe_after, departed_after = config.engine_health_probe_after_seconds, config.engine_departed_idle_seconds
        for watch in list(self._watches):
            since = watch.since
            if since is None or watch.reason is not None:
                continue
            waited = now - since
            if waited > (departed_after if watch.departed else probe_after):
                verdict = self._answers(watch, now)
                if verdict == "dead":
                    self._end(watch, "endpoint_left" if watch.departed else "health_probe_failed", now)
                    continue
                if verdict == "timed_out":
                    self._end(watch, _TIMED_OUT, now)
                    continue
            if waited > watch.limit:
                self._end(watch, "first_byte_timeout" if watch.first else "idle_timeout", now)

    def _answers(self, watch: _EngineWatch, now: float, fresh: bool = False) -> Verdict | None:
        """What the probes say of the endpoint ``watch`` waits on (:data:`Verdict`): ``dead`` when a
        ``/health`` GET sent during this wait failed fast, or (the endpoint left membership) when
        ``/health`` gave no answer for ``engine_health_probe_timeout_seconds`` +
        ``engine_health_probe_interval_seconds``; ``timed_out`` when the endpoint's slow run
        (:meth:`_run`: ``/health`` unanswered, no byte heard from the endpoint) spans more than
        ``engine_health_slow_fail_seconds`` *within this wait* (from ``max(run start, wait start)``);
        ``alive`` when a GET proved it alive within ``engine_health_probe_interval_seconds``; None
        while not known (a GET is running, or the next one is not due yet). One GET per endpoint at
        a time, not per request, and never a second one while one runs; ``fresh``: a new one unless
        one runs (the endpoint just left membership). A wait that began after a failed GET gets one
        of its own (the engine may be back).

        The verdicts (:meth:`_probe`): a SIGSTOPped engine still accepts TCP connects, so only an
        HTTP 2xx answer counts; a request to the endpoint that received a byte while the GET ran
        proves it alive (only an endpoint silent on every request it serves can be hung). A refusal,
        a reset or a non-2xx answer fails at once (vLLM answers 503 once its engine is dead). A GET
        that has no answer yet is no proof of a hang: vLLM's ``GET /health``
        (``vllm/entrypoints/serve/instrumentator/health.py``, 0.32) only awaits
        ``EngineClient.check_health()``, a flag check in ``AsyncLLM``, so it is slow exactly when the
        API server's event loop is saturated (30-40 s under high load), which is when long silences
        happen; the GET is therefore kept running (not cancelled and re-queued behind the same loop)
        and a late 2xx counts as alive. Leaving membership alone is no proof of a hang either (a
        draining engine deregisters first and then finishes its requests; an etcd that lost its data
        makes every endpoint "leave"), nor is a long silence (a deep queue, a long prefill, a whole
        non-streamed generation): a wait is cut only when the probes fail too."""
        probe = watch.probe
        if probe is None:
            return None
        config = self._config
        interval = config.engine_health_probe_interval_seconds
        since = watch.since
        run = self._run(probe, now)
        if run is not None and since is not None:
            span = now - max(run, since)
            if watch.departed and span >= config.engine_health_probe_timeout_seconds + interval:
                return "dead"  # unanswered, and its lease expired too: two signals
            if span > config.engine_health_slow_fail_seconds:
                watch.slow = span
                return "timed_out"
        if probe.task is not None:
            return None
        if probe.checked_at is not None and not fresh:
            if probe.alive:
                if now - probe.checked_at < interval:
                    return "alive"
            elif probe.alive is False:
                if since is not None and probe.sent_at >= since:  # failed during this wait
                    return "dead"
            elif now - probe.sent_at < interval:  # unanswered: the next one an interval after the last
                return None
        probe.sent_at, probe.heard_at_send = now, probe.heard
        probe.task = asyncio.ensure_future(self._probe(probe, watch.endpoint_id, watch.url))
        return None

    def _run(self, probe: _Probe, now: float) -> float | None:
        """The start of ``probe``'s endpoint's current slow run (None: none), kept up to date at ``now``.

        A run starts once a ``/health`` GET has gone unanswered past
        ``engine_health_probe_timeout_seconds`` (at its send, or now when a byte was heard from the
        endpoint since), goes on through the following GETs that get no answer either, and ends on
        a GET's answer (:meth:`_probe`), on any byte heard from the endpoint (on any request), or
        when more than ``engine_health_probe_interval_seconds`` passed with no GET running (nobody
        waited on the endpoint: the old run says nothing of a later wait)."""
        if probe.slow_since is not None and probe.heard != probe.run_heard:
            probe.slow_since = None  # the endpoint sent a byte: it serves
        if probe.task is not None:
            if probe.slow_since is None and now - probe.sent_at > self._config.engine_health_probe_timeout_seconds:
                probe.slow_since = probe.sent_at if probe.heard == probe.heard_at_send else now
                probe.run_heard = probe.heard
        elif probe.slow_since is not None and (
                probe.checked_at is None or now - probe.checked_at > self._config.engine_health_probe_interval_seconds):
            probe.slow_since = None  # a gap with no probing
        return probe.slow_since

    async def _probe(self, probe: _Probe, endpoint_id: str, url: str) -> None:
        config = self._config
        # kept running past the slow limit by a probe timeout: the waits' verdict (_answers, every tick)
        # comes while it still runs, not raced by its end and a second GET
        health = await self._health_of(url, config.engine_health_slow_fail_seconds
                                       + config.engine_health_probe_timeout_seconds)
        if health != "alive" and probe.heard != probe.heard_at_send:
            health = "alive"  # a request to it received a byte meanwhile: it serves, whatever /health says
        if health == "alive":
            probe.alive, probe.slow_since = True, None
            self._refused.pop(endpoint_id, None)
        elif health == "dead":
            probe.alive, probe.slow_since = False, None
        else:  # unanswered for the whole limit: the run goes on into the next GET (_answers sends it)
            probe.alive = None
            if probe.slow_since is None:
                probe.slow_since, probe.run_heard = probe.sent_at, probe.heard
        probe.checked_at, probe.task = _now(), None
        if probe.alive is not True:
            self._check()  # end the waits it fails now (and send the next GET), not at the next tick
        self._forget(endpoint_id, probe)

    async def await_engine(self, endpoint: Endpoint, request_id: str, sending: Awaitable[_T]) -> _T:
        """``sending`` (a request to ``endpoint`` that runs no inference: the passthrough routes,
        :mod:`services.router.passthrough`) awaited under the same hung-engine watch as the
        inference requests: past ``engine_health_probe_after_seconds`` the endpoint's ``/health`` is
        probed, one probe per endpoint shared with every other request waiting on it (:meth:`_answers`),
        and the wait ends when the probes fail; its answer counts as a byte heard from the endpoint.
        No limit of its own (``sending``'s client bounds it).

        Raises:
            EngineStall: the probes failed (``health_probe_failed``, ``health_probe_timed_out`` or
                ``endpoint_left``); ``sending`` is cancelled.
            ShuttingDown: the router is stopping.
        """
        watch = self._watch(endpoint, request_id, stream=False)
        watch.limit = float("inf")
        watch.since = _now()
        try:
            result = await sending
            watch.heard()
            return result
        except asyncio.CancelledError:
            watch.since = None
            if not watch.owns_cancel():
                raise
            raise watch.unreachable() from None
        finally:
            self._unwatch(watch)

    async def engine_health(self, endpoint: Endpoint) -> Health:
        """``endpoint``'s ``GET /health`` verdict now (:data:`Health`, within
        ``engine_health_probe_timeout_seconds``), ``alive`` also when a request bound to it through
        this flow received a byte while the probe ran: one probe, outside the shared per-endpoint
        state (waits on an engine use :meth:`_answers` / :meth:`await_engine`)."""
        probe = self._probes.get(endpoint.id)
        heard = probe.heard if probe is not None else 0
        health = await self._health_of(endpoint.url, self._config.engine_health_probe_timeout_seconds)
        if health != "alive" and probe is not None and probe.heard != heard:
            return "alive"
        return health

    async def _health_of(self, url: str, limit: float) -> Health:
        """GET ``url/health`` (vLLM and the engine simulator serve it) within ``limit`` seconds:
        ``alive`` on a 2xx answer, ``slow`` when none came in time, ``dead`` when refused, reset or
        answered otherwise (vLLM answers 503 once its engine is dead)."""
        if self._probe_http is None:
            self._probe_http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
            self._own_probe_http = True
        try:
            async with asyncio.timeout(limit):
                response = await self._probe_http.get(url + "/health", timeout=httpx.Timeout(limit))
        except (TimeoutError, httpx.TimeoutException):
            return "slow"
        except Exception:
            return "dead"
        return "alive" if response.is_success else "dead"

    # -- engines that refuse connections (docs/degraded-modes.md, "an engine refuses") -------------

    def refused_endpoints(self) -> dict[str, str]:
        """The endpoints whose last connect was refused, id -> base URL (a killed engine, its lease
        alive until it expires): excluded from ``/health``'s live endpoints until one answers again
        (a request's response headers, a ``/health`` GET's 2xx: :meth:`recheck_refused`) or its
        membership changes (:meth:`forget_refused`)."""
        return dict(self._refused)

    def forget_refused(self, endpoint_ids: Iterable[str]) -> None:
        """Membership changed for these endpoints (registered again, e.g. restarted; or left): their
        refusal says nothing of the new registration."""
        for endpoint_id in endpoint_ids:
            self._refused.pop(endpoint_id, None)

    async def recheck_refused(self, timeout_seconds: float) -> None:
        """``GET /health`` each refused endpoint (at once, within ``timeout_seconds``): a 2xx ends its
        refusal (the engine is back on the same address; ``/health``'s evaluation calls this)."""
        refused = list(self._refused.items())
        if not refused:
            return
        verdicts = await asyncio.gather(*(self._health_of(url, timeout_seconds) for _, url in refused))
        for (endpoint_id, url), verdict in zip(refused, verdicts, strict=True):
            if verdict == "alive" and self._refused.get(endpoint_id) == url:
                del self._refused[endpoint_id]
                logger.info("engine answers again endpoint=%s url=%s", endpoint_id, url)

    def endpoints_left(self, endpoint_ids: Iterable[str]) -> int:
        """Membership says these endpoints left (lease expired or deregistered): a request waiting on
        one of them for over ``engine_departed_idle_seconds`` ends only when the endpoint's ``/health``
        does not answer (:meth:`_answers`; a fresh probe starts now for a wait already past that
        limit): a draining engine keeps answering and is not cut. The count of requests waiting on
        them."""
        gone = set(endpoint_ids)
        now, waiting = _now(), 0
        probed: set[str] = set()
        for watch in list(self._watches):
            if watch.endpoint_id in gone and watch.reason is None:
                watch.departed = True
                waiting += 1
                if (watch.since is not None and now - watch.since > self._config.engine_departed_idle_seconds
                        and watch.endpoint_id not in probed):
                    probed.add(watch.endpoint_id)
                    self._answers(watch, now, fresh=True)
        return waiting

    def end_all(self) -> int:
        """The router is stopping: every request bound to an engine ends (503 before its answer
        started, else the in-stream error event + ``[DONE]``: :data:`SHUTDOWN_MESSAGE`). Their count."""
        now = _now()
        watches = [w for w in self._watches if w.reason is None]
        for watch in watches:
            self._end(watch, _SHUTDOWN, now)
        return len(watches)

    async def aclose(self) -> None:
        """Stop the reaper (at shutdown, after the HTTP server stopped)."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for probe in self._probes.values():
            if probe.task is not None:
                probe.task.cancel()
        self._probes.clear()
        if self._flow_control_liveness is not None:
            self._flow_control_liveness.cancel()
        if self._probe_http is not None and self._own_probe_http:
            await self._probe_http.aclose()
            self._probe_http = None

    def _breaker_changed(self, name: str, timeout: float) -> Callable[[bool], None]:
        def changed(is_open: bool) -> None:
            metrics.record_breaker(name, is_open)
            if is_open:
                self._degraded_log.warn(
                    name, "action=breaker_open reason=a call got no answer within %gs and nothing else came back; "
                    "for %gs requests do not wait on it, then one probe call at a time", timeout, self._config.dependency_breaker_cool_down_seconds,
                    cause="breaker_open")
            else:
                logger.info("degraded mode dependency=%s action=breaker_closed", name)
        return changed

    def dependency_checked(self, name: str, status: str) -> None:
        """A ``/health`` check's result for ``name``: ``SERVING`` ends its breaker's cool-down early, so a
        dependency that woke up gets the next request's probe at once (readiness's callback)."""
        breaker = self.breakers.get(name)
        if breaker is not None and status == "SERVING":
            breaker.seen_serving()

    def open_breakers(self) -> list[str]:
        """Dependencies whose breaker is open now (``/health`` lists them as degraded)."""
        return [name for name, breaker in self.breakers.items() if breaker.is_open()]

    def _on_credit(self, meta: RequestMeta) -> bool:
        """Whether the admission client would admit this request on a lent credit right now (no round
        trip, so no answer from flow_control: :meth:`_admit` then has no evidence either way)."""
        at_once = getattr(self._admission, "admits_at_once", None)
        return bool(at_once is not None and at_once(meta.priority, meta.admit_options))

    async def _admit(self, request: RouterRequest, meta: RequestMeta, on_credit: bool | None = None) -> Ticket:
        """flow_control's decision; when it is unreachable, or its breaker is open (it timed out
        recently: its cool-down, or another request is the probe), the degraded mode's (a local slot or 503).
        ``on_credit``: :meth:`_on_credit`, asked just before with no suspension since (None: asked here)."""
        breaker = self.breakers["flow_control"]
        route = breaker.admit()
        if route == "skip":
            return self._admit_locally(FlowControlUnreachable(
                "flow_control suspect: a recent admission call got no decision in time (breaker open)"))
        probe = route == "probe"
        # a request admitted on a lent credit gets no answer from flow_control: no evidence either way
        # (neither a probe's answer nor a sign of life)
        if on_credit is None:
            on_credit = self._on_credit(meta)
        answered = False
        sent_at = self._clock()
        try:
            call = self._admission.admit(
                AdmitQuery(
                    request_id=meta.request_id,
                    flow_id=meta.flow_id,
                    priority=meta.priority,
                    prompt_tokens=request.prompt_tokens_estimate,
                    max_tokens=request.admission_max_tokens,
                    model=request.model,
                    options=meta.admit_options,
                )
            )
            check_every = self._config.admission_liveness_check_seconds
            if (on_credit or check_every <= 0 or check_every >= self._config.admission_timeout_seconds
                    or self._flow_control_liveness is None):
                ticket = await call
            else:
                ticket = await self._admission_watched(call, sent_at, check_every)
            answered = not on_credit
            return ticket
        except FlowControlHung as exc:  # no decision and no sign of life: do not wait out the admission timeout
            breaker.timed_out(probe)
            probe = False
            return self._admit_locally(exc)
        except AdmissionTimedOut as exc:  # no decision in time: the client gets 504; say so, and count it
            # Queued past the router's wait by a flow_control that is answering (a band TTL above
            # admission_timeout_seconds, a long queue under saturation) is its job, not a hang: only a
            # flow_control that shows no sign of life opens the breaker (the client's 504 is the same).
            hung = not await self._flow_control_alive(sent_at)
            if hung:
                breaker.timed_out(probe)
            else:
                breaker.busy(probe)
            probe = False
            metrics.record_degraded("flow_control", "timed_out")
            self._degraded_log.warn("flow_control", "action=timed_out status=504 request_id=%s flow=%s model=%s "
                                    "flow_control=%s error=%s", meta.request_id, meta.flow_id, request.model,
                                    "unresponsive" if hung else "answering (queued, not hung)", exc, cause="timed_out")
            raise
        except FlowControlUnreachable as exc:
            return self._admit_locally(exc)
        except errors.KvmeshError:  # flow_control's own answer (a rejection)
            answered = True
            raise
        finally:
            if answered:
                breaker.answered(probe)
            else:
                breaker.failed(probe)

    async def _admission_watched(self, call: Awaitable[Ticket], sent_at: float, check_every: float) -> Ticket:
        """Await the admission ``call``; each ``check_every`` seconds without a decision, ask whether
        flow_control is alive (:meth:`_flow_control_alive`): keep waiting if so (queued), else cancel the call
        (its Enqueue is released on the stream) and raise :class:`FlowControlHung`."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=check_every)
                if done:
                    return task.result()
                if not await self._flow_control_alive(sent_at):
                    waited = self._clock() - sent_at
                    raise FlowControlHung(f"flow_control unresponsive: no admission decision in {waited:.1f}s and "
                                          "no answer to its health check")
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieved)

    async def _flow_control_alive(self, since: float) -> bool:
        """Whether flow_control is responsive after an admission call sent at ``since`` (clock) timed out:
        it answered a call since then and within :data:`LIVENESS_FRESH_SECONDS`, or it answers a
        health check now (one at a time, shared; ``health_check_timeout_seconds``). Without a health
        check (an admission client that has none), only the answers count."""
        breaker = self.breakers["flow_control"]
        if breaker.heard_since(max(since, self._clock() - LIVENESS_FRESH_SECONDS)):
            return True
        if self._flow_control_liveness is None:
            return False
        alive = await self._flow_control_liveness.alive()
        if alive:
            breaker.heard()
        return alive

    def _admit_locally(self, exc: FlowControlUnreachable) -> Ticket:
        """The fail-open path: a local slot while under the cap, else ``exc`` (503)."""
        local = self.local_admission
        if local.try_admit():
            metrics.record_degraded("flow_control", "admitted_locally")
            self._degraded_log.warn("flow_control", "action=admitted_locally in_flight=%d cap=%d error=%s",
                                    local.in_flight, local.max_in_flight, exc)
            return LocalTicket(local)
        metrics.record_degraded("flow_control", "refused")
        self._degraded_log.warn("flow_control", "action=refused in_flight=%d cap=%d error=%s",
                                local.in_flight, local.max_in_flight, exc)
        if not local.fail_open:
            raise exc
        raise FlowControlUnreachable(
            f"{exc}; {local.in_flight} requests already admitted without it (limit {local.max_in_flight})"
        ) from exc

    async def _pick(
        self, request: RouterRequest, meta: RequestMeta, tried: list[str], life: _Lifetime | None = None
    ) -> PickReply:
        """epp's pick; when epp is unreachable, the local least-request pick over the etcd view; a request
        pinned to an endpoint (a stored response's follow-up) goes there only, without epp. ``life``:
        its ``picks_asked`` is set once epp may hold the pick (it answered, the call was abandoned while
        epp had it, or it passed its deadline: :class:`~services.router.degraded.PickerTimedOut`)."""
        if request.pinned_endpoint_id is not None and request.previous_response_id is not None:
            endpoint = pinned_endpoint(request.model, request.previous_response_id, request.pinned_endpoint_id,
                                       self._endpoints(request.model), tried)
            return PickReply((endpoint,), 0, AFFINITY_PROFILE)
        query = PickQuery(
            request_id=meta.epp_request_id,
            model=request.model,
            prompt_token_ids=request.prompt_token_ids,
            prompt=request.prompt_text,
            messages=request.messages,
            exclude_endpoint_ids=tuple(tried),
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            render_json=render_fields_json(request.kind, request.body),
        )
        breaker = self.breakers["epp"]
        route = breaker.admit()
        if route == "skip":  # epp timed out recently (cool-down, or another request probes): do not wait on it
            return self._pick_locally(request, tried, PickerUnreachable(
                "endpoint picker suspect: a recent Pick got no answer in time (breaker open)"))
        probe = route == "probe"
        sent_at = self._clock()
        try:
            reply = await self._picker.pick(query)
        except asyncio.CancelledError:
            breaker.abandoned(probe)
            if life is not None:  # abandoned in flight: epp may have counted it
                life.picks_asked = True
            raise
        except errors.UnknownModel as exc:
            breaker.answered(probe)
            # Validated as served a moment ago: either its endpoints just left (503), or epp has not
            # learnt them yet (a restarted epp before its first etcd sync), when the router's own view
            # still has them: then the degraded mode's local pick serves it, as for an unreachable epp.
            local = self._local_pick(request, tried, exc) if self._config.epp_failure_mode == "open" else None
            if local is not None:
                return local
            raise ModelUnavailable(f"model '{request.model}' has no live endpoint right now ({exc})") from exc
        except PickerUnreachable as exc:
            if isinstance(exc, PickerTimedOut):
                # epp's Pick does not queue: it is hung when no pick at all was answered during this
                # one's wait; a slow pick while others are answered is a busy epp (this request still
                # picks locally, the breaker stays closed)
                if breaker.heard_since(sent_at):
                    breaker.busy(probe)
                else:
                    breaker.timed_out(probe)
            else:
                breaker.failed(probe)
            if life is not None and isinstance(exc, PickerTimedOut):  # epp had it: it may have counted it
                life.picks_asked = True
            return self._pick_locally(request, tried, exc)
        except errors.KvmeshError:  # epp's own answer (no endpoint, bad request)
            breaker.answered(probe)
            raise
        except BaseException:
            breaker.failed(probe)
            raise
        breaker.answered(probe)
        if life is not None:  # epp counts this pick until told how the request ended
            life.picks_asked = True
        return reply

    def _pick_locally(self, request: RouterRequest, tried: list[str], exc: PickerUnreachable) -> PickReply:
        """The degraded pick when epp is unreachable (or its breaker is open): the local least-request
        order, or ``exc`` (503) with ``epp_failure_mode: closed`` or no live endpoint."""
        if self._config.epp_failure_mode != "open":
            metrics.record_degraded("epp", "refused")
            raise exc
        candidates = self.local_picker.order(
            (ep for ep in self._endpoints(request.model) if ep.model == request.model), tried
        )
        if not candidates:
            metrics.record_degraded("epp", "refused")
            self._degraded_log.warn("epp", "action=refused model=%s reason=no live endpoint error=%s", request.model, exc)
            raise exc
        metrics.record_degraded("epp", "picked_locally")
        self._degraded_log.warn("epp", "action=picked_locally model=%s target=%s error=%s",
                                request.model, candidates[0].id, exc)
        return PickReply(tuple(candidates), 0, "router-local-least-request")

    def _local_pick(self, request: RouterRequest, tried: list[str], exc: Exception) -> PickReply | None:
        """The local least-request pick over the router's etcd view; None when that view has no endpoint."""
        candidates = self.local_picker.order(
            (ep for ep in self._endpoints(request.model) if ep.model == request.model), tried
        )
        if not candidates:
            return None
        metrics.record_degraded("epp", "picked_locally")
        self._degraded_log.warn("epp", "action=picked_locally model=%s target=%s reason=epp does not know the model "
                                "error=%s", request.model, candidates[0].id, exc)
        return PickReply(tuple(candidates), 0, "router-local-least-request")

    @contextlib.asynccontextmanager
    async def session(self, request: RouterRequest, meta: RequestMeta) -> AsyncIterator[FlowSession]:
        """Admit the request, pick an endpoint, open the engine response; release it all on exit.

        Yields the open :class:`FlowSession`. How the body ends decides the outcome (module docstring).

        Raises:
            QueueFull | Shed | Saturated | QueueTTLExpired | NotReady: from admission, on entry.
            NoEndpointsAvailable: on entry, nothing to pick or every attempt failed before the first byte.
            InvalidRequest: on entry, epp's token count shows the prompt does not fit the model's context.
        """
        life = _Lifetime(
            request=request,
            meta=meta,
            engine_key_for=self._config.engine_key_for,
            clock=self._clock,
            started=self._clock(),
            span=_tracer.start_span(
                "router.request",
                context=meta.trace_context,
                kind=SpanKind.SERVER if meta.server_span else SpanKind.INTERNAL,
                attributes={"kvmesh.request_id": meta.request_id, "kvmesh.epp_request_id": meta.epp_request_id,
                            "kvmesh.model": request.model, "kvmesh.flow_id": meta.flow_id},
            ),
        )
        metrics.IN_FLIGHT.inc()
        watch: _EngineWatch | None = None
        # set before any pick: a request that ends without an engine's answer still tells epp (NOT_DISPATCHED)
        life.on_completed = getattr(self._picker, "report_completed", None)
        try:
            with trace.use_span(life.span, end_on_exit=False):
                on_credit = self._on_credit(meta)
                early_pick = self._start_early_pick(request, meta, life, on_credit)
                try:
                    life.ticket = await self._admit(request, meta, on_credit)
                except BaseException as exc:
                    if isinstance(exc, errors.KvmeshError):  # rejected: no early picks until one is dispatched at once
                        self._admitting_at_once = False
                    await _discard(early_pick)
                    raise
                metrics.record_stage("admission", self._clock() - life.started)
                early_pick = await self._keep_early_pick(early_pick, life.ticket)
                response, endpoint, life.proxy_span, attempts, watch = await self._connect(request, meta, early_pick,
                                                                                           life.started, life)
            life.span.set_attribute("kvmesh.endpoint", endpoint.id)  # note_start ran when its headers came
            life.on_end = lambda: self.local_picker.note_end(endpoint.id)
            life.session = FlowSession(
                request=request,
                meta=meta,
                endpoint=endpoint,
                status_code=response.status_code,
                content_type=response.content_type,
                attempts=attempts,
                _response=response,
                _clock=self._clock,
                _started=life.started,
                _watch=watch,
            )
            if isinstance(response, _PrimedResponse):
                life.session._first_byte_at = response.primed_at
            yield life.session
        except _CLIENT_GONE as exc:
            if isinstance(exc, asyncio.CancelledError) and exc.args == (SHUTDOWN_MESSAGE,):
                life.shut_down, life.exception = True, exc  # the router's drain, not the client
            else:
                life.client_gone, life.exception = True, exc
            raise
        except BaseException as exc:
            life.exception = exc
            raise
        finally:
            self._unwatch(watch)
            await life.close()

    def _start_early_pick(
        self, request: RouterRequest, meta: RequestMeta, life: _Lifetime | None = None, on_credit: bool = False
    ) -> asyncio.Task[PickReply] | None:
        """The Pick, started beside admission while flow_control has been admitting at once
        (``early_pick``; see :meth:`_keep_early_pick`); None when not speculating, or when the
        admission client holds a credit for the request (admitted without a round trip: the pick
        then runs inline after it, without a task and its two event-loop hand-offs: ``on_credit``,
        :meth:`_on_credit`)."""
        if not self._config.early_pick or not self._admitting_at_once or on_credit:
            return None
        return asyncio.ensure_future(self._timed_pick(request, meta, [], life))

    async def _keep_early_pick(self, task: asyncio.Task[PickReply] | None, ticket: Ticket) -> asyncio.Task[PickReply] | None:
        """Keep the early pick only when the request was not queued (late binding: a request that
        waited in flow_control is picked again, against the pool as it is at dispatch)."""
        queued = float(getattr(ticket, "queue_seconds", 0.0))
        self._admitting_at_once = queued <= self._config.early_pick_max_queue_seconds
        if task is not None and not self._admitting_at_once:
            await _discard(task)
            return None
        return task

    async def _timed_pick(
        self, request: RouterRequest, meta: RequestMeta, tried: list[str], life: _Lifetime | None = None
    ) -> PickReply:
        started = self._clock()
        pick = await self._pick(request, meta, tried, life)
        metrics.record_stage("pick", self._clock() - started)
        return pick

    async def _connect(
        self, request: RouterRequest, meta: RequestMeta, early_pick: asyncio.Task[PickReply] | None = None,
        started: float | None = None, life: _Lifetime | None = None,
    ) -> tuple[EngineResponse, Endpoint, trace.Span, int, _EngineWatch]:
        tried: list[str] = []
        # the last failed attempt: counted (a retry, a stall "redispatched") only once another attempt
        # starts; when none does, a stall is "abandoned" (_gave_up)
        last_error: EngineUnreachable | None = None
        max_attempts = self._config.max_fallback_attempts
        try:
            while len(tried) < max_attempts:
                try:
                    if early_pick is not None:
                        pick, early_pick = await early_pick, None
                    else:
                        pick = await self._timed_pick(request, meta, tried, life)
                except errors.NoEndpointsAvailable:
                    if last_error is None:
                        raise
                    break
                if pick.prompt_tokens and not tried:
                    info = self._catalog().get(request.model)
                    check_context(request.model, info.max_model_len if info else None, pick.prompt_tokens,
                                  request.max_tokens)
                fresh = [ep for ep in pick.candidates if ep.id not in tried]
                if not fresh:
                    break
                for endpoint in fresh:
                    if len(tried) >= max_attempts:
                        break
                    if not tried and started is not None:  # arrival -> first POST: admission and pick as they overlapped
                        metrics.record_stage("pre_dispatch", self._clock() - started)
                    if last_error is not None:  # another attempt starts now: the failed one moved on
                        failed, last_error = last_error, None
                        self._moved_on(failed)
                    tried.append(endpoint.id)
                    watch = self._watch(endpoint, meta.request_id, request.stream)
                    try:
                        response, proxy_span = await self._attempt(request, meta, endpoint, len(tried), watch)
                        watch.first, watch.limit = False, self._config.engine_stream_idle_timeout_seconds
                        return response, endpoint, proxy_span, len(tried), watch
                    except EngineUnreachable as exc:
                        self._unwatch(watch)
                        last_error = exc
                        if exc.refused:  # nothing listens there: not a live endpoint for /health meanwhile
                            self._refused[endpoint.id] = endpoint.url
                        if not isinstance(exc, EngineStall):  # its own message names the engine already
                            last_error = EngineUnreachable(f"engine {endpoint.id} at {endpoint.url} {exc}", exc.refused)
                            last_error.__cause__ = exc.__cause__
                        logger.warning(
                            "engine failed before first byte request_id=%s endpoint=%s attempt=%d error=%s cause=%r",
                            meta.request_id, endpoint.id, len(tried), last_error, exc.__cause__,
                        )
                    except BaseException:
                        self._unwatch(watch)
                        raise
            raise errors.NoEndpointsAvailable(
                f"no endpoint answered for model '{request.model}' after {len(tried)} attempt(s): {str(last_error) or type(last_error).__name__}"
            )
        except BaseException as exc:
            if last_error is not None:
                self._gave_up(last_error, exc)
            raise

    async def _attempt(
        self, request: RouterRequest, meta: RequestMeta, endpoint: Endpoint, attempt: int, watch: _EngineWatch
    ) -> tuple[EngineResponse, trace.Span]:
        """Send to ``endpoint`` and wait for the first byte of a successful answer (the request is bound
        to an engine only once it answers: until then the client has seen nothing and any failure
        moves on), under ``watch``: past ``engine_first_byte_timeout_seconds`` (streamed; a
        non-streamed answer is its first byte: ``request_timeout_seconds``) or once the endpoint left
        membership the engine is judged hung.

        Raises:
            EngineUnreachable: refused, reset or timed out before the first byte (:class:`EngineStall`:
                judged hung); the caller tries the next candidate.
            ShuttingDown: the router is stopping.
        """
        watch.since = _now()
        response: EngineResponse | None = None
        span: trace.Span | None = None
        try:
            response, span = await self._send(request, meta, endpoint, attempt)
            watch.heard()
            if self._refused:
                self._refused.pop(endpoint.id, None)  # it answers again
            # headers arrived: the engine holds the request (queued or in prefill) for the local
            # least-request pick from now on, not only once its first byte comes
            self.local_picker.note_start(endpoint.id)
            if response.status_code >= 400:
                return response, span
            chunks = response.aiter_bytes()
            first, rest = b"", chunks
            try:
                while not first:
                    first = await anext(chunks)
                watch.heard()
            except StopAsyncIteration:
                return _PrimedResponse(response, first, None, self._clock()), span
            return _PrimedResponse(response, first, rest, self._clock()), span
        # Each branch first marks the wait over (``since = None``, before any await): the reaper,
        # endpoints_left or end_all must not end the watch (cancelling the task again) while the
        # abandoned answer closes, or that second cancel would escape as a bare CancelledError.
        except asyncio.CancelledError:
            watch.since = None
            owned = watch.owns_cancel()
            self._abandoned(endpoint, response)
            await _abandon(response, span)
            if not owned:
                raise
            raise watch.unreachable() from None
        except EngineUnreachable:
            watch.since = None
            self._abandoned(endpoint, response)
            await _abandon(response, span)
            raise
        except Exception as exc:  # the answer failed after its headers, before any byte: nothing was passed on
            watch.since = None
            self._abandoned(endpoint, response)
            await _abandon(response, span)
            raise EngineUnreachable("failed before the first byte of its answer") from exc
        finally:
            watch.since = None

    def _abandoned(self, endpoint: Endpoint, response: EngineResponse | None) -> None:
        """An attempt given up after its headers arrived: the local picker's count drops again."""
        if response is not None:
            self.local_picker.note_end(endpoint.id)

    async def _send(
        self, request: RouterRequest, meta: RequestMeta, endpoint: Endpoint, attempt: int
    ) -> tuple[EngineResponse, trace.Span]:
        span = _tracer.start_span(
            "router.proxy",
            kind=SpanKind.CLIENT,
            attributes={
                "http.request.method": "POST",
                "url.full": endpoint.url + request.kind.value,
                "kvmesh.endpoint": endpoint.id,
                "kvmesh.attempt": attempt,
            },
        )
        headers = {
            "content-type": "application/json",
            "accept": _ACCEPT_SSE if request.stream else _ACCEPT_JSON,
            REQUEST_ID_HEADER: meta.request_id,
        }
        dp_rank = data_parallel_rank_of(endpoint.id)
        if dp_rank is not None:  # one rank of a data-parallel server (kvmesh.types.dp_endpoint_id)
            headers[DATA_PARALLEL_RANK_HEADER] = str(dp_rank)
        headers.update(engine_authorization(self._config.engine_key_for(request.model)))
        with trace.use_span(span, end_on_exit=False):
            inject_http_headers(headers)
        sent = self._clock()
        try:
            response = await self._http.post(
                endpoint.url + request.kind.value, _encode_body(request.body),
                [*((k, v) for k, v in meta.forward_headers if k not in headers), *headers.items()],
            )
            metrics.record_stage("engine_headers", self._clock() - sent)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        return response, span


_now = time.monotonic
"""The clock of the hung-engine watch (real time, whatever clock the flow's metrics use)."""


async def _abandon(response: EngineResponse | None, span: trace.Span | None) -> None:
    """Drop an engine answer that will not be used (its connection closed: the engine sees the cancel)."""
    if span is not None:
        span.set_status(Status(StatusCode.ERROR, "abandoned before the first byte"))
        span.end()
    if response is not None:
        with contextlib.suppress(Exception):
            await response.aclose()


async def _discard(task: asyncio.Task[PickReply] | None) -> None:
    """Cancel an early pick that will not be used and wait for it (its error, if any, is dropped)."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])  # the caller's own cancellation still propagates
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


_ACCEPT_SSE = "text/event-stream"
_ACCEPT_JSON = "application/json"
_JSON_ENCODER = msgspec.json.Encoder()


def _encode_body(body: object) -> bytes:
    """The request body as JSON bytes (msgspec; ``json`` for what msgspec cannot hold, e.g. integers
    beyond 64 bits, which the engine then rejects itself)."""
    try:
        return _JSON_ENCODER.encode(body)
    except (msgspec.EncodeError, OverflowError, TypeError):
        return json.dumps(body).encode()


def build_http_client(config: RouterConfig) -> EngineClient:
    """The pooled engine client (``config.engine_http_client``: aiohttp or httpx; see
    :mod:`services.router.engine_client`): pool of ``max_connections`` kept-alive connections,
    connect timeout ``connect_timeout_seconds``, every read bounded by ``request_timeout_seconds``."""
    if config.engine_http_client == "httpx":
        timeout = httpx.Timeout(config.request_timeout_seconds, connect=config.connect_timeout_seconds)
        limits = httpx.Limits(max_connections=config.max_connections,
                              max_keepalive_connections=min(256, config.max_connections))
        return HttpxEngineClient(httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False))
    return AiohttpEngineClient(config.max_connections, config.connect_timeout_seconds, config.request_timeout_seconds)


def build_passthrough_client(config: RouterConfig) -> httpx.AsyncClient:
    """The httpx client of the routes without admission or pick (``/tokenize``, ``/detokenize``)."""
    timeout = httpx.Timeout(config.request_timeout_seconds, connect=config.connect_timeout_seconds)
    return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                             trust_env=False)
