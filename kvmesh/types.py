"""Shared nouns: endpoints, media and block hashes, as frozen dataclasses and enums.

The same nouns appear in the protobuf contracts (``kvmesh.common.v1``) and in etcd
registrations (JSON); the JSON form lives here, the protobuf form in :mod:`kvmesh.wire`.
"""

from __future__ import annotations

import enum
import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from typing import NewType

EndpointId = NewType("EndpointId", str)
"""An endpoint's stable id: ``"host:port"`` of its HTTP API."""

BlockHash = NewType("BlockHash", int)
"""A 64-bit block hash (an engine's, or kvmesh's own block key)."""

DEFAULT_BLOCK_SIZE_TOKENS = 64
"""Block size assumed for an endpoint that does not state its own (tokens)."""


class Medium(enum.StrEnum):
    """Where a KV block lives; the values are vLLM's ``BlockStored.medium`` strings."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"
    SHARED = "SHARED"

    @classmethod
    def parse(cls, value: str | None) -> Medium:
        """Map an event's medium string (``None`` means GPU, vLLM's default) to a Medium.

        Raises:
            ValueError: for a medium kvmesh does not know.
        """
        if value is None:
            return cls.GPU
        upper = value.upper()
        return cls(MEDIUM_ALIASES.get(upper, upper))


MEDIUM_ALIASES: dict[str, str] = {
    "CPU_PINNED": "CPU",  # SGLang 0.5.23 StorageMedium.CPU (HiCache L2, host pinned memory)
    "EXTERNAL": "SHARED",  # SGLang 0.5.23 StorageMedium.EXTERNAL (L4: shared / remote pool, e.g. Mooncake)
    "STORAGE": "DISK",  # vLLM 0.32 MEDIUM_STORAGE (offloading to storage)
}
"""Other engines' medium strings for the same tiers (``Medium.parse`` maps them)."""


