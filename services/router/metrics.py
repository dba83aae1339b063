"""The router's Prometheus metrics (default registry, served by GrpcService's /metrics) and record_* helpers.

| metric | type | labels |
| --- | --- | --- |
| ``kvmesh_router_request_ttft_seconds`` | histogram (TTFT_BUCKETS_SECONDS) | model_name |
| ``kvmesh_router_request_e2e_duration_seconds`` | histogram (LATENCY_BUCKETS_SECONDS) | model_name |
| ``kvmesh_router_requests_total`` | counter | outcome |
| ``kvmesh_router_requests_in_flight`` | gauge | — |
| ``kvmesh_router_upstream_retries_total`` | counter | — |
| ``kvmesh_router_stage_duration_seconds`` | histogram (STAGE_BUCKETS_SECONDS) | stage |
| ``kvmesh_router_epp_completions_dropped_total`` | counter | reason (queue_full, unreachable): completions not told to epp |
| ``kvmesh_router_engine_stalled_total`` | counter | reason (first_byte_timeout, idle_timeout, endpoint_left, health_probe_failed, health_probe_timed_out), action (redispatched, abandoned, ended) |

``stage`` (:data:`STAGES`, where a request's time goes in the router; epp's own stages, the
prefix-match step's tokenize and Score included, are epp's ``kvmesh_epp_plugin_duration_seconds``):
``admission`` (arrival to flow_control's DISPATCHED), ``pick`` (one epp Pick call, or the local
pick), ``engine_headers`` (POST sent to the engine's response headers: pool acquire, connect when
the pool has no idle connection, the engine's own time to its first byte), ``proxy`` (first to last
answer byte, passed on to the client), ``release`` (Complete + closing the admission stream),
``pre_dispatch`` (arrival to the first POST to an engine: admission and pick as they overlapped,
the early pick running beside admission; a retry's later picks not included).

``outcome`` is one of :class:`RequestOutcome` (a closed set; a status the router answers itself maps through
:func:`outcome_for_status`: every 4xx without an outcome of its own is ``invalid``; an engine's error answer
passed on maps through :func:`engine_outcome`: its 401/403/407, the engine refusing the credentials the router
presented, is ``upstream_error``, a misconfigured router, not the client's mistake); ``model_name`` is the served model
(closed: the models registered in etcd), "unknown" when empty.
"""

from __future__ import annotations

import enum

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.metrics import LATENCY_BUCKETS_SECONDS, TTFT_BUCKETS_SECONDS


class RequestOutcome(enum.StrEnum):
    """How a request ended (a low-cardinality metric label)."""

    SUCCESS = "success"
    INVALID = "invalid"
    NOT_FOUND = "not_found"
    REJECTED = "rejected"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    UPSTREAM_ERROR = "upstream_error"
    CANCELLED = "cancelled"
    ERROR = "error"


_STATUS_OUTCOME = {404: RequestOutcome.NOT_FOUND, 429: RequestOutcome.REJECTED, 499: RequestOutcome.CANCELLED,
                   503: RequestOutcome.UNAVAILABLE, 504: RequestOutcome.TIMEOUT}
"""The statuses with an outcome of their own; any other 4xx is ``invalid``, any other 5xx ``error``."""

REQUEST_TTFT = Histogram(
    "kvmesh_router_request_ttft_seconds",
    "Time from the router receiving a request to the first response byte from the engine.",
    ["model_name"],
    buckets=TTFT_BUCKETS_SECONDS,
)
REQUEST_E2E = Histogram(
    "kvmesh_router_request_e2e_duration_seconds",
    "Time from the router receiving a request to its last response byte.",
    ["model_name"],
    buckets=LATENCY_BUCKETS_SECONDS,
)
REQUESTS = Counter("kvmesh_router_requests", "Requests by outcome.", ["outcome"])
IN_FLIGHT = Gauge("kvmesh_router_requests_in_flight", "Requests admitted and not yet finished.")
STAGES = ("admission", "pick", "pre_dispatch", "engine_headers", "proxy", "release")
STAGE_BUCKETS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05,
                         0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STAGE_DURATION = Histogram(
    "kvmesh_router_stage_duration_seconds",
    "Time a request spends in one stage of the router's hop (admission, pick, pre_dispatch, engine_headers, proxy, "
    "release).",
    ["stage"],
    buckets=STAGE_BUCKETS_SECONDS,
)
_STAGE_CHILDREN = {stage: STAGE_DURATION.labels(stage=stage) for stage in STAGES}
RETRIES = Counter("kvmesh_router_upstream_retries",
                  "Engine attempts that failed before the first byte and were followed by another attempt (a "
                  "failed last attempt is not a retry).")


def outcome_for_status(status: int) -> RequestOutcome:
    """The outcome label of a request answered with HTTP ``status``: < 400 ``success``; 404 ``not_found``,
    429 ``rejected``, 499 (client closed) ``cancelled``, 503 ``unavailable``, 504 ``timeout``; any other
    4xx ``invalid`` (the client's request: 400, 401, 403, 405, 408, 409, 413, 415, 422, 431, ...), any
    other status ``error``."""
    if status < 400:
        return RequestOutcome.SUCCESS
    outcome = _STATUS_OUTCOME.get(status)
    if outcome is not None:
        return outcome
    return RequestOutcome.INVALID if status < 500 else RequestOutcome.ERROR


