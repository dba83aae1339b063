"""Send a workload through the router and measure it (the I/O half of ``kvmesh replay``).

Each request is a streaming ``POST /v1/completions`` with the prompt as token ids (``<s>`` first)
or, with ``prompt_format="text"``, as the text the engines tokenize to those same ids (for routers
that refuse token ids: sglang-router), ``max_tokens`` from the workload, ``ignore_eos: true`` and
``stream_options.include_usage``.

When a request is sent:

* open loop (``think_s`` None): at ``arrival_s / time_scale`` wall seconds after the start, but
  never before the request it depends on (``after``, the previous turn) has completed;
* closed loop (``think_s`` set, agentic sessions): ``think_s / time_scale`` after ``after``
  completed, the way an agent sends its next call once it has the answer and ran its tools;
* a session's first request waits for one of ``max_sessions`` session slots (closed-loop
  concurrency; a slot frees when every request of its session has completed);
* never with more than ``concurrency_limit`` requests in flight.

TTFT is the time to the first SSE chunk that carries text; end-to-end the time to ``data: [DONE]``
(or the stream's end); ITL the mean gap between the first and the last text chunk per later token. Output tokens come
from the final ``usage`` (falling back to the number of text chunks). Events are decoded by
``httpx-sse`` and each chunk parsed by :mod:`kvmesh.openai_stream` (an in-stream ``error`` event
fails the request).

Engine prefix-cache counters are scraped from each engine's ``/metrics`` before and after; the
engines come from the caller (a mesh it started), epp's ``ListEndpoints`` or etcd
(:mod:`kvmesh_cli.discovery`). The same scrapes keep vLLM's per-request histograms
(:data:`~kvmesh_cli.report.ENGINE_HISTOGRAMS`), and, given the router's and flow_control's ``/metrics``
URLs, the router's stage histograms; one load sampler (:class:`kvmesh_cli.timeline.EngineSampler`: the
caller's ``--timeline`` one, else one every ``load_interval_s``) reads the engines' running / waiting gauges and
flow_control's queue size during the run: the TTFT breakdown (:func:`kvmesh_cli.report.ttft_breakdown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from httpx_sse import aconnect_sse

from kvmesh.openai_stream import DONE, parse_event
from kvmesh_cli.report import (
    ENGINE_HISTOGRAMS,
    EXTERNAL_HITS_METRIC,
    EXTERNAL_QUERIES_METRIC,
    HITS_METRIC,
    QUERIES_METRIC,
    REQUESTS_METRIC,
    ROUTER_STAGE_HISTOGRAM,
    Hist,
    RequestResult,
    parse_histograms,
    parse_prometheus_counter,
)
from kvmesh_cli.timeline import EngineSampler, load_samples
from kvmesh_cli.workloads import Workload, WorkloadRequest, request_text, request_token_ids

logger = logging.getLogger(__name__)


@dataclass
class ReplayOutcome:
    results: list[RequestResult]
    wall_duration_s: float
    """First send to last completion, wall seconds."""
    counters_before: dict[str, tuple[float, ...]]
    counters_after: dict[str, tuple[float, ...]]
    loop_lag_s: list[float] = field(default_factory=list)
    """The client's own event-loop lag, wall seconds, one sample per ``LAG_PROBE_S`` (:func:`probe_loop_lag`):
    how late the client itself noticed what it measures (a starved client inflates every TTFT)."""
    histograms_before: dict[str, dict[str, Hist]] = field(default_factory=dict)
    """Per engine URL, :data:`~kvmesh_cli.report.ENGINE_HISTOGRAMS` at the scrape before the run."""
    histograms_after: dict[str, dict[str, Hist]] = field(default_factory=dict)
    router_before: dict[str, Hist] | None = None
    """The router's ``kvmesh_router_stage_duration_seconds`` by stage before the run (None: no router URL)."""
    router_after: dict[str, Hist] | None = None
    load: list[tuple[float, float, float | None]] = field(default_factory=list)
    """Samples of (running, waiting) per engine (mean over the engines that answered) and flow_control's
    queue size (None without its URL), one per sampler point (:func:`kvmesh_cli.timeline.load_samples`)."""


