"""gRPC EndpointPicker servicer: protobuf in, :class:`Scheduler` call, protobuf out. Nothing clever.

Endpoints go out through :func:`kvmesh.wire.endpoint_to_proto`, the one translator. Domain errors
propagate to the shared interceptor, which maps them (InvalidRequest -> INVALID_ARGUMENT,
UnknownModel -> NOT_FOUND, NoEndpointsAvailable -> UNAVAILABLE, anything else -> INTERNAL).

``PickMany`` carries every Pick of one client (the router) on one long-lived bidirectional stream
(:class:`_PickSession`; issue 10, as flow_control's ``AdmitMany``): each entry is the same
:meth:`Scheduler.pick` call as ``Pick``, answered by the client's id; a failed entry gets the status
and error class the unary call would have answered (:func:`kvmesh.interceptors.translate`, the same
table), in a ``PickError`` for that entry alone, and the stream goes on. ``Completed`` reports may
ride the stream's batches.

A ``PickRequest`` may carry its token ids packed (``prompt_token_ids_packed``: little-endian
uint32 bytes, handed to the scheduler as :class:`~kvmesh.prefix_index.PackedTokenIds` without
decoding) and ask for a lean response (``max_endpoints``, ``omit_breakdown``): the router sends all
three; ``PickerInfo.packed_token_ids`` tells callers this epp reads the packed form.

Request ids: epp counts a pick's load (its pending and unprefilled counts, its active prompt tokens)
under ``PickRequest.request_id`` until the ``CompletedRequest`` with that id frees it. The proto makes
the id optional (grpcurl, a GIE-style client), so a pick without one is counted under an id epp makes
unique (:func:`pick_id`: the call's ``x-request-id``, ``~``, a suffix unique to this process, as
:func:`kvmesh.types.pick_request_id` builds the router's), never under ``""`` shared by every such
client; a unary ``Pick`` returns the made-up id in the trailing metadata ``kvmesh-pick-request-id``
(the id a ``Completed`` for it names), a ``PickMany`` entry cannot (its load is then released by the
engines' scrapes and TTLs). A ``CompletedRequest`` without a ``request_id`` frees nothing and is refused
(``Completed``: ``INVALID_ARGUMENT`` naming the entry, nothing of the batch applied; riding a
``PickMany`` batch, which answers nothing for completions: skipped, counted unmatched, logged). An id
longer than :data:`MAX_REQUEST_ID_CHARS` is ``INVALID_ARGUMENT`` in both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc
import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.chat_messages import chat_messages, chat_role
from kvmesh.errors import InvalidRequest, mapping_for
from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.interceptors import current_request_id, translate
from kvmesh.prefix_index import PackedTokenIds
from kvmesh.streams import stop_stream_writer
from kvmesh.types import CompletionOutcome, pick_request_id
from kvmesh.wire import completion_from_proto, endpoint_to_proto
from services.epp.framework.interfaces import ChatMessage, SchedulingRequest
from services.epp.metrics import record_completions
from services.epp.scheduler import PickDecision, Scheduler

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.epp")

SERVICE_NAME = epp_pb2.DESCRIPTOR.services_by_name["EndpointPicker"].full_name
"""The full gRPC service name (``kvmesh.epp.v1.EndpointPicker``): health checks and reflection use it."""


def _render_fields(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        fields = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"render_json is not JSON: {exc}") from exc
    except RecursionError:  # msgspec recurses per nesting level (the router caps its bodies at 64)
        raise InvalidRequest("render_json is nested too deeply") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("render_json must be a JSON object")
    return fields


_LITTLE_ENDIAN = sys.byteorder == "little"


def _token_ids(request: epp_pb2.PickRequest) -> Sequence[int]:
    """The prompt's token ids: ``prompt_token_ids_packed`` (little-endian uint32, 4 bytes per id) as a
    :class:`~kvmesh.prefix_index.PackedTokenIds` over the message's bytes (no per-id decoding; the
    prefix-match step hashes straight from them), else the repeated ``prompt_token_ids``.

    Raises: InvalidRequest when both are set or the packed length is not a multiple of 4."""
    packed = request.prompt_token_ids_packed
    if not packed:
        return tuple(request.prompt_token_ids)
    if len(request.prompt_token_ids):
        raise InvalidRequest("set prompt_token_ids or prompt_token_ids_packed, not both")
    if len(packed) % 4:
        raise InvalidRequest(
            f"prompt_token_ids_packed is {len(packed)} bytes: not a whole number of little-endian uint32 ids "
            "(4 bytes each)")
    if _LITTLE_ENDIAN:
        return PackedTokenIds(packed)
    return struct.unpack(f"<{len(packed) // 4}I", packed)


PROMPT_FORMS = ("prompt", "prompt_token_ids", "messages")
"""The prompt's forms (the router's ``CompletionRequest`` has the same three): at most one per request."""


def _check_prompt_forms(request: epp_pb2.PickRequest) -> None:
    """Raises InvalidRequest when more than one of ``prompt``, ``prompt_token_ids`` (repeated or
    packed) and ``messages`` is set: the router's ``Complete`` refuses the same mix with the same
    words. None at all is accepted (``PickerInfo.needs_prompt`` false: the caller may leave them out)."""
    present = (bool(request.prompt), bool(request.prompt_token_ids) or bool(request.prompt_token_ids_packed),
               bool(request.messages))
    if sum(present) > 1:
        named = " and ".join(f"'{name}'" for name, set_ in zip(PROMPT_FORMS, present, strict=True) if set_)
        raise InvalidRequest(f"at most one of 'prompt', 'prompt_token_ids', 'messages' may be set (got {named})")


def check_timeout_seconds(value: float) -> float:
    """A ``PickEntry.timeout_seconds`` as read: 0 means no deadline.

    Raises: InvalidRequest for a negative or non-finite value (a unary ``Pick``'s gRPC deadline
    cannot be either)."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"'timeout_seconds' must be a finite number >= 0 (0: no deadline), got {value}")
    return value