class EndpointRole(enum.StrEnum):
    """What part of inference an endpoint serves (prefill/decode disaggregation)."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A model server as registered in etcd under ``/kvmesh/v1/endpoints/<model>/<id>``.

    Attributes:
        id: ``"host:port"`` of the HTTP API (stable across restarts of the same server).
        url: base URL of the OpenAI-compatible API, e.g. ``"http://127.0.0.1:8001"``.
        model: served model name.
        block_size_tokens: KV-cache block size in tokens.
        events_endpoint: ZMQ endpoint its KV-event publisher uses (``""`` when none).
        role: ``both``, ``prefill`` or ``decode``.
        labels: free-form labels (e.g. ``{"engine": "simulator"}``).
        instance_id: the incarnation: unique per start of the server process (a restart on the
            same address registers a new one, so its old index entries are dropped); ``""`` when
            the registrant does not say (then only the event sequence restarting reveals a restart).
        replay_endpoint: ZMQ ROUTER endpoint of vLLM's KV-event replay buffer
            (``KVEventsConfig.replay_endpoint``), ``""`` when there is none.
        data_parallel_rank: the data-parallel rank this registration stands for, when one server
            (one URL) fronts several ranks, each with its own KV cache; ``None`` otherwise. Its id is
            :func:`dp_endpoint_id` of the server's ``host:port`` (rank 0 keeps the bare id), its
            events are those whose batch carries that rank, and requests to it carry vLLM's
            ``X-data-parallel-rank`` header.
        hash_algo: the engine's block-hash algorithm (vLLM's ``--prefix-caching-hash-algo``,
            e.g. ``"sha256_cbor"``), ``""`` when unknown; the indexer's parity check uses it.
    """

    id: EndpointId
    url: str
    model: str
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    events_endpoint: str = ""
    role: EndpointRole = EndpointRole.BOTH
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    instance_id: str = ""
    replay_endpoint: str = ""
    hash_algo: str = ""
    data_parallel_rank: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Endpoint:
        """Parse a registration value.

        Raises:
            ValueError: when the value is not a JSON object with at least ``id``, ``url`` and ``model``.
        """
        try:
            data = json.loads(text)
            return cls(
                id=EndpointId(data["id"]),
                url=data["url"],
                model=data["model"],
                block_size_tokens=int(data.get("block_size_tokens", DEFAULT_BLOCK_SIZE_TOKENS)),
                events_endpoint=data.get("events_endpoint", ""),
                role=EndpointRole(data.get("role", "both")),
                labels=dict(data.get("labels", {})),
                instance_id=str(data.get("instance_id", "")),
                replay_endpoint=str(data.get("replay_endpoint", "")),
                hash_algo=str(data.get("hash_algo", "")),
                data_parallel_rank=None if data.get("data_parallel_rank") is None else int(data["data_parallel_rank"]),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad endpoint registration {text!r}: {exc}") from exc


def dp_endpoint_id(endpoint_id: str, data_parallel_rank: int | None) -> EndpointId:
    """The endpoint id of one data-parallel rank of the server ``endpoint_id`` (``host:port``).

    Rank None or 0 is the server's own id (so every non-DP engine, whose batches say rank 0, keeps
    its id); rank ``r > 0`` is ``"<host:port>#dp<r>"``.
    """
    if not data_parallel_rank:
        return EndpointId(endpoint_id)
    return EndpointId(f"{endpoint_id}#dp{int(data_parallel_rank)}")


LORA_ADAPTERS_LABEL = "lora_adapters"
"""Registration label: comma-separated LoRA adapter names an endpoint serves (vLLM's ``--lora-modules``
names); the router sends a request whose ``model`` names one to its base model's pool under it."""

KV_STORES_LABEL = "kv_stores"
"""Engine registration label: comma-separated ids (gRPC ``host:port``) of the kv_store instances its
offload connector writes to and loads from; blocks those instances publish count for the engine."""

KV_SOURCE_LABEL = "kv_source"
"""Label of a registration under ``/kvmesh/v1/kv_sources/``: the kind of KV-event source (``kv_store``)."""

SHARED_DOMAINS_LABEL = "shared_domains"
"""kv_store source label: comma-separated names of its shared tiers' namespaces (``sharedfs:<path>``,
``mooncake:<master>/<namespace>``); a ``SHARED`` block of one source is reachable through every
source naming the same domain."""

DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
"""vLLM's request header that sends a request to one data-parallel rank of a server."""


def data_parallel_rank_of(endpoint_id: str) -> int | None:
    """The rank of a :func:`dp_endpoint_id` (``host:port#dp<r>`` -> r), None for a bare ``host:port``."""
    _, sep, rank = endpoint_id.rpartition("#dp")
    return int(rank) if sep and rank.isdigit() else None


@dataclass(frozen=True, slots=True)
class ServiceInstance:
    """A kvmesh service instance as registered under ``/kvmesh/v1/services/<service>/<id>``."""

    service: str
    id: str
    grpc_address: str
    metrics_address: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class CompletionOutcome(enum.StrEnum):
    """How a routed request ended, as the router saw it (epp's ``Completed`` RPC, issue 9)."""

    SUCCESS = "success"
    ERROR = "error"
    """The engine answered an error status or the stream broke."""
    CANCELLED = "cancelled"
    """The client went away and the router cancelled the engine request."""
    NOT_DISPATCHED = "not_dispatched"
    """The router received epp's pick but no engine answered the request (admission refused it after an
    early pick, every attempt failed before its first byte, the client left first): epp drops the pick's
    load without changing any engine's running count."""


_PICK_ID_PREFIX = os.urandom(4).hex()
"""This process's part of :func:`pick_request_id` (several routers, or epp's ext_proc, share one epp)."""
_pick_id_numbers = itertools.count(1)


def pick_request_id(request_id: str) -> str:
    """The id epp knows one request by (``PickRequest.request_id``, the ``CompletedRequest`` that ends
    it): ``<request_id>~<8 hex unique to this process><n hex>``, the caller's id kept as its prefix
    for correlating logs and spans. epp reads a second pick under one id as the same request picked
    again (superseding the first), while clients may send one ``x-request-id`` on several requests
    (it is kept as sent for the engine, logs and the answer): each request's own id keeps them apart.
    vLLM does alike: the client's id stays its ``external_req_id``, its internal id gets a random suffix."""
    return f"{request_id}~{_PICK_ID_PREFIX}{next(_pick_id_numbers):x}"


@dataclass(frozen=True, slots=True)
class RequestCompletion:
    """A routed request that ended: the router tells epp so its load leaves the endpoint at once.

    Attributes:
        request_id: the ``PickRequest.request_id`` of the request.
        endpoint_id: the endpoint that served it (may differ from epp's pick after a fallback).
        prompt_tokens: prompt tokens (the engine's usage when reported, else the router's estimate).
        cached_tokens: of those, the ones the engine found cached (0: unknown).
        outcome: how it ended.
        completion_tokens: output tokens generated (the engine's usage, else the streamed chunks; 0: unknown).
    """

    request_id: str
    endpoint_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outcome: CompletionOutcome = CompletionOutcome.SUCCESS
    completion_tokens: int = 0
