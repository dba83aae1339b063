"""The models the mesh serves, derived from the live endpoint set in etcd (pure, no I/O).

A model is served when at least one endpoint registered under ``/kvmesh/v1/endpoints/<model>/``
is live. Its context length is the smallest ``max_model_len`` label among those endpoints (an
engine registers ``labels={"max_model_len": "<n>"}``; see engine_simulator), so a request the
router admits fits every endpoint epp may pick. Endpoints without the label do not constrain it;
a model with no labelled endpoint has ``max_model_len=None`` (unknown: only the engine checks).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
