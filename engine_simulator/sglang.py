"""The simulator's SGLang personality (``--personality sglang``): SGLang 0.5.23's HTTP API, metric
names and KV-event shape over the same engine core.

Read from SGLang 0.5.23's source (the ``sglang`` wheel on PyPI; it does not run on CPU, see
``docs/engines.md``):

* HTTP (``sglang/srt/entrypoints/http_server.py``): ``POST /generate`` (native:
  ``{"text" | "input_ids", "sampling_params": {"max_new_tokens", "ignore_eos", "skip_special_tokens",
  "no_stop_trim"}, "stream",
  "lora_path", "cache_salt"}`` -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``; streamed as SSE
  ``data: {...}`` chunks with the cumulative text, then ``data: [DONE]``; the text of an EOS-ended answer
  leaves the EOS out (SGLang's detokenizer ``trim_matched_stop``, unless ``no_stop_trim``) and special tokens
  read "" (``skip_special_tokens``, default True), so it never ends with ``</s>`` by default; ``output_ids``
  keep the EOS id), ``GET /server_info``
  (and the deprecated ``/get_server_info``: the resolved server args, ``kv_events``, ``version``),
  ``GET /model_info``, ``GET|POST /flush_cache``; the OpenAI routes, ``/tokenize``, ``/health`` and
  ``/v1/models`` are shared with the vLLM personality.
* Metrics (``sglang/srt/observability/metrics_collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (a fraction), ``sglang:num_used_tokens``,
  ``sglang:max_total_num_tokens``, ``sglang:page_size``, ``sglang:cache_hit_rate``,
  ``sglang:gen_throughput``, ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
  ``sglang:cached_tokens_total``, ``sglang:num_requests_total``, ``sglang:num_aborted_requests_total``
  and the ``sglang:time_to_first_token_seconds`` / ``inter_token_latency_seconds`` /
  ``e2e_request_latency_seconds`` histograms, labelled ``model_name, engine_type, tp_rank,
  pp_rank, moe_ep_rank`` (``is_streaming`` on the per-request families, ``cache_source`` on cached tokens).
* KV events (``sglang/srt/disaggregation/kv_events.py``): :func:`kvmesh.kv_events.encode_sglang_batch`
  (tagged maps without vLLM's ``extra_keys``/``group_idx``/``kv_cache_spec_kind``, signed int64
  hashes, media ``GPU``/``CPU_PINNED``, ``cache_salt`` and ``lora_name`` as fields, batch
  ``[ts, events, attn_dp_rank]``).

Block hashes stay the simulator's (vLLM's ``sha256_cbor`` low 64 bits, as signed int64): SGLang's
own are a native SHA-256 chain that kvmesh never recomputes (it keys blocks by token ids).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine_simulator.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineMetrics
from engine_simulator.publisher import ZmqEventPublisher
from engine_simulator.scheduler import FinishReason, Request, RequestOutput
from engine_simulator.server import (
    EngineHttpApi,
    _collect,
    _json_body,
    _wait_disconnect,
    engine_dead_event,
    request_scope,
)
from kvmesh.errors import InvalidRequest, UnknownModel
from kvmesh.kv_events import KVEvent, encode_sglang_batch

SGLANG_VERSION = "0.5.23"
"""The SGLang release this personality follows."""


class SGLangEventPublisher(ZmqEventPublisher):
    """The ZMQ publisher (seq, replay buffer) writing SGLang 0.5.23's payload shape."""

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.publish_payload(encode_sglang_batch(time.time(), events, self.data_parallel_rank))


