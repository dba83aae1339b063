"""Engine routes passed through without admission or a pick: vLLM's ``POST /tokenize`` and ``POST /detokenize``.

These run no inference (the engine's API process tokenizes; vLLM 0.32 does not queue them), so
they skip flow_control and epp: the router sends the body, unchanged, to the least-loaded live
endpoint of the body's ``model`` (the router's own in-flight count over its etcd view, as the
degraded pick does), with the pool's engine key and the forwarded client headers
(:mod:`services.router.headers`); a refused connection moves to the next endpoint, at most
``max_fallback_attempts``. The engine's status and body come back unchanged.

``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the one endpoint that stored the response
(:meth:`Passthrough.to_endpoint`; :mod:`services.router.response_affinity`), with the same headers.

A hung engine (docs/degraded-modes.md, "an engine hung"): each wait runs under the request flow's
hung-engine watch (:meth:`~services.router.request_flow.RequestFlow.await_engine`), the same one the
inference requests use: an engine that gives no answer within ``engine_health_probe_after_seconds``
has its ``GET /health`` probed, one GET per endpoint at a time however many requests (passed through
or not) wait on it (a slow one is kept running, not re-sent), again every
``engine_health_probe_interval_seconds`` after it answered. When the probes fail (refused, reset or not
2xx; or no answer for longer than ``engine_health_slow_fail_seconds`` within the wait; never while
another request to the engine receives bytes) the wait ends as a transport failure does (``/tokenize``,
``/detokenize``: the next endpoint, as an inference request before its first byte; a stored response's
route: 503), counted as ``kvmesh_router_engine_stalled_total{reason}`` (``health_probe_failed``,
``health_probe_timed_out`` or ``endpoint_left``; ``action="redispatched"`` once another endpoint is tried,
and a retry; ``"abandoned"`` when none follows: 503, or the client left); while it answers, the wait goes
on (up to ``request_timeout_seconds``). Before, a hung engine held these for ``request_timeout_seconds``.

Errors: no live endpoint of a model served recently is :class:`~services.router.validation.ModelUnavailable`
(503); every endpoint failing at the transport is ``NoEndpointsAvailable`` (503).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import httpx

from kvmesh import errors
from kvmesh.types import Endpoint
from services.router import metrics
from services.router.config import RouterConfig
from services.router.degraded import LocalPicker
from services.router.engine_client import unreachable
from services.router.headers import engine_authorization
from services.router.request_flow import REQUEST_ID_HEADER, EngineStall
from services.router.response_affinity import StoredResponseGone
from services.router.validation import ModelUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PassedAnswer:
    """An engine's answer to a passed-through route: status, body bytes, content type and who answered."""

    status_code: int
    content: bytes
    content_type: str
    endpoint_id: str


AwaitEngine: TypeAlias = Callable[[Endpoint, str, Awaitable[httpx.Response]], Awaitable[httpx.Response]]
"""``await_engine(endpoint, request_id, sending)``: ``sending``'s answer under the hung-engine watch
(:meth:`~services.router.request_flow.RequestFlow.await_engine`; raises ``EngineStall``)."""


