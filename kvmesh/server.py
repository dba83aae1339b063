"""GrpcService: the one gRPC server lifecycle every kvmesh service uses.

``start()`` never blocks: it builds a grpc.aio server with the standard interceptors
(:func:`kvmesh.interceptors.server_interceptors`), the ``grpc.health.v1`` service, server
reflection (names taken from the generated descriptors), binds ``host:grpc_port`` (without
``SO_REUSEPORT``, so a taken port fails instead of being shared), starts the Prometheus endpoint,
writes the bound ports to ``ports_file`` when configured (:func:`write_ports_file`), starts the
service's background tasks, registers the instance in
etcd and only then marks health SERVING. ``run()`` is ``start()`` plus waiting for
SIGTERM/SIGINT, then the drain in ``stop()``: health NOT_SERVING, lease revoked,
``server.stop(grace)``, background tasks cancelled and awaited, hooks run, traces flushed (within
``otlp_shutdown_timeout_seconds``: a dead collector does not hold the exit).

:func:`main` is every process's entry point (``python -m services.<svc>``, ``python -m
engine_simulator``): each ``__main__.py`` is ``main(<Svc>Config, build_service, prog=..., name=...)``
and each process's ``app.py`` holds its ``build_service(config)`` composition root.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.config import GrpcServiceConfig, ProcessConfig, load_config
from kvmesh.interceptors import server_interceptors
from kvmesh.listen import ListenError
from kvmesh.logging import setup_logging
from kvmesh.membership import LeaseRegistration, service_key
from kvmesh.metrics import MetricsServer, start_metrics_server
from kvmesh.tracing import setup_tracing, shutdown_tracing
from kvmesh.types import ServiceInstance

logger = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


class HealthServicer(health.aio.HealthServicer):
    """grpcio-health-checking's asyncio servicer plus ``List`` (grpc.health.v1 ``Health/List``, added to
    upstream health.proto in 2024; grpcio-health-checking 1.85's asyncio servicer answers it with an
    exception). ``List`` returns every registered service name (``""`` = the whole server) -> status."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, Any] = {"": health_pb2.HealthCheckResponse.SERVING}

    async def set(self, service: str, status: Any) -> None:
        if not self._gracefully_shutting_down:
            self._statuses[service] = status
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
        await super().enter_graceful_shutdown()

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self._statuses.items()}
        )
Background = Callable[[], Coroutine[Any, Any, None]]


@dataclass
class ServiceSpec:
    """What a service plugs into the lifecycle.

    Attributes:
        name: short service name (``"epp"``); also the OpenTelemetry ``service.name`` suffix.
        service_names: full gRPC service names (``descriptor.services_by_name[...].full_name``),
            for reflection and per-service health.
        add_servicers: registers the servicers on the server.
        on_start: awaited before the port opens (connect clients, start watchers).
        background: long-running coroutines, cancelled on stop.
        on_stop: awaited after the server stopped (close clients), in order; each bounded by the shutdown grace
            + :data:`_HOOK_STOP_SECONDS`: one that overruns is logged and cancelled, and one still running
            :data:`_HOOK_CANCEL_SECONDS` after its cancel (it swallowed the cancellation) is logged and left
            behind, running; the stop goes on to the next hook either way (one that fails is logged too).
        ready: when set, health stays NOT_SERVING after start until it returns (warm-up gating).
        max_receive_message_bytes: the largest request message the gRPC server accepts (bytes); a larger one
            gets ``RESOURCE_EXHAUSTED`` from grpcio before any servicer code runs. None: grpcio's 4 MiB default.
    """

    name: str
    service_names: Sequence[str]
    add_servicers: Callable[[grpc.aio.Server], None]
    on_start: Sequence[Hook] = ()
    background: Sequence[Background] = ()
    on_stop: Sequence[Hook] = ()
    register_in_etcd: bool = True
    ready: Hook | None = None
    max_receive_message_bytes: int | None = None


