"""LeaseRegistration's keep-alive against a real etcd: one LeaseKeepAlive per refresh (its reply's TTL
says whether etcd still knows the lease), and a lease etcd forgot is noticed at the next refresh and
the key registered again under a new lease (issue 10's idle cost: the LeaseTimeToLive call beside
every refresh was dropped; etcd 3.5's LeaseKeepAliveResponse.TTL is 0 for an unknown lease)."""

from __future__ import annotations

import asyncio

import aetcd

from kvmesh.membership import ETCD_CHANNEL_OPTIONS, LeaseRegistration


async def _lease_of(client: aetcd.Client, key: str) -> int | None:
    value = await client.get(key.encode())
    return None if value is None else value.lease


async def test_a_revoked_lease_is_noticed_at_the_next_refresh_and_the_key_comes_back(etcd: str) -> None:
    host, port = etcd.rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port), options=ETCD_CHANNEL_OPTIONS)
    await client.connect()
    key = "/kvmesh/test/lease-keepalive/a"
    reg = LeaseRegistration([etcd], key, "v", ttl_seconds=3)  # refreshed every 1 s
    await reg.start()
    try:
        first = await _lease_of(client, key)
        assert first
        await asyncio.sleep(2.5)  # two refreshes: the same lease, the key still there
        assert await _lease_of(client, key) == first
        await client.revoke_lease(first)  # etcd forgets the lease: the key goes with it
        assert await client.get(key.encode()) is None
        deadline = asyncio.get_running_loop().time() + 5.0
        again = None
        while asyncio.get_running_loop().time() < deadline and not again:
            await asyncio.sleep(0.1)
            again = await _lease_of(client, key)
        assert again and again != first  # registered again within about one refresh interval
        assert await client.get(key.encode()) is not None
    finally:
        await reg.stop()
        await client.close()
