"""Timestamps of each pick across the router and epp (``bench/pick_stage_trace.py``; not imported otherwise).

Loaded as ``sitecustomize`` by the mesh's processes only when ``bench/pick_stage_trace.py`` puts this
folder on their ``PYTHONPATH`` and sets ``KVMESH_PICK_TRACE_DIR``: after ``services.router.clients``,
``services.router.request_flow`` (router) or ``services.epp.servicer`` / ``services.epp.scheduler``
(epp) are imported, their hot functions are wrapped to record ``(point, request id,
time.perf_counter_ns())``; a daemon thread appends the records to ``<dir>/<pid>.tsv`` once a second.
``perf_counter_ns`` is ``CLOCK_MONOTONIC`` on Linux, one clock for every process of the host.
Nothing of this runs in a normal mesh (no ``KVMESH_PICK_TRACE_DIR``, not on the path).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_DIR = os.environ.get("KVMESH_PICK_TRACE_DIR")
_now = time.perf_counter_ns
_records: list[tuple[str, str, int]] = []


def _rec(point: str, rid: str) -> None:
    _records.append((point, rid, _now()))


def _flusher() -> None:
    assert _DIR is not None
    path = os.path.join(_DIR, f"{os.getpid()}.tsv")
    while True:
        time.sleep(1.0)
        global _records
        batch, _records = _records, []
        if batch:
            with open(path, "a") as out:
                out.writelines(f"{p}\t{r}\t{t}\n" for p, r, t in batch)


def _around(owner: Any, name: str, start: str, end: str, rid: Callable[..., str]) -> None:
    """Wrap ``owner.<name>`` (a function or coroutine function) to record ``start`` before the call and
    ``end`` after it returned, for the request id ``rid(*args, **kwargs)`` reads from the call's arguments."""
    orig = getattr(owner, name)
    if inspect.iscoroutinefunction(orig):
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            r = rid(*args, **kwargs)
            _rec(start, r)
            out = await orig(*args, **kwargs)
            _rec(end, r)
            return out
    else:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            r = rid(*args, **kwargs)
            _rec(start, r)
            out = orig(*args, **kwargs)
            _rec(end, r)
            return out
    setattr(owner, name, wrapped)


class _Proxy:
    """Stands for a gRPC call or servicer context (every attribute is the wrapped one's); a subclass
    overrides the methods it times."""

    def __init__(self, inner: Any) -> None:
        self._c = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def _patch_router_clients(mod: Any) -> None:
    stream_cls = mod._PickStream
    ids: dict[int, str] = {}

    orig_send = stream_cls.send

    def send(self: Any, entry: Any) -> None:
        if entry.HasField("request"):
            ids[entry.id] = entry.request.request_id
            _rec("r.enqueue", entry.request.request_id)
        orig_send(self, entry)

    stream_cls.send = send

    orig_take = stream_cls._take_batch

    def take(self: Any) -> Any:
        woke = _now()
        batch = orig_take(self)
        built = _now()
        if batch is not None:
            for e in batch.entries:
                rid = ids.get(e.id, "")
                _records.append(("r.writer_woke", rid, woke))
                _records.append(("r.batch_built", rid, built))
        return batch

    stream_cls._take_batch = take

    class _CallProxy(_Proxy):
        async def write(self, batch: Any) -> None:
            await self._c.write(batch)
            t = _now()
            for e in batch.entries:
                _records.append(("r.written", ids.get(e.id, ""), t))

        async def read(self) -> Any:
            message = await self._c.read()
            t = _now()
            for r in getattr(message, "results", ()):
                _records.append(("r.read", ids.get(r.id, ""), t))
            return message

    orig_start = mod._MuxCall._start

    def start(self: Any, prefix: str) -> None:
        if isinstance(self, stream_cls):
            self._call = _CallProxy(self._call)
        orig_start(self, prefix)

    mod._MuxCall._start = start

    orig_resolve = mod._MuxCall._resolve

    def resolve(self: Any, key: int, reply: Any) -> None:
        orig_resolve(self, key, reply)
        if isinstance(self, stream_cls):
            _rec("r.resolved", ids.pop(key, ""))

    mod._MuxCall._resolve = resolve

    _around(mod.PickerClient, "pick", "r.client_pick", "r.client_done", lambda self, query: query.request_id)
    _around(mod.PickerClient, "_pick_on_stream", "r.request_built", "r.resumed",
            lambda self, request, *a, **kw: request.request_id)


def _patch_router_flow(mod: Any) -> None:
    _around(mod.RequestFlow, "_timed_pick", "r.stage_start", "r.stage_end",
            lambda self, request, meta, *a, **kw: meta.request_id)


def _patch_epp_servicer(mod: Any) -> None:
    session = mod._PickSession
    ids: dict[int, str] = {}
    orig_handle = session.handle

    def handle(self: Any, entry: Any) -> None:
        rid = entry.request.request_id
        ids[entry.id] = rid
        _rec("e.received", rid)
        orig_handle(self, entry)
        _rec("e.handled", rid)

    session.handle = handle

    orig_pick = session._pick

    async def pick(self: Any, key: int, entry: Any, request: Any) -> None:
        _rec("e.task_start", ids.get(key, ""))
        await orig_pick(self, key, entry, request)

    session._pick = pick

    orig_answer = session._answer

    def answer(self: Any, result: Any) -> None:
        _rec("e.answered", ids.get(result.id, ""))
        orig_answer(self, result)

    session._answer = answer

    orig_enter = mod._enter_trace

    def enter_trace(entry: Any) -> Any:
        span = orig_enter(entry)
        _rec("e.trace_entered", entry.request.request_id)
        return span

    mod._enter_trace = enter_trace

    _around(mod, "response_to_proto", "e.response_start", "e.response_built",
            lambda decision, request=None: request.request_id if request is not None else "")

    orig_init = session.__init__

    class _CtxProxy(_Proxy):
        async def write(self, message: Any) -> None:
            t = _now()
            for r in message.results:
                _records.append(("e.write_start", ids.get(r.id, ""), t))
            await self._c.write(message)
            t = _now()
            for r in message.results:
                _records.append(("e.written", ids.pop(r.id, ""), t))

    def init(self: Any, scheduler: Any, context: Any) -> None:
        orig_init(self, scheduler, _CtxProxy(context))

    session.__init__ = init


def _patch_epp_scheduler(mod: Any) -> None:
    _around(mod.Scheduler, "pick", "e.decide_start", "e.decide_end", lambda self, request: request.request_id)

    from services.epp.framework import profile as profile_mod

    def rid(self: Any, state: Any, request: Any, *a: Any, **kw: Any) -> str:
        return str(request.request_id)

    _around(profile_mod.SchedulerProfile, "prepare", "e.prepare_start", "e.prepare_end", rid)
    _around(profile_mod.SchedulerProfile, "run", "e.run_start", "e.run_end", rid)


_PATCHES = {
    "services.router.clients": _patch_router_clients,
    "services.router.request_flow": _patch_router_flow,
    "services.epp.servicer": _patch_epp_servicer,
    "services.epp.scheduler": _patch_epp_scheduler,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            orig_exec(module)
            _PATCHES[name](module)

        loader.exec_module = exec_module  # type: ignore[attr-defined]
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_flusher, name="pick-trace-flush", daemon=True).start()
