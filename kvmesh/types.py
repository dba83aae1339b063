"""Shared nouns: endpoints, media and block hashes, as frozen dataclasses and enums.

The same nouns appear in the protobuf contracts (``kvmesh.common.v1``) and in etcd
registrations (JSON); the JSON form lives here, the protobuf form in :mod:`kvmesh.wire`.
"""

from __future__ import annotations

import enum
import json
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
        return cls(value.upper())


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
    """

    id: EndpointId
    url: str
    model: str
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    events_endpoint: str = ""
    role: EndpointRole = EndpointRole.BOTH
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

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
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad endpoint registration {text!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ServiceInstance:
    """A kvmesh service instance as registered under ``/kvmesh/v1/services/<service>/<id>``."""

    service: str
    id: str
    grpc_address: str
    metrics_address: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
