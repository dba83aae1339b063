"""``SidecarConfig``: the sidecar's one typed config (flags, ``KVMESH_REGISTRATION_SIDECAR_*`` env, YAML).

The sidecar serves no gRPC, so its base is :class:`~kvmesh.config.ProcessConfig`; ``--metrics-port``
serves its ``kvmesh_registration_sidecar_*`` metrics on ``--host`` (0 picks a free port).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from kvmesh.config import ProcessConfig
from kvmesh.types import EndpointRole


class SidecarConfig(ProcessConfig):
    """Registers an engine (vLLM or any OpenAI-compatible server) in etcd while its /health answers."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_REGISTRATION_SIDECAR_")

    engine_url: str = ""
    """Base URL of the engine's HTTP API, e.g. http://127.0.0.1:8011 (required); its host:port is the endpoint id."""
    model: str = ""
    """Served model name (vLLM's --served-model-name); required."""
    block_size_tokens: int = Field(32, ge=1, le=4096)
    """The engine's KV block size in tokens (vLLM's --block-size)."""
    events_endpoint: str = ""
    """ZMQ endpoint of the engine's KV-event publisher (its kv-events-config endpoint); empty: none."""
    replay_endpoint: str = ""
    """ZMQ endpoint of the engine's KV-event replay ROUTER (its kv-events-config replay_endpoint); empty: none."""
    role: EndpointRole = EndpointRole.BOTH
    """Role registered in etcd (prefill/decode disaggregation)."""
    engine_label: str = "vllm"
    """Value of the ``engine`` label of the registration."""
    max_model_len: int = Field(0, ge=0)
    """Context length registered as the ``max_model_len`` label; 0 asks the engine's GET /v1/models
    (and an engine whose /v1/models cannot be read is *not* registered: ERROR log, transition ``refused``)."""
    engine_api_key: SecretStr | None = None
    """The engine's API key (vLLM ``--api-key``), sent as ``Authorization: Bearer`` on every probe
    (vLLM checks it on ``/v1/*``, so ``/v1/models`` needs it). Env ``KVMESH_REGISTRATION_SIDECAR_ENGINE_API_KEY``."""
    health_path: str = "/health"
    """Health route polled on the engine (200 = healthy)."""
    health_interval_seconds: float = Field(1.0, gt=0, le=60)
    """Time between two health polls."""
    health_timeout_seconds: float = Field(2.0, gt=0, le=60)
    """Timeout of one health poll (a timeout counts as a failure)."""
    failure_threshold: int = Field(3, ge=1, le=100)
    """Consecutive failed polls that deregister the engine (refused connection or non-200 status)."""
    unresponsive_grace_seconds: float = Field(30.0, ge=0, le=3600)
    """A busy engine (polls time out, connection accepted) stays registered this long before deregistering."""
    success_threshold: int = Field(1, ge=1, le=100)
    """Consecutive good polls that (re-)register it."""

    @model_validator(mode="after")
    def _check(self) -> SidecarConfig:
        if not self.engine_url:
            raise ValueError("--engine-url is required")
        parts = urlsplit(self.engine_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"--engine-url must be http(s)://host:port, got {self.engine_url!r}")
        if not self.model:
            raise ValueError("--model is required")
        return self

    @property
    def endpoint_id(self) -> str:
        """``host:port`` of ``engine_url`` (the endpoint id, as the topic ``kv@<id>@<model>`` names it)."""
        parts = urlsplit(self.engine_url)
        return f"{parts.hostname}:{parts.port}"
