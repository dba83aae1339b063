"""KvStoreConfig: every knob of the kv_store service (flags > env > file > defaults)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig

MIB = 1024 * 1024


class KvStoreConfig(GrpcServiceConfig):
    """The tiered KV store: an in-memory CPU tier with LRU eviction."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_KV_STORE_")

    cpu_capacity_bytes: int = Field(1024 * MIB, gt=0)
    """Budget of the in-memory tier for value bytes; least recently used keys are evicted beyond it."""
    get_chunk_bytes: int = Field(1 * MIB, ge=1024, le=3 * MIB)
    """Size of each data chunk a Get streams back (below gRPC's default 4 MiB message limit)."""
