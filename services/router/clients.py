"""gRPC clients of flow_control (the admission stream) and epp (Pick), translated to domain types/errors.

This is the only router module that imports grpc besides the servicer. Both channels are long-lived
and carry no client interceptors (``bench/grpc_hop.py``: the OpenTelemetry interceptor costs a task
and, on the admission stream, a request queue per call); each Admit and Pick puts the W3C trace
context in its metadata itself, so flow_control's and epp's server spans stay children of the
router's request span. Every call has a deadline
from :class:`~services.router.config.RouterConfig`; remote failures become domain errors so the
request flow and both front doors see one vocabulary.

Admission (``FlowControl.Admit``, a bidirectional stream whose life is the request's slot):
``admit()`` opens the stream, sends ``Enqueue`` and waits for the one ``AdmitResponse``;
``DISPATCHED`` returns an :class:`AdmissionTicket`, rejections raise (capacity, TTL expiry, shed,
rate quota, other -> 429 as llm-d; no endpoint for the model -> 503). ``AdmissionTicket.close()`` sends ``Complete`` (when given), half-closes, waits
briefly for flow_control to end the call and then cancels it: either way the slot is released.
On the multiplexed ``AdmitMany`` stream (the default, :class:`_AdmitStream`) a request may instead
be admitted on an admission credit flow_control lent the stream, without a round trip
(``admission_credits``; docs/flow-control.md).

Pick (``EndpointPicker.PickMany``, one long-lived bidirectional stream carrying every pick by id,
batched per write, the ``Completed`` reports riding the same writes (:class:`_PickStream`); or
``EndpointPicker.Pick``, one unary call per pick, with ``pick_transport: unary`` or an epp without
``PickMany``): the prompt (token ids, text or messages) travels only when epp's
configured profiles read it. :class:`PickerClient` asks ``GetPickerInfo`` once and keeps the
answer until the channel to epp leaves READY (epp restarted or unreachable); when epp does not
implement it or the call fails, the prompt is sent (the safe default: behaviour as before).

Remote statuses become domain errors through :data:`kvmesh.errors.REMOTE_ERRORS`, with the
per-call overrides below (what ``UNAVAILABLE`` or ``DEADLINE_EXCEEDED`` means from each peer).
A status the peer *answered* (it carries the ``kvmesh-error-class`` trailer,
:func:`kvmesh.channels.answered`) goes through the table; one it did not (unreachable, reset,
crashed, a bug) becomes :class:`~services.router.degraded.FlowControlUnreachable` /
:class:`~services.router.degraded.PickerUnreachable`, which the request flow's degraded modes handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import errors
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as fc_pb2
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as fc_pb2_grpc
from kvmesh.channels import answered, insecure_channel, to_domain_error, trace_metadata
from kvmesh.types import Endpoint, RequestCompletion
from kvmesh.wire import completion_to_proto, endpoint_from_proto
from services.router import metrics
from services.router.degraded import AdmissionTimedOut, FlowControlUnreachable, PickerTimedOut, PickerUnreachable

logger = logging.getLogger(__name__)


SERVING = "SERVING"


async def check_health(channel: grpc.aio.Channel | None, timeout_seconds: float) -> str:
    """grpc.health.v1 ``Check`` of the whole server (service ``""``) behind ``channel``.

    Returns ``"SERVING"``, another status name (``"NOT_SERVING"``), the gRPC code of a failed
    check (``"UNAVAILABLE"``: down; ``"DEADLINE_EXCEEDED"``: no answer within ``timeout_seconds``,
    e.g. a hung process; ``"UNIMPLEMENTED"``: no health service), or ``"NOT_CONNECTED"``; never raises.
    """
    if channel is None:
        return "NOT_CONNECTED"
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_seconds)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclass(frozen=True, slots=True)
class AdmitOptions:
    """The rest of an ``Enqueue``: body bytes, the request's queue TTL and TTFT objective (seconds,
    0 = none) and its tenant's quotas (0 = unlimited; :mod:`services.router.tenants`)."""

    byte_size: int = 0
    ttl_seconds: float = 0.0
    ttft_slo_seconds: float = 0.0
    max_concurrency: int = 0
    rate_per_second: float = 0.0
    burst: int = 0


@dataclass(frozen=True, slots=True)
class AdmitQuery:
    """What flow_control's ``Admit`` needs to queue a request (sizes in tokens); becomes an ``Enqueue``."""

    request_id: str
    flow_id: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    model: str
    options: AdmitOptions | None = None
    """Body size, TTL, TTFT objective and the tenant's quotas (None: none of them)."""


@dataclass(frozen=True, slots=True)
class CompletionReport:
    """The outcome flow_control hears when a request ends (times in seconds)."""

    prompt_tokens: int
    completion_tokens: int
    ttft_seconds: float
    e2e_seconds: float
    success: bool


_REJECTIONS: dict[int, type[errors.KvmeshError]] = {
    fc_pb2.QUEUE_OUTCOME_REJECTED_CAPACITY: errors.QueueFull,
    fc_pb2.QUEUE_OUTCOME_EVICTED_TTL: errors.AdmissionTTLExpired,  # 429 + Retry-After, as llm-d
    fc_pb2.QUEUE_OUTCOME_SHED: errors.Shed,
    fc_pb2.QUEUE_OUTCOME_REJECTED_RATE_LIMITED: errors.RateLimited,
    fc_pb2.QUEUE_OUTCOME_REJECTED_NO_ENDPOINTS: errors.NoEndpointsAvailable,  # 503: the model has no endpoint
    fc_pb2.QUEUE_OUTCOME_REJECTED_OTHER: errors.Saturated,
}

