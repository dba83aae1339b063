"""Connecting to etcd: a slow etcd is waited for, a refused connection fails at once, a silent one says so.

Against real sockets and the session's real etcd (3.4): a proxy that holds each accepted connection for
300 ms before relaying it to etcd (the TCP + HTTP/2 handshake of a loaded or remote etcd), a listener
that accepts and never answers, and a port nothing listens on. Before the fix the etcd clients' connect
deadline was gRPC's ``min_reconnect_backoff_ms`` (100 ms, :func:`kvmesh.membership.etcd_channel_options`),
so the 300 ms etcd was failed at every attempt and the silent one was reported after 0.1 s as "did not
answer within 5s"; the control case below shows the proxy still defeats such a client (grpcio 1.85).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import aetcd
import grpc
import pytest

from kvmesh.membership import (
    ETCD_STATE,
    EndpointWatcher,
    LeaseRegistration,
    _client,
    endpoint_key,
    etcd_channel_options,
)
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.discovery import DiscoveryError, read_etcd_prefix, why_unreachable
from kvmesh_cli.launcher import free_port
from kvmesh_cli.mesh import MeshStartError, check_etcd

HANDSHAKE_DELAY_S = 0.3
"""How long the proxy holds each connection before relaying it: 3x the old 100 ms connect deadline."""


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that waits ``delay_s`` after accepting a connection, then relays it to
    ``upstream`` both ways (its own event loop in a thread, so sync and async tests can both use it)."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._delay_s = delay_s
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self.connections = 0
        self.address = ""

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
                with contextlib.suppress(Exception):
                    self._server.close_clients()  # type: ignore[attr-defined]  # 3.13+
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await asyncio.sleep(self._delay_s)
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@pytest.fixture
def slow_etcd(etcd: str) -> Iterator[DelayProxy]:
    with DelayProxy(etcd, HANDSHAKE_DELAY_S) as proxy:
        yield proxy


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """``host:port`` of a socket that completes TCP handshakes (the kernel's backlog) and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        yield f"127.0.0.1:{silent.getsockname()[1]}"


async def test_control_a_100ms_connect_deadline_cannot_reach_the_slow_etcd(slow_etcd: DelayProxy) -> None:
    """What the options were: the proxy really does defeat a client whose connect deadline is 100 ms."""
    old = {**etcd_channel_options(), "grpc.min_reconnect_backoff_ms": 100}
    host, _, port = slow_etcd.address.rpartition(":")
    client = aetcd.Client(host=host, port=int(port), timeout=3.0, options=old)
    try:
        started = time.monotonic()
        with pytest.raises(aetcd.exceptions.ConnectionFailedError, match="before receiving SETTINGS frame"):
            await client.get_prefix(b"/kvmesh/v1/")
        assert time.monotonic() - started < 1.0  # cut short long before the call's own 3 s deadline
    finally:
        await client.close()


async def test_registration_and_watcher_wait_for_a_slow_etcd(slow_etcd: DelayProxy, etcd: str) -> None:
    endpoint = Endpoint(id=EndpointId("slow-etcd-engine"), url="http://127.0.0.1:1", model="m-slow-etcd")
    key = endpoint_key(endpoint)
    failures_before = {op: ETCD_STATE.failures(op) for op in ("register", "watch")}
    registration = LeaseRegistration([slow_etcd.address], key, endpoint.to_json(), ttl_seconds=5,
                                     first_attempt_timeout_seconds=5.0)
    watcher = EndpointWatcher([slow_etcd.address], model=endpoint.model)
    started = time.monotonic()
    await registration.start()
    try:
        assert registration.registered, "registered through an etcd whose handshake takes 300 ms"
        assert time.monotonic() - started < 3.0
        await watcher.start(first_sync_timeout_seconds=5.0)
        assert await watcher.wait_for(lambda view: endpoint.id in view, 5.0), watcher.snapshot()
        assert slow_etcd.connections >= 2  # both went through the proxy
        # not one failed attempt on the way (each used to fail "before receiving SETTINGS frame")
        assert {op: ETCD_STATE.failures(op) for op in ("register", "watch")} == failures_before
    finally:
        await watcher.stop()
        await registration.stop()
    async with aetcd.Client(host=etcd.rpartition(":")[0], port=int(etcd.rpartition(":")[2])) as direct:
        assert await direct.get(key.encode()) is None  # stop() revoked the lease through the proxy


def test_cli_reads_a_slow_etcd(slow_etcd: DelayProxy, etcd: str) -> None:
    async def put() -> None:
        host, _, port = etcd.rpartition(":")
        async with aetcd.Client(host=host, port=int(port)) as client:
            await client.put(b"/kvmesh-test/slow-etcd/a", b"1")

    asyncio.run(put())
    assert read_etcd_prefix(slow_etcd.address, "/kvmesh-test/slow-etcd/", timeout_s=2.0) == [b"1"]
    check_etcd(slow_etcd.address, timeout_s=2.0)  # kvmesh up --etcd <slow etcd> starts


def test_refused_connection_still_fails_at_once() -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=rf"^etcd {dead} refused the connection \(.*Connection refused"):
        read_etcd_prefix(dead, "/kvmesh/v1/", timeout_s=5.0)
    assert time.monotonic() - started < 1.0


