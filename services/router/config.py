"""RouterConfig: every knob of the router, typed, bounded and documented.

Precedence (from :func:`kvmesh.config.load_config`): flags > env ``KVMESH_ROUTER_*`` > ``--config`` file > defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig
from services.router.tenants import TenantSpec


def _default_objective_priorities() -> dict[str, int]:
    # GIE's historical criticality names (Critical / Standard / Sheddable) as priority bands.
    return {"critical": 10, "standard": 0, "sheddable": -10}


class RouterConfig(GrpcServiceConfig):
    """The router: OpenAI HTTP + gRPC Inference in front of flow_control, epp and the engines."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_ROUTER_")

    http_port: int = Field(0, ge=0, le=65535)
    """Port of the OpenAI-compatible HTTP API on ``host``; 0 picks a free one (logged at start)."""
    flow_control_address: str = "127.0.0.1:50060"
    """host:port of the flow_control gRPC service (the admission stream)."""
    epp_address: str = "127.0.0.1:50070"
    """host:port of the epp gRPC service (Pick)."""
    request_timeout_seconds: float = Field(600.0, gt=0, le=86400)
    """Upper bound on one proxied engine request (read/write/pool timeouts of the HTTP client)."""
    connect_timeout_seconds: float = Field(10.0, gt=0, le=120)
    """TCP connect timeout to an engine; a failed connect moves on to the next fallback. Sized for
    a loaded host: on a starved machine an accept can take seconds (2 s lost requests under a
    replay on 2 busy cores); a dead engine refuses at once and is not waited for."""
    engine_first_byte_timeout_seconds: float = Field(300.0, gt=0, le=86400)
    """Longest wait from sending a *streamed* request to an engine to the first byte of its answer
    (queueing in the engine plus prefill); past it the engine is judged hung and the request, which
    the client has not seen a byte of yet, is sent to the next candidate (as a refused connection
    is). 300 s as Envoy's default ``stream_idle_timeout``: a long prefill on a loaded engine stays
    well within it. A non-streamed answer is its first byte (the whole generation), so it waits up
    to ``request_timeout_seconds``. Either wait ends sooner when the engine's ``/health`` fails
    (``engine_health_probe_after_seconds``)."""
    engine_stream_idle_timeout_seconds: float = Field(120.0, gt=0, le=86400)
    """Longest silence of an engine between two pieces of an answer that started; past it the
    answer ends as a failed engine's does (SSE: the in-stream error event + ``[DONE]``; gRPC
    ``UNAVAILABLE``). Decode steps are milliseconds apart; 120 s leaves room for a request
    preempted while others prefill."""
    engine_departed_idle_seconds: float = Field(5.0, gt=0, le=3600)
    """Once an endpoint left membership (its lease expired: the engine hung or died without a
    reset), how long a request may still wait on it without a byte before it is ended (re-sent
    elsewhere when the client has seen nothing, else the in-stream error), *if* its ``/health``
    does not answer either: leaving membership is no proof of a hang (a draining engine deregisters
    first, then finishes its requests; an etcd that lost its data makes every endpoint leave), so
    past this wait the router probes ``GET /health`` and cuts only when the probe fails or times
    out; while it answers, the normal first-byte / idle limits apply."""
    engine_health_probe_after_seconds: float = Field(10.0, gt=0, le=86400)
    """How long a request may wait on an engine without a byte (before its first byte, or silent
    mid-answer) before the router asks the engine's ``GET /health`` whether it still answers: an
    engine that hangs while its membership lease lives on (vLLM wedged behind a registration
    sidecar that keeps the lease; the process paused) is otherwise found only by the first-byte /
    idle limits (300 s / 120 s) or ``request_timeout_seconds`` (600 s, non-streamed). A probe that
    is refused, reset or answered non-2xx fails the endpoint at once (``health_probe_failed``); a
    ``/health`` that gives no answer fails it once it has been unanswered for
    ``engine_health_slow_fail_seconds`` within the wait (``health_probe_timed_out``); never while
    any request to the endpoint receives bytes (only an endpoint silent on every request it serves
    can be hung). Either verdict ends the wait as a departed endpoint's does: re-sent to the next
    candidate before the first byte (the client has seen nothing; the cut closes the engine
    connection, and vLLM aborts the request once its loop notices, so a 503 would save no work),
    the in-stream error after it. An answering ``/health``, even a late one, keeps it waiting (a
    long queue or prefill is not a hang). 10 s: well past a normal TTFT and decode gap, so an
    engine that answers quickly costs nothing (no probe, no timer per request) and a busy one at
    most one ``GET /health`` at a time. With the defaults an engine whose ``/health`` is refused or
    answers 503 is found in about 10-11 s (this + a tick), a hung one whose lease lives on
    (SIGSTOPped behind a sidecar that keeps the lease; its ``/health`` accepts and never answers) in
    about 70 s (this + ``engine_health_slow_fail_seconds``), one whose lease expired too (the whole
    process SIGSTOPped: TTL 10 s + the router's 2 s departure grace) in about 20 s (a ``GET /health``
    unanswered for ``engine_health_probe_timeout_seconds`` + ``engine_health_probe_interval_seconds``
    once it left membership)."""
    engine_health_probe_timeout_seconds: float = Field(5.0, gt=0, le=60)
    """How long the ``GET /health`` of an endpoint that requests wait on past
    ``engine_health_probe_after_seconds`` (one GET per endpoint at a time, not per request, shared
    by the passthrough routes) may go unanswered before the endpoint's *slow run* starts (from
    the GET's send). The GET is not cancelled then: it keeps running, and no other is sent to the
    endpoint, up to ``engine_health_slow_fail_seconds`` (plus this); an answer that comes late still counts
    (2xx: alive; vLLM answers 503 once its engine is dead). A SIGSTOPped engine accepts TCP
    connects but never answers. Unanswered past this alone is no failure (see
    ``engine_health_slow_fail_seconds``), except once the endpoint left membership: unanswered for
    this + ``engine_health_probe_interval_seconds``, it fails (``endpoint_left``; the lease's expiry
    is the second signal). Also the limit of :meth:`RequestFlow.engine_health`'s one-off probe."""
    engine_health_probe_interval_seconds: float = Field(5.0, gt=0, le=3600)
    """How long an answered ``GET /health`` vouches for its endpoint: requests still waiting on it
    without a byte have it probed again this long after the answer. After a GET that got no answer
    in its whole limit the next one follows at once (the slow run goes on); more than this with no
    GET running (nobody waited on the endpoint) ends the slow run."""
    engine_health_slow_fail_seconds: float = Field(60.0, gt=0, le=3600)
    """How long an endpoint's ``/health`` must go unanswered (no refusal, reset or error status, no
    answer at all; no byte from the endpoint on any request meanwhile; measured within the wait,
    from the later of the wait's start and the first unanswered GET's send) before a request
    waiting on it counts it hung while its lease lives (``health_probe_timed_out``). Each
    ``GET /health`` is kept running that long (plus ``engine_health_probe_timeout_seconds``) rather
    than cancelled at ``engine_health_probe_timeout_seconds`` and queued again behind the same loop. vLLM's ``GET /health``
    (``vllm/entrypoints/serve/instrumentator/health.py``, 0.32) awaits
    ``EngineClient.check_health()``, which in ``AsyncLLM`` only checks whether the engine core
    died: it answers 200 (503 when dead) as soon as the API server's event loop runs it, so a slow
    answer means that loop is saturated, measured at 30-40 s under high load (vllm-project/vllm
    PR #38157), not that the engine hangs. 60 s: above that, so a busy engine's late answer comes
    in time and it is not cut, and still below the idle limit
    (``engine_stream_idle_timeout_seconds``, 120 s). A request cut on this verdict before its first
    byte is re-sent to the next candidate, as on a fast verdict; after it the stream ends with the
    in-stream error. A SIGSTOPped engine with its lease alive is found in about
    ``engine_health_probe_after_seconds`` + this (70 s with the defaults)."""
    request_body_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    """Longest time to receive a request's whole body once its headers arrived (nginx's
    ``client_body_timeout`` is 60 s): a client that declares more than it sends (or drips it) gets
    408 and the connection is closed, instead of holding it forever."""
    request_header_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    """Longest time from a connection's first byte of a request (or its opening) to the end of that
    request's headers; past it the connection is closed (nginx's ``client_header_timeout``, 60 s).
    uvicorn bounds only idle keep-alive connections, so a client dripping header bytes held one."""
    admission_timeout_seconds: float = Field(35.0, gt=0, le=86400)
    """Longest wait for flow_control's dispatch decision, then 504. A few seconds above flow_control's
    default queue TTL (30 s), which normally fires first; this one bounds a hung flow_control."""
    admission_liveness_check_seconds: float = Field(2.0, ge=0, le=3600)
    """While an admission call waits on flow_control with no decision, every this many seconds the router asks
    whether flow_control is alive (it answered any call meanwhile, else its health check within
    ``health_check_timeout_seconds``). A hung one (neither) opens the breaker at once and the request is
    admitted locally (fail-open with its cap) instead of waiting out ``admission_timeout_seconds``: a client
    whose own timeout is shorter (30 s is common) no longer sees a full outage for as long as flow_control
    hangs. A queued request on a live flow_control keeps waiting. Not for requests admitted on a lent credit
    (no wait). 0, or a value not below ``admission_timeout_seconds``: off (a hang is found only at the
    admission timeout)."""
    pick_timeout_seconds: float = Field(5.0, gt=0, le=120)
    """Deadline of one epp Pick call."""
    dependency_breaker_cool_down_seconds: float = Field(5.0, ge=0, le=600)
    """Circuit breaker of the per-request dependencies (epp's Pick, flow_control's admission): after a
    call to one **timed out** (``pick_timeout_seconds`` / ``admission_timeout_seconds`` with no
    answer) while the dependency showed no sign of life (a hung dependency: for epp, no other Pick
    answered during the wait; for flow_control, no admission answered within the last second and no
    answer to a health check within ``health_check_timeout_seconds``, so a request merely queued
    past the timeout opens nothing), for this long requests do not wait on it: they take the path of an
    unreachable one (the local pick; local admission, fail-open with its cap); after it, one probe
    call at a time is let through (the others still do not wait), whose answer closes the breaker
    at once and whose timeout renews the cool-down (docs/degraded-modes.md). Env
    ``KVMESH_ROUTER_DEPENDENCY_BREAKER_COOL_DOWN_SECONDS``. 0 disables the breaker (every request
    waits its full timeout, as before)."""
    admission_close_timeout_seconds: float = Field(2.0, gt=0, le=60)
    """How long closing the admission stream may wait for flow_control to end it before it is cancelled."""
    max_fallback_attempts: int = Field(3, ge=1, le=32)
    """Endpoints tried per request (target plus fallbacks, re-picking with exclusions when the list runs out)."""
    max_connections: int = Field(1024, ge=1, le=65536)
    """Size of the pooled HTTP client's connection pool to the engines."""
    early_pick: bool = True
    """Ask epp for the Pick while flow_control decides admission (one round trip less on the
    request's path) as long as recent requests were dispatched at once; a request that was queued
    longer than ``early_pick_max_queue_seconds`` is picked again at dispatch (late binding)."""
    early_pick_max_queue_seconds: float = Field(0.01, ge=0, le=60)
    """Queue time (flow_control's ``queue_seconds``) up to which an early pick is used."""
    engine_http_client: Literal["aiohttp", "httpx"] = "aiohttp"
    """HTTP client of the proxy hop (``services/router/engine_client.py``; aiohttp measured faster:
    docs/BENCHMARKS.md §3)."""
    http_parser: Literal["httptools", "h11"] = "httptools"
    """HTTP/1.1 parser of the front door (uvicorn's ``http``): ``httptools`` (llhttp, C) or ``h11``
    (pure Python; docs/BENCHMARKS.md §3 compares them)."""
    admission_stream: Literal["multiplexed", "per_request"] = "multiplexed"
    """How admission travels: ``multiplexed``, one long-lived ``FlowControl.AdmitMany`` stream
    carrying every request's enqueue / decision / complete, batched per write (no call set-up per
    request; the stream's end releases every slot it holds), or ``per_request``, one ``Admit``
    stream per request. A flow_control without ``AdmitMany`` is asked per request."""
    admission_credits: int = Field(8, ge=0, le=1024)
    """Admission credits to ask flow_control for on the multiplexed stream (flow_control lends at
    most its own ``admission_credits``): while nothing is queued and the pool has room, a request of
    the credits' band without a tenant quota is dispatched at once on a credit, without waiting for
    flow_control's answer (its Enqueue still travels for the accounting; flow_control revokes the
    credits as soon as anything queues). 0 = every request waits for the decision (docs/flow-control.md)."""
    admission_credit_flush_seconds: float = Field(0.02, ge=0, le=1)
    """How long the Enqueue of a request admitted on a credit may wait to share a write with the
    stream's next entry (a short request's Complete): flow_control and the router then do nothing
    for it while the request goes to the engine. flow_control counts the credit as a request in
    flight meanwhile (every limit holds); only its per-flow counts lag by up to this. 0 = at once."""
    pick_transport: Literal["multiplexed", "unary"] = "multiplexed"
    """How picks travel to epp: ``multiplexed``, one long-lived ``EndpointPicker.PickMany`` stream
    carrying every request's pick by id, batched per write, the ``Completed`` reports riding the same
    writes (no call set-up per request), or ``unary``, one ``Pick`` call per request. An epp without
    ``PickMany`` is asked with unary calls (until it reconnects). Env ``KVMESH_ROUTER_PICK_TRANSPORT``."""
    epp_completed_flush_seconds: float = Field(0.02, ge=0, le=1)
    """How long a finished request's ``Completed`` report to epp may wait to ride the pick stream's
    next write (the next request's pick: epp then learns of the completion just before it decides,
    as with an immediate report) instead of a write of its own after every answer: one write and one
    epp wake-up less per request (docs/BENCHMARKS.md §3, wave 6). 0 = at once."""
    retry_after_seconds: int = Field(1, ge=0, le=3600)
    """Value of the ``retry-after`` header on 429 answers."""
    max_request_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest accepted request body (from ``content-length``, and counted while reading a chunked
    body); larger ones get 413 with an OpenAI error body. The gRPC front door's bound on a request message
    too (larger: ``RESOURCE_EXHAUSTED``, gRPC's status for a message over the receiver's limit)."""
    health_check_timeout_seconds: float = Field(0.5, gt=0, le=30)
    """Deadline of the grpc.health.v1 checks of flow_control and epp behind ``GET /health``, and of the
    check that tells a busy flow_control from a hung one after an admission timeout (the breaker)."""
    health_cache_seconds: float = Field(1.0, ge=0, le=60)
    """How long a ``GET /health`` result is reused, so probes stay cheap (0 checks every time)."""
    max_tokens_limit: int = Field(1_048_576, ge=1)
    """Absolute cap on ``max_tokens`` regardless of the model's context (rejects absurd values)."""
    default_flow_id: str = "default"
    """Flow (fairness id) of requests without ``x-gateway-inference-fairness-id`` (or an API key's tenant)."""
    objective_priorities: dict[str, int] = Field(default_factory=_default_objective_priorities)
    """``x-llm-d-inference-objective`` name -> priority band (a numeric objective is used as the priority)."""
    flow_control_failure_mode: Literal["open", "closed"] = "open"
    """flow_control unreachable: ``open`` admits requests locally while fewer than
    ``degraded_max_in_flight`` are admitted that way (then 503 + ``retry-after``); ``closed``: 503 at once."""
    degraded_max_in_flight: int = Field(256, ge=0, le=1_000_000)
    """Cap on requests admitted without flow_control at once (the fail-open mode's local in-flight limit)."""
    epp_failure_mode: Literal["open", "closed"] = "open"
    """epp unreachable: ``open`` picks the least-loaded live endpoint (router's own in-flight count,
    from its etcd view); ``closed``: 503."""
    tenants: list[TenantSpec] = Field(default_factory=list)
    """Tenants: API keys -> fairness id, maximum priority, rate and concurrency quotas
    (:mod:`services.router.tenants`); empty = headers are trusted (open mode)."""
    require_api_key: bool = False
    """With tenants configured: answer 401 to requests without an API key (else they get the default flow)."""
    anonymous_max_priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    """With tenants configured: the highest priority a request without an API key may ask for."""
    shutdown_http_grace_seconds: float = Field(5.0, ge=0, le=300)
    """On stop, how long open HTTP requests may finish before uvicorn force-closes them."""
    engine_api_key: SecretStr | None = None
    """API key kvmesh presents to engines started with vLLM's ``--api-key`` (``Authorization: Bearer``),
    for every pool without its own entry in ``engine_api_keys``; never a client's key
    (``docs/openai-compat.md``, "Headers and keys"). Env ``KVMESH_ROUTER_ENGINE_API_KEY``."""
    engine_api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    """Per-pool engine API keys: served model name (the InferencePool) -> key; wins over ``engine_api_key``."""
    model_memory_seconds: float = Field(3600.0, ge=0, le=30 * 86400)
    """A model whose last endpoint left less than this long ago is *unavailable* (503 + ``retry-after``),
    not unknown (404): a lease that expired, an engine restarting. 0 forgets at once."""
    max_n: int = Field(128, ge=1, le=4096)
    """Largest ``n`` (choices per prompt) accepted; vLLM has no limit of its own, this bounds one request's work."""
    max_batch_prompts: int = Field(1024, ge=1, le=100_000)
    """Most prompts in one batched completions ``prompt`` (a list of strings or of token-id lists)."""
    response_affinity_entries: int = Field(100_000, ge=0, le=10_000_000)
    """``/v1/responses`` ids remembered with the endpoint that stored them, so a ``previous_response_id``
    follow-up goes there (:mod:`services.router.response_affinity`; LRU); 0 pins nothing."""
    response_affinity_ttl_seconds: float = Field(3600.0, gt=0, le=30 * 86400)
    """How long a response id stays pinned to its endpoint after the answer."""

    def engine_key_for(self, model: str) -> str | None:
        """The API key to present to the engines of ``model``'s pool, or None (send none of kvmesh's own)."""
        key = self.engine_api_keys.get(model) or self.engine_api_key
        return key.get_secret_value() if key is not None else None
