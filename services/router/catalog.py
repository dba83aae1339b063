"""The models the mesh serves, derived from the live endpoint set in etcd (pure, no I/O).

A model is served when at least one endpoint registered under ``/kvmesh/v1/endpoints/<model>/``
is live. Its context length is the smallest ``max_model_len`` label among those endpoints (an
engine registers ``labels={"max_model_len": "<n>"}``; see engine_simulator), so a request the
router admits fits every endpoint epp may pick. Endpoints without the label do not constrain it;
a model with no labelled endpoint has ``max_model_len=None`` (unknown: only the engine checks).

A model that *was* served and has no live endpoint now (a lease expired, an engine restarting) is
not unknown: :class:`ModelMemory` remembers the names (models and LoRA adapters) it saw live, and
the catalog lists those that left less than ``memory_seconds`` ago in ``departed``; the router
answers them 503 + ``retry-after`` (retryable), and 404 only for names never served.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvmesh.types import LORA_ADAPTERS_LABEL, Endpoint

MAX_MODEL_LEN_LABEL = "max_model_len"



@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One served model: name, context length in tokens (None = unknown), live endpoint count."""

    name: str
    max_model_len: int | None
    endpoints: int


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    """An immutable view: model name -> :class:`ModelInfo`."""

    models: dict[str, ModelInfo] = field(default_factory=dict)
    lora_adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapter name -> the base model whose endpoints serve it."""
    departed: frozenset[str] = frozenset()
    """Names (models, adapters) served recently that have no live endpoint now (:class:`ModelMemory`)."""

    def recently_served(self, name: str) -> bool:
        """Whether ``name`` was served recently and is not now (503, not 404)."""
        return name in self.departed

    @classmethod
    def from_endpoints(cls, endpoints: Iterable[Endpoint]) -> ModelCatalog:
        lens: dict[str, int | None] = {}
        counts: dict[str, int] = {}
        endpoints_list = list(endpoints)
        for ep in endpoints_list:
            counts[ep.model] = counts.get(ep.model, 0) + 1
            raw = ep.labels.get(MAX_MODEL_LEN_LABEL)
            value: int | None = None
            if raw is not None:
                try:
                    value = int(raw)
                except ValueError:
                    value = None
                if value is not None and value <= 0:
                    value = None
            current = lens.get(ep.model)
            if value is not None and (current is None or value < current):
                lens[ep.model] = value
            else:
                lens.setdefault(ep.model, current)
        adapters: dict[str, str] = {}
        for ep in endpoints_list:
            for name in ep.labels.get(LORA_ADAPTERS_LABEL, "").split(","):
                if name.strip() and name.strip() not in counts:
                    adapters.setdefault(name.strip(), ep.model)
        return cls({name: ModelInfo(name, lens.get(name), n) for name, n in sorted(counts.items())}, adapters)

    def base_model(self, name: str) -> str | None:
        """The base model serving LoRA adapter ``name`` (None when it is no adapter)."""
        return self.lora_adapters.get(name)

    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str) -> ModelInfo | None:
        return self.models.get(name)


class ModelMemory:
    """Which names were served recently (pure; the caller passes the time, monotonic seconds).

    :meth:`observe` takes each new catalog: a name that was live and is no more is remembered from
    that moment for ``memory_seconds``; a name that comes back is live again.
    """

    def __init__(self, memory_seconds: float) -> None:
        self.memory_seconds = memory_seconds
        self._live: set[str] = set()
        self._left: dict[str, float] = {}

    def observe(self, catalog: ModelCatalog, now: float) -> ModelCatalog:
        """``catalog`` with ``departed`` filled in, the memory updated with what is live at ``now``."""
        live = set(catalog.models) | set(catalog.lora_adapters)
        for name in self._live - live:
            self._left[name] = now
        for name in live:
            self._left.pop(name, None)
        self._live = live
        return self.current(catalog, now)

    def current(self, catalog: ModelCatalog, now: float) -> ModelCatalog:
        """``catalog`` with ``departed`` = the names that left less than ``memory_seconds`` before ``now``."""
        for name, left in list(self._left.items()):
            if now - left >= self.memory_seconds:
                del self._left[name]
        return replace(catalog, departed=frozenset(self._left))

    def next_expiry(self) -> float | None:
        """When the oldest remembered name is forgotten (None when nothing is remembered)."""
        return min(self._left.values()) + self.memory_seconds if self._left else None
