"""A whole mesh on one machine: etcd, the five kvmesh services and N simulated engines.

``Mesh(MeshSpec(...))`` is what ``kvmesh up``, ``kvmesh replay`` (without ``--router``),
``kvmesh compare`` and the integration tests use::

    with Mesh(MeshSpec(engines=2, policy="precise-prefix", run_dir=tmp)) as mesh:
        httpx.post(f"{mesh.router_url}/v1/completions", json={...})

A mesh owns its run folder while it runs (:class:`~kvmesh_cli.rundir.RunDirLock`, a ``flock`` on
``<run_dir>/mesh.lock``): a second mesh started there is refused, and etcd data a SIGKILLed mesh left
there (its registrations on leases a restarted etcd would renew, its old revisions) is deleted before the
new mesh's etcd starts (:func:`~kvmesh_cli.rundir.clear_stale_etcd_data`); a clean stop deletes it too.

Start order (output in ``<run_dir>/<name>.log``): etcd (unless ``spec.etcd`` names one) ->
kv_indexer (binds the ZMQ SUB socket the engines connect to) -> kv_store, flow_control, epp and
the engines -> the router (given flow_control's and epp's addresses), then all awaited in parallel:
gRPC health for services, ``GET /health`` for engines, then until epp's ``ListEndpoints`` shows all N
engines and the router's ``/v1/models`` lists the model. A process that exits while being awaited
fails the start at once with its log tail.

Ports cannot collide, by construction: every kvmesh process (services and simulated engines) is
started with port 0 and ``--ports-file``; the kernel hands each bind a distinct free port (no
server sets ``SO_REUSEPORT``, so none can share one), and the process writes what it bound
atomically once listening; the harness reads that file (:func:`~kvmesh_cli.launcher.wait_ports_file`)
before starting anyone who needs the address. Only etcd, kv_indexer's ZMQ port and vLLM are given a
port (they cannot report one); each fails loudly when it is taken, and etcd and kv_indexer are then
started again on fresh ports. :meth:`Mesh.restart` brings a killed member back on the ports it had.

Ports the spec fixes (``router_http_port``, ``router_grpc_port``, and a local ``--etcd``'s port) must
differ: two equal ones are refused before anything starts (:func:`port_clash`), not left to a late bind error.

Stop: SIGTERM to every member's process group but etcd's at once, one shared deadline
(``stop_timeout_seconds``), SIGKILL to what is left (:func:`~kvmesh_cli.launcher.stop_all`); then etcd, the
one order that matters (each service revokes its etcd lease on its way out; with etcd gone first each waits
out the revoke's time-out). About as long as the slowest member's own shutdown, not the sum of them all.
A stop interrupted (a second Ctrl-C) SIGKILLs what is left at once. Orphans are prevented three ways:
``stop()`` from ``__exit__``; an ``atexit`` hook for meshes still running when the interpreter
exits (the CLI turns SIGTERM/SIGHUP into a normal exit, see :func:`exit_on_signals`); and on Linux
every child gets ``PR_SET_PDEATHSIG=SIGKILL``, so even a SIGKILLed caller leaves nothing behind.
Because PDEATHSIG fires when the *thread* that spawned a child exits, processes are spawned only
from the thread calling :meth:`Mesh.start` (use the main thread).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Self, TypeVar

import grpc
import httpx
import yaml

from kvmesh.listen import ListenError, bind_tcp, rename_port_flags
from kvmesh_cli.launcher import (
    LOOPBACK,
    ManagedProcess,
    free_port,
    python_module,
    start_etcd,
    stop_all,
    wait_grpc_healthy,
    wait_http_ok,
    wait_ports_file,
)
from kvmesh_cli.rundir import LOCK_WAIT_S, RunDirBusy, RunDirLock, clear_stale_etcd_data

logger = logging.getLogger(__name__)


def _flags(**values: object) -> list[str]:
    """``--name value`` for each value that is set (None: the process's own default applies)."""
    out: list[str] = []
    for name, value in values.items():
        if value is not None:
            out += ["--" + name.replace("_", "-"), repr(value) if isinstance(value, float) else str(value)]
    return out

DEFAULT_MODEL = "sim-llama-3.1-8b"
"""Served model name of the simulated engines."""


@dataclass
class MeshSpec:
    """What to start. Times in wall seconds unless named ``model``.

    A field left at None passes no flag: the process uses its own default (the engine's in
    ``engine_simulator/config.py`` or vLLM's :class:`~kvmesh_cli.vllm_engine.VllmEngineSpec`, the
    services' in their ``config.py``), so each default is written once.
    """

    run_dir: Path
    """Logs, etcd data and the tokenizer's default location live here; one running mesh at a time
    (``<run_dir>/mesh.lock``), and etcd data found there at start, left by a mesh that did not stop, is deleted."""
    engines: int = 4
    policy: str = "tier-cost"
    """epp ``--scheduling-config``: a named config of ``services/epp/configs/`` (``tier-cost``, the default precise
    profile; ``precise-prefix``, ``round-robin``, ...) or a YAML path."""
    time_scale: float | None = None
    """Engine ``--time-scale``: simulated time runs this many times faster than wall time."""
    model: str = DEFAULT_MODEL
    block_size_tokens: int | None = None
    num_gpu_blocks: int = 512
    """Simulated engines' KV blocks (fewer than the simulator's default, so caches evict)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    etcd: str | None = None
    """``host:port`` of an external etcd; None starts a local one under ``run_dir/etcd``."""
    router_http_port: int | None = None
    router_grpc_port: int | None = None
    lease_ttl_seconds: int | None = None
    log_level: str | None = None
    start_timeout_seconds: float = 120.0
    stop_timeout_seconds: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)
    engine: Literal["simulator", "vllm"] = "simulator"
    """``vllm``: real vLLM servers (``make vllm-env model``) on the tiny model, each with a
    registration sidecar; ``model`` is then the served name and ``block_size_tokens`` a multiple of 32.
    ``num_gpu_blocks`` does not apply (vLLM sizes its cache from ``VLLM_CPU_KVCACHE_SPACE``)."""
    vllm_model_dir: Path | None = None
    """The model vLLM serves; None: ``$KVMESH_TINY_MODEL`` or ``.run/models/tiny-llama``."""
    vllm_num_gpu_blocks_override: int | None = None
    """vLLM ``--num-gpu-blocks-override`` (a small cache forces eviction)."""
    vllm_enforce_eager: bool = True
    vllm_dev_mode: bool = False
    """``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``)."""
    vllm_extra_args: tuple[str, ...] = ()
    engine_events_endpoint: str | None = None
    """Where engines publish KV events; None: kv_indexer's bind endpoint (a test may put a tap between)."""
    offload: str = "off"
    """Simulated engines' KV offload connector (``--offload``): ``off``, ``cpu`` or ``cpu+kv_store`` (the
    mesh's kv_store then publishes to kv_indexer and each engine names it in ``--kv-stores``)."""
    long_prefill_token_threshold: int | None = None
    """vLLM 0.32's ``--long-prefill-token-threshold`` for every engine, simulated or real (0 disables it)."""
    long_prefill_token_threshold_adaptive: bool = False
    """vLLM 0.32's ``--long-prefill-token-threshold-adaptive`` for every engine (the cap floored at
    ``max_num_batched_tokens // (running + waiting)``)."""
    scheduler_reserve_full_isl: bool | None = None
    """vLLM 0.32's ``--scheduler-reserve-full-isl`` for every engine (admit a request only when its whole sequence's
    blocks are free); None: the engine's default (true for vLLM and the simulator alike)."""
    engine_api_key: str | None = None
    """vLLM's ``--api-key`` for every engine (simulated or real); the pool's engine key is then given to
    the router and epp (``--engine-api-key``) and to each vLLM registration sidecar, so kvmesh's own calls
    authenticate (``docs/openai-compat.md``, "Headers and keys"). None: engines are open."""
    router_api_key: str | None = None
    """A client API key the router accepts (``--api-key`` of ``replay``/``compare``), sent by the readiness
    probe as ``Authorization: Bearer``; a refusal (401/403) fails the start at once. None: the first key
    of ``KVMESH_ROUTER_TENANTS`` (:func:`tenant_api_key`), if any."""


