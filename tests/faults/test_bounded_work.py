"""Bounded work on every path (issue 14 item 2), end to end through a mesh on the precise policy.

The case from the issue: a 2,000,000-byte text prompt made epp send it to /tokenize on every
engine in turn, each engine blocked ~10 s, both lost their etcd lease and were purged, and
bystanders got 503 then 404. Its siblings: huge chat messages, a huge token-id list, many
concurrent big prompts. Each must get a clean answer (4xx, or 200 for a prompt that fits) within a
bounded time, while bystander requests keep succeeding and no engine leaves etcd.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aetcd
import httpx
import pytest

from kvmesh.lease_thread import ThreadedLeaseRegistration
from kvmesh.membership import EndpointWatcher, LeaseRegistration
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.fault_load import OK, Load
from kvmesh_cli.mesh import Mesh

pytestmark = [pytest.mark.faults, pytest.mark.integration]

BOUND_SECONDS = 10.0
"""A huge request's answer comes within this (on a loaded 2-core machine; ~0.1-2 s measured)."""


def _words(n_chars: int, seed: int) -> str:
    words = " ".join(f"lorem{(seed + 7 * k) % 1000}" for k in range(n_chars // 6 + 1))
    return words[:n_chars]


CASES: dict[str, tuple[str, dict[str, object]]] = {
    "text prompt 2,000,000 bytes": ("/v1/completions", {"prompt": "a" * 2_000_000}),
    "text prompt 2 MB of words": ("/v1/completions", {"prompt": _words(2_000_000, 1)}),
    "chat 2 messages x 1 MB": ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": _words(1_000_000, 2)}, {"role": "user", "content": "b" * 1_000_000}]}),
    "400,000 token ids": ("/v1/completions", {"prompt": [i % 2000 + 3 for i in range(400_000)]}),
}


@pytest.fixture
async def leaves(mesh: Mesh):  # type: ignore[no-untyped-def]
    """Every endpoint that leaves etcd while the test runs."""
    watcher = EndpointWatcher([mesh.etcd_address], model=mesh.spec.model)
    gone: list[EndpointId] = []

    def listener(joined: dict[EndpointId, Endpoint], left: dict[EndpointId, Endpoint]) -> None:
        gone.extend(i for i in left if i not in joined)

    watcher.add_listener(listener)
    await watcher.start()
    yield gone
    await watcher.stop()


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[int, float, str]:
    started = time.monotonic()
    reply = await client.post(url, json=body)
    return reply.status_code, time.monotonic() - started, reply.text[:300]


@pytest.mark.parametrize("case", list(CASES))
async def test_huge_request_is_answered_at_once_and_costs_no_lease(mesh: Mesh, leaves: list[EndpointId], case: str) -> None:
    path, extra = CASES[case]
    body = {"model": mesh.spec.model, "max_tokens": 4, **extra}
    async with Load(mesh.router_url, mesh.spec.model, concurrency=3) as bystanders, \
            httpx.AsyncClient(timeout=60) as client:
        await asyncio.sleep(0.5)
        status, elapsed, text = await _send(client, mesh.router_url + path, body)
        await asyncio.sleep(2.0)  # bystanders keep going after it
    print(f"{case}: HTTP {status} in {elapsed:.2f}s ({text[:150]!r}); bystanders {dict(bystanders.classes())}")
    assert 400 <= status < 500, (status, text)
    assert "context length" in text or "too large" in text.lower() or status == 413, text
    assert elapsed < BOUND_SECONDS
    assert set(bystanders.classes()) == {OK}, bystanders.classes()
    assert not leaves, f"engines left etcd: {leaves}"


async def test_many_concurrent_big_prompts(mesh: Mesh, leaves: list[EndpointId]) -> None:
    """16 concurrent prompts of 150,000-600,000 characters (past epp's 262,144-character tokenize bound or not; engines encode them off their event loop): every one
    answered (200 or 400) within the bound, bystanders unaffected, no engine leaves."""
    bodies = [{"model": mesh.spec.model, "max_tokens": 2, "prompt": _words(150_000 + 30_000 * i, i)} for i in range(16)]
    async with Load(mesh.router_url, mesh.spec.model, concurrency=3) as bystanders, \
            httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.sleep(0.5)
        results = await asyncio.gather(*(_send(client, mesh.router_url + "/v1/completions", b) for b in bodies))
        await asyncio.sleep(1.0)
    statuses = sorted(s for s, _, _ in results)
    slowest = max(e for _, e, _ in results)
    print(f"16 big prompts: statuses {statuses} slowest {slowest:.2f}s; bystanders {dict(bystanders.classes())}")
    assert set(statuses) <= {200, 400}, results
    assert slowest < 2 * BOUND_SECONDS
    assert set(bystanders.classes()) == {OK}, bystanders.classes()
    assert not leaves, f"engines left etcd: {leaves}"


@pytest.mark.parametrize("threaded", [True, False])
async def test_lease_keepalive_survives_a_blocked_owner_loop(etcd: str, threaded: bool) -> None:
    """The owner's event loop blocked for 2.5 lease TTLs (a long CPU-bound call holding the loop):
    the threaded registration (the simulator's) keeps its key; the plain one, refreshed from the
    blocked loop, loses it (which is what purged both engines in issue 14)."""
    key = f"/kvmesh/v1/test-lease/{uuid.uuid4().hex}"
    cls = ThreadedLeaseRegistration if threaded else LeaseRegistration
    registration = cls([etcd], key, "v", ttl_seconds=2)
    await registration.start()
    try:
        time.sleep(5.0)  # noqa: ASYNC251 - blocking the owner's loop is the fault under test
        host, _, port = etcd.rpartition(":")
        async with aetcd.Client(host=host, port=int(port)) as client:
            present = await client.get(key.encode()) is not None
        assert present is threaded
    finally:
        await registration.stop()


async def test_engine_answers_health_while_tokenizing_two_megabytes(mesh: Mesh, leaves: list[EndpointId]) -> None:
    """A direct /tokenize of 2,000,000 bytes (vLLM applies no context check there): the engine encodes it
    off its event loop, so /health answers promptly meanwhile, and it stays registered."""
    url = mesh.engine_urls[0]
    async with httpx.AsyncClient(timeout=60) as client:
        big = asyncio.create_task(client.post(f"{url}/tokenize", json={"model": mesh.spec.model,
                                                                       "prompt": _words(2_000_000, 5)}))
        health: list[float] = []
        while not big.done():
            started = time.monotonic()
            assert (await client.get(f"{url}/health", timeout=5)).status_code == 200
            health.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
        reply = await big
    assert reply.status_code == 200 and reply.json()["count"] > 100_000
    print(f"/tokenize 2 MB: {len(health)} health polls meanwhile, slowest {max(health):.3f}s")
    assert len(health) >= 3 and max(health) < 1.0, health
    assert not leaves, f"engines left etcd: {leaves}"
