"""etcd membership: lease-backed registrations and prefix watches.

Layout (all values JSON):

| key | value |
| --- | --- |
| ``/kvmesh/v1/endpoints/<model>/<endpoint id>`` | :class:`kvmesh.types.Endpoint` |
| ``/kvmesh/v1/services/<service>/<instance id>`` | :class:`kvmesh.types.ServiceInstance` |

A :class:`LeaseRegistration` grants a lease (TTL default 10 s), puts its key with it and
refreshes it every TTL/3; if the lease is lost (etcd restarted, a long pause) it grants a
new one and puts the key again. ``stop()`` revokes the lease so watchers see the leave at
once. A :class:`EndpointWatcher` loads the prefix, then follows its watch stream; when etcd
is unreachable it keeps the last known view, logs it, and resynchronises on reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aetcd

from kvmesh.types import Endpoint, EndpointId

logger = logging.getLogger(__name__)

ENDPOINTS_PREFIX = "/kvmesh/v1/endpoints/"
SERVICES_PREFIX = "/kvmesh/v1/services/"
KV_SOURCES_PREFIX = "/kvmesh/v1/kv_sources/"
"""KV-event sources that are not engines (kv_store instances): ``<prefix><model>/<id>``, the same
``Endpoint`` JSON; kv_indexer follows them, routing (epp, router) never sees them."""
_RETRY_SECONDS = 1.0
DEPARTURE_GRACE_SECONDS = 2.0
"""How long a watcher keeps an endpoint whose key went away, for it to register again
(:class:`EndpointWatcher`): above the ~0.5-1 s engines take to re-register after etcd expired their
leases on resuming, below the fault suite's "membership converges within the lease TTL" margin."""


def endpoint_key(endpoint: Endpoint) -> str:
    return f"{ENDPOINTS_PREFIX}{endpoint.model}/{endpoint.id}"


def kv_source_key(source: Endpoint) -> str:
    return f"{KV_SOURCES_PREFIX}{source.model}/{source.id}"


def service_key(service: str, instance_id: str) -> str:
    return f"{SERVICES_PREFIX}{service}/{instance_id}"


def _client(etcd_endpoints: list[str], timeout_seconds: float = 3.0) -> aetcd.Client:
    if not etcd_endpoints:
        raise ValueError("no etcd endpoints configured")
    host, _, port = etcd_endpoints[0].rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=timeout_seconds, options=ETCD_CHANNEL_OPTIONS)


ETCD_CHANNEL_OPTIONS = {
    # gRPC shares subchannels process-wide by default: a new client to an etcd that just came back would
    # inherit the failed subchannel's backoff (1 s growing to 120 s) and fail at once with the old
    # "connection refused". Each client gets its own, reconnecting within a second.
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}
"""gRPC channel options of every etcd client kvmesh makes (membership, leases, watches)."""