@dataclass
class Member:
    """One started process and where it listens (``None`` for what it does not serve)."""

    name: str
    process: ManagedProcess
    grpc: str | None = None
    http: str | None = None
    metrics: str | None = None
    argv: Callable[[dict[str, int]], list[str]] | None = None
    """Builds the argv with some ports fixed (name -> port; missing ones are 0); None: not restartable."""
    ports_file: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)
    """What the process reported binding (``grpc``, ``metrics``, ``http``)."""

    @property
    def log_path(self) -> Path:
        return self.process.log_path


T = TypeVar("T")

_RUNNING: weakref.WeakSet[Mesh] = weakref.WeakSet()

_PORT_FLAGS: dict[str, dict[str, str]] = {"router": {"--http-port": "--router-port", "--grpc-port": "--router-grpc-port"}}
"""A member's own port flags -> ``kvmesh up``'s flags for the same ports (the others are always 0: free)."""


@atexit.register
def _stop_all() -> None:
    for mesh in list(_RUNNING):
        with contextlib.suppress(Exception):
            mesh.stop()


@contextlib.contextmanager
def exit_on_signals(
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
    *,
    then_ignore: bool = False,
) -> Iterator[None]:
    """Within the block, the given signals raise KeyboardInterrupt (so ``with Mesh`` unwinds).

    Event loops run inside the block through :func:`run_interruptible`, which takes the signals over
    while the loop runs (a KeyboardInterrupt raised inside a running task leaves that task's
    exception unretrieved and a traceback on stderr).

    ``then_ignore``: for a command that exits (130) once interrupted. After the first signal (or a
    KeyboardInterrupt from :func:`run_interruptible`) leaves the block, the signals stay *ignored* to the
    process's end instead of being restored, so a second Ctrl-C cannot raise inside the command's
    interrupted line, click's exit or an ``atexit`` hook (a traceback, or 130 turned into "Aborted!");
    SIGKILL still ends it. Without it (``kvmesh up``), each signal raises: a second Ctrl-C cuts the
    mesh's stop short (the ``atexit`` hook finishes it).

    SIGINT is set explicitly too: a shell starts a background job (``kvmesh up &`` in a script)
    with SIGINT *ignored*, and Python keeps an inherited ignore, so ``kill -INT`` did nothing.
    Only effective in the main thread; elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if then_ignore and interrupted:  # on its way out already
            return
        interrupted.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    except KeyboardInterrupt:
        interrupted.append(0)
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if then_ignore and interrupted else h)


def run_interruptible(
    coro: Coroutine[Any, Any, T],
    signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
) -> T:
    """``asyncio.run(coro)``, where one of ``signals`` stops ``coro`` the asyncio way.

    The first signal cancels ``coro``'s task: its handler only records the signal and asks the loop
    (``call_soon_threadsafe``) to cancel, so nothing is raised inside whichever request task happens
    to run and no task ends with an exception nobody retrieves. The tasks unwind through
    ``CancelledError`` at their awaits, the loop then cancels whatever tasks are left, closes async
    generators and shuts its default executor down (``asyncio.Runner.close``), and once the loop has
    closed, ``KeyboardInterrupt("signal N")`` is raised here, as :func:`exit_on_signals` raises it in
    synchronous code.

    A second signal while it unwinds is ignored, up to the moment the loop has closed: the handlers
    in force before (:func:`exit_on_signals`'s, or Python's default) are restored only then, so no
    later signal can raise inside the loop's own clean-up (a task being cancelled, the executor's
    shutdown) and print a traceback. The unwinding is bounded by what ``coro`` does on cancellation
    and by the default executor's running jobs. Outside the main thread: plain ``asyncio.run``.

    Raises:
        KeyboardInterrupt: one of ``signals`` arrived (whatever ``coro`` did on its way out).
    """
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(coro)
    received: list[int] = []
    tasks: list[asyncio.Task[T]] = []
    runner = asyncio.Runner()
    loop = runner.get_loop()

    def cancel() -> None:
        if tasks and not tasks[0].done():
            tasks[0].cancel()

    def handler(signum: int, frame: FrameType | None) -> None:
        if received:  # a second signal while it unwinds: ignored
            return
        received.append(signum)
        with contextlib.suppress(RuntimeError):  # the loop has closed already: nothing left to cancel
            loop.call_soon_threadsafe(cancel)

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)  # a signal from here on cancels it (cancel() runs at the next await at the earliest)
        if received:  # it came before the task existed
            raise asyncio.CancelledError
        return await coro

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        try:
            result = runner.run(main())
        finally:
            runner.close()  # cancel the rest, shut the executor down: still under ``handler``
    except BaseException:
        if received:
            raise KeyboardInterrupt(f"signal {received[0]}") from None
        raise
    finally:
        coro.close()  # never started (a signal before the loop ran it): no "never awaited" warning
        for s, h in previous.items():
            signal.signal(s, h)
    if received:
        raise KeyboardInterrupt(f"signal {received[0]}")
    return result


class MeshStartError(RuntimeError):
    """A member did not come up; the message carries its log tail."""


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})
"""Hosts whose ports are this machine's: an external ``--etcd`` there holds its port."""