_ADMIT_STATUS_OVERRIDES: dict[grpc.StatusCode, type[errors.KvmeshError]] = {
    # flow_control down, crashing or cut off: the degraded mode decides (services.router.degraded)
    grpc.StatusCode.UNAVAILABLE: FlowControlUnreachable,
    grpc.StatusCode.UNKNOWN: FlowControlUnreachable,
    grpc.StatusCode.INTERNAL: FlowControlUnreachable,
    grpc.StatusCode.CANCELLED: FlowControlUnreachable,
    grpc.StatusCode.UNIMPLEMENTED: FlowControlUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: AdmissionTimedOut,  # a deadline on Admit is the queue's (504)
}
_EntryT = TypeVar("_EntryT")
_ReplyT = TypeVar("_ReplyT")

_STATUS_WAIT_SECONDS = 1.0
"""How long a stream's failed write waits for its reader to see the call's final status."""

_PICK_STATUS_OVERRIDES: dict[grpc.StatusCode, type[errors.KvmeshError]] = {
    # epp down, crashing or past pick_timeout: the router picks from its own view (services.router.degraded)
    grpc.StatusCode.UNAVAILABLE: PickerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PickerTimedOut,  # epp may have counted it: told how it ended
    grpc.StatusCode.UNKNOWN: PickerUnreachable,
    grpc.StatusCode.INTERNAL: PickerUnreachable,
    grpc.StatusCode.CANCELLED: PickerUnreachable,
    grpc.StatusCode.UNIMPLEMENTED: PickerUnreachable,
}


def _enqueue_options(options: AdmitOptions | None) -> dict[str, Any]:
    if options is None:
        return {}
    return {
        "byte_size": max(0, options.byte_size), "ttl_seconds": max(0.0, options.ttl_seconds),
        "ttft_slo_seconds": max(0.0, options.ttft_slo_seconds), "max_concurrency": max(0, options.max_concurrency),
        "rate_per_second": max(0.0, options.rate_per_second), "burst": max(0, options.burst),
    }


