"""Tenants: API keys bind a request to its fairness id, a maximum priority and quotas (pure; no I/O).

Configured in the router's config (``tenants`` in the ``--config`` YAML)::

    tenants:
      - name: acme
        api_keys: [sk-acme-1, sk-acme-2]
        fairness_id: acme            # default: the name
        max_priority: 10             # a higher priority header is capped to this
        default_priority: 0          # priority when the request names none
        rate_per_second: 20          # 0 = unlimited (flow_control rejects above it: 429)
        burst: 40
        max_concurrency: 64          # 0 = unlimited (flow_control holds the rest in the queue)

Binding (:meth:`TenantDirectory.bind`), once any tenant is configured:

| request | fairness id | priority |
|---|---|---|
| a known key (``Authorization: Bearer <key>`` or ``x-api-key``) | the tenant's (the fairness header is ignored) | header capped at ``max_priority``, else ``default_priority`` |
| no key, ``require_api_key`` false | the router's ``default_flow_id`` | header capped at ``anonymous_max_priority``, else 0 capped likewise |
| no key, ``require_api_key`` true; a malformed or unknown key | 401 (OpenAI error body) | |

With no tenant configured the router trusts the headers as before (open mode), and an
``Authorization`` header is ignored (OpenAI SDKs always send one). Keys are compared through
their SHA-256 digests in a dict, so a lookup takes the same time whatever key is sent.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvmesh import errors

_KEY = re.compile(r"[\x21-\x7e]{8,256}")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class TenantSpec(BaseModel):
    """One tenant of the router's config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    api_keys: list[SecretStr] = Field(min_length=1)
    """Shown as ``**********`` in ``--print-config`` and the start-up config log line (as ``engine_api_key``)."""
    fairness_id: str = Field("", max_length=256)
    max_priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    default_priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    rate_per_second: float = Field(0.0, ge=0, le=1_000_000)
    burst: int = Field(0, ge=0, le=1_000_000)
    max_concurrency: int = Field(0, ge=0, le=1_000_000)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A resolved tenant (units: requests, requests/s)."""

    name: str
    fairness_id: str
    max_priority: int
    default_priority: int
    rate_per_second: float = 0.0
    burst: int = 0
    max_concurrency: int = 0


@dataclass(frozen=True, slots=True)
class Binding:
    """Who a request is, for admission: its flow, priority and the tenant's quotas (0 = none)."""

    tenant: str
    flow_id: str
    priority: int
    rate_per_second: float = 0.0
    burst: int = 0
    max_concurrency: int = 0


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii", "surrogateescape")).digest()


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The API key of a request: ``Authorization: Bearer <key>`` (OpenAI) or ``x-api-key``; None when absent.

    Raises:
        Unauthenticated: an ``Authorization`` header that is not ``Bearer <key>``, or a key that is
            not 8-256 printable ASCII characters.
    """
    raw = headers.get("authorization")
    if raw is not None:
        scheme, _, rest = raw.strip().partition(" ")
        if scheme.lower() != "bearer" or not rest.strip():
            raise errors.Unauthenticated("malformed 'authorization' header: expected 'Bearer <api key>'")
        key = rest.strip()
    else:
        header_key = headers.get("x-api-key")
        if header_key is None:
            return None
        key = header_key
    if not _KEY.fullmatch(key):
        raise errors.Unauthenticated("malformed API key: expected 8-256 printable ASCII characters")
    return key


class TenantDirectory:
    """API key -> :class:`Tenant`, and the binding rules of the module docstring.

    Raises:
        ValueError: the same key configured for two tenants, or a default priority above the maximum.
    """

    def __init__(
        self, tenants: Sequence[TenantSpec], default_flow_id: str = "default", require_api_key: bool = False,
        anonymous_max_priority: int = 0,
    ) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        for spec in tenants:
            default = spec.default_priority if spec.default_priority is not None else min(0, spec.max_priority)
            if default > spec.max_priority:
                raise ValueError(f"tenant {spec.name!r}: default_priority {default} > max_priority {spec.max_priority}")
            tenant = Tenant(spec.name, spec.fairness_id or spec.name, spec.max_priority, default,
                            spec.rate_per_second, spec.burst, spec.max_concurrency)
            for secret in spec.api_keys:
                key = secret.get_secret_value()
                if not _KEY.fullmatch(key):
                    raise ValueError(f"tenant {spec.name!r}: an API key is not 8-256 printable ASCII characters")
                digest = _digest(key)
                if digest in self._by_digest:
                    raise ValueError(f"tenant {spec.name!r}: an API key is also configured for another tenant")
                self._by_digest[digest] = tenant
        self.default_flow_id = default_flow_id
        self.require_api_key = require_api_key
        self.anonymous_max_priority = anonymous_max_priority

    @property
    def enabled(self) -> bool:
        """Whether any tenant is configured (else the router trusts the request headers)."""
        return bool(self._by_digest)

    def tenant(self, api_key: str) -> Tenant | None:
        return self._by_digest.get(_digest(api_key))

    def bind(self, api_key: str | None, header_flow_id: str | None, header_priority: int | None) -> Binding:
        """The request's flow, priority and quotas (see the module docstring).

        Raises:
            Unauthenticated: an unknown key, or no key while ``require_api_key``.
        """
        if not self.enabled:
            return Binding("", header_flow_id or self.default_flow_id, header_priority or 0)
        if api_key is None:
            if self.require_api_key:
                raise errors.Unauthenticated("an API key is required ('Authorization: Bearer <api key>')")
            cap = self.anonymous_max_priority
            priority = min(header_priority if header_priority is not None else 0, cap)
            return Binding("", self.default_flow_id, priority)
        tenant = self.tenant(api_key)
        if tenant is None:
            raise errors.Unauthenticated("incorrect API key provided")
        priority = tenant.default_priority if header_priority is None else min(header_priority, tenant.max_priority)
        return Binding(tenant.name, tenant.fairness_id, priority, tenant.rate_per_second, tenant.burst,
                       tenant.max_concurrency)
