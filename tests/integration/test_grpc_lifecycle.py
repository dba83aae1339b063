"""The shared GrpcService over a real grpc.aio server: error table, request ids, health, drain."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import errors
from kvmesh.config import GrpcServiceConfig
from kvmesh.interceptors import current_request_id
from kvmesh.server import GrpcService, ServiceSpec

SERVICE = "kvmesh.test.v1.Probe"
seen_request_ids: list[str] = []


async def _fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    seen_request_ids.append(current_request_id())
    kind = request.decode()
    if kind == "ok":
        return b"fine"
    if kind == "invalid":
        raise errors.InvalidRequest("max_tokens must be > 0")
    if kind == "saturated":
        raise errors.Saturated("pool saturated")
    if kind == "missing":
        raise errors.UnknownModel("model 'x' is not served")
    raise RuntimeError("secret internal detail")


async def _stream(request: bytes, context: grpc.aio.ServicerContext):
    yield b"one"
    raise errors.QueueTTLExpired("waited too long")


def _add(server: grpc.aio.Server) -> None:
    identity = lambda b: b  # noqa: E731 - raw bytes in and out
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Fail": grpc.unary_unary_rpc_method_handler(_fail, identity, identity),
                    "Stream": grpc.unary_stream_rpc_method_handler(_stream, identity, identity),
                },
            )
        ]
    )


@pytest.fixture
async def service() -> GrpcService:
    config = GrpcServiceConfig(etcd_endpoints=[], shutdown_grace_seconds=0.5)
    svc = GrpcService(config, ServiceSpec("probe", [SERVICE], _add, register_in_etcd=False))
    await svc.start()
    yield svc
    await svc.stop()


@pytest.mark.parametrize(
    ("kind", "code", "detail"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0"),
        ("saturated", grpc.StatusCode.RESOURCE_EXHAUSTED, "pool saturated"),
        ("missing", grpc.StatusCode.NOT_FOUND, "model 'x' is not served"),
        ("crash", grpc.StatusCode.INTERNAL, "internal error"),
    ],
    ids=["invalid", "saturated", "unknown-model", "unhandled"],
)
async def test_domain_errors_map_to_status(service: GrpcService, kind: str, code: grpc.StatusCode, detail: str) -> None:
    async with grpc.aio.insecure_channel(service.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Fail")
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await call(kind.encode())
        assert exc_info.value.code() == code
        assert exc_info.value.details() == detail
        # The service stays up after every error.
        assert await call(b"ok") == b"fine"


async def test_stream_error_after_first_item(service: GrpcService) -> None:
    async with grpc.aio.insecure_channel(service.address) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Stream")(b"")
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            async for item in call:
                received.append(item)
        assert received == [b"one"]
        assert exc_info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_request_id_from_metadata(service: GrpcService) -> None:
    seen_request_ids.clear()
    async with grpc.aio.insecure_channel(service.address) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Fail")
        await call(b"ok", metadata=(("x-request-id", "req-42"),))
        await call(b"ok")
    assert seen_request_ids[0] == "req-42"
    assert len(seen_request_ids[1]) == 16  # generated when absent


async def test_health_goes_not_serving_on_drain() -> None:
    config = GrpcServiceConfig(etcd_endpoints=[], shutdown_grace_seconds=0.5)
    svc = GrpcService(config, ServiceSpec("probe", [SERVICE], _add, register_in_etcd=False))
    await svc.start()
    async with grpc.aio.insecure_channel(svc.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(svc.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping


async def test_a_hook_that_never_returns_does_not_hold_the_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvmesh.server as server_module

    monkeypatch.setattr(server_module, "_HOOK_STOP_SECONDS", 0.3)
    ran: list[str] = []

    async def hangs() -> None:
        ran.append("hangs")
        await asyncio.Event().wait()

    async def after() -> None:
        ran.append("after")

    config = GrpcServiceConfig(etcd_endpoints=[], shutdown_grace_seconds=0.1)
    svc = GrpcService(config, ServiceSpec("probe", [SERVICE], _add, register_in_etcd=False, on_stop=[hangs, after]))
    await svc.start()
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(svc.stop(), 10)
    assert ran == ["hangs", "after"]  # the hook after the stuck one still ran
    assert asyncio.get_running_loop().time() - started < 5


async def test_a_hook_that_swallows_its_cancel_is_left_behind_and_does_not_hold_the_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ServiceSpec.on_stop's contract: a hook past its bound is cancelled, and one that swallows the
    cancellation and keeps going is left behind running; the stop goes on to the next hook.
    (``asyncio.wait_for`` would wait for it: the stop took as long as the hook chose.)"""
    import kvmesh.server as server_module

    monkeypatch.setattr(server_module, "_HOOK_STOP_SECONDS", 0.3)
    monkeypatch.setattr(server_module, "_HOOK_CANCEL_SECONDS", 0.2, raising=False)
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    deaf_done = asyncio.Event()

    async def deaf() -> None:
        ran.append("deaf")
        deadline = loop.time() + 4.0
        try:
            while loop.time() < deadline:
                try:
                    await asyncio.sleep(deadline - loop.time())
                except asyncio.CancelledError:
                    ran.append("swallowed")
        finally:
            deaf_done.set()

    async def after() -> None:
        ran.append("after")

    config = GrpcServiceConfig(etcd_endpoints=[], shutdown_grace_seconds=0.1)
    svc = GrpcService(config, ServiceSpec("probe", [SERVICE], _add, register_in_etcd=False, on_stop=[deaf, after]))
    await svc.start()
    started = loop.time()
    await asyncio.wait_for(svc.stop(), 10)
    took = loop.time() - started
    assert ran == ["deaf", "swallowed", "after"]  # cancelled once, then the stop went on without it
    assert took < 2.5, took  # bound 0.1 + 0.3 s, + 0.2 s after the cancel; the hook itself runs 4 s
    assert not deaf_done.is_set() and len(server_module._LEFT_BEHIND) == 1  # left behind, still running
    await asyncio.wait_for(deaf_done.wait(), 10)
    await asyncio.sleep(0)
    assert not server_module._LEFT_BEHIND  # forgotten once it ended


