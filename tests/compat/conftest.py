"""Compat suite set-up: tests marked ``vllm`` need the real vLLM environment (``make test-vllm``).

Without ``.venv-vllm`` and the tiny model (``make vllm-env model``) they are skipped with the
reason, and the terminal summary says so in one line, so a plain ``make test`` shows that the real
engine was not exercised. ``KVMESH_REQUIRE_VLLM=1`` (set by ``make test-vllm``) turns the skip into
an error instead.
"""

from __future__ import annotations

import os

import pytest

from kvmesh_cli.vllm_engine import vllm_missing_reason

_skipped: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("vllm") is not None]
    reason = vllm_missing_reason() if marked else None
    if reason is None:
        return
    if os.environ.get("KVMESH_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(f"make test-vllm: {reason}")
    skip = pytest.mark.skip(reason=f"real vLLM not available: {reason}")
    for item in marked:
        item.add_marker(skip)
    _skipped.append(f"{len(marked)} vLLM compat tests skipped: {reason}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _skipped:
        terminalreporter.write_line(line, yellow=True)