class LeaseRegistration:
    """Keeps ``key = value`` alive in etcd under a lease while the owner runs.

    ``start()`` returns after the first successful put, or after ``first_attempt_timeout_seconds``
    with the retries continuing in the background (a service must not hang on etcd).
    """

    def __init__(
        self,
        etcd_endpoints: list[str],
        key: str,
        value: str,
        ttl_seconds: int = 10,
        first_attempt_timeout_seconds: float = 5.0,
    ) -> None:
        self._etcd_endpoints = etcd_endpoints
        self.key = key
        self._value = value
        self.ttl_seconds = ttl_seconds
        self._first_timeout = first_attempt_timeout_seconds
        self._client: aetcd.Client | None = None
        self._lease: aetcd.Lease | None = None
        self._task: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lease:{self.key}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._registered.wait(), self._first_timeout)
        if not self._registered.is_set():
            logger.warning("etcd registration pending key=%s (etcd unreachable, retrying)", self.key)

    async def update(self, value: str) -> None:
        """Change the registered value (kept under the same lease)."""
        self._value = value
        if self._client is not None and self._lease is not None:
            await self._client.put(self.key.encode(), value.encode(), lease=self._lease)

    async def _register(self) -> None:
        if self._client is None:
            self._client = _client(self._etcd_endpoints)
            await self._client.connect()
        self._lease = await self._client.lease(self.ttl_seconds)
        await self._client.put(self.key.encode(), self._value.encode(), lease=self._lease)
        self._registered.set()
        logger.info("registered key=%s lease=%x ttl=%ds", self.key, self._lease.id, self.ttl_seconds)

    async def _run(self) -> None:
        interval = max(0.5, self.ttl_seconds / 3)
        while True:
            try:
                if self._lease is None:
                    await self._register()
                await asyncio.sleep(interval)
                # One LeaseKeepAlive per refresh: its reply carries the TTL left, 0 once etcd forgot the
                # lease (as etcd's clientv3 reads it), so no LeaseTimeToLive call beside it (idle cost, issue 10).
                reply = await self._lease.refresh()  # type: ignore[union-attr]
                if reply is None or reply.TTL <= 0:
                    logger.warning("lease lost key=%s; registering again", self.key)
                    self._lease = None
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("etcd keepalive failed key=%s error=%s", self.key, exc)
                self._lease = None
                await self._close_client()
                await asyncio.sleep(_RETRY_SECONDS)

    async def _close_client(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
            self._client = None

    async def stop(self) -> None:
        """Stop refreshing and revoke the lease (the key disappears at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), 2.0)
            logger.info("deregistered key=%s", self.key)
        self._lease = None
        await self._close_client()


MembershipListener = Callable[[dict[EndpointId, Endpoint], dict[EndpointId, Endpoint]], None]
"""Called with ``(joined, left)`` after every change of the view (never with both empty)."""


class EndpointWatcher:
    """The live endpoint set under ``/kvmesh/v1/endpoints/`` (optionally one model).

    ``snapshot()`` is the current view; listeners hear joins and leaves (a changed
    registration counts as a leave then a join only when its identity fields change).

    Departure grace: an endpoint whose key disappears stays in the view for
    ``departure_grace_seconds`` (:data:`DEPARTURE_GRACE_SECONDS`) and leaves only if it has not
    registered again by then. etcd paused or partitioned for longer than the lease TTL expires every
    lease at once when it comes back, and every engine re-registers within about a second: without
    the grace the whole pool "leaves" for that second (each request 503, kv_indexer purging what it
    indexed). A dead engine leaves that much later; until then the router's connect fails fast and
    the request moves on to a fallback before its first byte (docs/degraded-modes.md).
    """

    def __init__(self, etcd_endpoints: list[str], model: str | None = None, root: str = ENDPOINTS_PREFIX,
                 departure_grace_seconds: float = DEPARTURE_GRACE_SECONDS) -> None:
        self._etcd_endpoints = etcd_endpoints
        self.prefix = root + (f"{model}/" if model else "")
        self.departure_grace_seconds = departure_grace_seconds
        self._view: dict[str, Endpoint] = {}  # etcd key -> endpoint
        self._held: dict[str, Endpoint] = {}  # etcd key -> endpoint whose key went away less than the grace ago
        self._expiries: dict[str, asyncio.TimerHandle] = {}
        self._expiring: asyncio.Future[None] | None = None
        self._listeners: list[MembershipListener] = []
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._changed = asyncio.Condition()

    def add_listener(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def snapshot(self) -> dict[EndpointId, Endpoint]:
        view = {ep.id: ep for ep in self._held.values()}
        view.update((ep.id, ep) for ep in self._view.values())  # a live registration wins over a held one
        return view

    async def start(self, first_sync_timeout_seconds: float = 5.0) -> None:
        """Start watching; returns after the first full load or the timeout (retries continue)."""
        self._task = asyncio.create_task(self._run(), name=f"watch:{self.prefix}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), first_sync_timeout_seconds)

    async def stop(self) -> None:
        for handle in self._expiries.values():
            handle.cancel()
        self._expiries.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_for(self, predicate: Callable[[dict[EndpointId, Endpoint]], bool], timeout: float) -> bool:
        """Wait until ``predicate(snapshot())`` holds; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self.snapshot())), timeout)
            except TimeoutError:
                return False
        return True

    def _parse(self, key: str, value: bytes) -> Endpoint | None:
        try:
            return Endpoint.from_json(value)
        except ValueError as exc:
            logger.warning("ignoring bad registration key=%s error=%s", key, exc)
            return None

    async def _replace(self, new_view: dict[str, Endpoint]) -> None:
        old = self.snapshot()
        if self.departure_grace_seconds > 0:
            loop = asyncio.get_running_loop()
            for key, ep in self._view.items():
                if key not in new_view and key not in self._held:
                    self._held[key] = ep
                    self._expiries[key] = loop.call_later(self.departure_grace_seconds, self._expire, key)
                    logger.info("endpoint registration gone id=%s; kept %.1fs for it to register again",
                                ep.id, self.departure_grace_seconds)
            for key in [k for k in self._held if k in new_view]:
                del self._held[key]
                self._expiries.pop(key).cancel()
                logger.info("endpoint registered again id=%s", new_view[key].id)
        self._view = new_view
        await self._publish(old)

    def _expire(self, key: str) -> None:
        self._expiries.pop(key, None)
        if key in self._held:
            old = self.snapshot()
            del self._held[key]
            self._expiring = asyncio.ensure_future(self._publish(old))

    async def _publish(self, old: dict[EndpointId, Endpoint]) -> None:
        """Tell the listeners (and :meth:`wait_for`) how the view changed from ``old``."""
        new = self.snapshot()
        joined = {i: e for i, e in new.items() if i not in old or old[i] != e}
        left = {i: e for i, e in old.items() if i not in new or new[i] != e}
        if joined or left:
            for endpoint_id in left:
                logger.info("endpoint left id=%s", endpoint_id)
            for endpoint_id, ep in joined.items():
                logger.info("endpoint joined id=%s model=%s url=%s", endpoint_id, ep.model, ep.url)
            for listener in self._listeners:
                try:
                    listener(joined, left)
                except Exception:
                    logger.exception("membership listener failed")
        async with self._changed:
            self._changed.notify_all()

    async def _run(self) -> None:
        while True:
            client = _client(self._etcd_endpoints)
            try:
                await client.connect()
                result = await client.get_prefix(self.prefix.encode())
                view: dict[str, Endpoint] = {}
                for kv in result:
                    ep = self._parse(kv.key.decode(), kv.value)
                    if ep is not None:
                        view[kv.key.decode()] = ep
                revision = result.header.revision if result.header is not None else None
                await self._replace(view)
                self._synced.set()
                watch = await client.watch_prefix(
                    self.prefix.encode(), start_revision=(revision + 1) if revision else None
                )
                async for event in watch:
                    key = event.kv.key.decode()
                    updated = dict(self._view)
                    if event.kind == "PUT":
                        ep = self._parse(key, event.kv.value)
                        if ep is None:
                            continue
                        updated[key] = ep
                    else:
                        updated.pop(key, None)
                    await self._replace(updated)
                raise ConnectionError("watch stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning(
                    "etcd watch failed prefix=%s error=%s; keeping last view of %d endpoints",
                    self.prefix, exc, len(self._view),
                )
                await asyncio.sleep(_RETRY_SECONDS)
            finally:
                with contextlib.suppress(Exception):
                    await client.close()
