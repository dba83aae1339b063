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
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvmesh.errors import InvalidRequest, KvmeshError, NoEndpointsAvailable, Saturated, mapping_for
from kvmesh.hashing import KeyScope
from kvmesh.types import DATA_PARALLEL_RANK_HEADER, LORA_ADAPTERS_LABEL, Endpoint
from services.epp.framework.interfaces import ChatMessage, SchedulingRequest
from services.epp.scheduler import Scheduler
from services.epp.tokenization.fields import render_fields

logger = logging.getLogger(__name__)

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


def _text_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # text parts count for routing; other parts are the engine's to check
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise InvalidRequest(f"messages[{index}].content must be a string or a list of content parts")


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
    served = {e.model for e in endpoints_list} if (endpoints_list := list(endpoints)) else set()
    if model not in served:
        for e in endpoints_list:
            if model in (n.strip() for n in e.labels.get(LORA_ADAPTERS_LABEL, "").split(",")):
                lora_name, model = model, e.model
                break
    prompt_text = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        prompt_text = prompt
    elif isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = tuple(prompt)
        elif prompt and isinstance(prompt[0], str):  # a batch: route on its first prompt
            prompt_text = prompt[0]
        elif prompt and isinstance(prompt[0], list) and all(isinstance(t, int) for t in prompt[0]):
            token_ids = tuple(prompt[0])
    elif prompt is not None:
        raise InvalidRequest("'prompt' must be a string, a list of strings or a list of token ids")
    raw_messages = data.get("messages")
    if raw_messages is not None:
        if not isinstance(raw_messages, list):
            raise InvalidRequest("'messages' must be a list")
        parsed: list[ChatMessage] = []
        for i, m in enumerate(raw_messages):
            if not isinstance(m, dict):
                raise InvalidRequest(f"messages[{i}] must be an object")
            parsed.append(ChatMessage(str(m.get("role", "")), _text_content(m.get("content"), i)))
        messages = tuple(parsed)
    return SchedulingRequest(
        model=model,
        request_id=request_id,
        token_ids=token_ids,
        prompt=prompt_text,
        messages=messages,
        scope=KeyScope(lora_name, cache_salt or None),
        render=render_fields(data),
    )


# --- subset hints and destinations ----------------------------------------------------------------


