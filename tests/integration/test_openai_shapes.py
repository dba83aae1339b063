"""Issue 7 (router side), end to end: real etcd, flow_control, epp and routers in front of simulated
engines held to vLLM 0.32's OpenAI server (``--api-key``, batched prompts, ``n``, embeddings,
responses, tokenize/detokenize; ``engine_simulator/openai_extras.py``).

Cases and siblings tested here:
* case 1: engines started with ``--api-key``: a keyed router (``engine_api_keys``) serves clients
  whatever they send as ``Authorization``; an open-mode router passes the client's key (200 with the
  right one, the engine's 401 as an OpenAI error without it); ``/tokenize`` needs no key (vLLM
  checks ``/v1/*`` only); the registration sidecar refuses to register an engine whose
  ``/v1/models`` answers 401 and registers it with ``max_model_len`` once given the key.
* case 4: a model whose only endpoint's lease expired is 503 + ``retry-after``; a name never served 404.
* case 5: ``prompt: ["a", "b"]``, ``prompt: [[1,2,3],[1,2,4]]``, ``n: 2`` on completions and chat,
  streamed and not: choices indexed ``prompt * n + i``, usage summed as the engine sums it.
* also: ``/v1/models`` aggregated, ``/v1/embeddings`` (pooling pool) and ``/v1/responses`` (generate
  pool) passed, each 404 on the pool that does not serve it; ``/tokenize``, ``/detokenize`` passed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvmesh.membership import EndpointWatcher
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration

KEY = "sk-engine-secret-0001"
GEN, EMB, SOLO = "sim", "emb", "solo"


@dataclass
class Shapes:
    keyed: str  # router presenting the pool key
    open: str  # router in open mode (client's Authorization passes)
    engines: dict[str, str]  # name -> url
    procs: dict[str, ManagedProcess]


def _engine(run_dir: Path, etcd: str, name: str, model: str, *flags: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = ManagedProcess(
        f"engine-{name}-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", model,
                      "--block-size-tokens", "16", "--num-gpu-blocks", "256", "--max-model-len", "2048",
                      "--etcd-endpoints", etcd, "--lease-ttl-seconds", "2", "--time-scale", "200", *flags),
        run_dir / f"engine-{name}-{port}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/health", 60)
    return proc, url


@pytest.fixture
def shapes(start_service, etcd: str, run_dir: Path) -> Iterator[Shapes]:  # type: ignore[no-untyped-def]
    procs: dict[str, ManagedProcess] = {}
    engines: dict[str, str] = {}
    try:
        for name, model, flags in (("gen", GEN, ()), ("emb", EMB, ("--runner", "pooling")), ("solo", SOLO, ())):
            procs[name], engines[name] = _engine(run_dir, etcd, name, model, "--api-key", KEY, *flags)
        _, flow = start_service("flow_control")
        _, epp = start_service("epp", "--scheduling-config", "round-robin")
        keyed_port, open_port = free_port(), free_port()
        start_service("router", "--http-port", str(keyed_port), "--flow-control-address", flow, "--epp-address", epp,
                      "--engine-api-keys", json.dumps({GEN: KEY, EMB: KEY, SOLO: KEY}))
        start_service("router", "--http-port", str(open_port), "--flow-control-address", flow, "--epp-address", epp)
        keyed, open_ = f"http://127.0.0.1:{keyed_port}", f"http://127.0.0.1:{open_port}"
        for router in (keyed, open_):
            wait_until(lambda r=router: {m["id"] for m in httpx.get(f"{r}/v1/models").json()["data"]}, 30,
                       "the router to list every model", until=lambda ids: {GEN, EMB, SOLO} <= ids)
        yield Shapes(keyed, open_, engines, procs)
    finally:
        for proc in procs.values():
            proc.stop()


def _post(url: str, body: dict, **headers: str) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(url, json=body, headers=headers, timeout=30)


def _sse(reply: httpx.Response) -> list[dict]:  # type: ignore[type-arg]
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_engine_api_key_case_1(shapes: Shapes) -> None:
    body = {"model": GEN, "prompt": "hello", "max_tokens": 2}
    gen = shapes.engines["gen"]
    # the simulator holds vLLM's rule: /v1/* needs the key, /tokenize and /health do not
    assert _post(gen + "/v1/completions", body).status_code == 401
    assert _post(gen + "/v1/completions", body, authorization=f"Bearer {KEY}").status_code == 200
    assert _post(gen + "/tokenize", {"model": GEN, "prompt": "hello"}).status_code == 200
    # keyed router: the pool key is presented whatever the client sends (its own key never reaches the engine)
    for auth in ({}, {"authorization": "Bearer client-key-123"}, {"authorization": f"Bearer {KEY}"}):
        reply = _post(shapes.keyed + "/v1/completions", body, **auth)
        assert reply.status_code == 200, reply.text
    # open router: the client's Authorization is the engine's business (the literal case 1)
    assert _post(shapes.open + "/v1/completions", body, authorization=f"Bearer {KEY}").status_code == 200
    refused = _post(shapes.open + "/v1/completions", body, authorization="Bearer wrong-key-000")
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error" and "refused the credentials" in refused.json()["error"]["message"]


def test_batched_prompts_and_n_case_5(shapes: Shapes) -> None:
    router = shapes.keyed
    for prompt, n in ((["a", "b"], 1), ([[1, 2, 3], [1, 2, 4]], 1), ("one prompt", 2), (["x y", "z"], 2)):
        body = {"model": GEN, "prompt": prompt, "max_tokens": 3, "n": n, "ignore_eos": True}
        reply = _post(router + "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        prompts = len(prompt) if isinstance(prompt, list) else 1
        assert [c["index"] for c in answer["choices"]] == list(range(prompts * n))
        assert answer["usage"]["completion_tokens"] == 3 * prompts * n
        direct = _post(shapes.engines["gen"] + "/v1/completions", body, authorization=f"Bearer {KEY}").json()
        assert answer["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]  # each prompt counted once
        assert set(answer) == set(direct) and set(answer["choices"][0]) == set(direct["choices"][0])
    chat = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2, "ignore_eos": True}
    reply = _post(router + "/v1/chat/completions", chat)
    assert reply.status_code == 200 and [c["index"] for c in reply.json()["choices"]] == [0, 1]
    # streamed: every choice's chunks carry its index; the usage chunk is the sum
    stream = {"model": GEN, "prompt": ["a", "b"], "n": 2, "max_tokens": 2, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    chunks = _sse(_post(router + "/v1/completions", stream))
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    chat_chunks = _sse(_post(router + "/v1/chat/completions", {**chat, "stream": True}))
    assert {c["choices"][0]["index"] for c in chat_chunks if c["choices"]} == {0, 1}


def test_other_endpoints_pass_with_the_right_status(shapes: Shapes) -> None:
    router = shapes.keyed
    models = {m["id"]: m for m in httpx.get(router + "/v1/models").json()["data"]}
    assert models[GEN]["max_model_len"] == 2048 and models[GEN]["endpoints"] == 1
    # OpenAI's models.retrieve (GET /v1/models/{model}): the same card; an unknown id is 404
    retrieved = httpx.get(f"{router}/v1/models/{GEN}")
    assert retrieved.status_code == 200 and retrieved.json() == {**models[GEN], "created": retrieved.json()["created"]}
    missing = httpx.get(router + "/v1/models/" + "no-such/model" * 50)
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]  # as an unknown model in a request
    assert len(missing.text) < 1000  # the unknown id is echoed cut to 200 characters
    emb = _post(router + "/v1/embeddings", {"model": EMB, "input": ["a", "b c"]})
    assert emb.status_code == 200, emb.text
    assert [d["index"] for d in emb.json()["data"]] == [0, 1] and emb.json()["usage"]["prompt_tokens"] > 0
    not_served = _post(router + "/v1/embeddings", {"model": GEN, "input": "a"})
    assert not_served.status_code == 404 and "does not serve /v1/embeddings" in not_served.json()["error"]["message"]
    resp = _post(router + "/v1/responses", {"model": GEN, "input": "hello", "max_output_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "response" and resp.json()["usage"]["output_tokens"] <= 2
    assert _post(router + "/v1/responses", {"model": EMB, "input": "hello"}).status_code == 404
    tok = _post(router + "/tokenize", {"model": GEN, "prompt": "hello world"})
    assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"])
    detok = _post(router + "/detokenize", {"model": GEN, "tokens": tok.json()["tokens"]})
    assert detok.status_code == 200 and "hello world" in detok.json()["prompt"]
    assert _post(router + "/tokenize", {"model": "never-served", "prompt": "x"}).status_code == 404
    assert _post(router + "/tokenize", {"prompt": "x"}).status_code == 400  # three models: 'model' is required


def test_recently_served_model_is_503_with_retry_after_case_4(shapes: Shapes) -> None:
    router = shapes.keyed
    assert _post(router + "/v1/completions", {"model": SOLO, "prompt": "hi", "max_tokens": 1}).status_code == 200
    shapes.procs["solo"].kill()  # SIGKILL: the lease is not revoked, it expires
    wait_until(lambda: {m["id"] for m in httpx.get(f"{router}/v1/models").json()["data"]}, 30,
               "the solo model's lease to expire", until=lambda ids: SOLO not in ids)
    for path, body in (("/v1/completions", {"model": SOLO, "prompt": "hi", "max_tokens": 1}),
                       ("/tokenize", {"model": SOLO, "prompt": "hi"})):
        reply = _post(router + path, body)
        assert reply.status_code == 503, reply.text
        assert int(reply.headers["retry-after"]) >= 1 and reply.json()["error"]["type"] == "service_unavailable"
    never = _post(router + "/v1/completions", {"model": "never-served", "prompt": "hi", "max_tokens": 1})
    assert never.status_code == 404 and "retry-after" not in never.headers


def test_sidecar_needs_the_engine_key_for_max_model_len(start_service, etcd: str, run_dir: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    engine = ManagedProcess(
        f"engine-side-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", "side",
                      "--max-model-len", "777", "--etcd-endpoints", "", "--api-key", KEY, "--time-scale", "200"),
        run_dir / f"engine-side-{port}.log",
    ).start()
    sidecars: list[ManagedProcess] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)

        def sidecar(*flags: str) -> ManagedProcess:
            proc = ManagedProcess(
                f"sidecar-{len(sidecars)}-{port}",
                python_module("services.registration_sidecar", "--engine-url", f"http://127.0.0.1:{port}", "--model", "side",
                              "--etcd-endpoints", etcd, "--lease-ttl-seconds", "2", "--health-interval-seconds", "0.2",
                              "--metrics-port", "0", *flags),
                run_dir / f"sidecar-{len(sidecars)}-{port}.log",
            ).start()
            sidecars.append(proc)
            return proc

        keyless = sidecar()
        wait_until(lambda: "cannot read max_model_len" in keyless.log_tail(), 30, "the keyless sidecar to refuse loudly")
        assert "401" in keyless.log_tail() and "--engine-api-key" in keyless.log_tail()
        keyless.stop()
        sidecar("--engine-api-key", KEY)
        async def labels() -> dict[str, str]:
            watcher = EndpointWatcher([etcd])
            await watcher.start()
            try:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    found = [ep for ep in watcher.snapshot().values() if ep.model == "side"]
                    if found:
                        return dict(found[0].labels)
                    await asyncio.sleep(0.2)
                return {}
            finally:
                await watcher.stop()

        assert asyncio.run(labels()).get("max_model_len") == "777"
    finally:
        for proc in sidecars:
            proc.stop()
        engine.stop()
