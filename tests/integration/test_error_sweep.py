"""Every HTTP route and every gRPC method of every kvmesh process, fed malformed input: the status
class is the documented one and never a 5xx / UNKNOWN / INTERNAL, with no traceback in any log.

gRPC methods are found by server reflection on each running service (so a method added later is
swept without editing this file): undecodable request bytes -> ``INVALID_ARGUMENT``; an empty
(all-default) message -> any status but ``UNKNOWN``/``INTERNAL``. HTTP routes are read from the
router's and the simulator's Starlette apps: JSON routes get undecodable, non-object, 1,000-deep,
invalid-UTF-8, wrong-content-type bodies -> 4xx; every route gets a wrong method -> 405 and junk
query strings -> not 5xx. Each service's Prometheus endpoint gets junk too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from engine_simulator.server import EngineHttpApi, ServerState
from kvmesh_cli.mesh import Mesh, MeshSpec
from services.router.config import RouterConfig
from services.router.http_app import RouterHttpApi

pytestmark = pytest.mark.integration

MODEL = "sim-sweep"
GRPC_SERVICES = ("kv_indexer", "kv_store", "flow_control", "epp", "router")
UNDECODABLE = b"\x0f\xff\xff\xff"  # field 1 with wire type 7 (none such), then a truncated varint
DEEP = b'{"model": "x", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
BAD_JSON_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    ("not-json", b"{not json", {"content-type": "application/json"}),
    ("not-an-object", b"[1, 2, 3]", {"content-type": "application/json"}),
    ("deep-1000", DEEP, {"content-type": "application/json"}),
    ("deep-100000", b"[" * 100_000 + b"]" * 100_000, {"content-type": "application/json"}),
    ("invalid-utf8", b'{"model": "\xff\xfe", "prompt": "x"}', {"content-type": "application/json"}),
    ("lone-surrogate", b'{"model": "m", "prompt": "\\ud800"}', {"content-type": "application/json"}),
    ("wrong-types", b'{"model": 5, "prompt": {"a": 1}, "max_tokens": "many", "messages": 3}', {"content-type": "application/json"}),
    ("empty", b"", {"content-type": "application/json"}),
    ("huge-number", b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", {"content-type": "application/json"}),
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("sweep"), engines=1, policy="precise-prefix",
                    time_scale=50.0, model=MODEL, num_gpu_blocks=128)
    with Mesh(spec) as m:
        yield m
        for member in m.members:
            if member.name != "etcd":
                log = Path(member.log_path).read_text(errors="replace")
                assert "Traceback" not in log, f"{member.name} logged a traceback:\n{log[-3000:]}"


def _methods(address: str) -> list[tuple[str, bool, bool]]:
    """``(/package.Service/Method, client_streaming, server_streaming)`` for every method the server reflects."""
    out = []
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        for service in database.get_services():
            descriptor = database.FindFileContainingSymbol(service)
            for svc in descriptor.service:
                if f"{descriptor.package}.{svc.name}" != service:
                    continue
                for m in svc.method:
                    out.append((f"/{service}/{m.name}", m.client_streaming, m.server_streaming))
    return out


def _call(channel: grpc.Channel, method: str, client_streaming: bool, server_streaming: bool, payload: bytes) -> grpc.StatusCode:
    ident: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    try:
        if client_streaming and server_streaming:
            for _ in channel.stream_stream(method, **ident)(iter([payload]), timeout=3):
                pass
        elif client_streaming:
            channel.stream_unary(method, **ident)(iter([payload]), timeout=3)
        elif server_streaming:
            for _ in channel.unary_stream(method, **ident)(payload, timeout=3):
                pass
        else:
            channel.unary_unary(method, **ident)(payload, timeout=3)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_every_grpc_method_rejects_undecodable_bytes(mesh: Mesh, service: str) -> None:
    address = mesh.member(service).grpc or ""
    methods = _methods(address)
    own = [m for m in methods if not m[0].startswith(("/grpc.health.", "/grpc.reflection."))]
    assert own, f"{service} reflects no methods of its own"
    assert any(m[0].startswith("/grpc.health.v1.Health/") for m in methods)
    with grpc.insecure_channel(address) as channel:
        for method, cs, ss in methods:
            if method.startswith("/grpc.reflection."):
                continue  # grpcio's own reflection servicer, not kvmesh's to answer
            code = _call(channel, method, cs, ss, UNDECODABLE)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method}: undecodable bytes -> {code}"
            empty = _call(channel, method, cs, ss, b"")
            assert empty not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), f"{method}: empty message -> {empty}"
    log = Path(mesh.member(service).log_path).read_text(errors="replace")
    assert "undecodable request method=" in log  # one warning line per bad call...
    assert "Traceback" not in log  # ...and no traceback


def _routes(app: Any) -> list[tuple[str, set[str]]]:
    return [(route.path, set(route.methods or ())) for route in app.routes]


def _router_routes() -> list[tuple[str, set[str]]]:
    return _routes(RouterHttpApi(RouterConfig(), None, lambda: None).app())  # type: ignore[arg-type]


def _engine_routes() -> list[tuple[str, set[str]]]:
    # The real state type with its defaults (route table only: no engine or renderer is touched).
    state = ServerState(None, None, "m", 2048, "", 0)  # type: ignore[arg-type]
    return _routes(EngineHttpApi(state).app())


@pytest.mark.parametrize("target", ["router", "engine-0"])
def test_every_http_route_answers_malformed_input_with_a_4xx(mesh: Mesh, target: str) -> None:
    base = mesh.member(target).http or ""
    routes = _router_routes() if target == "router" else _engine_routes()
    assert len(routes) >= 4
    with httpx.Client(timeout=30) as client:
        for path, methods in routes:
            if "POST" in methods:
                strict = path.startswith("/v1/") or path == "/tokenize"  # an OpenAI/vLLM JSON body is required
                for name, body, headers in BAD_JSON_BODIES:
                    reply = client.post(base + path, content=body, headers=headers)
                    if not strict:  # admin/debug routes with an optional body: any input, never a 5xx
                        assert reply.status_code < 500, (path, name, reply.status_code, reply.text[:300])
                        continue
                    assert 400 <= reply.status_code < 500, (path, name, reply.status_code, reply.text[:300])
                    assert reply.json()["error"]["message"], (path, name)
                if strict:
                    wrong_type = client.post(base + path, content=b'{"model": "m"}', headers={"content-type": "text/plain"})
                    assert wrong_type.status_code < 500, (path, "text/plain", wrong_type.status_code)
            other = "DELETE"
            assert client.request(other, base + path).status_code == 405, (path, other)
            if "GET" in methods:
                reply = client.get(base + path, params={"x": "\x00\xff", "model": "{" * 50})
                assert reply.status_code < 500 or (path == "/health" and reply.status_code == 503), (path, reply.status_code)
        unknown = client.post(base + "/v1/nope", content=UNDECODABLE)
        assert unknown.status_code == 404


def test_metrics_endpoints_never_5xx_on_junk(mesh: Mesh) -> None:
    with httpx.Client(timeout=10) as client:
        for member in mesh.members:
            if member.metrics is None:
                continue
            for method, url in (("GET", member.metrics + "?name[]=%ff"), ("POST", member.metrics), ("GET", member.metrics + "/../x")):
                reply = client.request(method, url, content=UNDECODABLE if method == "POST" else None)
                assert reply.status_code < 500, (member.name, method, url, reply.status_code)


def test_router_grpc_front_door_maps_bad_requests(mesh: Mesh) -> None:
    """Well-formed protobuf with bad values goes through the same table as HTTP."""
    from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(mesh.member("router").grpc or "") as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        cases = [
            (router_pb2.CompletionRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT),  # no prompt
            (router_pb2.CompletionRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND),
            (router_pb2.CompletionRequest(model=MODEL, prompt="x", max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for request, expected in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(request, timeout=10)
            assert info.value.code() == expected, (request, info.value.code())


def test_router_front_doors_share_one_size_bound(mesh: Mesh) -> None:
    """A prompt over grpcio's 4 MiB default but under ``max_request_body_bytes`` (32 MiB) is read by both front
    doors and answered alike (the engine's context-length 400 / INVALID_ARGUMENT); one over the bound is HTTP 413
    and gRPC RESOURCE_EXHAUSTED (before: gRPC refused anything over 4 MiB the HTTP front door took)."""
    from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc

    router = mesh.member("router")
    big = "hello " * (5 * 1024 * 1024 // 6)  # ~5 MiB of text: far past the model's context
    http = httpx.post(f"{router.http}/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1},
                      timeout=60)
    assert http.status_code == 400, http.text
    huge = "x" * (33 * 1024 * 1024)
    assert httpx.post(f"{router.http}/v1/completions", json={"model": MODEL, "prompt": huge},
                      timeout=60).status_code == 413
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(router.grpc or "", options=options) as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        for prompt, expected in ((big, grpc.StatusCode.INVALID_ARGUMENT), (huge, grpc.StatusCode.RESOURCE_EXHAUSTED)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt=prompt, max_tokens=1), timeout=60)
            assert info.value.code() == expected, info.value.details()