def destination(endpoint: Endpoint) -> str:
    """``ip:port`` Envoy connects to for ``endpoint`` (its URL's host and port)."""
    parts = urlsplit(endpoint.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    chunks = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
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


@dataclass
class _Stream:
    """State of one ext_proc stream (one HTTP request)."""

    request_mode: int = FULL_DUPLEX
    response_mode: int = _Mode.NONE
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    picked: bool = False


class ExternalProcessorServicer(ext_grpc.ExternalProcessorServicer):
    """``Process``: GIE's endpoint-picker protocol over one ext_proc stream per HTTP request."""

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
            if first and request.HasField("protocol_config"):
                stream.request_mode = request.protocol_config.request_body_mode
                stream.response_mode = request.protocol_config.response_body_mode
            first = False
            try:
                replies = await self._handle(stream, request)
            except Exception as exc:  # every failure of a request is an HTTP answer, never a broken stream
                if mapping_for(exc).http_status == 500:  # a bug or a misconfigured Envoy: with the traceback
                    logger.exception("ext_proc request failed request_id=%s", stream.headers.get("x-request-id", ""))
                else:
                    logger.info("ext_proc request refused request_id=%s status=%d: %s",
                                stream.headers.get("x-request-id", ""), mapping_for(exc).http_status, exc)
                yield immediate_response(exc)
                return
            for reply in replies:
                yield reply

    async def _handle(self, stream: _Stream, request: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(stream, request)
        if kind == "request_body":
            chunk = request.request_body
            if len(stream.body) + len(chunk.body) > self._settings.max_body_bytes:
                raise BodyTooLarge(f"request body is over {self._settings.max_body_bytes} bytes")
            stream.body += chunk.body
            if stream.request_mode == BUFFERED:
                return [await self._pick_reply(stream, in_body_response=True)]
            if chunk.end_of_stream:
                return [await self._pick_reply(stream, in_body_response=False),
                        *self._body_back(stream, end_of_stream=True)]
            return []
        if kind == "request_trailers":
            replies: list[ext_pb2.ProcessingResponse] = []
            if stream.request_mode == FULL_DUPLEX and not stream.picked:  # trailers end the body
                replies = [await self._pick_reply(stream, in_body_response=False),
                           *self._body_back(stream, end_of_stream=False)]
            return [*replies, ext_pb2.ProcessingResponse(request_trailers=ext_pb2.TrailersResponse())]
        if kind == "response_headers":
            served = request.metadata_context.filter_metadata.get(self._settings.metadata_namespace)
            if served is not None and DESTINATION_ENDPOINT_SERVED_KEY in served.fields:
                logger.debug("ext_proc served request_id=%s endpoint=%s", stream.headers.get("x-request-id", ""),
                             served.fields[DESTINATION_ENDPOINT_SERVED_KEY].string_value)
            return [ext_pb2.ProcessingResponse(response_headers=ext_pb2.HeadersResponse())]
        if kind == "response_body":
            body = request.response_body
            if stream.response_mode == FULL_DUPLEX:
                return [ext_pb2.ProcessingResponse(response_body=ext_pb2.BodyResponse(response=c))
                        for c in _streamed_body(body.body, body.end_of_stream)]
            return [ext_pb2.ProcessingResponse(response_body=ext_pb2.BodyResponse())]
        if kind == "response_trailers":
            return [ext_pb2.ProcessingResponse(response_trailers=ext_pb2.TrailersResponse())]
        raise InvalidRequest(f"unexpected ext_proc message {kind!r}")

    def _on_request_headers(self, stream: _Stream, request: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        if stream.request_mode not in _SUPPORTED_REQUEST_MODES and not request.request_headers.end_of_stream:
            mode = _Mode.BodySendMode.Name(stream.request_mode)
            raise KvmeshError(  # Envoy's configuration, not the client's request: 500
                f"ext_proc request_body_mode {mode} cannot carry the pick: configure FULL_DUPLEX_STREAMED or BUFFERED"
            )
        for h in request.request_headers.headers.headers:
            stream.headers[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        stream.subset = subset_from(request, stream.headers)
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
            return [ext_pb2.ProcessingResponse(request_headers=ext_pb2.HeadersResponse())]
        return []  # FULL_DUPLEX_STREAMED: the headers response waits for the pick

    async def _pick_reply(self, stream: _Stream, in_body_response: bool) -> ext_pb2.ProcessingResponse:
        request_id = stream.headers.get("x-request-id", "")
        endpoints = self._scheduler.datastore.endpoints()
        request = scheduling_request(bytes(stream.body), request_id, endpoints)
        if stream.subset is not None:
            of_model = [e for e in endpoints if e.model == request.model]
            outside = frozenset(e.id for e in of_model if not in_subset(e, stream.subset))
            if of_model and len(outside) == len(of_model):
                raise NoEndpointsAvailable(
                    f"no endpoint of model {request.model!r} is in the subset hint {', '.join(stream.subset) or '(empty)'}"
                )
            request = SchedulingRequest(
                model=request.model, request_id=request.request_id, token_ids=request.token_ids,
                prompt=request.prompt, messages=request.messages, scope=request.scope, exclude_endpoint_ids=outside,
            )
        decision = await self._scheduler.pick(request)
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
        inner = struct_pb2.Struct()
        inner.update({self._settings.header_key: value})
        metadata = struct_pb2.Struct()
        metadata.fields[self._settings.metadata_namespace].struct_value.CopyFrom(inner)
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