ENGINE_CREDENTIAL_STATUSES = frozenset({401, 403, 407})
"""An engine's (or a proxy's in front of it) refusal of the credentials the router presented: 401
Unauthorized, 403 Forbidden (vLLM 0.32 answers 401 for a wrong ``--api-key``; a gateway or proxy may
answer 403), 407 Proxy Authentication Required."""


def engine_outcome(status: int, client_credentials: bool = False) -> RequestOutcome:
    """The outcome label of a request an engine answered with HTTP ``status``, passed on to the client.

    As :func:`outcome_for_status`, except an engine's 401/403/407 (:data:`ENGINE_CREDENTIAL_STATUSES`):
    the engine refused the credentials the router presented (the pool's key, ``engine_api_key`` /
    ``engine_api_keys``, or none where the engine wants one): the router is misconfigured, and counting
    that ``invalid`` would hide it from error-rate alerts: ``upstream_error``. Only when
    ``client_credentials`` (the client's own ``authorization`` went to the engine unchanged: open mode,
    no engine key for the pool) is a 401/403 the client's wrong key: ``invalid``. A 407 is never the
    client's (``proxy-authorization`` is hop-by-hop, never forwarded).
    """
    if status in ENGINE_CREDENTIAL_STATUSES and not (client_credentials and status != 407):
        return RequestOutcome.UPSTREAM_ERROR
    return outcome_for_status(status)


def record_outcome(outcome: RequestOutcome) -> None:
    REQUESTS.labels(outcome=outcome.value).inc()


def record_ttft(model: str, seconds: float) -> None:
    REQUEST_TTFT.labels(model_name=model or "unknown").observe(seconds)


def record_e2e(model: str, seconds: float) -> None:
    REQUEST_E2E.labels(model_name=model or "unknown").observe(seconds)


DEGRADED = Counter(
    "kvmesh_router_degraded",
    "Requests decided by a degraded mode: dependency (flow_control, epp) unreachable; action "
    "admitted_locally / picked_locally (served without it) or refused (503); flow_control timed_out (504: "
    "no admission decision within admission_timeout_seconds, a hung flow_control).",
    ["dependency", "action"],
)

BREAKER_OPEN = Gauge(
    "kvmesh_router_dependency_breaker_open",
    "1 while the router's circuit breaker for a per-request dependency (epp Pick, flow_control admission) is "
    "open: a call timed out (hung dependency), so for dependency_breaker_cool_down_seconds requests take the "
    "unreachable-dependency path (local pick, local admission) without waiting, one probe call at a time.",
    ["dependency"],
)
BREAKER_TRANSITIONS = Counter(
    "kvmesh_router_dependency_breaker_transitions",
    "Circuit breaker transitions per dependency (epp, flow_control): to open (a call timed out) or closed "
    "(a probe was answered, or the cool-down passed with no probe in flight).",
    ["dependency", "to"],
)
for _dependency in ("epp", "flow_control"):
    BREAKER_OPEN.labels(dependency=_dependency).set(0)

DEPENDENCY_UP = Gauge(
    "kvmesh_router_dependency_up",
    "1 when the last grpc.health.v1 check of a dependency (flow_control, epp) answered SERVING, else 0 (refused, "
    "unreachable, hung, not serving): checked at start-up until it answers, then at each /health evaluation.",
    ["dependency"],
)


def record_dependency_check(dependency: str, status: str) -> None:
    DEPENDENCY_UP.labels(dependency=dependency).set(1 if status == "SERVING" else 0)


def record_breaker(dependency: str, is_open: bool) -> None:
    BREAKER_OPEN.labels(dependency=dependency).set(1 if is_open else 0)
    BREAKER_TRANSITIONS.labels(dependency=dependency, to="open" if is_open else "closed").inc()


EPP_COMPLETIONS_DROPPED = Counter(
    "kvmesh_router_epp_completions_dropped",
    "Request completions not reported to epp (its Completed RPC): queue_full, or unreachable (call failed).",
    ["reason"],
)


ENGINE_STALLED = Counter(
    "kvmesh_router_engine_stalled",
    "Engine requests ended because the engine stopped answering without failing: reason first_byte_timeout "
    "(engine_first_byte_timeout_seconds), idle_timeout (engine_stream_idle_timeout_seconds mid-answer), "
    "endpoint_left (it left membership, lease expired or deregistered, while the request waited on it and its "
    "/health failed), health_probe_failed (no byte past engine_health_probe_after_seconds, its lease alive, and its /health "
    "refused, reset or not 2xx) or health_probe_timed_out (likewise, its /health unanswered for longer than "
    "engine_health_slow_fail_seconds within the wait); action redispatched (no byte had reached the client and another attempt started: the next "
    "candidate), abandoned (no byte had reached the client and no attempt followed: no candidate left, the "
    "re-pick failed or the client went away; the request ends with that error, e.g. 503) or ended (the answer had "
    "started: in-stream error, gRPC UNAVAILABLE). A wait ended by the router stopping is not counted, nor the "
    "silence of an engine whose answer was already whole.",
    ["reason", "action"],
)


def record_engine_stalled(reason: str, action: str) -> None:
    ENGINE_STALLED.labels(reason=reason, action=action).inc()


def record_degraded(dependency: str, action: str) -> None:
    DEGRADED.labels(dependency=dependency, action=action).inc()


def record_stage(stage: str, seconds: float) -> None:
    """Observe ``seconds`` in ``stage`` (one of :data:`STAGES`; the label children are made once)."""
    _STAGE_CHILDREN[stage].observe(seconds)


def record_retry() -> None:
    RETRIES.inc()