class AdmissionTicket:
    """An admitted request's open stream; ``close()`` releases the slot (idempotent)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, queue_seconds: float, close_timeout_seconds: float) -> None:
        self._call = call
        self.queue_seconds = queue_seconds
        self._close_timeout = close_timeout_seconds
        self._closed = False

    async def close(self, report: CompletionReport | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(self._close_timeout):
                if report is not None:
                    await self._call.write(
                        fc_pb2.AdmitRequest(
                            complete=fc_pb2.Complete(
                                prompt_tokens=max(0, report.prompt_tokens),
                                completion_tokens=max(0, report.completion_tokens),
                                ttft_seconds=report.ttft_seconds,
                                e2e_seconds=report.e2e_seconds,
                                success=report.success,
                            )
                        )
                    )
                await self._call.done_writing()
                while await self._call.read() is not grpc.aio.EOF:
                    pass
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            logger.debug("admission stream close error=%r; cancelling", exc)
        finally:
            self._call.cancel()


class _MuxTicket:
    """An admitted request's slot on the multiplexed stream; ``close()`` sends its Complete (or a
    Release) without waiting for an answer (the stream keeps the order; its end frees every slot)."""

    __slots__ = ("_closed", "_key", "_stream", "queue_seconds")

    def __init__(self, stream: _AdmitStream, key: int, queue_seconds: float) -> None:
        self._stream = stream
        self._key = key
        self.queue_seconds = queue_seconds
        self._closed = False

    async def close(self, report: CompletionReport | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        if report is None:
            self._stream.send(fc_pb2.AdmitEntry(ticket=self._key, release=_RELEASE))
            return
        self._stream.send(fc_pb2.AdmitEntry(ticket=self._key, complete=fc_pb2.Complete(
            prompt_tokens=max(0, report.prompt_tokens), completion_tokens=max(0, report.completion_tokens),
            ttft_seconds=report.ttft_seconds, e2e_seconds=report.e2e_seconds, success=report.success,
        )))


_RELEASE = fc_pb2.Release()


_STREAM_END_LOG_SECONDS = 10.0
"""A stream's end is logged at INFO at most this often per kind of stream (then DEBUG): while a
dependency is down every request opens a new stream and sees it end; the degraded mode's own WARNING
(:class:`~services.router.degraded.DegradedLog`) already says so once per interval."""
_stream_end_logged: dict[str, float] = {}


def _log_stream_end(what: str, exc: BaseException) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        reason = f"{exc.code().name}: {exc.details()}"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    now = time.monotonic()
    quiet = now - _stream_end_logged.get(what, float("-inf")) < _STREAM_END_LOG_SECONDS
    if not quiet:
        _stream_end_logged[what] = now
    logger.log(logging.DEBUG if quiet else logging.INFO, "%s ended (%s); the next request opens a new one", what, reason)


class _MuxCall(Generic[_EntryT, _ReplyT]):
    """One long-lived bidirectional call carrying many requests by id (``FlowControl.AdmitMany``,
    ``EndpointPicker.PickMany``): a writer task (everything queued since its last write, in one batch
    message) and a reader task (replies -> the waiting callers' futures, by id; it yields once after
    each reply, so the callers it resolved go on before it starts the next read).

    When the call ends (the server gone, restarted, or the channel closed) every waiting caller fails
    with the call's error (:attr:`error`, as :meth:`_failure` reads it), sends become no-ops and
    :attr:`broken` is set: the client opens a new call for the next request. A failed write waits
    (at most ``_STATUS_WAIT_SECONDS``) for the reader to see the call's final status: a write after
    the server ended the call fails with a bare "Internal error from Core", while the reader's
    ``AioRpcError`` usually carries the real status (e.g. ``UNIMPLEMENTED`` from an older server).
    Not always: when the send fails just *after* the server's status arrived, grpc-python overwrites
    that status with the bare ``INTERNAL`` for good (measured: ~1% of calls a server ends before
    reading), so a call that ended before answering anything (:attr:`answered` False) cannot tell
    "not implemented" from a failure; the clients then ask once with the unary / per-request RPC.

    Subclasses give the batch to write (:meth:`_take_batch`), what a reply message resolves
    (:meth:`_on_message`), their errors (``_unreachable``, the two messages, ``_call_error``: the RPC's
    status table) and any extra clean-up on failure (:meth:`_on_fail`), and call :meth:`_start` at the
    end of ``__init__``.
    """

    _what = "stream"
    """The call's name in logs."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._pending: dict[int, asyncio.Future[_ReplyT]] = {}
        self._outbox: list[_EntryT] = []
        self._wake = asyncio.Event()
        self.broken = False
        self.error: BaseException | None = None
        self.answered = False
        """Whether the server sent any message on this call (a call that ended before answering anything
        may have failed on its first write with a bare status that hides the server's own)."""

    def _start(self, task_prefix: str) -> None:
        self._writer = asyncio.create_task(self._write(), name=f"{task_prefix}-writer")
        self._reader = asyncio.create_task(self._read(), name=f"{task_prefix}-reader")

    def send(self, entry: _EntryT) -> None:
        if self.broken:
            return
        self._outbox.append(entry)
        self._wake.set()

    def expect(self, key: int) -> asyncio.Future[_ReplyT]:
        """The future of ``key``'s reply (register before sending its entry)."""
        future: asyncio.Future[_ReplyT] = asyncio.get_running_loop().create_future()
        if self.broken:
            future.set_exception(self._failure())
        else:
            self._pending[key] = future
        return future

    def forget(self, key: int) -> None:
        self._pending.pop(key, None)

    def _take_batch(self) -> Any:
        """The message carrying everything queued (and clearing it); None when nothing is queued."""
        raise NotImplementedError

    def _on_message(self, message: Any) -> None:
        """Resolve the futures a reply message answers (:meth:`_resolve`)."""
        raise NotImplementedError

    _unreachable: type[errors.KvmeshError] = errors.KvmeshError
    """The error of a call that ended without a status (EOF, closed by the client)."""
    _ended_message = "the server ended the stream"
    _closed_message = "client closed"

    @staticmethod
    def _call_error(exc: BaseException) -> BaseException:
        """A failed call's error as the caller sees it (the status table of the RPC)."""
        raise NotImplementedError

    def _failure(self) -> BaseException:
        if self.error is not None:
            return self._call_error(self.error)
        return self._unreachable(f"{self._what} closed")

    def _ended(self) -> BaseException:
        """The error of a call the server ended cleanly (EOF)."""
        return self._unreachable(self._ended_message)

    def _closed(self) -> BaseException:
        """The error of waiting callers when the client closes the call."""
        return self._unreachable(self._closed_message)

    def _on_fail(self) -> None:
        """Extra clean-up when the call ends (queued entries are already dropped)."""

    def _resolve(self, key: int, reply: _ReplyT) -> None:
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(reply)

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch = self._take_batch()
                if batch is not None:
                    await self._call.write(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the call ended: its status comes from the reader when it has one
            await asyncio.wait({self._reader}, timeout=_STATUS_WAIT_SECONDS)
            self._fail(exc)

    async def _read(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    self._fail(self._ended())
                    return
                self.answered = True
                self._on_message(message)
                # the callers it resolved resume before the next read starts (a receive op costs tens of
                # µs that would otherwise sit between the reply and the request going on)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.broken:
            return
        self.broken, self.error = True, exc
        self._outbox.clear()
        self._on_fail()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._failure())
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._writer, self._reader):  # the one not ending this call would wait forever
            if task is not current and not task.done():
                task.cancel()
        _log_stream_end(self._what, exc)

    def unimplemented(self) -> bool:
        """Whether the call ended because the server does not implement it (an older server)."""
        return isinstance(self.error, grpc.aio.AioRpcError) and self.error.code() == grpc.StatusCode.UNIMPLEMENTED

    async def close(self) -> None:
        self._fail(self._closed())
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class _AdmitStream(_MuxCall[fc_pb2.AdmitEntry, fc_pb2.AdmitResponse]):
    """One ``FlowControl.AdmitMany`` call (:class:`_MuxCall`): entries -> decisions by ticket; when
    it ends, flow_control released the stream's slots itself.

    Credits (``credits`` > 0): the stream's first entry is a ``CreditRequest``; :attr:`credits`
    counts the admission credits flow_control lent (for band :attr:`credit_priority`), which
    :meth:`spend` takes one at a time; a revoke drops them all and answers with a ``CreditReturn``
    of the count dropped. A flow_control without credits never lends: :attr:`credits` stays 0.
    The Enqueue of a request admitted on a credit is sent with :meth:`send_soon`: it rides the next
    write (a short request's Complete: one write and one flow_control wake-up for both) or is sent
    ``flush_seconds`` later, off the request's path; flow_control counts the credit as a request in
    flight meanwhile, so no limit is loosened (only its per-flow counts lag by that much).
    """

    _what = "admission stream"

    def __init__(self, stub: fc_pb2_grpc.FlowControlStub, credits: int = 0, flush_seconds: float = 0.0) -> None:
        super().__init__(stub.AdmitMany())
        self.credits = 0
        self.credit_priority = 0
        self._flush_seconds = flush_seconds
        self._flush: asyncio.TimerHandle | None = None
        if credits > 0:
            self.send(fc_pb2.AdmitEntry(credit_request=fc_pb2.CreditRequest(max_credits=credits)))
        self._start("router-admit-many")

    def send_soon(self, entry: fc_pb2.AdmitEntry) -> None:
        """Queue ``entry`` for the next write, or a write within ``flush_seconds`` at the latest."""
        if self.broken:
            return
        self._outbox.append(entry)
        if self._flush_seconds <= 0:
            self._wake.set()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._flush_seconds, self._wake.set)

    def spend(self, priority: int) -> bool:
        """Take one credit for a request of band ``priority``; False when none is held for it."""
        if self.credits <= 0 or priority != self.credit_priority or self.broken:
            return False
        self.credits -= 1
        return True

    def _credit_update(self, update: fc_pb2.CreditUpdate) -> None:
        if update.revoke:
            returned, self.credits = self.credits, 0
            self.send(fc_pb2.AdmitEntry(credit_return=fc_pb2.CreditReturn(returned=returned)))
        self.credits += update.grant
        self.credit_priority = update.priority

    def _take_batch(self) -> fc_pb2.AdmitBatch | None:
        if not self._outbox:
            return None
        if self._flush is not None:  # everything queued goes now
            self._flush.cancel()
            self._flush = None
        batch, self._outbox = self._outbox, []
        return fc_pb2.AdmitBatch(entries=batch)

    def _on_message(self, message: fc_pb2.AdmitDecisions) -> None:
        for decision in message.decisions:
            if decision.HasField("error"):  # the entry was refused: that admission fails, the stream goes on
                future = self._pending.pop(decision.ticket, None)
                if future is not None and not future.done():
                    future.set_exception(_admit_entry_error(decision.error))
                continue
            self._resolve(decision.ticket, decision.response)
        if message.HasField("credits"):
            self._credit_update(message.credits)

    _unreachable = FlowControlUnreachable
    _ended_message = "flow_control ended the admission stream"
    _closed_message = "admission client closed"

    @staticmethod
    def _call_error(exc: BaseException) -> BaseException:
        return _admit_error(exc)

    def _on_fail(self) -> None:
        self.credits = 0  # flow_control freed them with the stream
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None


