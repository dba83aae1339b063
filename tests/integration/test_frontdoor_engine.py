"""Issue 7, the front door and the engine behind it (simulator held to vLLM 0.32, ``make test``).

One mesh (etcd, kv_indexer, flow_control, epp ``round-robin``, router) in front of two simulated
engines started with vLLM's ``--api-key`` (``MeshSpec.engine_api_key``: the router and epp get the
pool key) and ``VLLM_ENABLE_RESPONSES_API_STORE=1``, ``max_model_len`` 256. Cases:

* an engine's 4xx before the first byte reaches the client with the engine's own message: HTTP
  (streamed and not; OpenAI error body, status kept) and the gRPC front door (400 -> INVALID_ARGUMENT,
  401 -> UNAUTHENTICATED, each with the engine's message, never an empty "internal error");
* ``/v1/responses`` with ``previous_response_id``: every follow-up (streamed or not, chained) goes to
  the engine that stored the response although epp round-robins, ``GET /v1/responses/{id}`` too; an
  id no engine holds is the engine's 404 (vLLM 0.32 checks no id form), ``cancel`` reaches the holder; once the holder leaves the pool the
  follow-up is vLLM's 404 (``invalid_request_error``, ``param`` ``response_id``);
* epp's ``/tokenize`` fallback presents the pool's engine key: through an authenticating proxy (one
  that checks every path, as gateways do; vLLM itself checks ``/v1/*`` only) it gets the engine's
  tokens with the key and a :class:`TokenizeError` naming the credentials without.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from kvmesh_cli.mesh import DEFAULT_MODEL, Mesh, MeshSpec
from services.epp.config import EppConfig
from services.epp.framework.interfaces import Candidate, SchedulingRequest
from services.epp.tokenize_client import EngineTokenizer, TokenizeError
from tests.conftest import ServiceStarter
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "sk-pool-key-frontdoor-01"
MODEL = DEFAULT_MODEL
LONG_TEXT = "hello " * 400  # ~400 tokens: over max_model_len 256, under the router's byte lower bound


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, etcd: str) -> Iterator[Mesh]:
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("frontdoor"), engines=2, etcd=etcd, policy="round-robin",
                    time_scale=50.0, max_model_len=256, block_size_tokens=16, lease_ttl_seconds=2,
                    engine_api_key=KEY, extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    with Mesh(spec) as running:
        yield running


def _post(url: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=30)


def test_engine_key_guards_the_engines_and_the_router_presents_it(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert _post(mesh.engine_urls[0] + "/v1/completions", body).json() == {"error": "Unauthorized"}
    reply = _post(mesh.router_url + "/v1/completions", body, authorization="Bearer some-client-key")
    assert reply.status_code == 200, reply.text


def test_engine_4xx_passes_through_http(mesh: Mesh) -> None:
    """The engine's 400 (prompt over its context; a token id outside its vocabulary), streamed or not:
    status and the engine's message unchanged, and who answered."""
    for stream in (False, True):
        reply = _post(mesh.router_url + "/v1/completions",
                      {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 4, "stream": stream})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert "maximum context length is 256 tokens" in error["message"] and error["code"] == 400
        assert reply.headers["x-kvmesh-endpoint"] in {u.removeprefix("http://") for u in mesh.engine_urls}
    reply = _post(mesh.router_url + "/v1/completions", {"model": MODEL, "prompt": [5, 999_999], "max_tokens": 2})
    assert reply.status_code == 400 and "out of vocabulary" in reply.json()["error"]["message"], reply.text
    chat = _post(mesh.router_url + "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 4})
    assert chat.status_code == 400 and "maximum context length" in chat.json()["error"]["message"], chat.text


def test_engine_4xx_over_grpc_keeps_status_and_message(mesh: Mesh, start_service: ServiceStarter) -> None:
    router = mesh.member("router").grpc or ""
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        for call in (stub.Complete, lambda r, timeout: list(stub.CompleteStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(router_pb2.CompletionRequest(model=MODEL, prompt=LONG_TEXT, max_tokens=4), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "maximum context length is 256 tokens" in (err.value.details() or "")
    # a router without the pool key: the engines' 401 is UNAUTHENTICATED with their message
    _, keyless = start_service("router", "--http-port", str(free_port()),
                               "--flow-control-address", mesh.member("flow_control").grpc or "",
                               "--epp-address", mesh.epp_address)
    with grpc.insecure_channel(keyless) as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        wait_until(lambda: list(stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models), 30,
                   "the keyless router to list the model", until=lambda names: MODEL in names)
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(router_pb2.CompletionRequest(model=MODEL, prompt="hi", max_tokens=2), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "Unauthorized"


def _respond(mesh: Mesh, **fields: object) -> httpx.Response:
    body = {"model": MODEL, "max_output_tokens": 3, **fields}
    return _post(mesh.router_url + "/v1/responses", body)


def _sse_response_id(reply: httpx.Response) -> str:
    for line in reply.text.splitlines():
        if line.startswith("data: ") and '"response.completed"' in line:
            return str(json.loads(line[6:])["response"]["id"])
    raise AssertionError(f"no response.completed event in {reply.text[:300]!r}")


def test_previous_response_id_goes_to_the_engine_that_stored_it(mesh: Mesh) -> None:
    first = _respond(mesh, input="Tell me about block hashes.")
    assert first.status_code == 200, first.text
    holder, rid = first.headers["x-kvmesh-endpoint"], first.json()["id"]
    # epp round-robins: without the pin every other follow-up would reach the engine that lacks it (404)
    previous = rid
    for turn in range(4):
        follow = _respond(mesh, input=f"and then {turn}?", previous_response_id=previous)
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-kvmesh-endpoint"] == holder
        assert follow.json()["previous_response_id"] == previous
        previous = follow.json()["id"]  # chained: the follow-up's own answer is pinned too
    streamed = _respond(mesh, input="streamed?", previous_response_id=previous, stream=True)
    assert streamed.status_code == 200 and streamed.headers["x-kvmesh-endpoint"] == holder, streamed.text
    streamed_id = _sse_response_id(streamed)
    after_stream = _respond(mesh, input="after the stream", previous_response_id=streamed_id)
    assert after_stream.status_code == 200 and after_stream.headers["x-kvmesh-endpoint"] == holder
    for response_id in (rid, streamed_id):
        got = httpx.get(f"{mesh.router_url}/v1/responses/{response_id}", timeout=10)
        assert got.status_code == 200 and got.json()["id"] == response_id, got.text
        assert got.headers["x-kvmesh-endpoint"] == holder
    # the other engine does not hold it: exactly the 404 the pin avoids
    other = next(u for u in mesh.engine_urls if u.removeprefix("http://") != holder)
    direct = _post(other + "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": rid},
                   authorization=f"Bearer {KEY}")
    assert direct.status_code == 404 and direct.json()["error"]["message"] == f"Response with id '{rid}' not found."
    # ids no engine holds, or malformed: the engine's own answer
    unknown = _respond(mesh, input="x", previous_response_id="resp_" + "0" * 32)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id", unknown.text
    malformed = _respond(mesh, input="x", previous_response_id="abc")  # vLLM 0.32 checks no id form: 404
    assert malformed.status_code == 404 and malformed.json()["error"]["message"] == "Response with id 'abc' not found."
    cancel = httpx.post(f"{mesh.router_url}/v1/responses/{rid}/cancel", timeout=10)
    assert cancel.status_code == 400 and cancel.headers["x-kvmesh-endpoint"] == holder  # the holder's answer
    assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert _respond(mesh, input="x", previous_response_id=7).status_code == 400
    never = httpx.get(f"{mesh.router_url}/v1/responses/resp_{'1' * 32}", timeout=10)
    assert never.status_code == 404 and never.json()["error"]["type"] == "invalid_request_error"


def test_epp_tokenize_presents_the_pool_key(mesh: Mesh) -> None:
    """epp's /tokenize fallback through a proxy that checks the key on every path."""
    engine = mesh.engine_urls[0]

    async def guarded(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        async with httpx.AsyncClient() as client:
            reply = await client.post(engine + request.url.path, content=await request.body(),
                                      headers={"content-type": "application/json"})
        return Response(reply.content, reply.status_code, media_type="application/json")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/tokenize", guarded, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 10, "the auth proxy to listen")
        proxy = Candidate(Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=MODEL,
                                   block_size_tokens=16))
        config = EppConfig.model_validate({"engine_api_keys": {MODEL: KEY}, "etcd_endpoints": []})
        request = SchedulingRequest(model=MODEL, prompt="the pool key reaches the engine")
        want = _post(engine + "/tokenize", {"model": MODEL, "prompt": request.prompt}).json()["tokens"]

        async def tokenize(key_for: object) -> list[int]:
            async with httpx.AsyncClient() as client:
                tokenizer = EngineTokenizer(client, 5.0, 0, engine_key=key_for)  # type: ignore[arg-type]
                return await tokenizer.tokenize(request, [proxy])

        assert asyncio.run(tokenize(config.engine_key_for)) == want
        with pytest.raises(TokenizeError, match="refused epp's credentials"):
            asyncio.run(tokenize(EppConfig.model_validate({"etcd_endpoints": []}).engine_key_for))
    finally:
        server.should_exit = True
        thread.join(10)


def test_follow_up_after_the_holder_left_is_vllms_404(mesh: Mesh) -> None:
    """Last in the module: it stops an engine."""
    first = _respond(mesh, input="remember me")
    assert first.status_code == 200, first.text
    holder, rid = first.headers["x-kvmesh-endpoint"], first.json()["id"]
    index = next(i for i, u in enumerate(mesh.engine_urls) if u.removeprefix("http://") == holder)
    mesh.member(f"engine-{index}").process.stop(5)

    def endpoints() -> int:
        models = httpx.get(mesh.router_url + "/v1/models", timeout=5).json()["data"]
        return next((m["endpoints"] for m in models if m["id"] == MODEL), 0)

    wait_until(endpoints, 20, "the router to see the holder leave", until=lambda n: n == 1)
    time.sleep(0.2)
    gone = _respond(mesh, input="still there?", previous_response_id=rid)
    assert gone.status_code == 404, gone.text
    error = gone.json()["error"]
    assert error["message"].startswith(f"Response with id '{rid}' not found.") and holder in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_id"
    assert httpx.get(f"{mesh.router_url}/v1/responses/{rid}", timeout=10).status_code == 404
    fresh = _respond(mesh, input="a new conversation")  # the pool still serves
    assert fresh.status_code == 200 and fresh.headers["x-kvmesh-endpoint"] != holder
