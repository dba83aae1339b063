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

etcd unreachable is a degraded mode of every process (docs/degraded-modes.md): :data:`ETCD_STATE`
(one per process, shared by every registration and watcher in it) exports ``kvmesh_etcd_up`` (1/0)
and ``kvmesh_etcd_failures_total{operation}`` on the process's ``/metrics``, rate-limits the warning
lines (the first at once, then at most one per 10 s per operation with the count suppressed) and
answers :meth:`EtcdState.up` for health endpoints (the router's ``/health`` says ``"degraded"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import aetcd
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.logging import RateLimitedLog
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


ETCD_LOG_INTERVAL_SECONDS = 10.0
"""At most one etcd warning line per operation per this many seconds (the count of the others is shown)."""

ETCD_OPERATIONS = ("register", "keepalive", "update", "watch")
"""``operation`` label values of ``kvmesh_etcd_failures_total``: a lease grant + put (first or after
the lease was lost), a lease refresh, a value update under the lease, a prefix load + watch stream."""


class EtcdState:
    """This process's view of etcd reachability, fed by every :class:`LeaseRegistration` and
    :class:`EndpointWatcher` in it (thread-safe: engines refresh their lease from their own thread).

    ``up()`` is True while no client's last etcd call failed, False while any did, None before any
    client started (a process without etcd). Each failure is counted by operation; warnings are
    rate-limited per operation (the first at once, then one per ``log_interval_seconds`` saying how
    many were suppressed), and the return to reachable is one INFO line with the outage's length.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 log_interval_seconds: float = ETCD_LOG_INTERVAL_SECONDS) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: set[int] = set()
        self._failing: set[int] = set()
        self._failures: Counter[str] = Counter()
        self._log = RateLimitedLog(logger, log_interval_seconds, clock, thread_safe=True,
                                   suffix=" (+{more} more {kind} failures in the last {interval:.0f}s)")
        self._down_since: float | None = None
        self._down_failures = 0

    def up(self) -> bool | None:
        """True: reachable (as last seen by every client); False: some client's last call failed;
        None: no client yet."""
        with self._lock:
            if not self._clients:
                return None
            return not self._failing

    def failures(self, operation: str) -> int:
        """Failures counted for ``operation`` (one of :data:`ETCD_OPERATIONS`) since the process started."""
        with self._lock:
            return self._failures[operation]

    def succeeded(self, client: object) -> None:
        """``client`` reached etcd; the last failing client recovering logs the outage once."""
        with self._lock:
            self._clients.add(id(client))
            self._failing.discard(id(client))
            recovered = not self._failing and self._down_since is not None
            if recovered:
                down_for, count = self._clock() - (self._down_since or 0.0), self._down_failures
                self._down_since, self._down_failures = None, 0
                self._log.reset()
        if recovered:
            logger.info("etcd reachable again after %.1fs (%d failed etcd calls meanwhile)", down_for, count)

    def failed(self, client: object, operation: str, message: str, *args: object) -> None:
        """``client``'s ``operation`` failed: counted, and a WARNING ``degraded mode dependency=etcd
        operation=<operation> <message % args>`` unless one for the same operation went out less than the
        interval ago (then the next one says how many were suppressed). ``message`` says what the caller
        does about it (a watcher serves its last view, a registration retries)."""
        now = self._clock()
        with self._lock:
            self._clients.add(id(client))
            self._failing.add(id(client))
            self._failures[operation] += 1
            if self._down_since is None:
                self._down_since = now
            self._down_failures += 1
        self._log.warning(operation, "degraded mode dependency=etcd operation=%s " + message, operation, *args)

    def forget(self, client: object) -> None:
        """``client`` stopped: it no longer counts for :meth:`up`."""
        with self._lock:
            self._clients.discard(id(client))
            self._failing.discard(id(client))
            if not self._failing:
                self._down_since, self._down_failures = None, 0


class EtcdCollector(Collector):
    """``kvmesh_etcd_up`` and ``kvmesh_etcd_failures_total{operation}`` from an :class:`EtcdState`.

    ``kvmesh_etcd_up`` is absent while the process has no etcd client (etcd not configured)."""

    def __init__(self, state: EtcdState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "kvmesh_etcd_up",
            "1 while every etcd client of this process (lease keepalives, membership watches) reaches etcd, "
            "0 while one fails: membership is served from the last known view (docs/degraded-modes.md)",
        )
        state = self._state.up()
        if state is not None:
            up.add_metric([], 1.0 if state else 0.0)
        yield up
        failures = CounterMetricFamily(
            "kvmesh_etcd_failures", "Failed etcd calls of this process, by operation", labels=["operation"]
        )
        for operation in ETCD_OPERATIONS:
            failures.add_metric([operation], float(self._state.failures(operation)))
        yield failures

    def describe(self) -> Iterator[Metric]:
        return self.collect()


ETCD_STATE = EtcdState()
"""The process-wide :class:`EtcdState` (exported on the default Prometheus registry)."""


def register_etcd_metrics(registry: CollectorRegistry = REGISTRY, state: EtcdState = ETCD_STATE) -> EtcdCollector:
    """Export ``state`` on ``registry`` (done once for the default registry at import)."""
    collector = EtcdCollector(state)
    registry.register(collector)
    return collector


register_etcd_metrics()


async def etcd_health(timeout_seconds: float = 0.0, state: EtcdState = ETCD_STATE) -> str:
    """A health check in grpc.health.v1 terms from ``state`` (no I/O, ``timeout_seconds`` unused):
    ``"UNAVAILABLE"`` while an etcd client of this process fails, else ``"SERVING"``."""
    return "UNAVAILABLE" if state.up() is False else "SERVING"


def _short(exc: BaseException) -> str:
    """One line for an etcd client error (aetcd wraps grpc errors whose str spans many lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def endpoint_key(endpoint: Endpoint) -> str:
    return f"{ENDPOINTS_PREFIX}{endpoint.model}/{endpoint.id}"


def kv_source_key(source: Endpoint) -> str:
    return f"{KV_SOURCES_PREFIX}{source.model}/{source.id}"


def service_key(service: str, instance_id: str) -> str:
    return f"{SERVICES_PREFIX}{service}/{instance_id}"


ETCD_TIMEOUT_SECONDS = 3.0
"""Deadline of each etcd call a service's membership client makes (lease grant, put, refresh, prefix
load), and how long one connection attempt to etcd (TCP + HTTP/2 handshake) may take."""


def _client(etcd_endpoints: list[str], timeout_seconds: float = ETCD_TIMEOUT_SECONDS) -> aetcd.Client:
    if not etcd_endpoints:
        raise ValueError("no etcd endpoints configured")
    host, _, port = etcd_endpoints[0].rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=timeout_seconds,
                        options=etcd_channel_options(timeout_seconds))


RECONNECT_BACKOFF_MS = (100, 1000)
"""First and largest pause between two connection attempts to etcd, ms (gRPC's defaults: 1 s growing to 120 s)."""


def etcd_channel_options(connect_timeout_seconds: float = ETCD_TIMEOUT_SECONDS) -> dict[str, int]:
    """gRPC channel options of an etcd client whose connection attempts may take ``connect_timeout_seconds``.

    - ``grpc.use_local_subchannel_pool``: gRPC shares subchannels process-wide by default, so a new
      client to an etcd that just came back would inherit the failed subchannel's backoff and fail at
      once with the old "connection refused"; each client gets its own.
    - ``grpc.initial_reconnect_backoff_ms`` / ``grpc.max_reconnect_backoff_ms``: the pause between
      attempts (:data:`RECONNECT_BACKOFF_MS`), so a restarted etcd is used again within a second.
    - ``grpc.min_reconnect_backoff_ms``: despite its name, gRPC C-core uses it as MIN_CONNECT_TIMEOUT
      of gRPC's connection-backoff.md: an attempt's deadline is ``max(current backoff, this)``
      (``ParseArgsForBackoffValues`` / ``StartConnectingLocked`` in grpc's
      ``src/core/client_channel/subchannel.cc``, grpcio 1.85). Set equal to the backoff (100 ms), every
      attempt to an etcd whose TCP + HTTP/2 handshake takes longer (a loaded host, a remote etcd) was
      cut short and the first call failed UNAVAILABLE ("timed out before receiving SETTINGS frame")
      after ~0.1 s. Here it is the caller's timeout: a slow etcd is waited for, while a refused
      connection still fails at once (no deadline is involved).
    """
    return {
        "grpc.use_local_subchannel_pool": 1,
        "grpc.initial_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[0],
        "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[1],
        "grpc.min_reconnect_backoff_ms": max(RECONNECT_BACKOFF_MS[0], round(connect_timeout_seconds * 1000)),
    }


ETCD_CHANNEL_OPTIONS = etcd_channel_options()
"""gRPC channel options of a kvmesh etcd client with the default :data:`ETCD_TIMEOUT_SECONDS`
(:func:`etcd_channel_options`)."""


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
            try:
                await self._client.put(self.key.encode(), value.encode(), lease=self._lease)
            except Exception as exc:
                ETCD_STATE.failed(self, "update", "key=%s error=%s; raised to the caller", self.key, exc)
                raise

    async def _register(self) -> None:
        if self._client is None:
            self._client = _client(self._etcd_endpoints)
            await self._client.connect()
        self._lease = await self._client.lease(self.ttl_seconds)
        await self._client.put(self.key.encode(), self._value.encode(), lease=self._lease)
        self._registered.set()
        ETCD_STATE.succeeded(self)
        logger.info("registered key=%s lease=%x ttl=%ds", self.key, self._lease.id, self.ttl_seconds)

    async def _run(self) -> None:
        interval = max(0.5, self.ttl_seconds / 3)
        while True:
            operation = "register"
            try:
                if self._lease is None:
                    await self._register()
                await asyncio.sleep(interval)
                operation = "keepalive"
                # One LeaseKeepAlive per refresh: its reply carries the TTL left, 0 once etcd forgot the
                # lease (as etcd's clientv3 reads it), so no LeaseTimeToLive call beside it (idle cost, issue 10).
                reply = await self._lease.refresh()  # type: ignore[union-attr]
                if reply is None or reply.TTL <= 0:
                    logger.warning("lease lost key=%s; registering again", self.key)
                    self._lease = None
                    continue
                ETCD_STATE.succeeded(self)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                ETCD_STATE.failed(self, operation, "key=%s error=%s; registering again in %.0fs",
                                  self.key, _short(exc), _RETRY_SECONDS)
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
        ETCD_STATE.forget(self)


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
        ETCD_STATE.forget(self)

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
                ETCD_STATE.succeeded(self)
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
                ETCD_STATE.failed(self, "watch", "prefix=%s error=%s; serving from the last known membership (%d endpoints)",
                                  self.prefix, _short(exc), len(self._view))
                await asyncio.sleep(_RETRY_SECONDS)
            finally:
                with contextlib.suppress(Exception):
                    await client.close()