MAX_REQUEST_ID_CHARS = 1024
"""Longest ``PickRequest.request_id`` / ``CompletedRequest.request_id`` accepted: the router's ids are its
client's ``x-request-id`` (at most 256 characters) plus a ~20-character suffix; epp keeps up to 65,536
in-flight ids, so an unbounded one is memory a caller could fill."""

PICK_REQUEST_ID_TRAILER = "kvmesh-pick-request-id"
"""Trailing-metadata key of a unary ``Pick`` that came without a ``request_id``: the id epp counted it
under (:func:`pick_id`), for the ``CompletedRequest`` that frees its load."""


def _check_request_id(request_id: str, field: str) -> None:
    """Raises InvalidRequest when ``request_id`` is longer than :data:`MAX_REQUEST_ID_CHARS`."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"'{field}' is {len(request_id)} characters: at most {MAX_REQUEST_ID_CHARS}")


def pick_id(request_id: str) -> str:
    """The id a pick is counted under: ``request_id`` as sent, or for ``""`` one unique to this pick
    (the call's ``x-request-id`` or the interceptor's id for it, ``~``, a process-unique suffix:
    :func:`kvmesh.types.pick_request_id`), so id-less picks of different clients never share one.

    Raises: InvalidRequest for an id longer than :data:`MAX_REQUEST_ID_CHARS`."""
    if not request_id:
        return pick_request_id(current_request_id() or "pick")
    _check_request_id(request_id, "request_id")
    return request_id


def check_completion(message: epp_pb2.CompletedRequest, field: str) -> None:
    """Raises InvalidRequest when ``message`` (named ``field`` in the error, e.g. ``requests[2]``) has no
    ``request_id`` (it names the ``PickRequest.request_id`` it ends: without one it frees nothing) or
    one longer than :data:`MAX_REQUEST_ID_CHARS`."""
    if not message.request_id:
        raise InvalidRequest(
            f"'{field}.request_id' is empty: a completion names the PickRequest.request_id it ends "
            "(a Pick sent without one answers the id epp gave it in the trailer " + PICK_REQUEST_ID_TRAILER + ")")
    _check_request_id(message.request_id, f"{field}.request_id")


_NO_IDS: frozenset[str] = frozenset()


def _messages(request: epp_pb2.PickRequest, render: dict[str, Any]) -> tuple[ChatMessage, ...]:
    """``messages`` checked by the router's own rule (:mod:`kvmesh.chat_messages`): each role, and
    the verbatim ``render_json.messages`` (rich content parts) whole. Raises: InvalidRequest."""
    if "messages" in render:
        chat_messages(render["messages"])
    if not request.messages:
        return ()
    return tuple(ChatMessage(chat_role(m.role, f"messages[{i}]"), m.content) for i, m in enumerate(request.messages))


def request_from_proto(request: epp_pb2.PickRequest) -> SchedulingRequest:
    """The scheduler's request; its ``request_id`` is :func:`pick_id`'s (an empty one made unique).

    Raises: InvalidRequest when ``request_id`` is over :data:`MAX_REQUEST_ID_CHARS`, ``render_json``
    is not a JSON object, more than one prompt form is set (:func:`_check_prompt_forms`), the token
    ids are malformed (both forms set, a packed length not a multiple of 4), or a chat message breaks
    the router's rule (a role that is not a non-empty string: any such role is taken, as vLLM 0.32
    takes it; malformed content parts: :func:`_messages`, :mod:`kvmesh.chat_messages`), with the
    router's words."""
    request_id = pick_id(request.request_id)
    _check_prompt_forms(request)
    render = _render_fields(request.render_json)
    return SchedulingRequest(
        model=request.model,
        request_id=request_id,
        token_ids=_token_ids(request),
        prompt=request.prompt,
        messages=_messages(request, render),
        exclude_endpoint_ids=frozenset(request.exclude_endpoint_ids) if request.exclude_endpoint_ids else _NO_IDS,
        scope=KeyScope(request.lora_name or None, request.cache_salt or None)
        if request.lora_name or request.cache_salt else DEFAULT_SCOPE,
        render=render,
    )