def configured_ports(spec: MeshSpec) -> dict[str, int]:
    """The ports ``spec`` fixes, by field name (``router_http_port``, ``router_grpc_port``; ``etcd`` for an
    external etcd on this machine); the others are chosen by the kernel (port 0) and cannot collide."""
    ports = {name: port for name in ("router_http_port", "router_grpc_port")
             if (port := getattr(spec, name))}
    if spec.etcd:
        from kvmesh_cli.discovery import split_host_port

        with contextlib.suppress(ValueError):  # a malformed --etcd is check_etcd's to report
            host, port = split_host_port(spec.etcd)
            if host in LOCAL_HOSTS:
                ports["etcd"] = port
    return ports


def port_clash(ports: Mapping[str, int], label: Callable[[str], str] = str) -> tuple[str, str, int] | None:
    """The first two names in ``ports`` given the same port, as ``(first, second, port)`` (through ``label``:
    the CLI's option names); None when all differ."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            return label(seen[port]), label(name), port
        seen[port] = name
    return None


def taken_port(ports: Mapping[str, int], host: str = LOOPBACK) -> tuple[str, ListenError] | None:
    """The first of the router's fixed ports (``router_http_port``, ``router_grpc_port`` in ``ports``, by field
    name; others are skipped) that another process listens on, with the error its listener would raise:
    found before anything starts instead of after the whole mesh came up. Binds each once with
    ``SO_REUSEADDR`` (as the router does: a port in TIME_WAIT is free) and releases it at once; a race
    with another process binding it meanwhile is still caught by the router's own start-up."""
    for name, what in (("router_http_port", "http"), ("router_grpc_port", "grpc")):
        port = ports.get(name)
        if not port:
            continue
        try:
            bind_tcp(host, port).close()
        except OSError as exc:
            return name, ListenError(what, host, port, exc.strerror or str(exc))
    return None