class SGLangMetrics(EngineMetrics):
    """``sglang:*`` families fed by the same ``record_*`` calls as :class:`EngineMetrics`.

    ``exposition()`` renders only the SGLang registry. ``token_usage`` and ``num_used_tokens`` are
    the engine's block usage times the pool (tokens); ``cache_hit_rate`` is cached / prompt tokens
    since start.
    """

    def __init__(self, model_name: str, cache_info: dict[str, str], max_model_len: int, page_size: int,
                 num_pages: int) -> None:
        super().__init__(model_name, cache_info, max_model_len)
        self.sglang_registry = CollectorRegistry()
        reg = self.sglang_registry
        base = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        names = list(base)
        self._base = base
        self._stream = {**base, "is_streaming": "false"}
        self._total_tokens = page_size * max(num_pages - 1, 1)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        self._g_running = gauge("sglang:num_running_reqs", "The number of running requests.").labels(**base)
        self._g_queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.").labels(**base)
        self._g_usage = gauge("sglang:token_usage", "The token usage.").labels(**base)
        self._g_used = gauge("sglang:num_used_tokens", "The number of used tokens.").labels(**base)
        self._g_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.").labels(**base)
        self._g_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).").labels(**base)
        gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.").labels(
            **base).set(self._total_tokens)
        gauge("sglang:page_size", "KV cache page size in tokens.").labels(**base).set(page_size)
        gauge("sglang:num_pages", "Number of KV cache pages.").labels(**base).set(num_pages)
        gauge("sglang:context_len", "Maximum context length.").labels(**base).set(max_model_len)
        stream_names = [*names, "is_streaming"]
        self._c_prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", stream_names,
                                 registry=reg).labels(**self._stream)
        self._c_generation = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                     stream_names, registry=reg).labels(**self._stream)
        self._c_cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens by source (device/host/storage).",
                                 [*names, "cache_source"], registry=reg).labels(**base, cache_source="device")
        self._c_requests = Counter("sglang:num_requests", "Number of requests processed.", stream_names,
                                   registry=reg).labels(**self._stream)
        self._c_aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", names,
                                  registry=reg).labels(**base)
        self._h_ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                 stream_names, buckets=TTFT_BUCKETS, registry=reg).labels(**self._stream)
        self._h_itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                names, buckets=ITL_BUCKETS, registry=reg).labels(**base)
        self._h_e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                                stream_names, buckets=REQUEST_LATENCY_BUCKETS, registry=reg).labels(**self._stream)
        self._prompt_total = 0
        self._cached_total = 0

    def record_step(self, *, running: int, waiting: int, usage: float, step_tokens: int, new_preemptions: int,
                    new_generation_tokens: int, deferred: int = 0) -> None:
        super().record_step(running=running, waiting=waiting, usage=usage, step_tokens=step_tokens,
                            new_preemptions=new_preemptions, new_generation_tokens=new_generation_tokens,
                            deferred=deferred)
        self._g_running.set(running)
        self._g_queue.set(waiting)
        self._g_usage.set(usage)
        self._g_used.set(round(usage * self._total_tokens))
        if new_generation_tokens:
            self._c_generation.inc(new_generation_tokens)

    def record_scheduled(
        self, *, prompt_tokens: int, cached_tokens: int, external_queries: int = 0, external_hits: int = 0
    ) -> None:
        super().record_scheduled(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                 external_queries=external_queries, external_hits=external_hits)
        self._prompt_total += prompt_tokens
        self._cached_total += max(cached_tokens, 0)
        self._g_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    def record_first_token(self, *, ttft_seconds: float) -> None:
        super().record_first_token(ttft_seconds=ttft_seconds)
        self._h_ttft.observe(ttft_seconds)

    def record_token(self, *, itl_seconds: float) -> None:
        super().record_token(itl_seconds=itl_seconds)
        self._h_itl.observe(itl_seconds)

    def record_finished(self, *, finish_reason: str, prompt_tokens: int, cached_tokens: int, generation_tokens: int,
                        e2e_seconds: float, queue_seconds: float, prefill_seconds: float,
                        decode_seconds: float) -> None:
        super().record_finished(finish_reason=finish_reason, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                generation_tokens=generation_tokens, e2e_seconds=e2e_seconds,
                                queue_seconds=queue_seconds, prefill_seconds=prefill_seconds,
                                decode_seconds=decode_seconds)
        if finish_reason == "abort":
            self._c_aborted.inc()
            return
        self._c_prompt.inc(prompt_tokens)
        if cached_tokens > 0:
            self._c_cached.inc(cached_tokens)
        self._c_requests.inc()
        self._h_e2e.observe(e2e_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.sglang_registry)


@dataclass(frozen=True, slots=True)
class _TextOptions:
    """How a ``/generate`` answer's text is written (SGLang 0.5.23 ``SamplingParams``)."""

    skip_special_tokens: bool = True
    """Special tokens (``<s>``, ``</s>``) read "" (SGLang's default)."""
    no_stop_trim: bool = False
    """Keep the matched stop token (the EOS that ended the request) in the text."""


def _finish_reason(req: Request) -> dict[str, Any] | None:
    if req.finish_reason is None:
        return None
    reason = str(req.finish_reason)
    if reason == "length":
        return {"type": "length", "length": len(req.output_token_ids)}
    if reason == "stop":
        return {"type": "stop", "matched": 2}
    return {"type": "abort", "message": reason}


