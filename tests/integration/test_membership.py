"""etcd membership against a real etcd: join, leave on revoke, leave on lease expiry, outage."""

from __future__ import annotations

import asyncio

import aetcd

from kvmesh.membership import ETCD_CHANNEL_OPTIONS, EndpointWatcher, LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port, start_etcd


def _endpoint(port: int, model: str = "m") -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model)


async def test_join_then_leave_on_stop(etcd: str) -> None:
    watcher = EndpointWatcher([etcd], model="m")
    await watcher.start()
    events: list[tuple[set[str], set[str]]] = []
    watcher.add_listener(lambda joined, left: events.append((set(joined), set(left))))
    ep = _endpoint(1001)
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg.start()
    assert reg.registered
    assert await watcher.wait_for(lambda view: ep.id in view, 5)
    assert watcher.snapshot()[ep.id] == ep
    await reg.stop()
    assert await watcher.wait_for(lambda view: ep.id not in view, 5)
    assert events == [({ep.id}, set()), (set(), {ep.id})]
    await watcher.stop()


async def test_other_models_are_not_seen(etcd: str) -> None:
    watcher = EndpointWatcher([etcd], model="only-this")
    await watcher.start()
    other = _endpoint(1002, model="other")
    reg = LeaseRegistration([etcd], endpoint_key(other), other.to_json(), ttl_seconds=3)
    await reg.start()
    mine = _endpoint(1003, model="only-this")
    reg2 = LeaseRegistration([etcd], endpoint_key(mine), mine.to_json(), ttl_seconds=3)
    await reg2.start()
    assert await watcher.wait_for(lambda view: mine.id in view, 5)
    assert other.id not in watcher.snapshot()
    await reg.stop()
    await reg2.stop()
    await watcher.stop()


async def test_crashed_owner_expires_within_ttl(etcd: str) -> None:
    """A registration whose keepalive stops (process crash) disappears after the lease TTL."""
    watcher = EndpointWatcher([etcd])
    await watcher.start()
    ep = _endpoint(1004)
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=2)
    await reg.start()
    assert await watcher.wait_for(lambda view: ep.id in view, 5)
    assert reg._task is not None
    reg._task.cancel()  # simulate a crash: no more refreshes, no revoke
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await watcher.wait_for(lambda view: ep.id not in view, 8)
    assert loop.time() - started < 2 + 3  # TTL plus etcd's expiry granularity
    await watcher.stop()


async def test_bad_registration_value_is_ignored(etcd: str) -> None:
    host, _, port = etcd.rpartition(":")
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    watcher = EndpointWatcher([etcd], model="bad")
    await watcher.start()
    await client.put(b"/kvmesh/v1/endpoints/bad/x", b"{not json")
    good = _endpoint(1005, model="bad")
    await client.put(endpoint_key(good).encode(), good.to_json().encode())
    assert await watcher.wait_for(lambda view: good.id in view, 5)
    assert list(watcher.snapshot()) == [good.id]
    await client.delete_prefix(b"/kvmesh/v1/endpoints/bad/")
    await client.close()
    await watcher.stop()


async def test_watcher_keeps_last_view_through_an_etcd_outage(tmp_path) -> None:
    """etcd dies: the view stays as it was; etcd returns: the watcher resynchronises."""
    # Both ports pinned: the restart below reuses them, as a restarted etcd member keeps its peer URL.
    client_port, peer_port = free_port(), free_port()
    proc, address = start_etcd(tmp_path, client_port=client_port, peer_port=peer_port)
    assert proc.alive(), proc.log_tail()
    watcher = EndpointWatcher([address])
    await watcher.start()
    ep = _endpoint(1006)
    host, _, port = address.rpartition(":")
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    await client.put(endpoint_key(ep).encode(), ep.to_json().encode())
    assert await watcher.wait_for(lambda view: ep.id in view, 5)
    await client.close()
    proc.kill()
    # The watch stream breaks and retries every second; the view must not change meanwhile.
    assert not await watcher.wait_for(lambda view: ep.id not in view, 2.5)
    # Restart on the same data and port: the key is still there, a new one appears.
    proc2, _ = start_etcd(tmp_path, client_port=client_port, peer_port=peer_port)
    try:
        assert proc2.alive(), f"etcd did not restart on its ports:\n{proc2.log_tail()}"
        client = aetcd.Client(host=host, port=int(port), options=ETCD_CHANNEL_OPTIONS)
        await client.connect()
        late = _endpoint(1007)
        await client.put(endpoint_key(late).encode(), late.to_json().encode())
        await client.close()
        assert await watcher.wait_for(lambda view: {ep.id, late.id} <= set(view), 20)
    finally:
        await watcher.stop()
        proc2.stop()


async def test_a_registration_back_within_the_grace_never_leaves(etcd: str) -> None:
    """etcd expiring every lease at once (a pause longer than the TTL) and the engines registering again
    a moment later: the watcher's view keeps them throughout and its listeners hear no leave (the soak
    and a new user saw the whole pool "leave" for ~0.7 s, every request 503)."""
    watcher = EndpointWatcher([etcd], model="m", departure_grace_seconds=2.0)
    await watcher.start()
    events: list[tuple[set[str], set[str]]] = []
    watcher.add_listener(lambda joined, left: events.append((set(joined), set(left))))
    ep = _endpoint(1010)
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg.start()
    assert await watcher.wait_for(lambda view: ep.id in view, 5)
    await reg.stop()  # the key is gone at once (lease revoked)
    await asyncio.sleep(0.5)
    assert ep.id in watcher.snapshot()  # held within the grace
    again = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await again.start()
    await asyncio.sleep(2.5)  # past the grace
    assert ep.id in watcher.snapshot()
    assert events == [({ep.id}, set())]  # joined once, never left
    await again.stop()
    assert await watcher.wait_for(lambda view: ep.id not in view, 5)  # gone for good: leaves after the grace
    assert events == [({ep.id}, set()), (set(), {ep.id})]
    await watcher.stop()


async def test_the_grace_delays_a_real_departure_by_that_much_only(etcd: str) -> None:
    watcher = EndpointWatcher([etcd], model="m", departure_grace_seconds=1.0)
    await watcher.start()
    ep = _endpoint(1011)
    reg = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg.start()
    assert await watcher.wait_for(lambda view: ep.id in view, 5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await reg.stop()
    assert await watcher.wait_for(lambda view: ep.id not in view, 5)
    assert 0.9 <= loop.time() - started < 3.0
    no_grace = EndpointWatcher([etcd], model="m", departure_grace_seconds=0)
    await no_grace.start()
    reg2 = LeaseRegistration([etcd], endpoint_key(ep), ep.to_json(), ttl_seconds=3)
    await reg2.start()
    assert await no_grace.wait_for(lambda view: ep.id in view, 5)
    started = loop.time()
    await reg2.stop()
    assert await no_grace.wait_for(lambda view: ep.id not in view, 5)
    assert loop.time() - started < 0.9
    await no_grace.stop()
    await watcher.stop()
