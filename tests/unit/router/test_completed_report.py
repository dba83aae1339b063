"""The router's completion reports to epp (issue 9 item 4): fire-and-forget, dropped and counted when epp is away."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.types import CompletionOutcome, RequestCompletion
from kvmesh_cli.launcher import free_port
from services.router import clients
from services.router.clients import PickerClient
from services.router.metrics import EPP_COMPLETIONS_DROPPED


def _dropped(reason: str) -> float:
    return EPP_COMPLETIONS_DROPPED.labels(reason)._value.get()


async def test_unreachable_epp_drops_and_counts_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    client = PickerClient(f"127.0.0.1:{free_port()}", timeout_seconds=0.5)  # nothing listens there
    await client.connect()
    try:
        before = _dropped("unreachable")
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(3):
            client.report_completed(RequestCompletion(f"r{i}", "127.0.0.1:1", 10, 0, CompletionOutcome.SUCCESS))
        assert loop.time() - started < 0.05  # never waits on epp
        for _ in range(200):
            if _dropped("unreachable") >= before + 3:
                break
            await asyncio.sleep(0.01)
        assert _dropped("unreachable") == before + 3
        monkeypatch.setattr(clients, "COMPLETED_QUEUE_MAX", 0)
        full = _dropped("queue_full")
        client.report_completed(RequestCompletion("r9", "127.0.0.1:1"))
        assert _dropped("queue_full") == full + 1
    finally:
        await client.close()