async def scrape_engines(
    client: httpx.AsyncClient, engine_urls: Sequence[str]
) -> tuple[dict[str, tuple[float, ...]], dict[str, dict[str, Hist]]]:
    """One ``/metrics`` scrape per engine: ``({engine url: (prefix_cache_hits_total, prefix_cache_queries_total,
    request_success_total, external_prefix_cache_hits_total, external_prefix_cache_queries_total)},
    {engine url: {histogram name: Hist}})`` (vLLM 0.32's names; the external pair is the offload connector's,
    0 without one; the histograms are :data:`~kvmesh_cli.report.ENGINE_HISTOGRAMS`).

    Unreachable engines are omitted (and logged).
    """

    async def one(url: str) -> tuple[str, tuple[float, ...], dict[str, Hist]] | None:
        try:
            reply = await client.get(f"{url}/metrics", timeout=5.0)
            reply.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("cannot scrape %s/metrics: %s", url, exc)
            return None
        text = reply.text
        try:
            return url, (parse_prometheus_counter(text, HITS_METRIC), parse_prometheus_counter(text, QUERIES_METRIC),
                         parse_prometheus_counter(text, REQUESTS_METRIC),
                         parse_prometheus_counter(text, EXTERNAL_HITS_METRIC),
                         parse_prometheus_counter(text, EXTERNAL_QUERIES_METRIC)), \
                parse_histograms(text, ENGINE_HISTOGRAMS)
        except ValueError as exc:
            logger.warning("unparsable %s/metrics: %s", url, exc)
            return None

    got = [g for g in await asyncio.gather(*(one(u) for u in engine_urls)) if g is not None]
    return {url: c for url, c, _ in got}, {url: h for url, _, h in got}


async def scrape_counters(
    client: httpx.AsyncClient, engine_urls: Sequence[str]
) -> dict[str, tuple[float, ...]]:
    """The counters half of :func:`scrape_engines`."""
    return (await scrape_engines(client, engine_urls))[0]


async def scrape_router_stages(client: httpx.AsyncClient, metrics_url: str | None) -> dict[str, Hist] | None:
    """The router's ``kvmesh_router_stage_duration_seconds`` by stage from ``metrics_url`` (the full
    ``.../metrics`` URL); None without a URL or when it does not answer (logged)."""
    if metrics_url is None:
        return None
    try:
        reply = await client.get(metrics_url, timeout=5.0)
        reply.raise_for_status()
        return parse_histograms(reply.text, (ROUTER_STAGE_HISTOGRAM,), by_label="stage")
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("cannot scrape the router's %s: %s", metrics_url, exc)
        return None


class RouterKey(httpx.Auth):
    """``Authorization: Bearer <api key>`` on requests to the router only (not on engines' ``/metrics``):
    a kvmesh router with tenants and ``require_api_key`` answers 401 without one."""

    def __init__(self, router_url: str, api_key: str) -> None:
        self._router = httpx.URL(router_url)
        self._header = f"Bearer {api_key}"

    def auth_flow(self, request: httpx.Request) -> typing.Generator[httpx.Request, httpx.Response, None]:
        if (request.url.scheme, request.url.host, request.url.port) == (
                self._router.scheme, self._router.host, self._router.port):
            request.headers["authorization"] = self._header
        yield request


async def discover_model(client: httpx.AsyncClient, router_url: str) -> str:
    """The first model the router serves.

    Raises:
        RuntimeError: when the router lists none.
    """
    reply = await client.get(f"{router_url}/v1/models", timeout=10.0)
    reply.raise_for_status()
    data = reply.json().get("data", [])
    if not data:
        raise RuntimeError(f"{router_url}/v1/models lists no model")
    return str(data[0]["id"])


PROMPT_FORMATS = ("tokens", "text")
LAG_PROBE_S = 0.05
"""Wall seconds between two probes of the client's event-loop lag."""