@dataclass
class GrpcService:
    """A running (or runnable) service: ``await start()``, ``await stop()``, or ``await run()``."""

    config: GrpcServiceConfig
    spec: ServiceSpec
    grpc_port: int = 0
    metrics_port: int = 0
    _server: grpc.aio.Server | None = None
    _health: HealthServicer | None = None
    _metrics: MetricsServer | None = None
    _registration: LeaseRegistration | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    extra_ports: dict[str, int] = field(default_factory=dict)
    """Other ports the process bound (the router's ``"http"``), set by ``on_start`` hooks; reported
    with ``grpc`` and ``metrics`` in the ports file."""

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    async def start(self) -> None:
        setup_tracing(f"kvmesh-{self.spec.name}", self.config.otlp_endpoint, self.config.otlp_shutdown_timeout_seconds)
        for hook in self.spec.on_start:
            await hook()
        # No SO_REUSEPORT: with it (grpc's default) a second server silently shares a taken port.
        options: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]
        if self.spec.max_receive_message_bytes is not None:
            options.append(("grpc.max_receive_message_length", self.spec.max_receive_message_bytes))
        server = grpc.aio.server(interceptors=server_interceptors(), options=options)
        self.spec.add_servicers(server)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        host = self.config.host
        try:
            self.grpc_port = server.add_insecure_port(f"{host}:{self.config.grpc_port}")
        except RuntimeError:  # grpcio: "Failed to bind to address"
            self.grpc_port = 0
        if self.grpc_port == 0:
            await server.stop(None)  # never started, but its C-core resources are released now, not at exit
            raise ListenError.probe("grpc", host, self.config.grpc_port, "gRPC could not bind the address")
        await server.start()
        self._server = server
        try:
            self._metrics = start_metrics_server(host, self.config.metrics_port)
        except OSError as exc:
            raise ListenError("metrics", host, self.config.metrics_port, exc.strerror or str(exc)) from None
        self.metrics_port = self._metrics.port
        write_ports_file(self.config.ports_file, {"grpc": self.grpc_port, "metrics": self.metrics_port, **self.extra_ports})
        for coro_fn in self.spec.background:
            self._tasks.append(asyncio.create_task(coro_fn(), name=getattr(coro_fn, "__name__", "background")))
        if self.spec.register_in_etcd and self.config.etcd_endpoints:
            instance_id = self.config.instance_id or self.address
            instance = ServiceInstance(
                service=self.spec.name,
                id=instance_id,
                grpc_address=self.address,
                metrics_address=f"{self.config.host}:{self.metrics_port}",
            )
            self._registration = LeaseRegistration(
                self.config.etcd_endpoints,
                service_key(self.spec.name, instance_id),
                instance.to_json(),
                ttl_seconds=self.config.lease_ttl_seconds,
            )
            await self._registration.start()
        if self.spec.ready is None:
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        else:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            self._tasks.append(asyncio.create_task(self._serve_when_ready(self.spec.ready), name="readiness"))
        logger.info(
            "%s serving grpc=%s metrics=%s:%d", self.spec.name, self.address, self.config.host, self.metrics_port
        )

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        assert self._health is not None
        for name in ("", *self.spec.service_names):
            await self._health.set(name, status)

    async def _serve_when_ready(self, ready: Hook) -> None:
        await ready()
        if not self._stopped.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            logger.info("%s ready: health SERVING", self.spec.name)

    async def stop(self) -> None:
        """Drain and stop; safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        logger.info("%s draining", self.spec.name)
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._registration is not None:
            await self._registration.stop()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_seconds)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for hook in self.spec.on_stop:
            await self._stop_hook(hook)
        if self._metrics is not None:
            self._metrics.stop()
        shutdown_tracing()
        logger.info("%s stopped", self.spec.name)

    async def _stop_hook(self, hook: Hook) -> None:
        """Await one ``on_stop`` hook, bounded (see :class:`ServiceSpec`): a hook that never returns,
        even once cancelled, must not keep a stopping process alive forever (``asyncio.wait_for``
        would wait for a cancel it swallowed)."""
        name, bound = getattr(hook, "__qualname__", hook), self.config.shutdown_grace_seconds + _HOOK_STOP_SECONDS
        task = asyncio.ensure_future(hook())
        try:
            done, _ = await asyncio.wait({task}, timeout=bound)
            if not done:
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=_HOOK_CANCEL_SECONDS)
        except asyncio.CancelledError:  # the stop itself was cancelled: the hook goes with it
            task.cancel()
            raise
        if not done:
            logger.error("%s on_stop hook %s did not finish within %.1f s nor %.1f s after its cancel; left behind",
                         self.spec.name, name, bound, _HOOK_CANCEL_SECONDS)
            _LEFT_BEHIND.add(task)
            task.add_done_callback(_forget_left_behind)
        elif task.cancelled():
            logger.error("%s on_stop hook %s did not finish within %.1f s; cancelled, going on", self.spec.name, name, bound)
        elif task.exception() is not None:
            logger.error("%s on_stop hook %s failed", self.spec.name, name, exc_info=task.exception())

    async def run(self) -> None:
        """Start, wait for SIGTERM/SIGINT (or a background task to crash), then stop. A background
        task that returns normally (a one-shot readiness gate) ends without stopping the service.

        Raises:
            ListenError: a listener cannot bind its address.
            Exception: whatever made a background task crash, re-raised once the service has stopped
                (the process then exits non-zero, not 0 as after SIGTERM).
        """
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        try:
            await self.start()
            waiter = asyncio.create_task(stop_requested.wait())
            pending: set[asyncio.Task[Any]] = {waiter, *self._tasks}
            failure: BaseException | None = None
            while not waiter.done() and failure is None:  # a task that ends normally (readiness) does not stop us
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not waiter and not task.cancelled() and task.exception() is not None:
                        logger.error("%s background task failed: %r", self.spec.name, task.exception())
                        failure = task.exception()
            waiter.cancel()
        finally:
            await self.stop()
        if failure is not None:  # the process exits non-zero (main: one line for a listener that cannot bind)
            raise failure


_HOOK_STOP_SECONDS = 10.0
"""What an ``on_stop`` hook may take beyond the shutdown grace before :meth:`GrpcService.stop` cancels it."""
_HOOK_CANCEL_SECONDS = 1.0
"""What a cancelled ``on_stop`` hook may take to end before :meth:`GrpcService.stop` goes on without it."""
_LEFT_BEHIND: set[asyncio.Future[None]] = set()
"""``on_stop`` hooks that ignored their cancellation, still running (a reference keeps each alive)."""


def _forget_left_behind(task: asyncio.Future[None]) -> None:
    _LEFT_BEHIND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("a left-behind on_stop hook failed", exc_info=task.exception())


def check_ports_file(path: str) -> None:
    """Check, before anything listens, that ``write_ports_file(path, ...)`` can succeed: ``path``'s folder
    exists and is writable (a read-only filesystem included) and ``path`` is no directory; nothing when
    ``path`` is empty.

    Raises:
        ValueError: ``--ports-file <path>: <why>`` (:func:`main` prints it in one line and exits 2).
    """
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    why = ""
    if os.path.isdir(path):
        why = "is a directory"
    elif not os.path.isdir(folder):
        why = f"its folder {folder} does not exist"
    elif os.statvfs(folder).f_flag & os.ST_RDONLY:
        why = f"its folder {folder} is on a read-only filesystem"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"its folder {folder} is not writable"
    if why:
        raise ValueError(f"--ports-file {path}: {why}")


def write_ports_file(path: str, ports: dict[str, int]) -> None:
    """Write ``ports`` (name -> bound port) as JSON to ``path`` atomically (temp file, then rename),
    so a reader never sees a partial file; nothing when ``path`` is empty (``ProcessConfig.ports_file``)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(ports, out)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PortsFileError(f"--ports-file {path}: cannot write it: {exc.strerror or exc}") from None


