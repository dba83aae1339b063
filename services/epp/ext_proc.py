"""Envoy ext_proc adapter: the Gateway API inference extension's endpoint-picker protocol.

epp answers Envoy's external-processing stream (``envoy.service.ext_proc.v3.ExternalProcessor/
Process``, protos from the ``xds-protos`` package) as GIE's endpoint picker does (GIE
``docs/proposals/004-endpoint-picker-protocol``, protocol v1.0.0; handlers as in GIE's
``pkg/epp/handlers``), so a GIE-configured Envoy routes each OpenAI request to the endpoint that
:meth:`Scheduler.pick <services.epp.scheduler.Scheduler.pick>` chooses, the same call the gRPC
``Pick`` makes. A thin adapter: ext_proc messages in, one pick, ext_proc messages out.

One stream is one HTTP request. What epp answers, per Envoy's body mode (``protocol_config``, which
Envoy sends on the first message; absent = ``FULL_DUPLEX_STREAMED``, GIE's mode):

| Envoy sends | ``FULL_DUPLEX_STREAMED`` (GIE) | ``BUFFERED`` |
| --- | --- | --- |
| request headers | nothing yet (held until the body is complete) | an empty headers response |
| request body chunks | collected; at end of stream: pick, then the headers response (mutation + metadata) and the body back as ``streamed_response`` chunks of at most 62,000 bytes | the whole body: pick, the body response carries the mutation + metadata |
| request trailers | an empty trailers response (the body is complete when trailers arrive) | an empty trailers response |
| response headers / body / trailers | empty headers response; body chunks echoed unchanged; empty trailers response | empty responses |

The pick's answer (both, with the same value, as the protocol requires):

- header ``x-gateway-destination-endpoint: <ip:port>`` (the target; with
  ``destination_endpoints`` > 1 also the fallbacks, comma-separated, best first; Envoy's
  ``ORIGINAL_DST`` cluster reads exactly one) plus ``Content-Length`` of the body,
- dynamic metadata ``{"envoy.lb": {"x-gateway-destination-endpoint": "<same value>"}}``,
- ``clear_route_cache`` so a route matching on that metadata is chosen now.

Subset hint (Envoy -> epp): ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
["x-gateway-destination-endpoint-subset"]`` (a list of ``ip:port``) or, as GIE's newer handlers also
read, the request header of that name (comma-separated; it wins over the metadata and is removed
before the request goes upstream). The pick only considers endpoints in the subset: an entry
``ip:port`` matches that endpoint, an entry ``ip`` every endpoint on that host (GIE matches on the IP
only, one pod per IP; here several engines may share a host). An empty subset, or one that no
endpoint of the model is in, is a 503.

Errors become ``ImmediateResponse``s through the one table (:func:`kvmesh.errors.mapping_for`),
each with an OpenAI-style JSON error body:

| cause | status |
| --- | --- |
| body not JSON / not an object, ``model`` missing, malformed prompt or messages (:class:`InvalidRequest`) | 400 |
| body over ``max_body_bytes`` | 413 |
| no endpoint serves the model (:class:`UnknownModel`; GIE's ``BadConfiguration``) | 404 |
| no live endpoint, empty or unmatched subset (:class:`NoEndpointsAvailable`) | 503 |
| shed / saturated (:class:`Saturated` and subclasses; GIE's ``InferencePoolResourceExhausted``) | 429 + ``x-llm-d-request-dropped-reason`` |
| a plugin bug or anything else | 500 |

A request without a body (headers with ``end_of_stream``, e.g. ``GET /v1/models``) goes to a
random registered endpoint (of the subset when one is given), as GIE does.

The per-request path (issue 10; docs/envoy.md "Cost of the hop"): Envoy opens one gRPC stream per
HTTP request, so epp's ext_proc server runs without the standard interceptor chain (services/epp/app.py:
a span per RPC and the error table cost ~0.3 ms of CPU per request; this servicer answers every
failure itself) and opens an ``epp.Pick`` span only when the HTTP request carries a sampled W3C
``traceparent``; the body is decoded with msgspec (Python's ``json`` only for what msgspec refuses)
and token ids are handed to the scheduler packed, as the router sends them; replies that carry
nothing are built once. What is left is grpc-python's cost per stream and per message (~80 % of
epp's CPU on this path, py-spy).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvmesh.chat_messages import chat_messages
from kvmesh.errors import InvalidRequest, KvmeshError, NoEndpointsAvailable, Saturated, mapping_for
from kvmesh.hashing import KeyScope
from kvmesh.prefix_index import PackedTokenIds
from kvmesh.types import DATA_PARALLEL_RANK_HEADER, LORA_ADAPTERS_LABEL, Endpoint, pick_request_id
from services.epp.framework.interfaces import ChatMessage, SchedulingRequest
from services.epp.scheduler import Scheduler
from services.epp.tokenization.fields import render_fields

logger = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.epp")
_LITTLE_ENDIAN = sys.byteorder == "little"
_SAMPLED_LAST_HEX = frozenset("13579bdf")  # W3C trace-flags byte with the sampled bit set
_decode_json = msgspec.json.Decoder().decode

SERVICE_NAME = ext_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
"""``envoy.service.ext_proc.v3.ExternalProcessor``: the gRPC service (and its health-check name)."""

DESTINATION_ENDPOINT_KEY = "x-gateway-destination-endpoint"
DESTINATION_ENDPOINT_NAMESPACE = "envoy.lb"
SUBSET_FILTER_KEY = "x-gateway-destination-endpoint-subset"
SUBSET_FILTER_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_ENDPOINT_SERVED_KEY = "x-gateway-destination-endpoint-served"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
BODY_CHUNK_BYTES = 62_000
"""Largest ``streamed_response`` chunk (GIE's ``bodyByteLimit``: some Envoy builds cap a chunk at 64 KiB)."""

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED
_SUPPORTED_REQUEST_MODES = {FULL_DUPLEX: "FULL_DUPLEX_STREAMED", BUFFERED: "BUFFERED"}


class BodyTooLarge(InvalidRequest):
    """The request body is over ``max_body_bytes`` (answered 413)."""


@dataclass(frozen=True, slots=True)
class ExtProcSettings:
    """How epp speaks GIE's protocol (GIE's flags ``--destination-endpoint-hint-key`` and
    ``--destination-endpoint-hint-metadata-namespace``).

    Attributes:
        destination_endpoints: endpoints in the header and metadata value: the target, then up to
            ``n - 1`` fallbacks (1 for ``ORIGINAL_DST`` clusters, which read a single ``ip:port``).
        max_body_bytes: largest request body epp collects (bytes); over it the request gets 413.
        header_key: the destination header (and metadata key).
        metadata_namespace: the dynamic-metadata namespace the destination goes under.
    """

    destination_endpoints: int = 1
    max_body_bytes: int = 16 * 1024 * 1024
    header_key: str = DESTINATION_ENDPOINT_KEY
    metadata_namespace: str = DESTINATION_ENDPOINT_NAMESPACE


# --- the OpenAI body -> SchedulingRequest ------------------------------------------------------


def scheduling_request(body: bytes, request_id: str, endpoints: Iterable[Endpoint]) -> SchedulingRequest:
    """The :class:`SchedulingRequest` for an OpenAI completions or chat body.

    ``prompt`` (text, or token ids), ``messages`` (text of each message), ``cache_salt`` and a
    ``model`` naming a LoRA adapter (registered under ``lora_adapters``: the pick then runs on its
    base model's endpoints in the adapter's key scope) are read; everything else is the engine's.

    Raises:
        InvalidRequest: not UTF-8 JSON, not an object, no string ``model``, or a ``prompt`` /
            ``messages`` / ``cache_salt`` of the wrong type.
    """
    try:
        data = _decode_json(body)  # msgspec: the values json.loads gives, several times faster
    except (msgspec.DecodeError, RecursionError):
        try:  # what msgspec refuses and json accepts (NaN, ints past 64 bits) reads as before
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise InvalidRequest(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string")
    cache_salt = data.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequest("'cache_salt' must be a string")
    lora_name: str | None = None
    endpoints_list = endpoints if isinstance(endpoints, list) else list(endpoints)
    if not any(e.model == model for e in endpoints_list):
        for e in endpoints_list:
            if model in (n.strip() for n in e.labels.get(LORA_ADAPTERS_LABEL, "").split(",")):
                lora_name, model = model, e.model
                break
    prompt_text = ""
    token_ids: Sequence[int] = ()
    messages: tuple[ChatMessage, ...] = ()
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        prompt_text = prompt
    elif isinstance(prompt, list):
        if prompt and all(type(t) is int for t in prompt):  # JSON ints (bool is not int's type)
            token_ids = _token_ids(prompt)
        elif prompt and isinstance(prompt[0], str):  # a batch: route on its first prompt
            prompt_text = prompt[0]
        elif prompt and isinstance(prompt[0], list) and all(isinstance(t, int) for t in prompt[0]):
            token_ids = _token_ids(prompt[0])
    elif prompt is not None:
        raise InvalidRequest("'prompt' must be a string, a list of strings or a list of token ids")
    raw_messages = data.get("messages")
    if raw_messages is not None:  # the router's rule and words (kvmesh.chat_messages): roles, content parts
        messages = tuple(ChatMessage(role, text) for role, text in chat_messages(raw_messages))
    return SchedulingRequest(
        model=model,
        request_id=request_id,
        token_ids=token_ids,
        prompt=prompt_text,
        messages=messages,
        scope=KeyScope(lora_name, cache_salt or None),
        render=render_fields(data),
    )


def _token_ids(ids: list[int]) -> Sequence[int]:
    """``ids`` as the scheduler reads them fastest: packed little-endian uint32 (the router's form,
    :class:`PackedTokenIds`: the prefix keys hash straight from the bytes), a tuple when an id is not
    a uint32 or the host is big-endian."""
    if _LITTLE_ENDIAN:
        try:
            return PackedTokenIds.build(ids)
        except (OverflowError, TypeError):
            pass
    return tuple(ids)


# --- subset hints and destinations ----------------------------------------------------------------


_DESTINATIONS: dict[str, str] = {}


def destination(endpoint: Endpoint) -> str:
    """``ip:port`` Envoy connects to for ``endpoint`` (its URL's host and port)."""
    cached = _DESTINATIONS.get(endpoint.url)
    if cached is not None:
        return cached
    parts = urlsplit(endpoint.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    value = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if len(_DESTINATIONS) > 65536:  # endpoints come and go: bound the cache
        _DESTINATIONS.clear()
    _DESTINATIONS[endpoint.url] = value
    return value


def subset_from(request: ext_pb2.ProcessingRequest, headers: dict[str, str]) -> list[str] | None:
    """The subset hint: the request header (comma-separated) if present, else the filter metadata
    list; None when neither is given (then every endpoint of the model is a candidate)."""
    raw = headers.get(SUBSET_FILTER_KEY)
    if raw is not None:
        return [e.strip() for e in raw.split(",") if e.strip()]
    ns = request.metadata_context.filter_metadata.get(SUBSET_FILTER_NAMESPACE)
    if ns is None or SUBSET_FILTER_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_FILTER_KEY]
    if value.HasField("list_value"):
        return [v.string_value.strip() for v in value.list_value.values if v.HasField("string_value")]
    if value.HasField("string_value"):
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return []


def in_subset(endpoint: Endpoint, subset: Sequence[str]) -> bool:
    """Whether ``endpoint`` is named by the subset (``ip:port`` exactly, or a bare ``ip``)."""
    dest = destination(endpoint)
    host = dest.rsplit(":", 1)[0].strip("[]")
    return any(entry == dest or entry.strip("[]") == host for entry in subset)


# --- ext_proc messages ------------------------------------------------------------------------------


def _header_options(values: dict[str, str]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in values.items()
    ]


def immediate_response(exc: BaseException) -> ext_pb2.ProcessingResponse:
    """The ``ImmediateResponse`` for a failed request (status from the error table; 413 for
    :class:`BodyTooLarge`), with an OpenAI error body and, for a shed request, the drop reason."""
    row = mapping_for(exc)
    status = 413 if isinstance(exc, BodyTooLarge) else row.http_status
    message = str(exc) if isinstance(exc, KvmeshError) else "internal error"
    headers = {"content-type": "application/json"}
    if isinstance(exc, Saturated):
        headers[DROPPED_REASON_HEADER] = exc.dropped_reason
    body = json.dumps({"error": {"message": message, "type": row.openai_type, "code": status}}).encode()
    return ext_pb2.ProcessingResponse(
        immediate_response=ext_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_pb2.HeaderMutation(set_headers=_header_options(headers)),
            body=body,
            details=f"kvmesh_epp_{row.openai_type}",
        )
    )


def _streamed_body(body: bytes, end_of_stream: bool) -> list[ext_pb2.CommonResponse]:
    if len(body) <= BODY_CHUNK_BYTES:  # one chunk (nearly every request and response chunk)
        return [ext_pb2.CommonResponse(body_mutation=ext_pb2.BodyMutation(
            streamed_response=ext_pb2.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)))]
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    return [
        ext_pb2.CommonResponse(
            body_mutation=ext_pb2.BodyMutation(
                streamed_response=ext_pb2.StreamedBodyResponse(
                    body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


# Replies that carry nothing but the phase: built once (grpc serializes each on every write; building
# a message costs more than serializing an empty one).
_EMPTY_REQUEST_HEADERS = ext_pb2.ProcessingResponse(request_headers=ext_pb2.HeadersResponse())
_EMPTY_REQUEST_TRAILERS = ext_pb2.ProcessingResponse(request_trailers=ext_pb2.TrailersResponse())
_EMPTY_RESPONSE_HEADERS = ext_pb2.ProcessingResponse(response_headers=ext_pb2.HeadersResponse())
_EMPTY_RESPONSE_BODY = ext_pb2.ProcessingResponse(response_body=ext_pb2.BodyResponse())
_EMPTY_RESPONSE_TRAILERS = ext_pb2.ProcessingResponse(response_trailers=ext_pb2.TrailersResponse())
_PICK = object()
"""What :meth:`ExternalProcessorServicer._on_message` returns when the message completes the body: pick now."""


@dataclass
class _Stream:
    """State of one ext_proc stream (one HTTP request)."""

    request_mode: int = FULL_DUPLEX
    response_mode: int = _Mode.NONE
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    picked: bool = False
    trailers_end_body: bool = False
    """The pick was triggered by request trailers (full duplex): its replies end with the trailers response."""


class ExternalProcessorServicer(ext_grpc.ExternalProcessorServicer):
    """``Process``: GIE's endpoint-picker protocol over one ext_proc stream per HTTP request.

    The per-message path is synchronous (:meth:`_on_message`); only the message that completes the
    request body awaits the pick. The stream gets no gRPC server span: Envoy's ext_proc stream is one
    per HTTP request and the pick is what matters, so an ``epp.Pick`` SERVER span is opened around the
    pick when the HTTP request carries a sampled W3C ``traceparent`` (as for the router's ``PickMany``).
    """

    def __init__(self, scheduler: Scheduler, settings: ExtProcSettings | None = None,
                 rng: random.Random | None = None) -> None:
        self._scheduler = scheduler
        self._settings = settings or ExtProcSettings()
        self._rng = rng or random.Random()

    async def Process(
        self, request_iterator: AsyncIterator[ext_pb2.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_pb2.ProcessingResponse]:
        stream = _Stream()
        first = True
        async for request in request_iterator:
            if first:
                first = False
                if request.HasField("protocol_config"):
                    stream.request_mode = request.protocol_config.request_body_mode
                    stream.response_mode = request.protocol_config.response_body_mode
            try:
                replies = self._on_message(stream, request)
                if replies is _PICK:
                    replies = await self._pick_replies(stream)
            except Exception as exc:  # every failure of a request is an HTTP answer, never a broken stream
                if mapping_for(exc).http_status == 500:  # a bug or a misconfigured Envoy: with the traceback
                    logger.exception("ext_proc request failed request_id=%s", stream.headers.get("x-request-id", ""))
                else:
                    logger.info("ext_proc request refused request_id=%s status=%d: %s",
                                stream.headers.get("x-request-id", ""), mapping_for(exc).http_status, exc)
                yield immediate_response(exc)
                return
            assert isinstance(replies, list)
            for reply in replies:
                yield reply

    def _on_message(self, stream: _Stream, request: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse] | object:
        """The replies to one message, or :data:`_PICK` when the body is complete and the pick is due."""
        kind = request.WhichOneof("request")
        if kind == "response_body":
            body = request.response_body
            if stream.response_mode == FULL_DUPLEX:
                return [ext_pb2.ProcessingResponse(response_body=ext_pb2.BodyResponse(response=c))
                        for c in _streamed_body(body.body, body.end_of_stream)]
            return [_EMPTY_RESPONSE_BODY]
        if kind == "request_headers":
            return self._on_request_headers(stream, request)
        if kind == "request_body":
            chunk = request.request_body
            if len(stream.body) + len(chunk.body) > self._settings.max_body_bytes:
                raise BodyTooLarge(f"request body is over {self._settings.max_body_bytes} bytes")
            stream.body += chunk.body
            if stream.request_mode == BUFFERED or chunk.end_of_stream:
                return _PICK
            return []
        if kind == "response_headers":
            if logger.isEnabledFor(logging.DEBUG):
                served = request.metadata_context.filter_metadata.get(self._settings.metadata_namespace)
                if served is not None and DESTINATION_ENDPOINT_SERVED_KEY in served.fields:
                    logger.debug("ext_proc served request_id=%s endpoint=%s", stream.headers.get("x-request-id", ""),
                                 served.fields[DESTINATION_ENDPOINT_SERVED_KEY].string_value)
            return [_EMPTY_RESPONSE_HEADERS]
        if kind == "request_trailers":
            if stream.request_mode == FULL_DUPLEX and not stream.picked:  # trailers end the body
                stream.trailers_end_body = True
                return _PICK
            return [_EMPTY_REQUEST_TRAILERS]
        if kind == "response_trailers":
            return [_EMPTY_RESPONSE_TRAILERS]
        raise InvalidRequest(f"unexpected ext_proc message {kind!r}")

    async def _pick_replies(self, stream: _Stream) -> list[ext_pb2.ProcessingResponse]:
        """The pick's replies: BUFFERED, the body response with the mutation; full duplex, the headers
        response with the mutation, then the body back (and the trailers response when trailers ended it)."""
        if stream.request_mode == BUFFERED:
            return [await self._pick_reply(stream, in_body_response=True)]
        routed = await self._pick_reply(stream, in_body_response=False)
        if stream.trailers_end_body:
            return [routed, *self._body_back(stream, end_of_stream=False), _EMPTY_REQUEST_TRAILERS]
        return [routed, *self._body_back(stream, end_of_stream=True)]

    def _on_request_headers(self, stream: _Stream, request: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        if stream.request_mode not in _SUPPORTED_REQUEST_MODES and not request.request_headers.end_of_stream:
            mode = _Mode.BodySendMode.Name(stream.request_mode)
            raise KvmeshError(  # Envoy's configuration, not the client's request: 500
                f"ext_proc request_body_mode {mode} cannot carry the pick: configure FULL_DUPLEX_STREAMED or BUFFERED"
            )
        headers = stream.headers
        for h in request.request_headers.headers.headers:
            headers[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        stream.subset = subset_from(request, headers)
        if request.request_headers.end_of_stream:  # no body (GET /v1/models ...): any endpoint, as GIE
            endpoints = self._scheduler.datastore.endpoints()
            if stream.subset is not None:
                endpoints = [e for e in endpoints if in_subset(e, stream.subset)]
            if not endpoints:
                raise NoEndpointsAvailable("no endpoint is registered" + (" in the subset hint" if stream.subset else ""))
            stream.picked = True
            chosen = self._rng.choice(endpoints)
            return [self._routing_response("request_headers", stream, [chosen], 0)]
        if stream.request_mode == BUFFERED:
            return [_EMPTY_REQUEST_HEADERS]
        return []  # FULL_DUPLEX_STREAMED: the headers response waits for the pick

    async def _pick_reply(self, stream: _Stream, in_body_response: bool) -> ext_pb2.ProcessingResponse:
        # One id per downstream request: two sharing an x-request-id (or sending none, when Envoy is set
        # not to generate one) are two picks to the datastore.
        request_id = pick_request_id(stream.headers.get("x-request-id", "") or "ext_proc")
        endpoints = self._scheduler.datastore.endpoints()
        request = scheduling_request(bytes(stream.body), request_id, endpoints)
        if stream.subset is not None:
            of_model = [e for e in endpoints if e.model == request.model]
            outside = frozenset(e.id for e in of_model if not in_subset(e, stream.subset))
            if of_model and len(outside) == len(of_model):
                raise NoEndpointsAvailable(
                    f"no endpoint of model {request.model!r} is in the subset hint {', '.join(stream.subset) or '(empty)'}"
                )
            request = dataclasses.replace(request, exclude_endpoint_ids=outside)
        span = _pick_span(stream.headers)
        if span is None:
            decision = await self._scheduler.pick(request)
        else:
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                decision = await self._scheduler.pick(request)
                span.set_attribute("kvmesh.request_id", request_id)
                span.set_attribute("kvmesh.model", request.model)
                span.set_attribute("kvmesh.endpoint", decision.target.id)
            finally:
                otel_context.detach(token)
                span.end()
        stream.picked = True
        chosen = [decision.target, *decision.fallbacks][: self._settings.destination_endpoints]
        kind = "request_body" if in_body_response else "request_headers"
        return self._routing_response(kind, stream, chosen, len(stream.body))

    def _routing_response(
        self, kind: str, stream: _Stream, chosen: list[Endpoint], body_bytes: int
    ) -> ext_pb2.ProcessingResponse:
        value = ",".join(destination(e) for e in chosen)
        set_headers = {self._settings.header_key: value}
        if body_bytes:
            set_headers["content-length"] = str(body_bytes)
        if chosen[0].data_parallel_rank is not None:
            set_headers[DATA_PARALLEL_RANK_HEADER] = str(chosen[0].data_parallel_rank)
        remove = [SUBSET_FILTER_KEY] if SUBSET_FILTER_KEY in stream.headers else []
        common = ext_pb2.CommonResponse(
            header_mutation=ext_pb2.HeaderMutation(set_headers=_header_options(set_headers), remove_headers=remove),
            clear_route_cache=True,
        )
        metadata = struct_pb2.Struct()
        metadata.fields[self._settings.metadata_namespace].struct_value.fields[self._settings.header_key].string_value = value
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("ext_proc pick request_id=%s destination=%s", stream.headers.get("x-request-id", ""), value)
        if kind == "request_body":
            return ext_pb2.ProcessingResponse(request_body=ext_pb2.BodyResponse(response=common), dynamic_metadata=metadata)
        return ext_pb2.ProcessingResponse(request_headers=ext_pb2.HeadersResponse(response=common), dynamic_metadata=metadata)

    def _body_back(self, stream: _Stream, end_of_stream: bool) -> list[ext_pb2.ProcessingResponse]:
        """The body, unchanged, as full-duplex ``streamed_response`` chunks (Envoy forwards what epp returns)."""
        body = bytes(stream.body)
        stream.body.clear()
        return [ext_pb2.ProcessingResponse(request_body=ext_pb2.BodyResponse(response=c))
                for c in _streamed_body(body, end_of_stream)]


def _pick_span(headers: dict[str, str]) -> trace.Span | None:
    """An ``epp.Pick`` SERVER span under the HTTP request's W3C trace context, when the request
    carries a ``traceparent`` whose sampled flag is set (else None: nothing is built)."""
    traceparent = headers.get("traceparent")
    if not traceparent or len(traceparent) < 55 or traceparent[-1:] not in _SAMPLED_LAST_HEX:
        return None
    carrier = {"traceparent": traceparent}
    if "tracestate" in headers:
        carrier["tracestate"] = headers["tracestate"]
    span = _tracer.start_span("epp.Pick", context=propagate.extract(carrier), kind=trace.SpanKind.SERVER)
    return span if span.is_recording() else None
