"""Load, outcome classes and resource probes for fault injection: the fault suite (tests/faults/) and ``bench/soak.py``.

:class:`Load` keeps ``concurrency`` clients sending small completions (every other one streamed)
to the router and classifies each request once it ends (:data:`OK`, a clean refusal ``refused_<status>``,
``http_500``/``http_<5xx>``, ``router_unreachable`` (connection refused: never accepted),
``lost`` (accepted, then no answer and no error status), ``stream_broken`` (the stream had started),
``timeout``). A request that had not started streaming must end ``ok`` or cleanly refused, never
``lost``, ``timeout`` or ``http_500`` (issue 14).

:func:`open_fds` and :func:`rss_bytes` read ``/proc``; :func:`metric_value` reads one sample of a
Prometheus exposition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

OK = "ok"
CLEAN_REFUSALS = {"refused_400", "refused_404", "refused_408", "refused_413", "refused_429",
                  "refused_502", "refused_503", "refused_504"}
NEVER = {"http_500", "lost", "timeout"}
"""Classes no fault may produce for a request that had not started streaming."""


@dataclass
class Outcome:
    started: float
    ended: float
    klass: str
    stream: bool
    detail: str = ""


@dataclass
class Load:
    """``concurrency`` closed-loop clients against ``router_url`` until :meth:`stop` (times: monotonic seconds)."""

    router_url: str
    model: str
    concurrency: int = 4
    max_tokens: int = 8
    request_timeout_seconds: float = 30.0
    prompt_words: int = 40
    outcomes: list[Outcome] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _n: int = 0

    async def __aenter__(self) -> Load:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.request_timeout_seconds,
                                         limits=httpx.Limits(max_connections=self.concurrency * 2))
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
        await self._client.aclose()

    def classes(self, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        """Outcome classes of the requests *started* in ``[since, until)``."""
        return Counter(o.klass for o in self.outcomes if since <= o.started < until)

    def bad(self, since: float = 0.0, until: float = float("inf"), allowed: frozenset[str] = frozenset()) -> list[Outcome]:
        """Requests started in the window whose class is in :data:`NEVER` (minus ``allowed``)."""
        return [o for o in self.outcomes if since <= o.started < until and o.klass in NEVER - allowed]

    async def _worker(self, i: int) -> None:
        while not self._stop.is_set():
            self._n += 1
            stream = self._n % 2 == 0
            topic = self._n % 16
            prompt = f"shared system preamble {topic} " + " ".join(f"w{(self._n * 7 + k) % 97}" for k in range(self.prompt_words))
            started = time.monotonic()
            klass, detail = await self._one(prompt, stream)
            self.outcomes.append(Outcome(started, time.monotonic(), klass, stream, detail))
            if klass not in (OK,):
                await asyncio.sleep(0.05)  # a refused client backs off a little, as a real one would

    async def _one(self, prompt: str, stream: bool) -> tuple[str, str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": stream,
                "ignore_eos": True}
        got_bytes = False
        try:
            async with self._client.stream("POST", f"{self.router_url}/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")[:200]
                    if reply.status_code == 500:
                        return "http_500", text
                    if reply.status_code in (400, 404, 408, 413, 429, 502, 503, 504):
                        return f"refused_{reply.status_code}", text
                    return f"http_{reply.status_code}", text
                chunks: list[bytes] = []
                async for chunk in reply.aiter_bytes():
                    got_bytes = True
                    chunks.append(chunk)
                raw = b"".join(chunks)
                if stream:
                    return (OK, "") if b"data: [DONE]" in raw else ("stream_broken", raw[-200:].decode(errors="replace"))
                json.loads(raw)["choices"]  # a complete JSON answer, or KeyError
                return OK, ""
        except httpx.ConnectError as exc:
            return "router_unreachable", repr(exc)
        except httpx.TimeoutException as exc:
            return "timeout", repr(exc)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return ("stream_broken" if got_bytes and stream else "lost"), repr(exc)


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (``/proc/<pid>/fd``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``/proc/<pid>/statm``)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def metric_value(url: str, name: str, timeout: float = 2.0) -> float | None:
    """The sum of the samples called ``name`` at the Prometheus ``url`` (None when unreachable or absent)."""
    try:
        text = httpx.get(url, timeout=timeout).text
    except httpx.HTTPError:
        return None
    total: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                total = (total or 0.0) + sample.value
    return total
