"""The gRPC front door binds API keys to tenants as HTTP does: same pure functions, gRPC statuses
from the one error table, SLO/TTL/quotas passed to flow_control.

A real in-process grpc.aio server with the shared interceptors serves ``InferenceServicer`` over a
:class:`RequestFlow` whose admission is a fake that records each ``AdmitQuery`` and whose engine is
an ``httpx.MockTransport``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from kvmesh import errors
from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.channels import ERROR_CLASS_TRAILER
from services.router.clients import AdmitQuery
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow
from services.router.servicer import metadata_headers
from services.router.tenants import TenantSpec
from tests.unit.router._support import inference_stub
from tests.unit.router.fakes import CATALOG, JSON_BODY, MODEL, SSE, FakeAdmission, FakePicker, FakeTicket

KEY_A = "sk-tenant-a-0001"
KEY_B = "sk-tenant-b-0001"
TENANTS = [
    TenantSpec(name="a", api_keys=[KEY_A], max_priority=10, rate_per_second=5, burst=10, max_concurrency=3),
    TenantSpec(name="b", api_keys=[KEY_B], fairness_id="team-b", max_priority=-1),
]
PROMPT = router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=2)


@dataclass
class RecordingAdmission(FakeAdmission):
    queries: list[AdmitQuery] = field(default_factory=list)

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        self.queries.append(request)
        return await super().admit(request)


def _engine(request: httpx.Request) -> httpx.Response:
    if b'"stream": true' in request.content or b'"stream":true' in request.content:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE)
    return httpx.Response(200, headers={"content-type": "application/json"}, content=JSON_BODY)


@dataclass
class Router:
    stub: router_pb2_grpc.InferenceStub
    admission: RecordingAdmission

    def last(self) -> AdmitQuery:
        return self.admission.queries[-1]


@asynccontextmanager
async def _serve(config: RouterConfig, admission: RecordingAdmission) -> AsyncIterator[Router]:
    flow = RequestFlow(config, lambda: CATALOG, admission, FakePicker(), httpx.AsyncClient(transport=httpx.MockTransport(_engine)))
    async with inference_stub(config, flow) as stub:
        yield Router(stub, admission)


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    async with _serve(RouterConfig(etcd_endpoints=[], tenants=TENANTS), RecordingAdmission()) as r:
        yield r


@pytest.fixture
async def strict() -> AsyncIterator[Router]:
    async with _serve(RouterConfig(etcd_endpoints=[], tenants=TENANTS, require_api_key=True), RecordingAdmission()) as r:
        yield r


@pytest.fixture
async def open_mode() -> AsyncIterator[Router]:
    async with _serve(RouterConfig(etcd_endpoints=[]), RecordingAdmission()) as r:
        yield r


def test_metadata_headers_first_value_wins_and_binary_keys_are_left_out() -> None:
    md = (("x-api-key", KEY_A), ("x-api-key", KEY_B), ("trace-bin", b"\x00"), ("X-Kvmesh-Priority", "3"))
    assert metadata_headers(md) == {"x-api-key": KEY_A, "x-kvmesh-priority": "3"}


@pytest.mark.parametrize(
    ("md", "flow_id", "priority", "expected"),
    [
        ((), "t1", 5, {"x-gateway-inference-fairness-id": "t1", "x-kvmesh-priority": "5"}),
        ((), "", 0, {}),
        ((("x-llm-d-inference-fairness-id", "m"),), "t1", 0, {"x-llm-d-inference-fairness-id": "m"}),
        ((("x-gateway-inference-objective", "critical"),), "", -3, {"x-gateway-inference-objective": "critical"}),
    ],
    ids=["fields", "unset", "metadata-flow-wins", "metadata-objective-wins"],
)
def test_message_fields_stand_for_headers_the_metadata_does_not_name(
    md: tuple[tuple[str, str], ...], flow_id: str, priority: int, expected: dict[str, str],
) -> None:
    request = router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id=flow_id, priority=priority)
    assert metadata_headers(md, request) == expected
    assert metadata_headers(md, request, "rid-1")["x-request-id"] == "rid-1"


@pytest.mark.parametrize(
    ("md", "flow", "priority"),
    [
        ((), "default", 0),
        ((("x-kvmesh-priority", "-10"),), "default", -10),
        ((("authorization", f"Bearer {KEY_A}"),), "a", 10),
        ((("authorization", f"Bearer {KEY_A}"), ("x-gateway-inference-objective", "critical")), "a", 10),
        ((("x-api-key", KEY_A), ("x-llm-d-inference-objective", "99"), ("x-gateway-inference-fairness-id", "spoof")), "a", 10),
        ((("x-api-key", KEY_B),), "team-b", -1),
    ],
    ids=["no-key-field-capped", "no-key-metadata-wins", "key-field-capped", "key-objective", "old-names-capped-fairness-ignored", "fairness-id"],
)
async def test_unary_binding(router: Router, md: tuple[tuple[str, str], ...], flow: str, priority: int) -> None:
    """The message asks for flow 'spoof' at priority 50: never trusted once tenants are configured."""
    request = router_pb2.CompletionRequest(model=MODEL, prompt="hello", max_tokens=2, flow_id="spoof", priority=50)
    reply = await router.stub.Complete(request, metadata=md, timeout=5)
    assert reply.text == "hello"
    assert (router.last().flow_id, router.last().priority) == (flow, priority)


async def test_quotas_slo_ttl_and_size_reach_flow_control(router: Router) -> None:
    md = (("authorization", f"Bearer {KEY_A}"), ("x-slo-ttft-ms", "250"), ("x-kvmesh-queue-ttl-ms", "1500"))
    await router.stub.Complete(PROMPT, metadata=md, timeout=5)
    options = router.last().options
    assert options is not None
    assert (options.rate_per_second, options.burst, options.max_concurrency) == (5, 10, 3)
    assert (options.ttft_slo_seconds, options.ttl_seconds) == (0.25, 1.5)
    assert options.byte_size == PROMPT.ByteSize() > 0


async def test_stream_applies_the_same_binding(router: Router) -> None:
    md = (("x-api-key", KEY_B), ("x-kvmesh-priority", "7"), ("x-slo-ttft-ms", "100"))
    chunks = [c async for c in router.stub.CompleteStream(PROMPT, metadata=md, timeout=5)]
    assert "".join(c.text for c in chunks) == "hello"
    query = router.last()
    assert (query.flow_id, query.priority) == ("team-b", -1)
    assert query.options is not None and query.options.ttft_slo_seconds == 0.1


async def test_tenant_default_priority_when_nothing_is_asked(router: Router) -> None:
    await router.stub.Complete(PROMPT, metadata=(("x-api-key", KEY_B),), timeout=5)
    assert (router.last().flow_id, router.last().priority) == ("team-b", -1)
    await router.stub.Complete(PROMPT, metadata=(("x-api-key", KEY_A),), timeout=5)
    assert (router.last().flow_id, router.last().priority) == ("a", 0)


async def test_request_id_metadata_is_the_admitted_id(router: Router) -> None:
    await router.stub.Complete(PROMPT, metadata=(("x-request-id", "grpc-rid-7"),), timeout=5)
    assert router.last().request_id == "grpc-rid-7"


async def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:  # type: ignore[attr-defined]
                pass
        else:
            await result  # type: ignore[misc]
    trailers = {k: v for k, v in (info.value.trailing_metadata() or ()) if isinstance(v, str)}
    return info.value.code(), info.value.details() or "", trailers


@pytest.mark.parametrize(
    "md",
    [
        (("authorization", "Bearer sk-unknown-key-0"),),
        (("authorization", f"Basic {KEY_A}"),),
        (("x-api-key", "short"),),
    ],
    ids=["unknown", "not-bearer", "malformed"],
)
@pytest.mark.parametrize("method", ["Complete", "CompleteStream"])
async def test_bad_keys_are_unauthenticated_and_nothing_is_admitted(
    router: Router, md: tuple[tuple[str, str], ...], method: str,
) -> None:
    code, _, trailers = await _code(lambda: getattr(router.stub, method)(PROMPT, metadata=md, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert trailers[ERROR_CLASS_TRAILER] == "Unauthenticated"
    assert router.admission.queries == []


async def test_bad_key_wins_over_a_bad_message(router: Router) -> None:
    bad = router_pb2.CompletionRequest(model=MODEL, prompt="x", prompt_token_ids=[1])
    code, _, _ = await _code(lambda: router.stub.Complete(bad, metadata=(("x-api-key", "sk-unknown-key-0"),), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_required_key(strict: Router) -> None:
    code, details, _ = await _code(lambda: strict.stub.Complete(PROMPT, timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "API key is required" in details
    code, _, _ = await _code(lambda: strict.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    models = await strict.stub.ListModels(router_pb2.ListModelsRequest(), metadata=(("x-api-key", KEY_A),), timeout=5)
    assert MODEL in models.models
    reply = await strict.stub.Complete(PROMPT, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=5)
    assert reply.text == "hello" and strict.last().flow_id == "a"


async def test_list_models_checks_a_sent_key(router: Router) -> None:
    assert MODEL in (await router.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)).models
    code, _, _ = await _code(lambda: router.stub.ListModels(
        router_pb2.ListModelsRequest(), metadata=(("x-api-key", "sk-unknown-key-0"),), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("md", "message", "needle"),
    [
        ((("x-kvmesh-priority", "1_0"),), PROMPT, "plain decimal"),
        ((("x-gateway-inference-objective", "urgent"),), PROMPT, "unknown inference objective"),
        ((("x-kvmesh-priority", "9999999999"),), PROMPT, "int32"),
        ((("x-slo-ttft-ms", "0"),), PROMPT, "x-slo-ttft-ms"),
        ((("x-kvmesh-queue-ttl-ms", "3600001"),), PROMPT, "x-kvmesh-queue-ttl-ms"),
        ((("x-gateway-inference-fairness-id", "f" * 257),), PROMPT, "at most 256"),
        ((), router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id="f" * 257), "at most 256"),
    ],
    ids=["loose-int", "unknown-objective", "over-int32", "slo-zero", "ttl-too-long", "long-fairness", "long-flow-field"],
)
async def test_bad_metadata_is_invalid_argument(
    router: Router, md: tuple[tuple[str, str], ...], message: router_pb2.CompletionRequest, needle: str,
) -> None:
    code, details, _ = await _code(lambda: router.stub.Complete(message, metadata=md, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details
    assert router.admission.queries == []


@pytest.mark.parametrize(
    ("reject", "cls"),
    [
        (errors.RateLimited("tenant rate quota spent", 2.0), "RateLimited"),
        (errors.QueueFull("queue full"), "QueueFull"),
        (errors.Shed("shed"), "Shed"),
        (errors.AdmissionTTLExpired("waited past its TTL"), "AdmissionTTLExpired"),
    ],
)
async def test_admission_rejections_are_resource_exhausted(reject: errors.Saturated, cls: str) -> None:
    async with _serve(RouterConfig(etcd_endpoints=[], tenants=TENANTS), RecordingAdmission(reject=reject)) as r:
        code, _, trailers = await _code(lambda: r.stub.Complete(PROMPT, metadata=(("x-api-key", KEY_A),), timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailers[ERROR_CLASS_TRAILER] == cls
        assert r.last().flow_id == "a"


async def test_open_mode_trusts_fields_and_metadata(open_mode: Router) -> None:
    request = router_pb2.CompletionRequest(model=MODEL, prompt="hello", flow_id="t1", priority=50)
    await open_mode.stub.Complete(request, metadata=(("authorization", "Bearer whatever-key"),), timeout=5)
    assert (open_mode.last().flow_id, open_mode.last().priority) == ("t1", 50)
    await open_mode.stub.Complete(PROMPT, metadata=(("x-gateway-inference-objective", "sheddable"),
                                                    ("x-gateway-inference-fairness-id", "m1")), timeout=5)
    assert (open_mode.last().flow_id, open_mode.last().priority) == ("m1", -10)


def test_a_long_flow_id_is_refused_by_its_field_name() -> None:
    """A fresh user's gRPC ``flow_id`` of 1,000 characters was refused as "'x-gateway-inference-fairness-id'
    header is 1000 characters": the error names the field the caller sent; the header's own check stays."""
    with pytest.raises(errors.InvalidRequest, match=r"^'flow_id' is 1000 characters \(at most 256\)$"):
        metadata_headers((), router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id="f" * 1000))
    assert metadata_headers((), router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id="f" * 256))[
        "x-gateway-inference-fairness-id"] == "f" * 256


@pytest.mark.parametrize("flow_id", ["\x00\n\u2603", "tab\there", "bell\x07", "line\nbreak", "\u200b\u2028"])
def test_a_flow_id_with_control_characters_is_refused_by_its_field_name(flow_id: str) -> None:
    """The sibling of the length check (a fresh-user trial: ``flow_id="\\x00\\n☃"`` got "'x-gateway-inference-fairness-id'
    header must be printable text"): the error names the field; printable text, non-ASCII included, passes."""
    with pytest.raises(errors.InvalidRequest, match=r"^'flow_id' must be printable text \(no control characters\)$"):
        metadata_headers((), router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id=flow_id))
    assert metadata_headers((), router_pb2.CompletionRequest(model=MODEL, prompt="x", flow_id="équipe ☃"))[
        "x-gateway-inference-fairness-id"] == "équipe ☃"
