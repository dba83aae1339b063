"""The ``rigs`` fixture of the event-pool tests: what a test opens (anything with ``async close()``,
e.g. :class:`tests.unit.kv_indexer._support.Rig`) is closed after it, failed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest


@pytest.fixture
async def rigs() -> AsyncIterator[list[Any]]:
    made: list[Any] = []
    yield made
    for rig in made:
        await rig.close()