PROGRESS_EVERY_SECONDS = 5.0
"""How often a long start-up wait reports what it still waits for."""
ETCD_CHECK_TIMEOUT_S = 5.0
"""How long ``--etcd`` (an external etcd) gets to answer one read before the mesh refuses to start."""


def check_etcd(address: str, timeout_s: float = ETCD_CHECK_TIMEOUT_S) -> None:
    """Read once from the external etcd at ``address`` before anything starts.

    Raises:
        MeshStartError: it did not answer within ``timeout_s`` (one line naming the address), or the
            address is not ``host:port``.
    """
    from kvmesh_cli.discovery import DiscoveryError, read_etcd_prefix

    try:
        read_etcd_prefix(address, "/kvmesh/v1/services/", timeout_s,
                         hint="start it, or leave --etcd out and the mesh starts its own")
    except DiscoveryError as exc:
        raise MeshStartError(str(exc)) from None
    except ValueError as exc:
        raise MeshStartError(f"--etcd {address!r}: {exc}") from None


def tenant_api_key(extra_env: dict[str, str]) -> str | None:
    """A client API key a mesh's router accepts, when the CLI can see its tenants (``KVMESH_ROUTER_TENANTS``).

    The router inherits this process's environment plus ``extra_env`` (``MeshSpec.extra_env``). Of the tenants
    with a key, the one that limits a replay least is chosen: no rate limit before any (then the highest
    ``rate_per_second``), then no concurrency cap before any (then the highest ``max_concurrency``), then the
    highest ``max_priority``; the first on a tie; its first key (``Authorization: Bearer <key>``). None in open
    mode or when the value cannot be read (JSON or YAML, as the router takes it).
    """
    raw = {**os.environ, **extra_env}.get("KVMESH_ROUTER_TENANTS")
    if not raw:
        return None
    try:
        tenants = yaml.safe_load(raw)  # JSON is YAML
    except yaml.YAMLError:
        return None

    def number(tenant: dict[str, Any], name: str) -> float:
        value = tenant.get(name, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    def openness(tenant: dict[str, Any]) -> tuple[float, float, float]:
        rate, concurrency = number(tenant, "rate_per_second"), number(tenant, "max_concurrency")
        return (math.inf if rate <= 0 else rate, math.inf if concurrency <= 0 else concurrency,
                number(tenant, "max_priority"))

    best: tuple[tuple[float, float, float], str] | None = None
    for tenant in tenants if isinstance(tenants, list) else []:
        keys = tenant.get("api_keys") if isinstance(tenant, dict) else None
        if isinstance(keys, list) and keys and isinstance(keys[0], str):
            rank = openness(tenant)
            if best is None or rank > best[0]:
                best = (rank, keys[0])
    return None if best is None else best[1]


class Mesh:
    """Start/stop a mesh described by a :class:`MeshSpec`; a context manager."""

    def __init__(self, spec: MeshSpec, progress: Callable[[str], None] | None = None) -> None:
        """``progress``: called with one line per start-up stage and, during a long wait, every
        :data:`PROGRESS_EVERY_SECONDS` with what is awaited (``kvmesh up`` prints them)."""
        self.spec = spec
        self._progress = progress or (lambda line: logger.info("%s", line))
        self.members: list[Member] = []
        self.etcd_address: str = spec.etcd or ""
        self.router_url = ""
        self.epp_address = ""
        self.kv_indexer_address = ""
        self.engine_urls: list[str] = []
        self.events_bind_endpoint = ""
        """kv_indexer's bound ZMQ SUB endpoint (where engines publish unless told otherwise)."""
        self._stopped = False
        self._lock = RunDirLock(spec.run_dir)
        self._previous_owner: int | None = None  # the pid that held the run folder and died without stopping
        self._router_refusal = ""  # why the router's /v1/models probe last failed (for the time-out message)
        self.router_requires_key = False
        """The router refused the readiness probe's keyless ``GET /v1/models`` (API-key mode, and no key to send:
        :meth:`router_api_key` is None); a client must send one of its tenants' keys."""

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Mesh:
        """Start everything and wait until the mesh serves; stops what started on failure.

        Raises:
            MeshStartError: when a member exits or is not ready within ``start_timeout_seconds``, or the
                run folder belongs to a running mesh (nothing is started or deleted then).
            FileNotFoundError: when no etcd is given and the ``etcd`` binary is missing.
        """
        spec = self.spec
        clash = port_clash(configured_ports(spec))
        if clash:
            raise MeshStartError(f"{clash[0]} and {clash[1]} are both {clash[2]}: each needs its own port")
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._previous_owner = self._lock.acquire(LOCK_WAIT_S)
        except RunDirBusy as exc:
            raise MeshStartError(str(exc)) from None
        _RUNNING.add(self)
        t0 = time.monotonic()
        try:
            self._start(spec)
        except BaseException:
            self.stop()
            raise
        logger.info("mesh up in %.1fs: engines=%d policy=%s router=%s", time.monotonic() - t0,
                    spec.engines, spec.policy, self.router_url)
        return self

    def _start(self, spec: MeshSpec) -> None:
        deadline = time.monotonic() + spec.start_timeout_seconds
        if spec.etcd is None:
            try:
                stale = clear_stale_etcd_data(spec.run_dir)
            except RunDirBusy as exc:
                raise MeshStartError(str(exc)) from None
            if stale:
                owner = f" (pid {self._previous_owner})" if self._previous_owner else ""
                self._progress(f"deleted the etcd data a mesh that did not stop{owner} left in {spec.run_dir}")
            proc, self.etcd_address = start_etcd(spec.run_dir, die_with_parent=True)
            self.members.append(Member("etcd", proc, grpc=self.etcd_address, http=f"http://{self.etcd_address}"))
            self._progress(f"etcd listening on {self.etcd_address}")
        else:
            check_etcd(spec.etcd)
            self._progress(f"etcd {spec.etcd} answers")
        from engine_simulator.tokenizer import ensure_tokenizer  # the simulator package, not the mesh

        tokenizer_path = ensure_tokenizer(None)

        # kv_indexer binds the SUB socket before engines connect and publish. ZMQ cannot report a
        # port it picked through the ports file, so that one port is chosen here; ZMQ binds without
        # SO_REUSEPORT, so a port taken meanwhile fails kv_indexer at once and another is tried.
        for attempt in range(5):
            events_bind = f"tcp://{LOOPBACK}:{free_port()}"
            kv_indexer = self._service("kv_indexer", "--events-bind-endpoint", events_bind)
            try:
                self._resolve(kv_indexer, deadline)
                break
            except MeshStartError:
                if attempt == 4 or "Address already in use" not in kv_indexer.process.log_tail():
                    raise
                self.members.remove(kv_indexer)
        self.events_bind_endpoint = events_bind
        self.kv_indexer_address = kv_indexer.grpc or ""
        # The others bind port 0 and report; each waits only for the addresses it is given.
        if spec.offload == "cpu+kv_store" and spec.engine == "simulator":
            # engines put their blocks there: it publishes what it holds, and is up before they start
            from engine_simulator.config import SimulatorConfig  # the simulator's defaults, not the mesh

            kv_store = self._service(
                "kv_store", "--events-endpoint", events_bind, "--events-model", spec.model,
                "--events-block-size-tokens",
                str(spec.block_size_tokens or SimulatorConfig.model_construct().block_size_tokens))
            self._resolve(kv_store, deadline)
        else:
            kv_store = self._service("kv_store")
        keyed = ["--engine-api-key", spec.engine_api_key] if spec.engine_api_key else []
        epp = self._service("epp", "--kv-indexer-address", self.kv_indexer_address,
                            "--scheduling-config", spec.policy, *keyed)
        if spec.engine == "vllm":
            engines = [self._vllm_engine(i, events_bind) for i in range(spec.engines)]
        else:
            engines = [self._engine(i, spec.engine_events_endpoint or events_bind, tokenizer_path)
                       for i in range(spec.engines)]
        for member in [kv_store, epp]:
            self._resolve(member, deadline)
        self.epp_address = epp.grpc or ""
        # flow_control reads the engines' load (its saturation signal) from epp's ListEndpoints (docs/flow-control.md)
        others = [kv_store, self._service("flow_control", "--epp-address", self.epp_address)]
        self._resolve(others[1], deadline)
        router = self._service("router", "--http-port", str(spec.router_http_port or 0),
                               "--flow-control-address", others[1].grpc or "",
                               "--epp-address", self.epp_address, *keyed, grpc_port=spec.router_grpc_port)
        for member in [router, *engines]:
            if member.ports_file is not None:  # a vLLM engine is given its port (it cannot report one)
                self._resolve(member, deadline)
        self.router_url = router.http or ""
        self.engine_urls = [e.http or "" for e in engines]
        self._progress(f"services started; waiting for their health and {len(engines)} engine(s) ...")
        self._await([kv_indexer, *others, epp, router], deadline, self._grpc_ready)
        self._await(engines, deadline, self._http_ready)
        self._wait_until(deadline, "epp to list all engines", [epp], self._epp_sees_all_engines)
        if spec.engines:
            self._wait_until(deadline, "router to list the model", [router], self._router_lists_model)

    def stop(self) -> None:
        """Stop every member (idempotent): all but etcd in parallel (SIGTERM at once, one shared deadline of
        ``stop_timeout_seconds``, then SIGKILL), then etcd (the services revoke their leases there on the way out).
        Interrupted (a KeyboardInterrupt: a second Ctrl-C), it SIGKILLs what is left at once and re-raises."""
        if self._stopped:
            return
        self._stopped = True
        _RUNNING.discard(self)
        t0 = time.monotonic()
        timeout = self.spec.stop_timeout_seconds
        try:
            stop_all([m.process for m in self.members if m.name != "etcd"], timeout)
            stop_all([m.process for m in self.members if m.name == "etcd"], timeout)
        finally:
            self._finish_stop()
        logger.info("mesh stopped in %.1fs", time.monotonic() - t0)

    def _finish_stop(self) -> None:
        """SIGKILL whatever still runs (nothing after a whole stop), delete the etcd data, free the run folder."""
        for m in self.members:  # belt and braces; after an interrupted stop, the rest at once
            with contextlib.suppress(Exception):
                m.process.kill()
        if self.spec.etcd is None and self._lock.held:  # ours (its lock), also when start-up was interrupted
            # before etcd joined the members
            # The etcd this mesh started holds only its leases and registrations, dead with it; its WAL
            # preallocates ~123 MB (two 61 MiB WAL segments), left behind by every `kvmesh up`/`compare` run. The logs stay.
            shutil.rmtree(self.spec.run_dir / "etcd", ignore_errors=True)
        self._lock.release()  # last: the folder is free once its etcd data is gone

    def pids(self) -> list[int]:
        return [m.process.pid for m in self.members if m.process.proc is not None]

    # -- spawning --------------------------------------------------------------------------

    def _process_flags(self) -> list[str]:
        """Flags every process of the mesh gets: loopback, this mesh's etcd, lease and log level if set."""
        return [
            "--host", LOOPBACK,
            "--etcd-endpoints", self.etcd_address,
            *_flags(lease_ttl_seconds=self.spec.lease_ttl_seconds, log_level=self.spec.log_level),
        ]

    def _common_flags(self, grpc_port: int, metrics_port: int) -> list[str]:
        return [
            *self._process_flags(),
            "--grpc-port", str(grpc_port),
            "--metrics-port", str(metrics_port),
            "--shutdown-grace-seconds", "1",
        ]

    def _spawn(self, member: Member, ports: dict[str, int]) -> ManagedProcess:
        """(Re)start ``member``'s process: its argv with ``ports`` fixed (empty: port 0, reported)."""
        assert member.argv is not None
        ports_file = self.spec.run_dir / f"{member.name}.ports.json"
        ports_file.unlink(missing_ok=True)
        member.ports_file = ports_file
        return ManagedProcess(
            member.name,
            member.argv(ports) + ["--ports-file", str(ports_file)],
            self.spec.run_dir / f"{member.name}.log",
            env=dict(self.spec.extra_env),
            die_with_parent=True,
        ).start()

    def _resolve(self, member: Member, deadline: float) -> None:
        """Wait for ``member``'s ports file and fill in its addresses.

        Raises:
            MeshStartError: it exited or reported nothing before ``deadline``.
        """
        assert member.ports_file is not None
        try:
            ports = wait_ports_file(member.ports_file, member.process, max(0.1, deadline - time.monotonic()))
        except RuntimeError:  # a port in use is named by the flag of this CLI, not the service's own
            tail = rename_port_flags(member.process.log_tail(), _PORT_FLAGS.get(member.name, {}))
            raise MeshStartError(f"{member.name} exited during start-up: {member.process.exit_note()}\n"
                                 f"{tail}") from None
        except TimeoutError:
            raise MeshStartError(f"{member.name} not ready in time:\n{member.process.log_tail()}") from None
        member.ports = ports
        if "grpc" in ports:
            member.grpc = f"{LOOPBACK}:{ports['grpc']}"
        if "http" in ports:
            member.http = f"http://{LOOPBACK}:{ports['http']}"
        if "metrics" in ports:
            member.metrics = f"http://{LOOPBACK}:{ports['metrics']}/metrics"
        elif member.http:
            member.metrics = f"{member.http}/metrics"

    def _service(self, name: str, *flags: str, grpc_port: int | None = None) -> Member:
        def argv(ports: dict[str, int]) -> list[str]:
            return python_module(f"services.{name}", *self._common_flags(ports.get("grpc", grpc_port or 0),
                                                                        ports.get("metrics", 0)), *flags,
                                 *(["--http-port", str(ports["http"])] if "http" in ports else []))

        member = Member(name, None, argv=argv)  # type: ignore[arg-type]
        member.process = self._spawn(member, {})
        self.members.append(member)
        return member

    def _engine(self, i: int, events_endpoint: str, tokenizer_path: Path) -> Member:
        spec = self.spec
        name = f"engine-{i}"

        def argv(ports: dict[str, int]) -> list[str]:
            return python_module(
                "engine_simulator",
                *self._process_flags(),
                "--port", str(ports.get("http", 0)),
                "--model", spec.model,
                "--num-gpu-blocks", str(spec.num_gpu_blocks),
                "--events-endpoint", events_endpoint,
                "--events-replay-endpoint", "tcp://127.0.0.1:*",  # vLLM's replay ROUTER: kv_indexer recovers gaps
                "--tokenizer-path", str(tokenizer_path),
                *(["--offload", spec.offload] if spec.offload != "off" else []),
                *(["--kv-stores", self.member("kv_store").grpc or ""] if spec.offload == "cpu+kv_store" else []),
                *(["--api-key", spec.engine_api_key] if spec.engine_api_key else []),
                *_flags(
                    block_size_tokens=spec.block_size_tokens,
                    max_num_seqs=spec.max_num_seqs,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                    max_model_len=spec.max_model_len,
                    time_scale=None if spec.time_scale is None else float(spec.time_scale),
                    long_prefill_token_threshold=spec.long_prefill_token_threshold,
                    long_prefill_token_threshold_adaptive="true" if spec.long_prefill_token_threshold_adaptive
                    else None,
                    scheduler_reserve_full_isl=None if spec.scheduler_reserve_full_isl is None
                    else str(spec.scheduler_reserve_full_isl).lower(),
                ),
            )

        member = Member(name, None, argv=argv)  # type: ignore[arg-type]
        member.process = self._spawn(member, {})
        self.members.append(member)
        return member

    # -- faults ----------------------------------------------------------------------------

    def member(self, name: str) -> Member:
        """The member called ``name`` (``"flow_control"``, ``"engine-0"``).

        Raises:
            KeyError: no such member.
        """
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)

    def kill(self, name: str) -> None:
        """SIGKILL a member's process group (a crash)."""
        self.member(name).process.kill()

    def restart(self, name: str, timeout_seconds: float = 60.0) -> Member:
        """Start a stopped or killed kvmesh member again on the ports it had (peers keep its address)
        and wait until it reports them. The old ports were just released, so this is the one place
        the harness names a port itself.

        Raises:
            ValueError: the member cannot be restarted (etcd, a vLLM engine).
            MeshStartError: it did not come back.
        """
        member = self.member(name)
        if member.argv is None:
            raise ValueError(f"{name} cannot be restarted by the mesh")
        member.process.kill()
        member.process = self._spawn(member, dict(member.ports))
        self._resolve(member, time.monotonic() + timeout_seconds)
        return member

    def _vllm_engine(self, i: int, events_bind: str) -> Member:
        """A real vLLM server plus its registration sidecar (named ``registration-<i>``)."""
        from kvmesh_cli.vllm_engine import VllmEngineSpec, sidecar_args, tiny_model_dir, vllm_python

        spec = self.spec
        given = {"block_size_tokens": spec.block_size_tokens, "max_model_len": spec.max_model_len,
                 "max_num_seqs": spec.max_num_seqs}
        sizes: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
        engine = VllmEngineSpec(
            port=free_port(),
            run_dir=spec.run_dir,
            events_endpoint=spec.engine_events_endpoint or events_bind,
            model=spec.model,
            model_dir=spec.vllm_model_dir or tiny_model_dir(),
            python=vllm_python(),
            **sizes,
            num_gpu_blocks_override=spec.vllm_num_gpu_blocks_override,
            enforce_eager=spec.vllm_enforce_eager,
            dev_mode=spec.vllm_dev_mode,
            extra_args=spec.vllm_extra_args,
            replay_port=free_port(),
            api_key=spec.engine_api_key,
            long_prefill_token_threshold=spec.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=spec.long_prefill_token_threshold_adaptive,
            scheduler_reserve_full_isl=spec.scheduler_reserve_full_isl,
        )
        name = f"engine-{i}"
        proc = ManagedProcess(name, engine.argv(), spec.run_dir / f"{name}.log",
                              env={**engine.env(), **spec.extra_env}, die_with_parent=True).start()
        # The registration names kv_indexer's bind endpoint (so it does not also connect elsewhere).
        registered = dataclasses.replace(engine, events_endpoint=events_bind)
        sidecar = ManagedProcess(
            f"registration-{i}",
            python_module("services.registration_sidecar", "--host", LOOPBACK, "--metrics-port", "0",
                          *sidecar_args(registered, self.etcd_address, spec.lease_ttl_seconds, spec.log_level)),
            spec.run_dir / f"registration-{i}.log",
            env=dict(spec.extra_env),
            die_with_parent=True,
        ).start()
        self.members.append(Member(f"registration-{i}", sidecar))
        member = Member(name, proc, http=engine.url, metrics=f"{engine.url}/metrics")
        self.members.append(member)
        return member

    # -- readiness -------------------------------------------------------------------------

    @staticmethod
    def _grpc_ready(member: Member) -> bool:
        try:
            wait_grpc_healthy(member.grpc or "", 1.0)
            return True
        except TimeoutError:
            return False

    @staticmethod
    def _http_ready(member: Member) -> bool:
        try:
            wait_http_ok(f"{member.http}/health", 1.0)
            return True
        except TimeoutError:
            return False

    def _epp_endpoints(self) -> list[Any] | None:
        """epp's ``ListEndpoints`` (its endpoint states), None when epp does not answer within 2 s."""
        from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc

        with grpc.insecure_channel(self.epp_address) as channel:
            try:
                reply = epp_pb2_grpc.EndpointPickerStub(channel).ListEndpoints(
                    epp_pb2.ListEndpointsRequest(), timeout=2.0)
            except grpc.RpcError:
                return None
        return list(reply.endpoints)

    def _epp_sees_all_engines(self, _member: Member) -> bool:
        endpoints = self._epp_endpoints()
        if endpoints is None:
            return False
        urls = {state.endpoint.url for state in endpoints}
        return all(u in urls for u in self.engine_urls)

    def router_api_key(self) -> str | None:
        """A client API key this mesh's router accepts: ``spec.router_api_key``, else
        :func:`tenant_api_key` of ``spec.extra_env``; None when neither names one."""
        return self.spec.router_api_key or tenant_api_key(self.spec.extra_env)

    def _epp_lists_model(self) -> bool:
        endpoints = self._epp_endpoints()
        return endpoints is not None and any(state.endpoint.model == self.spec.model for state in endpoints)

    def _router_lists_model(self, _member: Member) -> bool:
        """The router serves the model: its ``/v1/models`` lists it.

        In API-key mode (``require_api_key``) the probe sends :meth:`router_api_key`; when it
        has none to send and gets 401, the router counts as ready once its ``/health`` answers 200
        and epp (the router's source of endpoints) lists an endpoint serving the model. The last
        refusal is kept in ``self._router_refusal`` for the time-out message.

        Raises:
            MeshStartError: the router refused the key it was sent (401/403; its tenants are fixed
                at its start, so waiting cannot help).
        """
        key = self.router_api_key()
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            reply = httpx.get(f"{self.router_url}/v1/models", headers=headers, timeout=2.0)
        except httpx.HTTPError as exc:
            self._router_refusal = f"GET /v1/models failed: {exc}"
            return False
        if reply.status_code in (401, 403):
            if key:
                source = "the given API key (--api-key or KVMESH_API_KEY)" if self.spec.router_api_key else \
                    "the key from KVMESH_ROUTER_TENANTS"
                raise MeshStartError(f"router {self.router_url} answered GET /v1/models with HTTP "
                                     f"{reply.status_code} to {source}: it does not accept that key")
            self._router_refusal = (f"GET /v1/models answered HTTP {reply.status_code} "
                                    "(API-key mode; no key in KVMESH_ROUTER_TENANTS)")
            self.router_requires_key = True
            try:
                health = httpx.get(f"{self.router_url}/health", timeout=2.0)
            except httpx.HTTPError:
                return False
            return health.status_code == 200 and self._epp_lists_model()
        if reply.status_code != 200:
            self._router_refusal = f"GET /v1/models answered HTTP {reply.status_code}"
            return False
        listed = [m.get("id") for m in reply.json().get("data", [])]
        if self.spec.model in listed:
            return True
        self._router_refusal = f"GET /v1/models lists {listed}, not {self.spec.model!r}"
        return False

    def _wait_until(self, deadline: float, what: str, members: list[Member], probe: Callable[[Member], bool]) -> None:
        started = last_said = time.monotonic()
        while True:
            for m in members:
                if not m.process.alive():
                    raise MeshStartError(f"{m.name} exited while waiting for {what}: {m.process.exit_note()}\n"
                                         f"{m.process.log_tail()}")
            if probe(members[0]):
                return
            now = time.monotonic()
            if now > deadline:
                why = f" (last: {self._router_refusal})" if probe == self._router_lists_model and self._router_refusal else ""
                raise MeshStartError(f"timed out waiting for {what}{why}; see logs in {self.spec.run_dir}")
            if now - last_said >= PROGRESS_EVERY_SECONDS:
                last_said = now
                why = f"; last: {self._router_refusal}" if probe == self._router_lists_model and self._router_refusal else ""
                self._progress(f"still waiting for {what} ({now - started:.0f}s, gives up in {deadline - now:.0f}s; "
                               f"logs in {self.spec.run_dir}{why})")
            time.sleep(0.1)

    def _await(self, members: list[Member], deadline: float, probe: Callable[[Member], bool]) -> None:
        """Wait for every member's probe in parallel; fail fast when one exits."""

        def one(m: Member) -> None:
            while True:
                if not m.process.alive():
                    raise MeshStartError(f"{m.name} exited during start-up: {m.process.exit_note()}\n"
                                         f"{m.process.log_tail()}")
                if probe(m):
                    return
                if time.monotonic() > deadline:
                    raise MeshStartError(f"{m.name} not ready in time:\n{m.process.log_tail()}")
                time.sleep(0.1)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(members))) as pool:
            for fut in [pool.submit(one, m) for m in members]:
                fut.result()

    # -- reporting -------------------------------------------------------------------------

    def describe(self) -> list[dict[str, str]]:
        """One row per member: service, pid, gRPC, HTTP, metrics, log."""
        return [
            {
                "service": m.name,
                "pid": str(m.process.pid) if m.process.proc else "-",
                "grpc": m.grpc or "-",
                "http": m.http or "-",
                "metrics": m.metrics or "-",
                "log": str(m.log_path),
            }
            for m in self.members
        ]
