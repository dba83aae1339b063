"""Which client headers reach the engine, and which never do (pure: header pairs in, header pairs out).

The router is an HTTP proxy (RFC 9110 section 7.6): it forwards a client's end-to-end headers and
never its hop-by-hop ones. On top of that it keeps to itself what is kvmesh's (routing, priority,
credentials) and sets what it owns. The table (also ``docs/openai-compat.md``):

| header | to the engine |
| --- | --- |
| hop-by-hop: ``connection``, ``keep-alive``, ``proxy-authenticate``, ``proxy-authorization``, ``proxy-connection``, ``te``, ``trailer(s)``, ``transfer-encoding``, ``upgrade``, and every header ``connection`` names | never |
| ``host``, ``content-length``, ``content-encoding``, ``accept-encoding`` (the body is re-serialised, httpx negotiates its own) | never (set by httpx) |
| ``content-type``, ``accept``, ``x-request-id``, ``traceparent``, ``tracestate``, ``x-data-parallel-rank`` | replaced by the router's |
| kvmesh's own: ``x-kvmesh-*``, ``x-gateway-inference-fairness-id`` / ``-objective``, ``x-llm-d-inference-fairness-id`` / ``-objective``, ``x-llm-d-*``, ``x-slo-ttft-ms`` | never (read by the router) |
| credentials: ``x-api-key``, ``cookie`` | never |
| ``authorization`` | the pool's engine key when one is configured; else the client's, unchanged, only in open mode (no tenants: the client's key is meant for the engine); never with tenants (it is a kvmesh key) |
| everything else (``user-agent``, ``openai-organization``, ``openai-project``, ``x-stainless-*``, ``baggage``, custom ``x-*``) | passed unchanged |
"""

from __future__ import annotations

from collections.abc import Iterable

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade",
})
"""RFC 9110 section 7.6.1 (and the legacy ``proxy-connection``/``keep-alive``): meaningful for one connection only."""
SET_BY_ROUTER = frozenset({
    "host", "content-length", "content-encoding", "accept-encoding", "content-type", "accept", "x-request-id",
    "traceparent", "tracestate", "x-data-parallel-rank",
})
"""The router writes these itself (or lets httpx write them) for the engine request."""
KVMESH_HEADERS = frozenset({
    "x-gateway-inference-fairness-id", "x-gateway-inference-objective", "x-slo-ttft-ms",
})
KVMESH_PREFIXES = ("x-kvmesh-", "x-llm-d-")
"""Routing, priority and admission headers the router consumes (llm-d/GIE's and kvmesh's)."""
CREDENTIALS = frozenset({"x-api-key", "cookie"})
"""Client credentials for the router; an engine never sees them (``authorization`` is decided apart)."""
AUTHORIZATION = "authorization"


def forwarded_headers(headers: Iterable[tuple[str, str]], pass_authorization: bool) -> tuple[tuple[str, str], ...]:
    """The client's headers that go on to the engine (see the module table), names lower-cased.

    Args:
        headers: the client's request headers as ``(name, value)`` pairs (repeated names kept).
        pass_authorization: whether the client's ``authorization`` goes on (open mode and no
            engine key: the client authenticates to the engine itself).
    """
    pairs = [(name.lower(), value) for name, value in headers]
    named_by_connection = {
        token.strip().lower() for name, value in pairs if name == "connection" for token in value.split(",") if token.strip()
    }
    out: list[tuple[str, str]] = []
    for name, value in pairs:
        if name in HOP_BY_HOP or name in named_by_connection or name in SET_BY_ROUTER or name in CREDENTIALS:
            continue
        if name in KVMESH_HEADERS or name.startswith(KVMESH_PREFIXES):
            continue
        if name == AUTHORIZATION and not pass_authorization:
            continue
        out.append((name, value))
    return tuple(out)


def engine_authorization(engine_key: str | None) -> dict[str, str]:
    """The ``authorization`` header presenting kvmesh's engine key for a pool (empty when none is configured)."""
    return {AUTHORIZATION: f"Bearer {engine_key}"} if engine_key else {}
