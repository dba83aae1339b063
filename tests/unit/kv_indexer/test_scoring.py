"""longest_prefix_matches and media_counts: the prefix walk over a key -> holders table."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvmesh.types import EndpointId, Medium
from services.kv_indexer.scoring import MEDIUM_LANE, longest_prefix_matches, media_counts, media_of

G, C = Medium.GPU, Medium.CPU
a, b, c = EndpointId("a"), EndpointId("b"), EndpointId("c")
g, cpu = MEDIUM_LANE[G], MEDIUM_LANE[C]  # holders pack one 32-bit refcount per medium into an int
TABLE: Mapping[int, Mapping[EndpointId, int]] = {
    1: {a: g, b: g, c: cpu},
    2: {a: g + cpu, b: 2 * g},
    3: {a: g},
    5: {b: g},  # after a hole: never reached for b
}


@pytest.mark.parametrize(
    ("keys", "candidates", "expected"),
    [
        ([], None, {}),
        ([9, 1], None, {}),
        ([1], None, {"a": 1, "b": 1, "c": 1}),
        ([1, 2, 3], None, {"a": 3, "b": 2, "c": 1}),
        ([1, 2, 3, 4, 5], None, {"a": 3, "b": 2, "c": 1}),
        ([1, 2, 3], {"b", "c"}, {"b": 2, "c": 1}),
        ([1, 2, 3], {"zzz"}, {}),
        ([1, 2], None, {"a": 2, "b": 2, "c": 1}),
    ],
    ids=["empty", "first-miss", "one-block", "walk", "stops-at-hole", "candidates", "unknown-candidate", "all-to-the-end"],
)
def test_longest_prefix_matches(keys: list[int], candidates: set[EndpointId] | None, expected: dict) -> None:
    assert longest_prefix_matches(keys, TABLE, candidates) == expected


def test_media_counts() -> None:
    assert media_counts([1, 2, 3], TABLE, a) == {G: 3, C: 1}
    assert media_counts([1], TABLE, c) == {C: 1}
    assert media_counts([1, 2], TABLE, b) == {G: 2}  # a refcount of 2 is still one block


def test_packed_refcounts_name_their_media() -> None:
    assert media_of(g + cpu) == {G, C} and media_of(3 * cpu) == {C} and media_of(0) == frozenset()
    assert media_of(MEDIUM_LANE[Medium.SHARED]) == {Medium.SHARED}
