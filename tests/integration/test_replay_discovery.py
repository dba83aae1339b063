"""``kvmesh replay``'s engine discovery (``kvmesh_cli.discovery.find_engines``) against a real etcd and a
real epp: the given epp, another epp registered in etcd when it does not answer, then the engines
registered in etcd. The one-line errors for dead or malformed addresses are in
``tests/unit/cli/test_replay_discovery.py``."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest

from kvmesh.membership import LeaseRegistration, endpoint_key, service_key
from kvmesh.types import Endpoint, EndpointId, ServiceInstance
from kvmesh_cli.discovery import engines_from_epp, find_engines
from kvmesh_cli.launcher import free_port
from tests.support import wait_until_async


@pytest.fixture
async def engine(etcd: str) -> AsyncIterator[Endpoint]:
    """An engine registration with a real lease, as an engine registers itself (nothing serves it:
    discovery only lists it)."""
    port = free_port()
    ep = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=f"m-{uuid.uuid4().hex[:8]}")
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg.start()
    yield ep
    await reg.stop()


async def discover(epp: str | None, etcd: str | None) -> tuple[list[str], list[str]]:
    said: list[str] = []
    urls = await asyncio.to_thread(find_engines, epp, etcd, said.append)
    return urls, said


async def test_dead_epp_falls_back_to_the_epp_registered_in_etcd(start_service, etcd: str, engine: Endpoint) -> None:
    _, live_epp = start_service("epp", "--scheduling-config", "load-only")  # registers under /kvmesh/v1/services/epp/
    await wait_until_async(lambda: asyncio.to_thread(engines_from_epp, live_epp), 10, "epp to list the engine",
                           until=lambda urls: engine.url in urls)
    assert (await discover(live_epp, None))[0] == await asyncio.to_thread(engines_from_epp, live_epp)  # the given epp

    dead = f"127.0.0.1:{free_port()}"
    urls, said = await discover(dead, etcd)
    assert engine.url in urls
    assert said == [
        f"epp {dead} refused the connection (UNAVAILABLE): looking for another in etcd {etcd}",
        f"using epp {live_epp}, registered in etcd {etcd}",
    ]


async def test_no_registered_epp_answering_falls_back_to_the_engines_in_etcd(etcd: str, engine: Endpoint) -> None:
    dead, ghost = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    # an epp that registered and died without revoking its lease (its key outlives it until the TTL)
    record = ServiceInstance(service="epp", id=ghost, grpc_address=ghost)
    reg = LeaseRegistration([etcd], service_key("epp", ghost), record.to_json(), ttl_seconds=5)
    await reg.start()
    try:
        urls, said = await discover(dead, etcd)
    finally:
        await reg.stop()
    assert engine.url in urls
    assert said[0] == f"epp {dead} refused the connection (UNAVAILABLE): looking for another in etcd {etcd}"
    assert said[-1].startswith(f"no epp registered in etcd {etcd} answered: using the ")
    assert len(said) == 2


async def test_etcd_alone_lists_the_registered_engines_and_skips_bad_records(etcd: str, engine: Endpoint) -> None:
    bad = LeaseRegistration([etcd], f"/kvmesh/v1/endpoints/{engine.model}/broken", json.dumps({"id": 1}), ttl_seconds=5)
    await bad.start()
    try:
        urls, said = await discover(None, etcd)
    finally:
        await bad.stop()
    assert engine.url in urls and said == []
