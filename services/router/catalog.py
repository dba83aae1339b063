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

from kvmesh.types import Endpoint

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

    @classmethod
    def from_endpoints(cls, endpoints: Iterable[Endpoint]) -> ModelCatalog:
        lens: dict[str, int | None] = {}
        counts: dict[str, int] = {}
        for ep in endpoints:
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
        return cls({name: ModelInfo(name, lens.get(name), n) for name, n in sorted(counts.items())})

    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str) -> ModelInfo | None:
        return self.models.get(name)