def _admit_error(exc: BaseException) -> BaseException:
    """A failed admission call's error as the request flow sees it (see :meth:`AdmissionClient.admit`)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if answered(exc) and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # flow_control's own answer
            return to_domain_error(exc)
        return to_domain_error(exc, _ADMIT_STATUS_OVERRIDES, remote="flow_control unavailable")
    if isinstance(exc, errors.KvmeshError):
        return exc
    return FlowControlUnreachable(f"flow_control unavailable: admission call failed ({str(exc) or type(exc).__name__})")


def _admit_entry_error(error: fc_pb2.AdmitError) -> errors.KvmeshError:
    """An ``AdmitMany`` entry's ``AdmitError`` as the domain error the unary call's status would
    read as (its class when flow_control named one of the table's, else the status's row)."""
    message = f"rejected by admission: {error.message or error.code}"
    named = errors.error_class_named(error.error_class, error.code) if error.error_class else None
    return named(message) if named is not None else errors.from_grpc_status(error.code, message)


def _decision(reply: fc_pb2.AdmitResponse) -> errors.KvmeshError | None:
    """None for DISPATCHED, else the rejection's domain error."""
    if reply.outcome == fc_pb2.QUEUE_OUTCOME_DISPATCHED:
        return None
    if reply.outcome == fc_pb2.QUEUE_OUTCOME_UNSPECIFIED and reply.reason:  # an older flow_control's AdmitMany: a malformed enqueue
        return errors.InvalidRequest(f"rejected by admission: {reply.reason}")
    error_cls = _REJECTIONS.get(reply.outcome, errors.Saturated)
    message = f"rejected by admission: {reply.reason or fc_pb2.QueueOutcome.Name(reply.outcome)}"
    if issubclass(error_cls, errors.Saturated):
        return error_cls(message, reply.retry_after_seconds)
    return error_cls(message)


def _credit_eligible(request: AdmitQuery) -> bool:
    """Whether a request may be dispatched on an admission credit: one without a tenant quota
    (its concurrency and rate are counted by flow_control's decision alone); the band is checked
    by :meth:`_AdmitStream.spend`."""
    options = request.options
    return options is None or (options.max_concurrency <= 0 and options.rate_per_second <= 0)


