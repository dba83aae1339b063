"""Start and stop the processes of a mesh: etcd, kvmesh services, engines.

Shared by ``kvmesh up``/``kvmesh compare`` and the integration-test fixtures, so tests boot
the mesh exactly as users do. Every process listens on 127.0.0.1; each one's output goes to
``<run_dir>/<name>.log``. ``stop()`` sends SIGTERM, waits, then SIGKILLs the process group,
so no orphan survives a crash of the caller; :func:`stop_all` does that for many processes at once
(SIGTERM to all, one shared deadline, SIGKILL to what is left). A process that ended is described by
:meth:`ManagedProcess.exit_reason` (``exit code 1``, ``killed by SIGKILL``) and its log path.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ephemeral_port_reserve
import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on 127.0.0.1, reserved for about a minute for whoever binds it with ``SO_REUSEADDR``.

    ``ephemeral_port_reserve.reserve`` binds port 0, connects to it and closes the accepted side first,
    leaving the port in TIME_WAIT (``tcp_fin_timeout``, 60 s on Linux): the kernel hands it to no
    other ``bind(0)`` and no outgoing ``connect()`` meanwhile, while a server that sets
    ``SO_REUSEADDR`` (gRPC, uvicorn/asyncio, etcd, libzmq, Envoy, :func:`kvmesh.http_server.bind_tcp`
    all do) binds it at once. kvmesh processes in the mesh bind port 0 and report it
    (:func:`wait_ports_file`) instead; this serves what cannot report its port (etcd, peers,
    ZMQ bind endpoints passed on the command line).
    """
    return int(ephemeral_port_reserve.reserve(LOOPBACK))


def _poll_until(ready: Callable[[], bool], timeout_seconds: float, interval_seconds: float = 0.05) -> bool:
    """Call ``ready`` every ``interval_seconds`` until it returns True (-> True) or ``timeout_seconds`` pass (-> False)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(interval_seconds)
    return False


def wait_grpc_healthy(address: str, timeout_seconds: float = 30.0, service: str = "") -> None:
    """Poll ``grpc.health.v1.Health/Check`` on ``address`` until SERVING.

    Raises:
        TimeoutError: when not SERVING within ``timeout_seconds``.
    """
    last: Exception | None = None
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            nonlocal last
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            except grpc.RpcError as exc:
                last = exc
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        if _poll_until(serving, timeout_seconds):
            return
    raise TimeoutError(f"{address} not SERVING after {timeout_seconds}s (last error: {last})")


def wait_http_ok(url: str, timeout_seconds: float = 30.0) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        TimeoutError: when it does not within ``timeout_seconds``.
    """
    last: object = None

    def ok() -> bool:
        nonlocal last
        try:
            reply = httpx.get(url, timeout=1.0)
        except httpx.HTTPError as exc:
            last = exc
            return False
        last = reply.status_code
        return reply.status_code == 200

    if _poll_until(ok, timeout_seconds):
        return
    raise TimeoutError(f"{url} not ready after {timeout_seconds}s (last: {last})")


