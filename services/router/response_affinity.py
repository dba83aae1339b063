"""Stored responses live in one engine: ``/v1/responses`` follow-ups go to the engine that holds them (pure).

vLLM 0.32 keeps a stored response (``store`` true, the default, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``)
in the API server's memory (``OpenAIServingResponses.response_store``): a follow-up naming it as
``previous_response_id`` (or ``GET /v1/responses/{id}``) is answered only by that server; any other
answers 404 ``{"error": {"message": "Response with id '<id>' not found.", "type":
"invalid_request_error", "param": "response_id", "code": 404}}``. So the router remembers which endpoint
answered each response id (:class:`ResponseAffinity`, a bounded LRU with a TTL) and pins the
follow-up there (:func:`pinned_endpoint`): no epp pick, no fallback to another engine.

| follow-up's ``previous_response_id`` | router |
| --- | --- |
| remembered, its endpoint live | sent there (pick profile ``response-affinity``) |
| remembered, its endpoint gone from the pool (lease expired: the engine's memory went with it) | 404 as vLLM words it, naming the endpoint (:class:`StoredResponseGone`) |
| remembered, its endpoint failed to connect | 503 + ``retry-after`` (``NoEndpointsAvailable``: it may come back) |
| not remembered (another router answered it, evicted, expired) | picked as usual; the engine answers (404 if it does not hold it) |

Bounds: ``max_entries`` ids (oldest dropped first) and ``ttl_seconds`` per id (a pin older than that is
forgotten). One router's memory: peer routers do not share pins (a client should keep to one router, or
the follow-up may reach an engine that answers 404).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvmesh.errors import NoEndpointsAvailable, NotFound
from kvmesh.types import Endpoint

PROFILE = "response-affinity"
"""The pick profile named in logs and traces for a pinned follow-up."""


class StoredResponseGone(NotFound):
    """The endpoint that stored ``previous_response_id`` left the pool (HTTP 404, vLLM's wording and type)."""

    openai_type = "invalid_request_error"
    param = "response_id"


class ResponseAffinity:
    """Response id -> endpoint id, bounded (LRU) and expiring (TTL).

    Args:
        max_entries: ids remembered at most (0 remembers none).
        ttl_seconds: how long an id stays pinned after its answer (seconds).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, max_entries: int, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_entries
        self._ttl = ttl_seconds
        self._clock = clock
        self._pins: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def remember(self, response_id: str, endpoint_id: str, model: str = "") -> None:
        """Pin ``response_id`` to ``endpoint_id`` serving ``model`` (a newer pin of the same id replaces the older)."""
        if self._max <= 0 or not response_id:
            return
        self._pins[response_id] = (endpoint_id, model, self._clock() + self._ttl)
        self._pins.move_to_end(response_id)
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def endpoint_for(self, response_id: str | None) -> str | None:
        """The endpoint holding ``response_id``, or None (never pinned, evicted or expired)."""
        found = self.holder(response_id)
        return found[0] if found is not None else None

    def holder(self, response_id: str | None) -> tuple[str, str] | None:
        """``(endpoint id, model)`` holding ``response_id``, or None (never pinned, evicted or expired)."""
        if not response_id:
            return None
        pin = self._pins.get(response_id)
        if pin is None:
            return None
        endpoint_id, model, expires = pin
        if self._clock() >= expires:
            del self._pins[response_id]
            return None
        self._pins.move_to_end(response_id)
        return endpoint_id, model


def pinned_endpoint(model: str, response_id: str, endpoint_id: str, endpoints: Iterable[Endpoint],
                    tried: Iterable[str]) -> Endpoint:
    """The one candidate of a follow-up pinned to ``endpoint_id`` (the pick profile :data:`PROFILE`).

    Raises:
        StoredResponseGone: the endpoint is not live in the pool of ``model`` any more.
        NoEndpointsAvailable: it is live but already failed for this request (the caller's 503).
    """
    holder = next((ep for ep in endpoints if ep.id == endpoint_id and ep.model == model), None)
    if holder is None:
        raise StoredResponseGone(f"Response with id '{response_id}' not found. (it was stored by endpoint "
                                 f"{endpoint_id}, which left the pool of model '{model}')")
    if endpoint_id in set(tried):
        raise NoEndpointsAvailable(f"endpoint {endpoint_id}, which holds response '{response_id}', did not answer")
    return holder


def response_id_of(payload: bytes) -> str | None:
    """The ``id`` of a non-streamed ``/v1/responses`` answer (``{"id": "resp_...", "object": "response"}``)."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if isinstance(data, dict) and data.get("object") == "response" and isinstance(data.get("id"), str):
        return str(data["id"])
    return None


def response_id_in_events(raw: bytes) -> str | None:
    """The response id in streamed ``/v1/responses`` SSE bytes: the ``response`` object of the first
    ``response.created`` (or any event carrying one); None when these bytes hold none."""
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:") or b'"response"' not in line:
            continue
        try:
            data = json.loads(line[5:])
        except (ValueError, RecursionError):
            continue
        inner = data.get("response") if isinstance(data, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("id"), str):
            return str(inner["id"])
    return None


def stores(body: dict[str, object]) -> bool:
    """Whether the engine may store this response (``store`` defaults to true in the Responses API)."""
    return body.get("store", True) is not False
