"""longest_prefix_matches and media_counts: the prefix walk over a key -> holders table."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvmesh.types import EndpointId, Medium
from services.kv_indexer.scoring import longest_prefix_matches, media_counts

G, C = Medium.GPU, Medium.CPU
a, b, c = EndpointId("a"), EndpointId("b"), EndpointId("c")
TABLE: Mapping[int, Mapping[EndpointId, Mapping[Medium, int]]] = {
    1: {a: {G: 1}, b: {G: 1}, c: {C: 1}},
    2: {a: {G: 1, C: 1}, b: {G: 1}},
    3: {a: {G: 1}},
    5: {b: {G: 1}},  # after a hole: never reached for b
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
