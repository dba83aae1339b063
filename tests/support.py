"""Helpers and constants that tests import (``conftest.py`` holds only fixtures and hooks).

- ``RECORDINGS_DIR``: real vLLM 0.32 wire recordings, vendored in the repository, so every clone runs the
  same wire checks; ``recording(name)`` fails (never skips) when a file is missing.
- ``update_golden(config)``: whether this run rewrites golden files (``--update-golden``).
- ``wait_until`` / ``wait_until_async``: the one deadline-poll for "eventually true" conditions. On
  timeout they raise ``WaitTimeout`` (an ``AssertionError``) naming what was awaited and the last
  value the probe returned (or the last exception it raised, when told to tolerate it).
- ``serve_registered`` / ``stop_registered``: a test's own HTTP engine (any ASGI app) on 127.0.0.1 with
  an etcd registration under its endpoint key, as a real engine's sidecar would write it.
- ``OutputLines``: a subprocess's merged output, read on a thread (``text``, ``wait_for``, ``rest``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, overload

import pytest

from kvmesh.http_server import HttpServer
from kvmesh.membership import LeaseRegistration, endpoint_key
from kvmesh.types import Endpoint, EndpointId

T = TypeVar("T")

TESTS_DIR = Path(__file__).resolve().parent

RECORDINGS_DIR = TESTS_DIR / "compat" / "fixtures" / "vllm-0.32-cpu"
"""Real vLLM 0.32 (CPU build) wire recordings: KV-event frames, one /metrics page, tokenizer config.

Provenance and format in ``README.md`` there. They are part of the repository: a test that needs them
fails when they are missing instead of silently running fewer checks.
"""


def recording(name: str) -> Path:
    """The path of the vendored recording ``name``; fails the test when it is missing."""
    path = RECORDINGS_DIR / name
    if not path.is_file():
        pytest.fail(f"vLLM 0.32 recording missing: {path} (it is vendored in the repository; restore it)")
    return path


def service_ports(proc: Any) -> dict[str, int]:
    """The ports a service started by the ``start_service`` fixture bound (``{"grpc": .., "metrics": ..}``).

    It binds port 0 and writes them to its ports file, which sits beside its log (``<stem>.json``).
    """
    return {str(k): int(v) for k, v in json.loads(Path(proc.log_path).with_suffix(".json").read_text()).items()}


def update_golden(config: pytest.Config) -> bool:
    """Whether golden files are rewritten this run (``--update-golden`` or ``KVMESH_UPDATE_GOLDEN=1``)."""
    return bool(config.getoption("--update-golden")) or os.environ.get("KVMESH_UPDATE_GOLDEN") == "1"


class WaitTimeout(AssertionError):
    """``what`` did not hold within ``timeout`` seconds; ``last`` is the last value (or error) seen."""

    def __init__(self, what: str, timeout: float, last: object) -> None:
        super().__init__(f"timed out after {timeout:g}s waiting for {what}; last seen: {last!r}")
        self.what = what
        self.timeout = timeout
        self.last = last


class _Poll:
    """The bookkeeping shared by both waits: the deadline, the condition and the last value seen."""

    def __init__(self, timeout: float, what: str, until: Callable[[Any], object]) -> None:
        self._deadline = time.monotonic() + timeout
        self._timeout, self._what, self._until = timeout, what, until
        self._last: object = None

    def holds(self, value: object) -> bool:
        """True when ``value`` meets the condition; else records it, raising once the deadline has passed."""
        if self._until(value):
            return True
        self.missed(value)
        return False

    def missed(self, last: object) -> None:
        """Record a try that did not hold (a value or an ignored error).

        Raises:
            WaitTimeout: the deadline has passed.
        """
        self._last = last
        if time.monotonic() >= self._deadline:
            raise WaitTimeout(self._what, self._timeout, self._last)


def wait_until(
    probe: Callable[[], T],
    timeout: float,
    what: str,
    *,
    until: Callable[[T], object] = bool,
    interval: float = 0.05,
    before_each: Callable[[], object] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``probe`` every ``interval`` seconds until ``until(value)`` is true; return that value.

    Args:
        probe: returns the observed value (a bool for a plain predicate).
        timeout: seconds before giving up.
        what: what is awaited, for the failure message ("the router to list the model").
        until: the condition on the value; truthiness by default.
        before_each: called before every try (e.g. re-send an idempotent message a PUB socket may drop).
        ignore: exception types from ``probe`` that mean "not yet" (recorded as the last value seen).

    Raises:
        WaitTimeout: the condition did not hold within ``timeout``.
    """
    poll = _Poll(timeout, what, until)
    while True:
        if before_each is not None:
            before_each()
        try:
            value = probe()
        except ignore as exc:
            poll.missed(exc)
        else:
            if poll.holds(value):
                return value
        time.sleep(interval)