async def probe_loop_lag(out: list[float], interval_s: float = LAG_PROBE_S) -> None:
    """Append, every ``interval_s``, how much later than asked a sleep of ``interval_s`` returned; until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        out.append(max(0.0, loop.time() - asked))


async def send_one(
    client: httpx.AsyncClient, router_url: str, model: str, request: WorkloadRequest, seed: int,
    prompt_format: str = "tokens",
) -> RequestResult:
    """One streaming completion; never raises (errors become a failed result)."""
    prompt: list[int] | str = (request_text(request, seed) if prompt_format == "text"
                               else request_token_ids(request, seed))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    result = RequestResult(index=request.index, ok=False)
    t0 = time.monotonic()
    result.sent_at = t0
    chunks_with_text = 0
    last_text = t0
    try:
        async with aconnect_sse(client, "POST", f"{router_url}/v1/completions", json=body) as source:
            reply = source.response
            result.status = reply.status_code
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                result.error = f"HTTP {reply.status_code}: {text[:200]}"
                result.e2e_s = time.monotonic() - t0
                return result
            async for event in source.aiter_sse():
                if event.data.strip() == DONE:
                    break
                piece = parse_event(event.data)
                if piece is None:
                    continue
                if piece.error is not None:
                    result.error = str(piece.error)[:200]
                    result.e2e_s = time.monotonic() - t0
                    return result
                if piece.text:
                    chunks_with_text += 1
                    last_text = time.monotonic()
                    if result.ttft_s is None:
                        result.ttft_s = last_text - t0
                if piece.usage is not None:
                    result.output_tokens = piece.usage.completion_tokens
                    result.prompt_tokens = piece.usage.prompt_tokens
                    result.cached_tokens = piece.usage.cached_tokens
        result.e2e_s = time.monotonic() - t0
        if result.output_tokens == 0:
            result.output_tokens = chunks_with_text
        if result.ttft_s is not None and result.output_tokens > 1:
            result.itl_s = (last_text - t0 - result.ttft_s) / (result.output_tokens - 1)
        result.ok = True
    except httpx.HTTPError as exc:  # httpx_sse.SSEError (not an event stream) is an httpx.TransportError
        result.e2e_s = time.monotonic() - t0
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def replay(
    workload: Workload,
    *,
    router_url: str,
    engine_urls: Sequence[str],
    time_scale: float = 1.0,
    concurrency_limit: int = 64,
    model: str | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    request_timeout_s: float = 600.0,
    max_sessions: int | None = None,
    prompt_format: str = "tokens",
    transport: httpx.AsyncBaseTransport | None = None,
    sampler: EngineSampler | None = None,
    router_metrics_url: str | None = None,
    flow_control_metrics_url: str | None = None,
    load_interval_s: float = 1.0,
    api_key: str | None = None,
) -> ReplayOutcome:
    """Replay ``workload`` (open or closed loop per request, see the module doc) and collect results.

    ``sampler`` (optional) samples the engines' load through the same client from the first send to the
    last completion (:mod:`kvmesh_cli.timeline`); without one, an :class:`~kvmesh_cli.timeline.EngineSampler`
    every ``load_interval_s`` wall seconds does (the run's one load sampler either way: ``ReplayOutcome.load``).
    ``router_metrics_url`` / ``flow_control_metrics_url`` (full ``.../metrics`` URLs of a kvmesh mesh): the
    router's stages are scraped before and after, flow_control's queue size sampled with the engines' load.
    ``api_key``: sent to the router only, as ``Authorization: Bearer`` (:class:`RouterKey`).

    Raises:
        ValueError: when ``time_scale`` <= 0, ``concurrency_limit`` < 1, ``max_sessions`` < 1 or
            ``prompt_format`` is not one of :data:`PROMPT_FORMATS`.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    limits = httpx.Limits(max_connections=concurrency_limit + 8, max_keepalive_connections=concurrency_limit + 8)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    auth = RouterKey(router_url, api_key) if api_key else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport, auth=auth) as client:
        model = model or await discover_model(client, router_url)
        before, hists_before = await scrape_engines(client, engine_urls)
        router_before = await scrape_router_stages(client, router_metrics_url)
        sem = asyncio.Semaphore(concurrency_limit)
        done: dict[int, asyncio.Event] = {r.index: asyncio.Event() for r in workload.requests}
        session_slots = asyncio.Semaphore(max_sessions) if max_sessions is not None else None
        left_in_session: dict[str, int] = {}
        session_started: dict[str, asyncio.Event] = {}
        for r in workload.requests:
            if r.session is not None:
                left_in_session[r.session] = left_in_session.get(r.session, 0) + 1
                session_started.setdefault(r.session, asyncio.Event())
        results: list[RequestResult] = []
        start = time.monotonic()
        first_send: list[float] = []
        last_end = start

        async def wait_turn(req: WorkloadRequest) -> None:
            if req.think_s is not None and req.after in done:
                await done[req.after].wait()
                if req.think_s > 0:
                    await asyncio.sleep(req.think_s / time_scale)
                return
            delay = start + req.arrival_s / time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if req.after is not None and req.after in done:
                await done[req.after].wait()
            if session_slots is not None and req.session is not None:
                started = session_started[req.session]
                if not started.is_set():
                    if req.after is None or req.after not in done:  # the session's first request takes the slot
                        await session_slots.acquire()
                        started.set()
                    else:
                        await started.wait()

        async def run(req: WorkloadRequest) -> None:
            nonlocal last_end
            try:
                await wait_turn(req)
                async with sem:
                    first_send.append(time.monotonic())
                    res = await send_one(client, router_url, model, req, workload.seed, prompt_format)
                last_end = max(last_end, time.monotonic())
                results.append(res)
                if on_done is not None:
                    on_done(res)
            finally:
                done[req.index].set()
                if req.session is not None:
                    left_in_session[req.session] -= 1
                    if left_in_session[req.session] == 0 and session_slots is not None \
                            and session_started[req.session].is_set():
                        session_slots.release()

        if sampler is None and engine_urls:
            sampler = EngineSampler(engine_urls, load_interval_s, time_scale)
        if sampler is not None and sampler.flow_control_metrics_url is None:
            sampler.flow_control_metrics_url = flow_control_metrics_url
        sampling = asyncio.create_task(sampler.run(client)) if sampler is not None else None
        lags: list[float] = []
        probing = asyncio.create_task(probe_loop_lag(lags))
        try:
            await asyncio.gather(*(run(r) for r in workload.requests))
        finally:
            for task in (sampling, probing):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        after, hists_after = await scrape_engines(client, engine_urls)
        router_after = await scrape_router_stages(client, router_metrics_url)
    wall = last_end - (min(first_send) if first_send else start)
    results.sort(key=lambda r: r.index)
    return ReplayOutcome(results, wall, before, after, lags, hists_before, hists_after, router_before,
                         router_after, load_samples(sampler.points) if sampler is not None else [])