class AdmissionClient:
    """Admission over one multiplexed ``FlowControl.AdmitMany`` stream (default), or one
    ``FlowControl.Admit`` stream per request (``multiplexed=False``, or a flow_control without
    ``AdmitMany``).

    ``credits`` > 0 (multiplexed only): ask flow_control to lend the stream up to that many
    admission credits; a request of the credits' band without a tenant quota
    (:func:`_credit_eligible`) is then admitted on one at once, without waiting for a decision
    (its Enqueue still travels, marked ``on_credit``, within ``credit_flush_seconds``: see
    :class:`_AdmitStream`); any other request, or one that finds no credit, waits for the decision
    as before."""

    def __init__(self, address: str, admission_timeout_seconds: float, close_timeout_seconds: float,
                 multiplexed: bool = True, credits: int = 0, credit_flush_seconds: float = 0.0) -> None:
        self._address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: fc_pb2_grpc.FlowControlStub | None = None
        self._timeout = admission_timeout_seconds
        self._close_timeout = close_timeout_seconds
        self._multiplexed = multiplexed
        self._credits = max(0, credits)
        self._credit_flush = max(0.0, credit_flush_seconds)
        self._stream: _AdmitStream | None = None
        self._keys = itertools.count(1)

    def admits_at_once(self, priority: int, options: AdmitOptions | None = None) -> bool:
        """Whether :meth:`admit` would admit a request of band ``priority`` with ``options`` on a
        credit right now (no round trip, no suspension): the request flow then picks after
        admission instead of beside it (nothing to overlap, one task less)."""
        stream = self._stream
        return (stream is not None and not stream.broken and stream.credits > 0
                and priority == stream.credit_priority
                and (options is None or (options.max_concurrency <= 0 and options.rate_per_second <= 0)))

    async def admit(self, request: AdmitQuery) -> AdmissionTicket | _MuxTicket:
        """Enqueue and wait for dispatch (the errors: :meth:`_admit_per_request`)."""
        if self._stub is None:
            raise FlowControlUnreachable("admission client not connected")
        if not self._multiplexed:
            return await self._admit_per_request(request)
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _AdmitStream(self._stub, self._credits, self._credit_flush)
        key = next(self._keys)
        traceparent = tracestate = ""
        for name, value in trace_metadata():
            if name == "traceparent":
                traceparent = value
            elif name == "tracestate":
                tracestate = value
        if _credit_eligible(request) and stream.spend(request.priority):  # admitted now, no round trip
            stream.send_soon(fc_pb2.AdmitEntry(ticket=key, enqueue=_enqueue(request), traceparent=traceparent,
                                               tracestate=tracestate, on_credit=True))
            return _MuxTicket(stream, key, 0.0)
        future = stream.expect(key)
        stream.send(fc_pb2.AdmitEntry(ticket=key, enqueue=_enqueue(request), traceparent=traceparent,
                                      tracestate=tracestate))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):
                reply = await future
        except TimeoutError as exc:
            stream.forget(key)
            stream.send(fc_pb2.AdmitEntry(ticket=key, release=_RELEASE))
            raise AdmissionTimedOut(f"not dispatched within {self._timeout:g}s (flow_control gave no decision)") from exc
        except asyncio.CancelledError:
            stream.forget(key)
            stream.send(fc_pb2.AdmitEntry(ticket=key, release=_RELEASE))
            raise
        except FlowControlUnreachable:
            if stream.unimplemented():  # an older flow_control: one stream per request from here on
                logger.warning("flow_control does not implement AdmitMany; admitting with one stream per request")
                self._multiplexed = False
            elif stream.answered:
                raise
            # A stream that ended before answering anything: an older flow_control whose UNIMPLEMENTED
            # a first write racing the end of the call overwrote with a bare INTERNAL "Internal error
            # from Core" (grpc-python sets it when the send fails, after the server's status: ~1% of
            # such calls, the status lost for good), or a flow_control restarting. This request is
            # admitted on its own Admit stream, whose answer decides (flow_control reads the Enqueue
            # before it answers: no such race); the next request tries the multiplexed stream again.
            # Within what is left of this request's admission timeout (not a second whole one).
            return await self._admit_per_request(request, deadline)
        rejection = _decision(reply)
        if rejection is not None:
            raise rejection
        return _MuxTicket(stream, key, reply.queue_seconds)

    async def _admit_per_request(self, request: AdmitQuery, deadline: float | None = None) -> AdmissionTicket:
        """Enqueue and wait for dispatch, until ``deadline`` (loop time; None: the admission timeout from now).

        Raises:
            QueueFull | Shed | RateLimited | AdmissionTTLExpired | Saturated: flow_control rejected it
                (-> 429 with Retry-After and x-llm-d-request-dropped-reason), with its reason and retry hint.
            NoEndpointsAvailable: flow_control sees no endpoint for the model (-> 503).
            QueueTTLExpired: not dispatched within the router's admission timeout (a hung flow_control; -> 504).
            FlowControlUnreachable: flow_control is unreachable, or the call failed without a
                decision (closed stream, a write to a finished call: "RPC already finished") (-> the
                degraded mode, else 503).
        """
        if self._stub is None:
            raise FlowControlUnreachable("admission client not connected")
        assert self._stub is not None
        call = self._stub.Admit(metadata=trace_metadata())
        admitted = False
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self._timeout
        try:
            async with asyncio.timeout_at(deadline):
                await call.write(fc_pb2.AdmitRequest(enqueue=_enqueue(request)))
                reply = await call.read()
            if reply is grpc.aio.EOF:
                raise FlowControlUnreachable("flow_control closed the admission stream without a decision")
            rejection = _decision(reply)
            if rejection is None:
                admitted = True
                return AdmissionTicket(call, reply.queue_seconds, self._close_timeout)
            raise rejection
        except TimeoutError as exc:
            raise AdmissionTimedOut(f"not dispatched within {self._timeout:g}s (flow_control gave no decision)") from exc
        except grpc.aio.AioRpcError as exc:
            if answered(exc) and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # flow_control's own answer
                raise to_domain_error(exc) from exc
            raise to_domain_error(exc, _ADMIT_STATUS_OVERRIDES, remote="flow_control unavailable") from exc
        except (grpc.aio.UsageError, asyncio.InvalidStateError, grpc.RpcError) as exc:
            # the call ended under us (flow_control died between open and write): no decision. (A
            # send failing after the call ended is an AioRpcError INTERNAL "Internal error from Core",
            # the status the server sent lost: unreachable too, above.)
            raise FlowControlUnreachable(f"flow_control unavailable: admission call failed ({exc})") from exc
        finally:
            if not admitted:
                call.cancel()

    async def connect(self) -> None:
        """Create the channel (inside the running event loop: grpc.aio channels are bound to it);
        long-lived, without client interceptors: each call carries the trace context itself."""
        self._channel = insecure_channel(self._address, client_spans=False)
        self._stub = fc_pb2_grpc.FlowControlStub(self._channel)

    async def health(self, timeout_seconds: float) -> str:
        """flow_control's grpc.health.v1 status name (see :func:`check_health`)."""
        return await check_health(self._channel, timeout_seconds)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()


def _enqueue(request: AdmitQuery) -> fc_pb2.Enqueue:
    return fc_pb2.Enqueue(
        request_id=request.request_id,
        flow_id=request.flow_id,
        priority=request.priority,
        prompt_tokens=max(0, request.prompt_tokens),
        max_tokens=max(0, request.max_tokens),
        model=request.model,
        **_enqueue_options(request.options),
    )


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """``PickRequest.prompt_token_ids_packed``: each id as a little-endian uint32 (4 bytes per id).

    Raises: OverflowError for an id outside uint32 (the router's validation refuses those first)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # a platform whose C unsigned int is not 32 bits
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True, slots=True)
class PickQuery:
    """The prompt as the engine will see it, plus endpoints to leave out; becomes a ``PickRequest``."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    exclude_endpoint_ids: tuple[str, ...] = ()
    lora_name: str | None = None
    cache_salt: str | None = None
    render_json: bytes = b""
    """The body's token-changing fields (``validation.render_fields_json``), sent with the prompt."""


