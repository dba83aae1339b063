"""Per-pick scratch space shared by the plugins of one scheduling cycle, with typed keys.

GIE's ``CycleState`` is an untyped ``map[StateKey]any`` (STYLE.md lists it under "avoid");
here a :class:`StateKey` carries its value type, so ``state.get(TOKEN_IDS)`` is typed
``list[int] | None`` for readers and type checkers alike. This module holds only the generic
container: each key is declared in the module of the prepare step that produces it (e.g.
``TOKEN_IDS`` and ``PREFIX_MATCH`` in ``services/epp/plugins/prepare/prefix_match.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StateKey(Generic[T]):
    """A named key whose values have type ``T`` (``StateKey[list[int]]("token-ids", producer="prefix-match")``).

    Attributes:
        name: unique among the keys of one cycle.
        producer: the registered type of the prepare step that writes it (named in config errors).
    """

    name: str
    producer: str = ""


@dataclass(slots=True)
class CycleState:
    """Values written by one plugin and read by later ones within a single pick."""

    _values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: StateKey[T]) -> T | None:
        return self._values.get(key.name)

    def set(self, key: StateKey[T], value: T) -> None:
        self._values[key.name] = value

    def __contains__(self, key: StateKey[Any]) -> bool:
        return key.name in self._values