async def test_a_taken_grpc_port_is_a_listen_error_and_stops_cleanly() -> None:
    import socket

    from kvmesh.listen import ListenError

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        config = GrpcServiceConfig(etcd_endpoints=[], grpc_port=port, shutdown_grace_seconds=0.1)
        svc = GrpcService(config, ServiceSpec("probe", [SERVICE], _add, register_in_etcd=False))
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}"):
            await svc.start()
        await asyncio.wait_for(svc.stop(), 10)
    finally:
        holder.close()


DEAF_HOOK_PROCESS = """
import asyncio
import kvmesh.server as server
from kvmesh.config import GrpcServiceConfig

server._HOOK_STOP_SECONDS = 0.3
server._HOOK_CANCEL_SECONDS = 0.2

async def deaf() -> None:  # swallows every cancel and never ends
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

def build(config: GrpcServiceConfig) -> server.GrpcService:
    return server.GrpcService(config, server.ServiceSpec(
        "probe", ["kvmesh.test.v1.Probe"], lambda s: None, register_in_etcd=False, on_stop=[deaf]))

server.main(GrpcServiceConfig, build, prog="probe", name="probe",
            argv=["--grpc-port", "0", "--metrics-port", "0", "--shutdown-grace-seconds", "0.1",
                  "--ports-file", PORTS])
"""


def test_a_process_with_a_hook_that_never_ends_still_exits(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """main(): a left-behind on_stop hook that swallows every cancel must not keep the process alive
    (the runner's close would cancel it again and wait for ever): on SIGTERM it exits 1 with one ERROR line."""
    import signal
    import subprocess
    import sys
    import time

    ports = tmp_path / "ports.json"
    script = DEAF_HOOK_PROCESS.replace("PORTS", repr(str(ports)))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ports.exists():  # serving
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert "on_stop hook(s) still running after their cancel; exiting without them" in err