@overload
async def wait_until_async(
    probe: Callable[[], Awaitable[T]],
    timeout: float,
    what: str,
    *,
    until: Callable[[T], object] = ...,
    interval: float = ...,
    before_each: Callable[[], object] | None = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def wait_until_async(
    probe: Callable[[], T],
    timeout: float,
    what: str,
    *,
    until: Callable[[T], object] = ...,
    interval: float = ...,
    before_each: Callable[[], object] | None = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def wait_until_async(
    probe: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    until: Callable[[Any], object] = bool,
    interval: float = 0.05,
    before_each: Callable[[], object] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """``wait_until`` for the event loop: ``probe`` may be a coroutine function or a plain one.

    Sleeps with ``asyncio.sleep``, so the code under test keeps running between tries.

    Raises:
        WaitTimeout: the condition did not hold within ``timeout``.
    """
    poll = _Poll(timeout, what, until)
    while True:
        if before_each is not None:
            before_each()
        try:
            result = probe()
            value = await result if inspect.isawaitable(result) else result
        except ignore as exc:
            poll.missed(exc)
        else:
            if poll.holds(value):
                return value
        await asyncio.sleep(interval)


async def serve_registered(app: Any, etcd: str, model: str,
                           labels: dict[str, str]) -> tuple[HttpServer, Endpoint, LeaseRegistration]:
    """Serve ``app`` on 127.0.0.1 (a free port) and register it in ``etcd`` as an engine of ``model``
    (lease TTL 3 s); stop both with :func:`stop_registered`."""
    server = HttpServer(app, "127.0.0.1", 0, grace_seconds=0.2)
    await server.start()
    port = server.port
    endpoint = Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model, labels=labels)
    registration = LeaseRegistration([etcd], endpoint_key(endpoint), endpoint.to_json(), ttl_seconds=3)
    await registration.start()
    return server, endpoint, registration


async def stop_registered(server: HttpServer | None, registration: LeaseRegistration | None) -> None:
    """Deregister, then stop serving (either may be None: not started)."""
    if registration is not None:
        await registration.stop()
    if server is not None:
        await server.stop()


class OutputLines:
    """A subprocess's merged stdout/stderr, read line by line on a daemon thread, so a test can look at what
    it printed so far without blocking on the pipe."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.seen = proc, ""
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)

    def text(self) -> str:
        """Everything printed so far."""
        while True:
            try:
                self.seen += self._q.get_nowait()
            except queue.Empty:
                return self.seen

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """Everything printed once ``text`` has been; fails the test after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            try:
                self.seen += self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{text!r} not printed within {timeout} s; output so far:\n{self.seen}")
        return self.seen

    def rest(self) -> str:
        """Everything printed, once the process has exited (its pipe drained)."""
        time.sleep(0.2)
        return self.text()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts, reads what it is sent and never answers (a black-holed
    address as a client sees it: connected, then nothing until its deadline). ``spoken`` is set once a
    client has sent its first bytes (gRPC: the HTTP/2 preface), so the client is then waiting for a reply."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.spoken = threading.Event()
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the accept timed out (or the listener closed)
                continue
            self._open.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                self.spoken.set()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for conn in self._open:
            with contextlib.suppress(OSError):
                conn.close()


def eos_prompt(sim: Any, within: int = 12) -> tuple[list[int], list[int]]:
    """A token-id prompt whose generation on the simulator ``sim`` (an ``EngineSimulator``) samples EOS within
    ``within`` tokens (after the second), and its output ids up to and with that EOS (about 1 prompt in 160 does).

    Raises:
        AssertionError: no prompt among 20,000 does.
    """
    from engine_simulator.scheduler import Request
    from engine_simulator.tokenizer import EOS_ID

    cfg = sim.core.config
    for i in range(20000):
        prompt = [1, 3 + i % 1800, 5 + i // 1800, 7]
        req = Request("probe", prompt, within)
        for _ in range(within):
            req.output_token_ids.append(req.next_token(cfg.vocab_size, cfg.sampled_token_ids))
        out = list(req.output_token_ids)
        if EOS_ID in out[2:]:
            return prompt, out[:out.index(EOS_ID) + 1]
    raise AssertionError("no prompt samples EOS early")