async def test_services_see_a_refused_etcd_at_once() -> None:
    dead = f"127.0.0.1:{free_port()}"
    before = ETCD_STATE.failures("register")
    registration = LeaseRegistration([dead], "/kvmesh-test/refused", "{}", first_attempt_timeout_seconds=0.5)
    started = time.monotonic()
    await registration.start()
    try:
        assert not registration.registered
        assert ETCD_STATE.failures("register") > before  # the first attempt already failed and was counted
        assert time.monotonic() - started < 1.0
    finally:
        await registration.stop()


def test_silent_etcd_is_waited_for_then_said_to_have_accepted_but_not_answered() -> None:
    with silent_listener() as address:
        started = time.monotonic()
        with pytest.raises(MeshStartError) as caught:
            check_etcd(address, timeout_s=1.0)
        elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 3.0, elapsed  # waited the timeout it names (it used to give up after 0.1 s)
    message = str(caught.value)
    assert message.startswith(f"etcd {address} accepted the connection but did not answer within 1s ("), message
    assert "leave --etcd out" in message


def test_an_etcd_that_takes_the_call_but_never_answers_says_so() -> None:
    """The handshake completes (a gRPC server), the Range call is never answered (an etcd without quorum)."""
    release = threading.Event()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(10)
        return b""

    handler = grpc.method_handlers_generic_handler("etcdserverpb.KV",
                                                   {"Range": grpc.unary_unary_rpc_method_handler(hang)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        started = time.monotonic()
        with pytest.raises(DiscoveryError) as caught:
            read_etcd_prefix(address, "/kvmesh/v1/", timeout_s=1.0)
        assert 0.9 <= time.monotonic() - started < 3.0
    finally:
        release.set()
        server.stop(None)
    message = str(caught.value)
    assert message.startswith(f"etcd {address} did not answer within 1s ("), message  # no "accepted ... but"


@pytest.mark.parametrize(
    ("exc", "elapsed", "said"),
    [
        (TimeoutError(), 5.0, "did not answer within 5s (TimeoutError)"),
        (ConnectionError("x: connection attempt timed out before receiving SETTINGS frame"), 5.0,
         "accepted the connection but did not answer within 5s (x: connection attempt"),
        # a deadline that ran out long before the timeout (the old 100 ms connect deadline) says so
        (ConnectionError("x: connection attempt timed out before receiving SETTINGS frame"), 0.1,
         "gave up after 0.1s of the 5s allowed (x: connection attempt"),
        (ConnectionError("x: Connection refused"), 0.0, "refused the connection (x: Connection refused)"),
        (ConnectionError("name resolution failed"), 0.2, "could not be reached (name resolution failed)"),
    ],
)
def test_why_unreachable_says_what_happened(exc: BaseException, elapsed: float, said: str) -> None:
    assert why_unreachable(exc, 5.0, elapsed).startswith(said)


async def test_services_wait_the_timeout_for_a_silent_etcd() -> None:
    with silent_listener() as address:
        client = _client([address], timeout_seconds=1.0)
        started = time.monotonic()
        try:
            with pytest.raises(aetcd.exceptions.ClientError):
                await client.get_prefix(b"/kvmesh/v1/")
        finally:
            await client.close()
        assert time.monotonic() - started >= 0.9  # the whole timeout, not the 0.1 s backoff


@pytest.mark.parametrize(("timeout_s", "connect_ms"), [(3.0, 3000), (0.05, 100), (12.5, 12500)])
def test_connect_deadline_follows_the_timeout(timeout_s: float, connect_ms: int) -> None:
    options = etcd_channel_options(timeout_s)
    assert options["grpc.min_reconnect_backoff_ms"] == connect_ms  # gRPC C-core's MIN_CONNECT_TIMEOUT
    assert options["grpc.initial_reconnect_backoff_ms"] == 100  # a restarted etcd is retried within 0.1-1 s
    assert options["grpc.max_reconnect_backoff_ms"] == 1000


async def test_service_channels_reach_a_peer_whose_handshake_is_slow() -> None:
    """kvmesh's service-to-service channels (:func:`kvmesh.channels.insecure_channel`) had the same 100 ms
    connect deadline: a peer whose handshake took longer (a loaded process) was never reached. Now a
    real gRPC health server behind the 300 ms proxy answers; a refused port still fails within a second."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvmesh.channels import CONNECT_TIMEOUT_MS, insecure_channel

    assert CONNECT_TIMEOUT_MS >= 3 * HANDSHAKE_DELAY_S * 1000
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with DelayProxy(f"127.0.0.1:{port}", HANDSHAKE_DELAY_S) as proxy:
            async with insecure_channel(proxy.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        async with insecure_channel(f"127.0.0.1:{free_port()}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 1.0
    finally:
        await server.stop(None)
