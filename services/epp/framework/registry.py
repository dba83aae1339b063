"""Plugin type -> factory registry, refusing duplicates and naming the known types on a miss.

A factory is ``(name, parameters, handle) -> Plugin``; each validates its own parameters with its
pydantic model (:func:`parse_params`). GIE's ``pkg/epp/plugins/registry.go`` silently overwrote
duplicates; this one raises. There is no module-level registry: :func:`services.epp.plugins.default_registry`
builds a fresh one, so tests can register test-only plugins without leaking state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pydantic

from services.epp.framework.interfaces import ConfigError, Plugin, PluginHandle

PluginFactory = Callable[[str, Mapping[str, Any], PluginHandle], Plugin]
P = TypeVar("P", bound=pydantic.BaseModel)


class PluginRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, PluginFactory] = {}

    def register(self, type_name: str, factory: PluginFactory) -> None:
        """Raises ValueError when ``type_name`` is already registered or not kebab-case."""
        if not type_name or type_name != type_name.lower() or "_" in type_name or " " in type_name:
            raise ValueError(f"plugin type {type_name!r} is not kebab-case")
        if type_name in self._factories:
            raise ValueError(f"plugin type {type_name!r} is already registered")
        self._factories[type_name] = factory

    def types(self) -> list[str]:
        return sorted(self._factories)

    def create(self, type_name: str, name: str, params: Mapping[str, Any], handle: PluginHandle) -> Plugin:
        """Build one plugin instance.

        Raises:
            ConfigError: unknown type (the message lists the known ones) or invalid parameters.
        """
        factory = self._factories.get(type_name)
        if factory is None:
            raise ConfigError(f"unknown plugin type {type_name!r}; known types: {', '.join(self.types())}")
        return factory(name, params, handle)


def parse_params(model: type[P], type_name: str, name: str, params: Mapping[str, Any]) -> P:
    """Validate ``params`` against a plugin's pydantic model (which should forbid extra keys).

    Raises:
        ConfigError: naming the plugin and each bad field.
    """
    try:
        return model.model_validate(dict(params))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<parameters>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"plugin {name!r} (type {type_name}): invalid parameters: {problems}") from None


class NoParams(pydantic.BaseModel):
    """For plugins without parameters: any key is an error."""

    model_config = pydantic.ConfigDict(extra="forbid")
