"""The simulator's routes as methods of :class:`EngineHttpApi`, in process over ASGI (no port, no etcd).

The process-level behaviour (real ports, ZMQ, etcd, disconnects) is in
``tests/integration/test_engine_simulator.py``; this checks the route table and the response shapes.
"""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.routing import Route

from engine_simulator.app import EngineSimulator
from engine_simulator.server import EngineHttpApi, ServerState

MODEL = "tiny"
MAX_MODEL_LEN = 512

ROUTES = {
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions/render", "POST"),
    ("/v1/chat/completions/render", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/responses/{response_id}/cancel", "POST"),
    ("/v1/models", "GET"),
    ("/health", "GET"),
    ("/metrics", "GET"),
    ("/reset_prefix_cache", "POST"),
    ("/debug/kv_cache", "GET"),
    ("/debug/kv_events/drop", "POST"),
}


def test_route_table_is_the_documented_one(sim: EngineSimulator) -> None:
    api = EngineHttpApi(ServerState(None, sim.renderer, MODEL, MAX_MODEL_LEN, "", 0))  # type: ignore[arg-type]
    routes = {(r.path, m) for r in api.app().routes if isinstance(r, Route) for m in (r.methods or ()) if m != "HEAD"}
    assert routes == ROUTES


async def test_debug_kv_cache_reports_the_exact_cached_hashes(client: httpx.AsyncClient, sim: EngineSimulator) -> None:
    reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there " * 40, "max_tokens": 1})
    assert reply.status_code == 200
    body = (await client.get("/debug/kv_cache")).json()
    assert body["block_hashes"] == sim.core.cache.cached_hashes() and body["block_hashes"]
    assert (await client.post("/debug/kv_events/drop", json={"count": 1})).status_code == 400  # publishes nothing


async def test_completion_and_stream_shapes(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 3})
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"]["completion_tokens"] == 3 and "cached_tokens" in body["usage"]["prompt_tokens_details"]
    assert body["choices"][0]["finish_reason"] == "length"

    reply = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "The model `other` does not exist."),
        ("/v1/completions", {"model": MODEL}, 400, "'prompt' is required"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be at least 1, got 0."),
        ("/tokenize", {"model": MODEL}, 400, "either 'prompt' or 'messages' is required"),
        ("/v1/chat/completions/render", {"model": "other", "messages": []}, 404, "does not exist"),
    ],
    ids=["unknown-model", "no-prompt", "n", "tokenize-empty", "render-unknown-model"],
)
async def test_errors_are_vllm_bodies(
    client: httpx.AsyncClient, path: str, body: dict[str, object], status: int, fragment: str
) -> None:
    reply = await client.post(path, json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["param"] == ("model" if status == 404 else None)


async def test_bad_json_is_400(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", content=b"{nope")
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]


async def test_models_health_metrics_render_and_reset(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/health")).status_code == 200
    metrics = await client.get("/metrics")
    assert "vllm:num_requests_running" in metrics.text
    render = (await client.post("/v1/completions/render", json={"model": MODEL, "prompt": "abc"})).json()
    assert isinstance(render, list) and render[0]["count"] == len(render[0]["token_ids"])
    tokens = (await client.post("/tokenize", json={"model": MODEL, "prompt": "abc"})).json()
    assert tokens["tokens"] == render[0]["token_ids"] and tokens["max_model_len"] == MAX_MODEL_LEN
    assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