def wait_ports_file(path: Path, process: ManagedProcess, timeout_seconds: float) -> dict[str, int]:
    """The ports a process bound, from the JSON it writes to ``--ports-file`` (``ProcessConfig.ports_file``).

    The process binds port 0 (the kernel hands each bind a distinct free port) and writes what it
    got, atomically, once listening; so no two processes can be handed the same port.

    Raises:
        RuntimeError: the process exited first (with its log tail).
        TimeoutError: no file within ``timeout_seconds``.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
        except FileNotFoundError:
            pass
        if not process.alive():
            raise RuntimeError(f"{process.name} exited before reporting its ports: {process.exit_note()}\n"
                               f"{process.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{process.name} did not report its ports in {timeout_seconds:g}s:\n{process.log_tail()}")
        time.sleep(0.02)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class ManagedProcess:
    """One child process in its own process group, logging to ``log_path``.

    With ``die_with_parent`` the child gets Linux's ``PR_SET_PDEATHSIG=SIGKILL``: it is killed when
    the *thread* that spawned it exits, so a SIGKILLed caller leaves no orphan. Spawn such children
    from a thread that lives as long as they should (the main thread).
    """

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    die_with_parent: bool = False
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv, preexec = list(self.argv), None
        if self.die_with_parent and sys.platform.startswith("linux"):
            # util-linux's setpriv sets the death signal and execs the command: no Python runs between fork
            # and exec (a preexec_fn there is unsafe in a threaded parent: a parent with gRPC's threads saw
            # children die before exec, "epoll_wait error: Bad file descriptor"); the hook only without it
            setpriv = shutil.which("setpriv")
            if setpriv:
                argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
            else:
                preexec = _die_with_parent
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=preexec,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise RuntimeError with how it ended and the log's tail if the process has exited."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited: {self.exit_note()}\n{self.log_tail()}")

    def exit_reason(self) -> str:
        """How the process ended: ``exit code 3``, ``killed by SIGKILL`` (a negative return code: the signal's
        name, ``signal 64`` for one without a name); ``still running`` or ``never started`` otherwise."""
        if self.proc is None:
            return "never started"
        rc = self.proc.poll()
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit code {rc}"

    def exit_note(self) -> str:
        """:meth:`exit_reason` and where its output went: ``killed by SIGKILL; log /run/engine-1.log``
        (the log only when the file exists)."""
        return self.exit_reason() + (f"; log {self.log_path}" if self.log_path.is_file() else "")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL it (:func:`stop_all` of this one)."""
        stop_all([self], timeout_seconds)

    def terminate(self) -> bool:
        """SIGTERM the process group without waiting; False when it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        return True

    def kill(self) -> None:
        """SIGKILL at once (a crash, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def stop_all(processes: Iterable[ManagedProcess], timeout_seconds: float = 10.0) -> list[ManagedProcess]:
    """Stop many processes in parallel: SIGTERM every running one's process group at once, wait for them all
    until one shared deadline (``timeout_seconds`` from now), then SIGKILL the groups still running and reap
    them (up to 5 s more). The whole takes about as long as the slowest process's own shutdown, not the sum.

    Returns the processes that had to be SIGKILLed (none when all stopped on SIGTERM in time).
    """
    running = [p for p in processes if p.terminate()]
    deadline = time.monotonic() + timeout_seconds
    killed: list[ManagedProcess] = []
    for p in running:
        assert p.proc is not None
        try:
            p.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(p)
    for p in killed:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in killed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(5)  # type: ignore[union-attr]
    return killed


def etcd_binary() -> str:
    """Path of the ``etcd`` server binary.

    Raises:
        FileNotFoundError: with the install command when it is missing.
    """
    path = shutil.which("etcd")
    if path is None:
        raise FileNotFoundError("etcd is not installed; run: sudo apt-get install -y etcd-server")
    return path


def start_etcd(
    run_dir: Path,
    client_port: int | None = None,
    peer_port: int | None = None,
    die_with_parent: bool = False,
) -> tuple[ManagedProcess, str]:
    """Start a single-member etcd with its data under ``run_dir/etcd``; returns it and ``host:port``.

    etcd cannot report a port it picked, so its two ports come from :func:`free_port`; a port taken
    in between makes etcd exit at once ("address already in use": Go sets no ``SO_REUSEPORT``), and
    then fresh ports are tried, up to 5 times (only when the ports were not given).

    Raises:
        TimeoutError: when it is not healthy within 20 s.
    """
    chosen = client_port is not None or peer_port is not None
    for _attempt in range(1 if chosen else 5):
        proc, address = _start_etcd_once(run_dir, client_port or free_port(), peer_port or free_port(), die_with_parent)
        if proc.alive() or chosen:
            return proc, address
        if "address already in use" not in proc.log_tail():
            break
    raise RuntimeError(f"etcd did not start: {proc.exit_note()}\n{proc.log_tail()}")


def _start_etcd_once(run_dir: Path, client_port: int, peer_port: int, die_with_parent: bool) -> tuple[ManagedProcess, str]:
    client_url = f"http://{LOOPBACK}:{client_port}"
    peer_url = f"http://{LOOPBACK}:{peer_port}"
    proc = ManagedProcess(
        "etcd",
        [
            etcd_binary(),
            "--name", "kvmesh",
            "--data-dir", str(run_dir / "etcd"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvmesh={peer_url}",
            "--log-level", "warn",
        ],
        run_dir / "etcd.log",
        die_with_parent=die_with_parent,
    ).start()
    deadline = time.monotonic() + 20.0
    try:
        while True:
            if not proc.alive():  # e.g. a port taken in the meantime: the caller may retry
                return proc, f"{LOOPBACK}:{client_port}"
            try:
                wait_http_ok(f"{client_url}/health", 0.5)
                return proc, f"{LOOPBACK}:{client_port}"
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
    except BaseException:  # not healthy in time, or interrupted (Ctrl-C) while waiting: no etcd left behind
        proc.kill()
        raise


def python_module(module: str, *args: str) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