class Passthrough:
    """Sends a body to one live endpoint of a model (see the module docstring).

    ``answers``: the request flow's :meth:`~services.router.request_flow.RequestFlow.await_engine`
    (the shared hung-engine watch); None: waits are not watched."""

    def __init__(
        self, config: RouterConfig, http: httpx.AsyncClient, endpoints: Callable[[str], Iterable[Endpoint]],
        picker: LocalPicker, answers: AwaitEngine | None = None,
    ) -> None:
        self._config = config
        self._http = http
        self._endpoints = endpoints
        self._picker = picker
        self._answers = answers

    async def _answer(self, endpoint: Endpoint, request_id: str, sending: Awaitable[httpx.Response]) -> httpx.Response:
        """``sending``'s answer, watched as the module docstring says.

        Raises:
            EngineStall: no answer, and the endpoint's probes failed; the request is cancelled.
            httpx.TransportError: as the request raises it.
        """
        if self._answers is None:
            return await sending
        return await self._answers(endpoint, request_id, sending)

    async def forward(
        self, path: str, model: str, body: dict[str, Any], request_id: str, forward_headers: tuple[tuple[str, str], ...] = (),
    ) -> PassedAnswer:
        """POST ``body`` to ``path`` on the least-loaded live endpoint of ``model``.

        Raises:
            ModelUnavailable: no endpoint of ``model`` is live.
            NoEndpointsAvailable: every endpoint tried failed before answering.
        """
        tried: list[str] = []
        last_error: Exception | None = None
        own = {"content-type": "application/json", "accept": "application/json", REQUEST_ID_HEADER: request_id,
               **engine_authorization(self._config.engine_key_for(model))}
        headers = [*((k, v) for k, v in forward_headers if k not in own), *own.items()]
        content = json.dumps(body).encode()
        candidates = self._picker.order([ep for ep in self._endpoints(model) if ep.model == model], tried)
        if not candidates:
            raise ModelUnavailable(f"model '{model}' has no live endpoint right now; retry later")
        try:
            for endpoint in candidates[: self._config.max_fallback_attempts]:
                if last_error is not None:  # another attempt starts: the failed one moved on (counted once)
                    failed, last_error = last_error, None
                    _moved_on(failed)
                tried.append(endpoint.id)
                self._picker.note_start(endpoint.id)
                try:
                    reply = await self._answer(endpoint, request_id, self._http.post(
                        endpoint.url + path, content=content, headers=headers))
                except (httpx.TransportError, EngineStall) as exc:
                    last_error = exc
                    logger.warning("engine failed request_id=%s endpoint=%s path=%s error=%r", request_id, endpoint.id,
                                   path, exc)
                    continue
                finally:
                    self._picker.note_end(endpoint.id)
                last_error = None
                return PassedAnswer(reply.status_code, reply.content, reply.headers.get("content-type", "application/json"),
                                    endpoint.id)
            raise errors.NoEndpointsAvailable(
                f"no endpoint answered {path} for model '{model}' after {len(tried)} attempt(s): "
                f"{_in_words(tried[-1] if tried else '?', last_error)}")
        finally:
            if isinstance(last_error, EngineStall):  # no attempt followed it: the client gets 503 (or went away)
                metrics.record_engine_stalled(last_error.reason, "abandoned")

    async def to_endpoint(
        self, method: str, path: str, model: str, endpoint_id: str, request_id: str,
        forward_headers: tuple[tuple[str, str], ...] = (),
    ) -> PassedAnswer:
        """``method path`` (no body) on the live endpoint ``endpoint_id`` of ``model``, with the pool's key.

        Raises:
            StoredResponseGone: the endpoint is no longer live (what it held went with it).
            NoEndpointsAvailable: it failed before answering.
        """
        endpoint = next((ep for ep in self._endpoints(model) if ep.id == endpoint_id and ep.model == model), None)
        if endpoint is None:
            raise StoredResponseGone(f"Response with id '{path.split('/')[3]}' not found. (it was stored by "
                                     f"endpoint {endpoint_id}, which left the pool of model '{model}')")
        own = {"accept": "application/json", REQUEST_ID_HEADER: request_id,
               **engine_authorization(self._config.engine_key_for(model))}
        headers = [*((k, v) for k, v in forward_headers if k not in own), *own.items()]
        self._picker.note_start(endpoint.id)
        try:
            reply = await self._answer(endpoint, request_id, self._http.request(method, endpoint.url + path,
                                                                                headers=headers))
        except (httpx.TransportError, EngineStall) as exc:
            if isinstance(exc, EngineStall):  # no byte reached the client, and no other endpoint holds it: 503
                metrics.record_engine_stalled(exc.reason, "abandoned")
            raise errors.NoEndpointsAvailable(
                f"endpoint {endpoint.id} did not answer {method} {path}: {_in_words(endpoint.id, exc)}") from exc
        finally:
            self._picker.note_end(endpoint.id)
        return PassedAnswer(reply.status_code, reply.content, reply.headers.get("content-type", "application/json"),
                            endpoint.id)


def _moved_on(failed: Exception) -> None:
    """Another endpoint is tried after ``failed``: one retry, and a stall ``redispatched`` for a hung engine."""
    metrics.record_retry()
    if isinstance(failed, EngineStall):
        metrics.record_engine_stalled(failed.reason, "redispatched")


def _in_words(endpoint_id: str, exc: BaseException | None) -> str:
    """What the engine did, for the client's 503 (the HTTP client's own text stays in the WARNING line): a stall's
    message, else the transport error's (``engine_client.unreachable``: "refused the connection", ...)."""
    if isinstance(exc, EngineStall):
        return str(exc) or type(exc).__name__
    if exc is None:
        return "no attempt was made"
    return f"engine {endpoint_id} {unreachable(exc)}"