class SGLangHttpApi(EngineHttpApi):
    """:class:`EngineHttpApi` plus SGLang's native routes (the module docstring lists them)."""

    def __init__(self, state: Any, server_args: dict[str, Any]) -> None:
        super().__init__(state)
        self._server_args = server_args

    def app(self) -> Starlette:
        app = super().app()
        for route in (
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
        ):
            app.router.routes.append(route)
        return app

    def _generate_request(self, body: dict[str, Any]) -> tuple[Request, _TextOptions]:
        """A simulator request from a ``/generate`` body, and how its text is written.

        Raises:
            InvalidRequest: no ``text``/``input_ids``, a batch, bad ``sampling_params`` (``skip_special_tokens``,
                ``no_stop_trim`` not booleans too).
            UnknownModel: ``lora_path`` names no served adapter.
        """
        state = self._state
        if isinstance(body.get("text"), str):
            ids = self._renderer.prompt_ids(body["text"], True)
        elif isinstance(body.get("input_ids"), list) and all(isinstance(t, int) for t in body["input_ids"]):
            ids = list(body["input_ids"])
        else:
            raise InvalidRequest("Either text or input_ids should be provided (one prompt; batches are not simulated).")
        if not ids:
            raise InvalidRequest("The input is empty.")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise InvalidRequest("sampling_params must be an object")
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 1:
            raise InvalidRequest("max_new_tokens must be a positive integer")
        if len(ids) + max_new > state.max_model_len:
            raise InvalidRequest(
                f"Requested token count exceeds the model's maximum context length of {state.max_model_len} tokens."
            )
        lora_path = body.get("lora_path")
        if lora_path is not None and lora_path not in state.lora_adapters:
            raise UnknownModel(f"LoRA adapter {lora_path!r} is not loaded.")
        _, salt = request_scope(state, {"cache_salt": body.get("cache_salt")})
        lora = state.lora_adapters.get(lora_path) if lora_path else None
        text_options = []
        for name, default in (("skip_special_tokens", True), ("no_stop_trim", False)):
            value = params.get(name, default)
            if not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be a boolean")
            text_options.append(value)
        req = Request(str(body.get("rid") or uuid.uuid4().hex), ids, max_new,
                      ignore_eos=bool(params.get("ignore_eos", False)), lora=lora, cache_salt=salt)
        return req, _TextOptions(*text_options)

    def _generate_body(self, req: Request, started: float, options: _TextOptions) -> dict[str, Any]:
        """SGLang's ``/generate`` answer so far: ``text`` the output's detokenization (:class:`_TextOptions`: a
        terminating EOS left out, special tokens ""), ``output_ids`` every id (the EOS too)."""
        ids: list[int] = req.output_token_ids
        if req.finish_reason == FinishReason.STOP and not options.no_stop_trim and ids:
            ids = ids[:-1]  # trim_matched_stop: the matched stop token is not decoded
        return {
            "text": self._renderer.detokenize(ids, skip_special_tokens=options.skip_special_tokens),
            "output_ids": list(req.output_token_ids),
            "meta_info": {
                "id": req.request_id,
                "finish_reason": _finish_reason(req),
                "prompt_tokens": req.num_prompt_tokens,
                "completion_tokens": len(req.output_token_ids),
                "cached_tokens": max(req.num_cached_tokens, 0),
                "e2e_latency": time.monotonic() - started,
            },
        }

    async def generate(self, request: HttpRequest) -> Response:
        body = await _json_body(request)
        req, options = self._generate_request(body)
        started = time.monotonic()
        try:
            queue = self._engine.submit(req)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if body.get("stream"):
            return StreamingResponse(self._stream_generate(req, queue, started, options), media_type="text/event-stream")
        waiter = asyncio.create_task(_collect(queue))
        disconnect = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({waiter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not waiter.done():
                waiter.cancel()
                self._engine.abort(req.request_id)
        if not waiter.done() or waiter.cancelled():
            return Response(status_code=499)
        waiter.result()  # EngineDeadError: the engine died under the request (500)
        return JSONResponse(self._generate_body(req, started, options))

    async def _stream_generate(
        self, req: Request, queue: asyncio.Queue[RequestOutput], started: float, options: _TextOptions
    ) -> AsyncIterator[bytes]:
        try:
            while True:
                out = await queue.get()
                if out.error is not None:  # the engine died: the error event, then [DONE]
                    yield engine_dead_event().encode()
                    break
                yield b"data: " + json.dumps(self._generate_body(req, started, options)).encode() + b"\n\n"
                if out.finished:
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if req.finish_reason is None:
                self._engine.abort(req.request_id)

    async def server_info(self, request: HttpRequest) -> Response:
        state = self._state
        return JSONResponse({
            **self._server_args,
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
            "version": SGLANG_VERSION,
            "frontend": "python",
            "startup_time": state.created,
            "max_total_num_tokens": self._server_args.get("max_total_num_tokens"),
        })

    async def model_info(self, request: HttpRequest) -> Response:
        state = self._state
        return JSONResponse({
            "model_path": state.root,
            "served_model_name": state.model,
            "tokenizer_path": state.root,
            "is_generation": True,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        })

    async def flush_cache(self, request: HttpRequest) -> Response:
        if self._engine.reset_prefix_cache():
            return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)


def server_args(*, model: str, model_path: str, host: str, port: int, page_size: int, num_pages: int,
                max_running_requests: int, chunked_prefill_size: int, context_length: int,
                kv_events_endpoint: str, lora_paths: list[str]) -> dict[str, Any]:
    """The subset of SGLang's resolved ``ServerArgs`` that ``/server_info`` reports (names as SGLang's)."""
    kv_events_config = (
        json.dumps({"publisher": "zmq", "endpoint": kv_events_endpoint, "topic": ""}) if kv_events_endpoint else None
    )
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": model,
        "host": host,
        "port": port,
        "page_size": page_size,
        "max_running_requests": max_running_requests,
        "chunked_prefill_size": chunked_prefill_size,
        "context_length": context_length,
        "max_total_num_tokens": page_size * max(num_pages - 1, 1),
        "disable_radix_cache": False,
        "enable_metrics": True,
        "kv_events_config": kv_events_config,
        "kv_events": {"endpoint": kv_events_endpoint, "page_size": page_size} if kv_events_endpoint else None,
        "lora_paths": lora_paths,
        "dp_size": 1,
        "tp_size": 1,
        "device": "cpu",
    }