def pick_request(query: PickQuery, *, with_prompt: bool, packed: bool, max_endpoints: int) -> epp_pb2.PickRequest:
    """The router's ``PickRequest`` for ``query``: the prompt only ``with_prompt`` (epp reads it), its
    token ids ``packed`` (``prompt_token_ids_packed``) or repeated, at most ``max_endpoints`` endpoints
    asked for (0: all) and no breakdown (the router reads none)."""
    request = epp_pb2.PickRequest(
        request_id=query.request_id,
        model=query.model,
        exclude_endpoint_ids=query.exclude_endpoint_ids,
        lora_name=query.lora_name or "",
        cache_salt=query.cache_salt or "",
        max_endpoints=max_endpoints,
        omit_breakdown=True,
    )
    if with_prompt:
        if packed and query.prompt_token_ids:
            request.prompt_token_ids_packed = pack_token_ids(query.prompt_token_ids)
        else:
            request.prompt_token_ids.extend(query.prompt_token_ids)
        request.prompt = query.prompt
        request.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in query.messages)
        request.render_json = query.render_json
    return request


@dataclass(frozen=True, slots=True)
class PickReply:
    """epp's ``PickResponse`` as the router uses it: the target first, then fallbacks;
    ``prompt_tokens`` 0 when epp did not tokenize. (epp's own names: ``PickDecision`` from its
    scheduler, ``PickerResult`` from a picker plugin.)"""

    candidates: tuple[Endpoint, ...]
    prompt_tokens: int
    profile: str


_ENDPOINT_CACHE_MAX = 1024
"""Converted endpoints a :class:`PickerClient` keeps (a pool's endpoints; cleared when full)."""
COMPLETED_QUEUE_MAX = 10_000
"""Completions the router keeps for epp while a call is in flight; more are dropped (counted)."""
COMPLETED_BATCH_MAX = 512
"""Completions per ``Completed`` call."""


