"""Per-pick scratch space shared by the plugins of one scheduling cycle, with typed keys.

GIE's ``CycleState`` is an untyped ``map[StateKey]any`` (STYLE.md lists it under "avoid");
here a :class:`StateKey` carries its value type, so ``state.get(TOKEN_IDS)`` is typed
``list[int] | None`` for readers and type checkers alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from services.epp.framework.interfaces import PrefixMatch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StateKey(Generic[T]):
    """A named key whose values have type ``T`` (``StateKey[list[int]]("token-ids")``)."""

    name: str


@dataclass(slots=True)
class CycleState:
    """Values written by one plugin and read by later ones within a single pick."""

    _values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: StateKey[T]) -> T | None:
        return self._values.get(key.name)  # type: ignore[no-any-return]

    def set(self, key: StateKey[T], value: T) -> None:
        self._values[key.name] = value

    def __contains__(self, key: StateKey[Any]) -> bool:
        return key.name in self._values


TOKEN_IDS: StateKey[list[int]] = StateKey("token-ids")
"""The prompt's token ids once some plugin obtained them (given by the caller or tokenized)."""

PREFIX_MATCH: StateKey[PrefixMatch | None] = StateKey("prefix-match")
"""kv_indexer's answer for the prompt once fetched (None: no tokens, or the call failed: score 0)."""
