"""gRPC clients of flow_control (the admission stream) and epp (Pick), translated to domain types/errors.

This is the only router module that imports grpc besides the servicer. Every call has a deadline
from :class:`~services.router.config.RouterConfig`; remote failures become domain errors so the
request flow and both front doors see one vocabulary.

Admission (``FlowControl.Admit``, a bidirectional stream whose life is the request's slot):
``admit()`` opens the stream, sends ``Enqueue`` and waits for the one ``AdmitResponse``;
``DISPATCHED`` returns an :class:`AdmissionTicket`, rejections raise (capacity/shed/other -> 429,
TTL -> 504). ``AdmissionTicket.close()`` sends ``Complete`` (when given), half-closes, waits
briefly for flow_control to end the call and then cancels it: either way the slot is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import errors
from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as fc_pb2
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as fc_pb2_grpc
from kvmesh.channels import insecure_channel, to_domain_error
from kvmesh.types import Endpoint, EndpointId, EndpointRole

logger = logging.getLogger(__name__)


SERVING = "SERVING"


async def check_health(channel: grpc.aio.Channel | None, timeout_seconds: float) -> str:
    """grpc.health.v1 ``Check`` of the whole server (service ``""``) behind ``channel``.

    Returns ``"SERVING"``, another status name (``"NOT_SERVING"``), the gRPC code of a failed
    check (``"UNAVAILABLE"``: down; ``"DEADLINE_EXCEEDED"``: no answer within ``timeout_seconds``,
    e.g. a hung process; ``"UNIMPLEMENTED"``: no health service), or ``"NOT_CONNECTED"``; never raises.
    """
    if channel is None:
        return "NOT_CONNECTED"
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_seconds)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """What flow_control needs to queue a request (sizes in tokens)."""

    request_id: str
    flow_id: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    model: str


@dataclass(frozen=True, slots=True)
class CompletionReport:
    """The outcome flow_control hears when a request ends (times in seconds)."""

    prompt_tokens: int
    completion_tokens: int
    ttft_seconds: float
    e2e_seconds: float
    success: bool


_REJECTIONS: dict[int, type[errors.KvmeshError]] = {
    fc_pb2.QUEUE_OUTCOME_REJECTED_CAPACITY: errors.QueueFull,
    fc_pb2.QUEUE_OUTCOME_EVICTED_TTL: errors.QueueTTLExpired,
    fc_pb2.QUEUE_OUTCOME_SHED: errors.Shed,
    fc_pb2.QUEUE_OUTCOME_REJECTED_OTHER: errors.Saturated,
}


class AdmissionTicket:
    """An admitted request's open stream; ``close()`` releases the slot (idempotent)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, queue_seconds: float, close_timeout_seconds: float) -> None:
        self._call = call
        self.queue_seconds = queue_seconds
        self._close_timeout = close_timeout_seconds
        self._closed = False

    async def close(self, report: CompletionReport | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(self._close_timeout):
                if report is not None:
                    await self._call.write(
                        fc_pb2.AdmitRequest(
                            complete=fc_pb2.Complete(
                                prompt_tokens=max(0, report.prompt_tokens),
                                completion_tokens=max(0, report.completion_tokens),
                                ttft_seconds=report.ttft_seconds,
                                e2e_seconds=report.e2e_seconds,
                                success=report.success,
                            )
                        )
                    )
                await self._call.done_writing()
                while await self._call.read() is not grpc.aio.EOF:
                    pass
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            logger.debug("admission stream close error=%r; cancelling", exc)
        finally:
            self._call.cancel()


class AdmissionClient:
    """Opens one ``FlowControl.Admit`` stream per request."""

    def __init__(self, address: str, admission_timeout_seconds: float, close_timeout_seconds: float) -> None:
        self._address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: fc_pb2_grpc.FlowControlStub | None = None
        self._timeout = admission_timeout_seconds
        self._close_timeout = close_timeout_seconds

    async def admit(self, request: AdmissionRequest) -> AdmissionTicket:
        """Enqueue and wait for dispatch.

        Raises:
            QueueFull | Shed | Saturated: flow_control rejected it (-> 429), with its reason.
            QueueTTLExpired: it waited past the queue TTL or the admission timeout (-> 504).
            NotReady: flow_control is unreachable (-> 503).
        """
        if self._stub is None:
            raise errors.NotReady("admission client not connected")
        call = self._stub.Admit()
        admitted = False
        try:
            async with asyncio.timeout(self._timeout):
                await call.write(
                    fc_pb2.AdmitRequest(
                        enqueue=fc_pb2.Enqueue(
                            request_id=request.request_id,
                            flow_id=request.flow_id,
                            priority=request.priority,
                            prompt_tokens=max(0, request.prompt_tokens),
                            max_tokens=max(0, request.max_tokens),
                            model=request.model,
                        )
                    )
                )
                reply = await call.read()
            if reply is grpc.aio.EOF:
                raise errors.Saturated("flow_control closed the admission stream without a decision")
            if reply.outcome == fc_pb2.QUEUE_OUTCOME_DISPATCHED:
                admitted = True
                return AdmissionTicket(call, reply.queue_seconds, self._close_timeout)
            error_cls = _REJECTIONS.get(reply.outcome, errors.Saturated)
            raise error_cls(f"rejected by admission: {reply.reason or fc_pb2.QueueOutcome.Name(reply.outcome)}")
        except TimeoutError as exc:
            raise errors.QueueTTLExpired(f"not dispatched within {self._timeout:g}s") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                raise errors.NotReady(f"flow_control unavailable: {exc.details()}") from exc
            raise to_domain_error(exc) from exc
        finally:
            if not admitted:
                call.cancel()

    async def connect(self) -> None:
        """Create the channel (inside the running event loop: grpc.aio channels are bound to it)."""
        self._channel = insecure_channel(self._address)
        self._stub = fc_pb2_grpc.FlowControlStub(self._channel)

    async def health(self, timeout_seconds: float) -> str:
        """flow_control's grpc.health.v1 status name (see :func:`check_health`)."""
        return await check_health(self._channel, timeout_seconds)

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()


@dataclass(frozen=True, slots=True)
class PickQuery:
    """The prompt as the engine will see it, plus endpoints to leave out."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    exclude_endpoint_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PickResult:
    """epp's choice: the target first, then fallbacks; ``prompt_tokens`` 0 when epp did not tokenize."""

    candidates: tuple[Endpoint, ...]
    prompt_tokens: int
    profile: str


def endpoint_from_proto(ep: common_pb2.Endpoint) -> Endpoint:
    try:
        role = EndpointRole(ep.role or "both")
    except ValueError:
        role = EndpointRole.BOTH
    return Endpoint(
        id=EndpointId(ep.id),
        url=ep.url.rstrip("/"),
        model=ep.model,
        block_size_tokens=ep.block_size_tokens or 64,
        events_endpoint=ep.events_endpoint,
        role=role,
        labels=dict(ep.labels),
    )


class PickerClient:
    """Calls ``EndpointPicker.Pick``."""

    def __init__(self, address: str, timeout_seconds: float) -> None:
        self._address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: epp_pb2_grpc.EndpointPickerStub | None = None
        self._timeout = timeout_seconds

    async def connect(self) -> None:
        """Create the channel (inside the running event loop)."""
        self._channel = insecure_channel(self._address)
        self._stub = epp_pb2_grpc.EndpointPickerStub(self._channel)

    async def health(self, timeout_seconds: float) -> str:
        """epp's grpc.health.v1 status name (see :func:`check_health`)."""
        return await check_health(self._channel, timeout_seconds)

    async def pick(self, query: PickQuery) -> PickResult:
        """Ask epp where to send the request.

        Raises:
            NoEndpointsAvailable: epp has no candidate or is unreachable (-> 503).
            UnknownModel: epp serves no such model (-> 404).
        """
        request = epp_pb2.PickRequest(
            request_id=query.request_id,
            model=query.model,
            prompt_token_ids=query.prompt_token_ids,
            prompt=query.prompt,
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in query.messages],
            exclude_endpoint_ids=query.exclude_endpoint_ids,
        )
        if self._stub is None:
            raise errors.NotReady("picker client not connected")
        try:
            reply = await self._stub.Pick(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise errors.NoEndpointsAvailable(f"endpoint picker: {exc.details()}") from exc
            raise to_domain_error(exc) from exc
        candidates = [endpoint_from_proto(reply.target)] if reply.HasField("target") and reply.target.url else []
        candidates += [endpoint_from_proto(ep) for ep in reply.fallbacks if ep.url]
        if not candidates:
            raise errors.NoEndpointsAvailable(f"no endpoint available for model '{query.model}'")
        return PickResult(tuple(candidates), reply.prompt_tokens, reply.profile)

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
