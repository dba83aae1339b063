"""Engine routes passed through without admission or a pick: vLLM's ``POST /tokenize`` and ``POST /detokenize``.

These run no inference (the engine's API process tokenizes; vLLM 0.32 does not queue them), so
they skip flow_control and epp: the router sends the body, unchanged, to the least-loaded live
endpoint of the body's ``model`` (the router's own in-flight count over its etcd view, as the
degraded pick does), with the pool's engine key and the forwarded client headers
(:mod:`services.router.headers`); a refused connection moves to the next endpoint, at most
``max_fallback_attempts``. The engine's status and body come back unchanged.

``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the one endpoint that stored the response
(:meth:`Passthrough.to_endpoint`; :mod:`services.router.response_affinity`), with the same headers.

A hung engine (docs/degraded-modes.md, "an engine hung"): an engine that gives no answer within
``engine_health_probe_after_seconds`` has its ``GET /health`` asked (then again every
``engine_health_probe_interval_seconds``); when that fails too (refused, reset or not 2xx; no answer
within ``engine_health_probe_timeout_seconds`` only twice in a row, an overloaded vLLM answers
``/health`` late; and never while another request to the engine receives bytes:
:meth:`~services.router.request_flow.RequestFlow.engine_health`) the wait ends as a transport failure
does (``/tokenize``, ``/detokenize``: the next endpoint; a stored response's route: 503), counted as
``kvmesh_router_engine_stalled_total{reason="health_probe_failed"}`` (``action="redispatched"`` once
another endpoint is tried, and a retry; ``"abandoned"`` when none is left: 503); while it answers, the wait goes
on (up to ``request_timeout_seconds``). Before, a hung engine held these for ``request_timeout_seconds``.

Errors: no live endpoint of a model served recently is :class:`~services.router.validation.ModelUnavailable`
(503); every endpoint failing at the transport is ``NoEndpointsAvailable`` (503).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from kvmesh import errors
from kvmesh.types import Endpoint
from services.router import metrics
from services.router.config import RouterConfig
from services.router.degraded import LocalPicker
from services.router.headers import engine_authorization
from services.router.request_flow import REQUEST_ID_HEADER, Health
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


class EngineHung(Exception):
    """The engine gave no answer past ``engine_health_probe_after_seconds`` and its ``/health`` failed."""


class Passthrough:
    """Sends a body to one live endpoint of a model (see the module docstring).

    ``answers(endpoint)``: the verdict of the endpoint's ``/health``
    (:meth:`~services.router.request_flow.RequestFlow.engine_health`); None: waits are not probed."""

    def __init__(
        self, config: RouterConfig, http: httpx.AsyncClient, endpoints: Callable[[str], Iterable[Endpoint]],
        picker: LocalPicker, answers: Callable[[Endpoint], Awaitable[Health]] | None = None,
    ) -> None:
        self._config = config
        self._http = http
        self._endpoints = endpoints
        self._picker = picker
        self._answers = answers

    async def _answer(self, endpoint: Endpoint, sending: Awaitable[httpx.Response]) -> httpx.Response:
        """``sending``'s answer, the engine's ``/health`` asked past the probe threshold (module docstring).

        Raises:
            EngineHung: no answer, and the probe failed: ``dead``, or ``slow`` twice in a row (they
                are ``engine_health_probe_interval_seconds`` apart); the request is cancelled.
            httpx.TransportError: as the request raises it.
        """
        task = asyncio.ensure_future(sending)
        wait = self._config.engine_health_probe_after_seconds
        slow = False
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=wait)
                if done:
                    return task.result()
                health = "alive" if self._answers is None else await self._answers(endpoint)
                if (health == "dead" or (health == "slow" and slow)) and not task.done():
                    raise EngineHung(f"engine {endpoint.id} gave no answer for "
                                     f"{self._config.engine_health_probe_after_seconds:g}s and its /health does not answer")
                slow = health == "slow"
                wait = self._config.engine_health_probe_interval_seconds
        finally:
            if task.done():
                if not task.cancelled():
                    task.exception()  # retrieved (raised above when it was the answer)
            else:
                task.cancel()

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
                if last_error is not None:  # another attempt starts: the failed one moved on
                    _moved_on(last_error)
                tried.append(endpoint.id)
                self._picker.note_start(endpoint.id)
                try:
                    reply = await self._answer(endpoint, self._http.post(endpoint.url + path, content=content,
                                                                         headers=headers))
                except (httpx.TransportError, EngineHung) as exc:
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
                f"no endpoint answered {path} for model '{model}' after {len(tried)} attempt(s): {last_error!r}")
        finally:
            if isinstance(last_error, EngineHung):  # no attempt followed it: the client gets 503 (or went away)
                metrics.record_engine_stalled("health_probe_failed", "abandoned")

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
            reply = await self._answer(endpoint, self._http.request(method, endpoint.url + path, headers=headers))
        except (httpx.TransportError, EngineHung) as exc:
            if isinstance(exc, EngineHung):  # no byte reached the client, and no other endpoint holds it: 503
                metrics.record_engine_stalled("health_probe_failed", "abandoned")
            raise errors.NoEndpointsAvailable(f"endpoint {endpoint.id} did not answer {method} {path}: {exc!r}") from exc
        finally:
            self._picker.note_end(endpoint.id)
        return PassedAnswer(reply.status_code, reply.content, reply.headers.get("content-type", "application/json"),
                            endpoint.id)


def _moved_on(failed: Exception) -> None:
    """Another endpoint is tried after ``failed``: one retry, and a stall ``redispatched`` for a hung engine."""
    metrics.record_retry()
    if isinstance(failed, EngineHung):
        metrics.record_engine_stalled("health_probe_failed", "redispatched")