class PortsFileError(OSError):
    """The ports file could not be written (:func:`write_ports_file`); :func:`main` reports it in one line."""


class Process(Protocol):
    """What :func:`main` runs: a built process that serves until SIGTERM/SIGINT."""

    async def run(self) -> None: ...


C = TypeVar("C", bound=ProcessConfig)


def main(
    config_cls: type[C],
    build_service: Callable[[C], Process],
    *,
    prog: str,
    name: str,
    argv: list[str] | None = None,
) -> None:
    """Run one kvmesh process: config, logging, config logged once, build, serve until SIGTERM.

    Args:
        config_cls: the process's config class; flags, ``--config FILE`` and its env prefix are
            parsed into it (``--help`` and ``--print-config`` print and exit 0 here).
        build_service: the process's composition root (``app.py``); builds without serving.
        prog: program name shown in ``--help``.
        name: short process name on every log line (``"epp"``).
        argv: the flags (default ``sys.argv[1:]``).

    Raises:
        SystemExit: 2 on a bad flag or value, and when ``build_service`` raises ``ValueError``
            (a config it cannot build, e.g. an invalid scheduling config) or a ``--ports-file`` that cannot be
            written (:func:`check_ports_file`, before anything listens); 1 when a listener cannot
            bind its address (:class:`~kvmesh.http_server.ListenError`: a port in use); the message is
            written to stderr as ``<name>: <message>``, without a traceback.
    """
    config = load_config(config_cls, argv, prog=prog)
    setup_logging(name, config.log_level)
    try:
        check_ports_file(config.ports_file)  # before serving: a launcher waits on it
    except ValueError as exc:
        sys.stderr.write(f"{name}: {exc}\n")
        raise SystemExit(2) from None
    logger.info("config %s", json.dumps(config.model_dump(mode="json")))
    try:
        try:
            process = build_service(config)
        except ValueError as exc:
            sys.stderr.write(f"{name}: {exc}\n")
            raise SystemExit(2) from None
        runner = asyncio.Runner(loop_factory=event_loop_factory(config.event_loop))
        try:
            runner.run(process.run())
            _exit_past_left_behind(name)
        finally:
            runner.close()
    except ListenError as exc:  # a port in use: one line, not a traceback
        sys.stderr.write(f"{name}: {exc} ({exc.hint()})\n")
        raise SystemExit(1) from None
    except PortsFileError as exc:  # the folder vanished or filled after the check
        sys.stderr.write(f"{name}: {exc}\n")
        raise SystemExit(2) from None
    except Exception as exc:
        if getattr(exc, "errno", None) not in _LISTEN_ERRNOS:
            raise
        # another listener (a ZMQ bind: zmq.ZMQError carries the errno) that cannot bind its address
        sys.stderr.write(f"{name}: cannot listen: {exc}\n")
        raise SystemExit(1) from None


def _exit_past_left_behind(name: str) -> None:
    """The service stopped with on_stop hooks still running that ignored their cancel (``_LEFT_BEHIND``):
    closing the runner would cancel them again and wait for them (a hook that swallows every cancel
    would keep the stopping process alive for ever), so log, flush and leave now with status 1."""
    if not _LEFT_BEHIND:
        return
    logger.error("%s: %d on_stop hook(s) still running after their cancel; exiting without them",
                 name, len(_LEFT_BEHIND))
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


_LISTEN_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})
"""Errors of a bind that :func:`main` reports in one line (in use; no such local address; a privileged port)."""


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory of ``ProcessConfig.event_loop``: uvloop's (``"uvloop"``) or None (asyncio's default)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None