class _PickStream(_MuxCall[epp_pb2.PickEntry, epp_pb2.PickResult]):
    """One ``EndpointPicker.PickMany`` call (:class:`_MuxCall`): entries and completions -> results
    by id; when it ends, the completions still queued are dropped (counted)."""

    _what = "pick stream"

    def __init__(self, stub: epp_pb2_grpc.EndpointPickerStub, completed_flush_seconds: float = 0.0) -> None:
        super().__init__(stub.PickMany())
        self._completed: list[epp_pb2.CompletedRequest] = []
        self._flush_seconds = completed_flush_seconds
        self._flush: asyncio.TimerHandle | None = None
        self._start("router-pick-many")

    def send_completed(self, completed: list[epp_pb2.CompletedRequest]) -> bool:
        """Queue completions for the next write (a pick's), or a write within ``completed_flush_seconds``
        at the latest (0: at once); False (nothing queued) when the stream is broken."""
        if self.broken:
            return False
        self._completed.extend(completed)
        if self._flush_seconds <= 0:
            self._wake.set()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._flush_seconds, self._wake.set)
        return True

    def _take_batch(self) -> epp_pb2.PickBatch | None:
        if not self._outbox and not self._completed:
            return None
        if self._flush is not None:  # everything queued goes now
            self._flush.cancel()
            self._flush = None
        entries, self._outbox = self._outbox, []
        completed, self._completed = self._completed, []
        return epp_pb2.PickBatch(entries=entries, completed=completed)

    def _on_message(self, message: epp_pb2.PickResults) -> None:
        for result in message.results:
            self._resolve(result.id, result)

    _unreachable = PickerUnreachable
    _ended_message = "endpoint picker ended the pick stream"
    _closed_message = "picker client closed"

    @staticmethod
    def _call_error(exc: BaseException) -> BaseException:
        return _pick_call_error(exc)

    def _on_fail(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._completed:
            metrics.EPP_COMPLETIONS_DROPPED.labels("unreachable").inc(len(self._completed))
            self._completed.clear()


def _pick_call_error(exc: BaseException) -> BaseException:
    """A failed Pick call's (or pick stream's) error as the request flow sees it (see :meth:`PickerClient.pick`)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if answered(exc):  # epp's own answer (UNAVAILABLE: no endpoint) goes through the table
            return to_domain_error(exc)
        return to_domain_error(exc, _PICK_STATUS_OVERRIDES, remote="endpoint picker")
    if isinstance(exc, errors.KvmeshError):
        return exc
    return PickerUnreachable(f"endpoint picker: call failed ({str(exc) or type(exc).__name__})")


def _entry_error(error: epp_pb2.PickError) -> errors.KvmeshError:
    """A ``PickMany`` entry's error as the unary call's status would read (:func:`_pick_call_error`):
    with a class name epp answered it (the ``kvmesh-error-class`` trailer's rule), without one the
    call failed (a bug in epp, its deadline): :data:`_PICK_STATUS_OVERRIDES` first."""
    message = error.message or error.code
    if error.error_class:
        named = errors.error_class_named(error.error_class, error.code)
        return named(message) if named is not None else errors.from_grpc_status(error.code, message)
    code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)
    override = _PICK_STATUS_OVERRIDES.get(code)
    if override is not None:
        return override(f"endpoint picker: {message}")
    return errors.from_grpc_status(error.code, message)


class PickerClient:
    """Asks epp for picks, sending the prompt only when epp's profiles read it: over one
    multiplexed ``EndpointPicker.PickMany`` stream (default), or one unary ``Pick`` per request
    (``multiplexed=False``, or an epp without ``PickMany``: asked again after epp reconnects).

    Each ``PickRequest`` asks for only what the router uses: no per-candidate breakdown
    (``omit_breakdown``), at most ``max_endpoints`` endpoints, the target included (``max_endpoints``:
    endpoints tried per pick, the router's ``max_fallback_attempts``; 0: all), and the token ids packed
    (``prompt_token_ids_packed``, little-endian uint32) when epp's ``PickerInfo.packed_token_ids``
    says it reads them, else the repeated ``prompt_token_ids`` (an older epp). ``Completed`` reports
    ride the stream's next write (the next pick's) or go within ``completed_flush_seconds`` (0: at
    once; :class:`_PickStream`)."""

    def __init__(self, address: str, timeout_seconds: float, multiplexed: bool = True,
                 max_endpoints: int = 0, completed_flush_seconds: float = 0.0) -> None:
        if max_endpoints < 0:
            raise ValueError(f"max_endpoints must be >= 0, got {max_endpoints}")
        self._completed_flush = max(0.0, completed_flush_seconds)
        self._max_endpoints = max_endpoints
        self._packed = False  # epp reads prompt_token_ids_packed (PickerInfo.packed_token_ids)
        self._address = address
        self._multiplexed_wanted = multiplexed
        self._multiplexed = multiplexed
        self._stream: _PickStream | None = None
        self._keys = itertools.count(1)
        self._channel: grpc.aio.Channel | None = None
        self._stub: epp_pb2_grpc.EndpointPickerStub | None = None
        self._timeout = timeout_seconds
        self._needs_prompt: bool | None = None  # None: not known (never asked, or forgotten)
        self._info_generation = 0  # bumped whenever the answer is forgotten; a stale answer is dropped
        self._watch_task: asyncio.Task[None] | None = None
        self._asking: asyncio.Future[bool] | None = None  # the GetPickerInfo call in flight, shared
        self._completed: list[RequestCompletion] = []  # ended requests not yet told to epp (bounded)
        self._completed_ready = asyncio.Event()
        self._completed_task: asyncio.Task[None] | None = None
        self._endpoints: dict[bytes, Endpoint] = {}  # a PickResponse's Endpoint by its bytes (_endpoint)

    async def connect(self) -> None:
        """Create the channel (inside the running event loop; long-lived, no client interceptors:
        each Pick carries the trace context itself) and watch its connectivity."""
        self._channel = insecure_channel(self._address, client_spans=False)
        self._stub = epp_pb2_grpc.EndpointPickerStub(self._channel)
        self._watch_task = asyncio.create_task(self._forget_on_reconnect(self._channel), name="router-epp-watch")
        self._completed_task = asyncio.create_task(self._send_completed(), name="router-epp-completed")

    def report_completed(self, completion: RequestCompletion) -> None:
        """Tell epp a request ended (fire-and-forget, never blocks nor raises): queued and sent in
        batches by one background task (``Completed``). Past ``COMPLETED_QUEUE_MAX`` queued, or
        when the call fails (epp unreachable, old epp without the RPC), the completions are dropped
        and counted in ``kvmesh_router_epp_completions_dropped_total{reason}``: epp then frees that
        load at its next metrics scrape or the picks' TTL, as before."""
        if len(self._completed) >= COMPLETED_QUEUE_MAX:
            metrics.EPP_COMPLETIONS_DROPPED.labels("queue_full").inc()
            return
        self._completed.append(completion)
        self._completed_ready.set()

    async def _send_completed(self) -> None:
        while True:
            await self._completed_ready.wait()
            self._completed_ready.clear()
            batch, self._completed = self._completed[:COMPLETED_BATCH_MAX], self._completed[COMPLETED_BATCH_MAX:]
            if self._completed:
                self._completed_ready.set()
            if not batch or self._stub is None:
                continue
            stream = self._stream
            if self._multiplexed and stream is not None and stream.send_completed(
                    [completion_to_proto(c) for c in batch]):
                continue  # rides the pick stream's next write
            try:
                await self._stub.Completed(
                    epp_pb2.CompletedBatch(requests=[completion_to_proto(c) for c in batch]), timeout=self._timeout)
            except Exception as exc:  # epp unreachable, past the deadline, or without the RPC
                metrics.EPP_COMPLETIONS_DROPPED.labels("unreachable").inc(len(batch))
                logger.debug("epp Completed failed (%d dropped): %s", len(batch), exc)

    async def health(self, timeout_seconds: float) -> str:
        """epp's grpc.health.v1 status name (see :func:`check_health`)."""
        return await check_health(self._channel, timeout_seconds)

    def forget_picker_info(self) -> None:
        """Drop the cached ``GetPickerInfo`` answer: the next pick asks again."""
        self._needs_prompt = None
        self._packed = False
        self._info_generation += 1

    async def _forget_on_reconnect(self, channel: grpc.aio.Channel) -> None:
        """Forget the picker info each time the channel leaves READY (epp restarted or went away):
        the epp that answers next may run another configuration."""
        try:
            state = channel.get_state(try_to_connect=False)
            while True:
                await channel.wait_for_state_change(state)
                if state is grpc.ChannelConnectivity.READY:
                    self.forget_picker_info()
                    self._multiplexed = self._multiplexed_wanted  # the epp that answers next may have PickMany
                state = channel.get_state(try_to_connect=False)
        except Exception:  # e.g. a closed channel: the cached answer is kept from here on
            logger.warning("epp connectivity watch ended", exc_info=True)

    async def needs_prompt(self, timeout_seconds: float | None = None) -> bool:
        """Whether epp's configured profiles read the prompt (``GetPickerInfo.needs_prompt``).

        Asked once and cached (see :meth:`forget_picker_info`); concurrent callers share one call.
        Never raises: an epp without the RPC (``UNIMPLEMENTED``, cached) or a failed call (not
        cached, asked again next time) means True, so the prompt is sent as before.
        """
        if self._needs_prompt is not None:
            return self._needs_prompt
        if self._stub is None:
            return True
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(
                self._ask(self._stub, self._timeout if timeout_seconds is None else timeout_seconds)
            )
        return await asyncio.shield(self._asking)  # one caller cancelled does not cancel the others' answer

    async def _ask(self, stub: epp_pb2_grpc.EndpointPickerStub, timeout_seconds: float) -> bool:
        generation = self._info_generation
        try:
            info = await stub.GetPickerInfo(epp_pb2.GetPickerInfoRequest(), timeout=timeout_seconds)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and generation == self._info_generation:
                self._needs_prompt = True
            logger.debug("epp GetPickerInfo failed code=%s; sending the prompt", exc.code().name)
            return True
        if generation == self._info_generation:
            self._needs_prompt = info.needs_prompt
            self._packed = info.packed_token_ids
            logger.info("epp picker info needs_prompt=%s profiles=%s packed_token_ids=%s", info.needs_prompt,
                        list(info.profiles), info.packed_token_ids)
        return info.needs_prompt

    async def pick(self, query: PickQuery) -> PickReply:
        """Ask epp where to send the request (within ``timeout_seconds`` in all, the info call included).

        Raises:
            NoEndpointsAvailable: epp has no candidate (-> 503).
            PickerUnreachable: epp is unreachable, failed, or did not answer in time (-> the
                degraded mode's local pick, else 503).
            UnknownModel: epp serves no such model (-> 404).
            NotReady: :meth:`connect` has not run.
        """
        if self._stub is None:
            raise errors.NotReady("picker client not connected")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        with_prompt = await self.needs_prompt(self._timeout)
        request = pick_request(query, with_prompt=with_prompt, packed=self._packed, max_endpoints=self._max_endpoints)
        remaining = deadline - loop.time()
        if remaining <= 0:  # the info call used the whole budget: epp hangs
            raise PickerUnreachable("endpoint picker: Deadline Exceeded")
        if self._multiplexed:
            reply = await self._pick_on_stream(request, remaining, deadline)
        else:
            reply = await self._pick_unary(request, remaining)
        candidates = [self._endpoint(reply.target)] if reply.HasField("target") and reply.target.url else []
        candidates += [self._endpoint(ep) for ep in reply.fallbacks if ep.url]
        if not candidates:
            raise errors.NoEndpointsAvailable(f"no endpoint available for model '{query.model}'")
        return PickReply(tuple(candidates), reply.prompt_tokens, reply.profile)

    def _endpoint(self, message: common_pb2.Endpoint) -> Endpoint:
        """:func:`~kvmesh.wire.endpoint_from_proto` of ``message``, kept by its bytes: a pool's few
        endpoints come back in every pick (the conversion, ~15-30 µs, is a dict lookup after the first;
        :class:`~kvmesh.types.Endpoint` is frozen). At most ``_ENDPOINT_CACHE_MAX`` kept, then started over."""
        key = message.SerializeToString(deterministic=True)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if len(self._endpoints) >= _ENDPOINT_CACHE_MAX:
                self._endpoints.clear()
            endpoint = self._endpoints[key] = endpoint_from_proto(message)
        return endpoint

    async def _pick_unary(self, request: epp_pb2.PickRequest, timeout_seconds: float) -> epp_pb2.PickResponse:
        """One ``Pick`` call (the errors: :meth:`pick`)."""
        assert self._stub is not None
        try:
            return await self._stub.Pick(request, timeout=timeout_seconds, metadata=trace_metadata())
        except grpc.aio.AioRpcError as exc:
            raise _pick_call_error(exc) from exc
        except (grpc.aio.UsageError, grpc.RpcError) as exc:
            raise PickerUnreachable(f"endpoint picker: call failed ({exc})") from exc

    async def _pick_on_stream(self, request: epp_pb2.PickRequest, timeout_seconds: float,
                              deadline: float) -> epp_pb2.PickResponse:
        """One entry on the ``PickMany`` stream, opened on first use and after it ends (the errors:
        :meth:`pick`; the entry's error reads as the unary status would, :func:`_entry_error`).
        An epp without ``PickMany`` answers the first entry ``UNIMPLEMENTED``: that pick and the
        next ones go unary until the channel reconnects."""
        assert self._stub is not None
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _PickStream(self._stub, self._completed_flush)
        key = next(self._keys)
        future = stream.expect(key)
        traceparent = tracestate = ""
        for name, value in trace_metadata():
            if name == "traceparent":
                traceparent = value
            elif name == "tracestate":
                tracestate = value
        stream.send(epp_pb2.PickEntry(id=key, request=request, traceparent=traceparent, tracestate=tracestate,
                                      timeout_seconds=timeout_seconds))
        try:
            async with asyncio.timeout(timeout_seconds):
                result = await future
        except TimeoutError as exc:
            stream.forget(key)
            stream.send(epp_pb2.PickEntry(id=key, cancel=True))
            raise PickerTimedOut("endpoint picker: Deadline Exceeded") from exc
        except asyncio.CancelledError:
            stream.forget(key)
            stream.send(epp_pb2.PickEntry(id=key, cancel=True))
            raise
        except PickerUnreachable:
            if stream.unimplemented():
                logger.warning("epp does not implement PickMany; picking with one unary call per request")
                self._multiplexed = False
            elif stream.answered:
                raise
            # A stream that ended before answering anything (an older epp whose UNIMPLEMENTED a failed
            # first write hid behind a bare INTERNAL, or an epp restarting): this pick goes unary, which
            # any epp serves, within what is left of its deadline; the next pick tries the stream again.
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise
            return await self._pick_unary(request, remaining)
        if result.HasField("error"):
            raise _entry_error(result.error)
        return result.response

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        for task in (self._watch_task, self._asking, self._completed_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watch_task = self._asking = self._completed_task = None
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