class EndpointPickerServicer(epp_pb2_grpc.EndpointPickerServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def Pick(self, request: epp_pb2.PickRequest, context: grpc.aio.ServicerContext) -> epp_pb2.PickResponse:
        """One pick (:meth:`Scheduler.pick`). A request without ``request_id`` is counted under
        :func:`pick_id`'s id, returned in the trailer ``kvmesh-pick-request-id``."""
        scheduling = request_from_proto(request)
        decision = await self._scheduler.pick(scheduling)
        _annotate_pick(scheduling, decision)
        if not request.request_id:
            context.set_trailing_metadata(((PICK_REQUEST_ID_TRAILER, scheduling.request_id),))
        return response_to_proto(decision, request)

    async def PickMany(
        self, request_iterator: AsyncIterator[epp_pb2.PickBatch], context: grpc.aio.ServicerContext
    ) -> None:
        """Every Pick of one client on one stream (see :class:`_PickSession`). The client's
        half-close means "no more entries": the picks in flight are answered first (at most
        ``_DRAIN_SECONDS``); a cancelled or broken call stops them at once."""
        session = _PickSession(self._scheduler, context)
        try:
            async for batch in request_iterator:
                if batch.completed:
                    self._note_completed(batch.completed)
                for entry in batch.entries:
                    session.handle(entry)
            await session.drain()
        finally:
            await session.close()

    def _note_completed(self, requests: Iterable[epp_pb2.CompletedRequest]) -> int:
        """Free each ended request's pick load in the datastore at once (no I/O); returns how many matched.

        A ``PickMany`` batch's completions (nothing is answered for them): one that
        :func:`check_completion` refuses is skipped (counted unmatched, one warning per batch)."""
        datastore = self._scheduler.datastore
        matched = total = 0
        refused: list[str] = []
        for i, message in enumerate(requests):
            try:
                check_completion(message, f"completed[{i}]")
            except InvalidRequest as exc:
                refused.append(str(exc))
                total += 1
                continue
            done = completion_from_proto(message)
            matched += datastore.note_completed(
                done.request_id, done.endpoint_id, dispatched=done.outcome is not CompletionOutcome.NOT_DISPATCHED,
                output_tokens=done.completion_tokens if done.outcome is CompletionOutcome.SUCCESS else 0)
            total += 1
        record_completions(matched, total - matched)
        if refused:
            logger.warning("completions skipped (they free nothing) count=%d first=%s", len(refused), refused[0])
        return matched

    async def ListEndpoints(
        self, request: epp_pb2.ListEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> epp_pb2.ListEndpointsResponse:
        return epp_pb2.ListEndpointsResponse(
            endpoints=[
                epp_pb2.EndpointState(
                    endpoint=endpoint_to_proto(c.endpoint),
                    num_requests_waiting=c.metrics.num_requests_waiting,
                    num_requests_running=c.metrics.num_requests_running,
                    kv_cache_usage_perc=c.metrics.kv_cache_usage_perc,
                    metrics_age_seconds=-1.0 if c.metrics.age_seconds is None else c.metrics.age_seconds,
                )
                for c in self._scheduler.datastore.candidates()
            ]
        )

    async def Completed(
        self, request: epp_pb2.CompletedBatch, context: grpc.aio.ServicerContext
    ) -> epp_pb2.CompletedReply:
        """The router's completions: each frees its pick's load in the datastore at once (no I/O).

        Raises: InvalidRequest (nothing of the batch applied) when an entry has no ``request_id`` or
        one over :data:`MAX_REQUEST_ID_CHARS` (:func:`check_completion`, the entry named
        ``requests[i]``)."""
        for i, message in enumerate(request.requests):
            check_completion(message, f"requests[{i}]")
        return epp_pb2.CompletedReply(matched=self._note_completed(request.requests))

    async def GetPickerInfo(
        self, request: epp_pb2.GetPickerInfoRequest, context: grpc.aio.ServicerContext
    ) -> epp_pb2.PickerInfo:
        """Whether the configured profile reads the prompt, and the profile names (fixed for the process)."""
        profile = self._scheduler.profile
        return epp_pb2.PickerInfo(needs_prompt=profile.needs_prompt, profiles=[profile.name], packed_token_ids=True)


def response_to_proto(decision: PickDecision, request: epp_pb2.PickRequest | None = None) -> epp_pb2.PickResponse:
    """The scheduler's decision as a ``PickResponse`` (target, fallbacks best first, breakdown, profile),
    shaped by what ``request`` asked for: at most ``max_endpoints`` endpoints, the target included
    (0: all), and no breakdown when ``omit_breakdown`` (a router's pick builds only what it uses: at
    100 endpoints the 99 fallbacks and 100 breakdowns cost ~1.4 ms of a 3.5 ms Pick). The decision
    is not changed (traces still read its breakdown). ``request`` None: everything."""
    fallbacks = decision.fallbacks
    breakdown = decision.breakdown
    if request is not None:
        if request.max_endpoints:
            fallbacks = fallbacks[: request.max_endpoints - 1]
        if request.omit_breakdown:
            breakdown = []
    return epp_pb2.PickResponse(
        target=endpoint_to_proto(decision.target),
        fallbacks=[endpoint_to_proto(e) for e in fallbacks],
        breakdown=[epp_pb2.ScoreBreakdown(endpoint_id=s.id, scores=s.scores, total=s.total) for s in breakdown],
        profile=decision.profile,
        prompt_tokens=decision.prompt_tokens,
    )


def error_to_proto(exc: BaseException) -> epp_pb2.PickError:
    """What the unary ``Pick`` would have answered for ``exc`` (the shared interceptor's table):
    a domain error's status and class name, else ``INTERNAL`` with a generic message and no class
    (the client reads that as "epp failed", not as an answer), the traceback logged."""
    domain = translate(exc)
    if domain is None:
        logger.error("unhandled error in PickMany entry", exc_info=exc)
        return epp_pb2.PickError(code="INTERNAL", message="internal error")
    return epp_pb2.PickError(code=mapping_for(domain).grpc_status, error_class=type(domain).__name__,
                             message=str(domain))


_DEADLINE_EXCEEDED = epp_pb2.PickError(code="DEADLINE_EXCEEDED", message="Deadline Exceeded")
"""An entry's own deadline (``timeout_seconds``) passed: as a unary call past its deadline (no class)."""
_FLUSH_SECONDS = 1.0
"""How long a closing ``PickMany`` stream may take to write its last results."""
_SPAN_END_DELAY_SECONDS = 0.002
"""How long after a result's write returned its pick's span is annotated and ended (see :class:`_PickSession`)."""
_DRAIN_SECONDS = 5.0
"""How long a ``PickMany`` stream the client half-closed waits for its picks in flight."""
_SAMPLED_LAST_HEX = frozenset("13579bdfBDF")
"""Last hex digit of the W3C trace flags when the sampled bit (0x01) is set."""


class _PickSession:
    """One ``PickMany`` stream: the picks in flight by the client's id, and the results' writer.

    Each ``PickEntry`` runs :meth:`Scheduler.pick` in its own task (a pick may wait on tokenization
    or kv_indexer) under the entry's own deadline (``timeout_seconds``); its result or error goes
    to the outbox, and one writer task writes everything ready at that moment in one
    ``PickResults`` (under load one write carries many). A sampled pick's ``epp.Pick`` span is
    current while the pick runs and ends when the decision is made, but is annotated and ended (at
    that recorded time) ``_SPAN_END_DELAY_SECONDS`` after its result's write returned: ~50 µs of
    epp's CPU off the pick's path, and out of the window in which the router receives the result
    (on two cores, work epp does right after its write delays the router's receipt by as much).
    A malformed entry (zero or duplicate id,
    a negative or non-finite ``timeout_seconds``, a request ``Pick`` refuses: more than one prompt
    form, ``render_json`` that is not a JSON object, a ``request_id`` over ``MAX_REQUEST_ID_CHARS``)
    is answered ``INVALID_ARGUMENT`` for that id alone; an entry's request without ``request_id`` is
    counted under one of :func:`pick_id`'s (unique; not returned: nothing can complete it);
    a ``cancel`` entry stops its pick and nothing is answered for it. The session's end cancels
    every pick still running. An entry whose id is still in flight is refused and the pick in flight
    under that id is cancelled too: the ``INVALID_ARGUMENT`` is that id's one answer, no result follows
    it (the client, which reads an error as the end of that id, is never answered twice), as
    flow_control's ``AdmitMany`` does with a held ticket.
    """

    def __init__(self, scheduler: Scheduler, context: grpc.aio.ServicerContext) -> None:
        self._scheduler = scheduler
        self._context = context
        self._running: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[epp_pb2.PickResult] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._after_write: list[tuple[trace.Span, SchedulingRequest, PickDecision, int]] = []
        """Picks' spans to annotate and end (at the recorded time, ns) after their results are written."""
        self._writer = asyncio.create_task(self._write(), name="epp-pick-many-writer")

    def handle(self, entry: epp_pb2.PickEntry) -> None:
        key = entry.id
        if entry.cancel:
            task = self._running.pop(key, None)
            if task is not None:
                task.cancel()
            return
        try:
            if key == 0:
                raise InvalidRequest("pick id 0 is reserved: ids start at 1")
            if (held := self._running.pop(key, None)) is not None:
                held.cancel()
                raise InvalidRequest(
                    f"pick id {key} is already in flight on this stream: both entries are dropped (no result follows)")
            check_timeout_seconds(entry.timeout_seconds)
            request = request_from_proto(entry.request)
        except InvalidRequest as exc:
            self._answer(epp_pb2.PickResult(id=key, error=error_to_proto(exc)))
            return
        except Exception as exc:  # a bug reading one entry is that entry's INTERNAL, never the stream's end
            logger.exception("PickMany entry %d could not be read", key)
            self._answer(epp_pb2.PickResult(id=key, error=error_to_proto(exc)))
            return
        self._running[key] = asyncio.create_task(self._pick(key, entry, request))

    async def _pick(self, key: int, entry: epp_pb2.PickEntry, request: SchedulingRequest) -> None:
        span = _enter_trace(entry)  # this task runs in the request's trace (epp's kv_indexer call included)
        deadline = asyncio.timeout(entry.timeout_seconds if entry.timeout_seconds > 0 else None)
        try:
            async with deadline:
                decision = await self._scheduler.pick(request)
        except asyncio.CancelledError:
            if span is not None:
                span.end()
            raise
        except Exception as exc:
            if span is not None:
                span.record_exception(exc)
                span.end()
            self._running.pop(key, None)
            error = _DEADLINE_EXCEEDED if deadline.expired() else error_to_proto(exc)
            self._answer(epp_pb2.PickResult(id=key, error=error))
            return
        ended = time.time_ns() if span is not None else 0  # the span's end (OpenTelemetry's clock)
        self._running.pop(key, None)
        self._answer(epp_pb2.PickResult(id=key, response=response_to_proto(decision, entry.request)))
        if span is not None:  # annotated and ended after the result's write: off the pick's path
            self._after_write.append((span, request, decision, ended))

    def _answer(self, result: epp_pb2.PickResult) -> None:
        self._outbox.append(result)
        self._wake.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    batch, self._outbox = self._outbox, []
                    spans, self._after_write = self._after_write, []
                    try:
                        await self._context.write(epp_pb2.PickResults(results=batch))
                    finally:
                        if spans:
                            asyncio.get_running_loop().call_later(_SPAN_END_DELAY_SECONDS, _end_spans, spans)
                if self._closing:
                    return
        finally:
            spans, self._after_write = self._after_write, []
            _end_spans(spans)

    async def drain(self) -> None:
        """Wait (at most ``_DRAIN_SECONDS``) for the picks in flight to be answered."""
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=_DRAIN_SECONDS)

    async def close(self) -> None:
        """The client's side ended (or the call broke): stop the picks still running, write what is
        answered (the client may still read), stop the writer."""
        running, self._running = self._running, {}
        for task in running.values():
            task.cancel()
        if running:
            await asyncio.gather(*running.values(), return_exceptions=True)
        self._closing = True
        try:
            await stop_stream_writer(self._writer, self._wake, _FLUSH_SECONDS)
        finally:
            spans, self._after_write = self._after_write, []  # a writer stopped before it started
            _end_spans(spans)
        if running:
            logger.info("pick-many stream ended picks_stopped=%d", len(running))


def _end_spans(spans: list[tuple[trace.Span, SchedulingRequest, PickDecision, int]]) -> None:
    """Annotate (:func:`_annotate_pick`) and end each pick's span at its recorded end time (ns)."""
    for span, request, decision, ended in spans:
        _annotate_pick(request, decision, span)
        span.end(end_time=ended)


def _enter_trace(entry: epp_pb2.PickEntry) -> trace.Span | None:
    """Attach the entry's trace context to the current task (each pick runs in its own task, so
    nothing is detached): the pick's own calls (kv_indexer ``Score``) stay in the request's trace, as
    under the unary call's server interceptor. Returns an ``epp.Pick`` SERVER span, made current,
    when the caller's context is sampled (the sampled bit of the W3C trace flags), else None;
    without a ``traceparent`` nothing is built."""
    if not entry.traceparent:
        return None
    carrier = {"traceparent": entry.traceparent}
    if entry.tracestate:
        carrier["tracestate"] = entry.tracestate
    parent = propagate.extract(carrier)
    span: trace.Span | None = None
    if len(entry.traceparent) >= 55 and entry.traceparent[-1:] in _SAMPLED_LAST_HEX:
        span = _tracer.start_span("epp.Pick", context=parent, kind=trace.SpanKind.SERVER)
        if not span.is_recording():
            span = None
    otel_context.attach(trace.set_span_in_context(span, parent) if span is not None else parent)
    return span


def _annotate_pick(request: SchedulingRequest, decision: object, span: trace.Span | None = None) -> None:
    """Trace attributes on the Pick span (issue 11; ``span``, else the current one): request id (the one
    the pick is counted under: :func:`pick_id`), model, the
    chosen endpoint, its fallbacks, the profile, the prompt's token count and each scorer's score for the winner."""
    if span is None:
        span = trace.get_current_span()
    if not span.is_recording():
        return
    target = getattr(decision, "target", None)
    span.set_attribute("kvmesh.request_id", request.request_id)
    span.set_attribute("kvmesh.model", request.model)
    span.set_attribute("kvmesh.endpoint", str(getattr(target, "id", "")))
    span.set_attribute("kvmesh.fallbacks", [str(e.id) for e in getattr(decision, "fallbacks", ())])
    span.set_attribute("kvmesh.profile", str(getattr(decision, "profile", "")))
    span.set_attribute("kvmesh.prompt_tokens", int(getattr(decision, "prompt_tokens", 0) or 0))
    for row in getattr(decision, "breakdown", ()):
        if target is not None and row.id == target.id:
            for scorer, value in row.scores.items():
                span.set_attribute(f"kvmesh.score.{scorer}", float(value))
            span.set_attribute("kvmesh.score.total", float(row.total))
