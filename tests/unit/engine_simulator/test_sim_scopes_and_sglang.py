"""The simulator's LoRA/cache_salt hashing (vLLM 0.32's extra keys) and its SGLang 0.5.23 personality,
in process over ASGI (the mixed pool through a real mesh is ``tests/integration/test_mixed_pool.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route

from engine_simulator.app import EngineSimulator, build_service
from engine_simulator.config import SimulatorConfig
from engine_simulator.engine import AsyncEngine
from engine_simulator.publisher import NullEventPublisher
from engine_simulator.scheduler import LoraAdapter, Request
from engine_simulator.server import ServerState
from engine_simulator.sglang import SGLangHttpApi, server_args
from kvmesh.clock import ScaledClock
from kvmesh.hashing import KeyScope, external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored, stored_key_scope
from services.epp.datastore import parse_vllm_metrics

MODEL = "tiny"
BLOCK = 16


def test_lora_and_salt_hash_as_vllm_0_32_and_publish_untagged_extra_keys() -> None:
    tokens = list(range(3, 3 + 3 * BLOCK))
    lora = LoraAdapter("sql", 1, "/adapters/sql")
    req = Request("r", tokens, 1, lora=lora, cache_salt="t1")
    expected = sha256_cbor_block_hashes(
        tokens, BLOCK, extra_keys=[(("lora", "sql", "/adapters/sql"), ("cache_salt", "t1")),
                                   (("lora", "sql", "/adapters/sql"),), (("lora", "sql", "/adapters/sql"),)])
    assert req.block_hashes(3, BLOCK) == [external_hash_to_int(d) for d in expected]
    assert req.event_extra_keys(0, 3) == [("sql", "t1"), ("sql",), ("sql",)]
    plain = Request("p", tokens, 1)
    assert plain.block_hashes(3, BLOCK) == [external_hash_to_int(d) for d in sha256_cbor_block_hashes(tokens, BLOCK)]
    assert set(plain.block_hashes(3, BLOCK)).isdisjoint(req.block_hashes(3, BLOCK))
    event = BlockStored(req.block_hashes(3, BLOCK), None, tokens, BLOCK, lora_id=1, lora_name="sql",
                        extra_keys=[list(k) for k in req.event_extra_keys(0, 3)])
    assert stored_key_scope(event) == (KeyScope("sql", "t1"), None)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> EngineSimulator:
    config = SimulatorConfig(model=MODEL, max_model_len=512, time_scale=10000.0, block_size_tokens=BLOCK,
                             num_gpu_blocks=64, personality="sglang", lora_adapters="sql",
                             tokenizer_path=str(tmp_path_factory.mktemp("tok")), etcd_endpoints=[])
    return build_service(config)


@pytest.fixture
async def client(sim: EngineSimulator) -> AsyncIterator[httpx.AsyncClient]:
    engine = AsyncEngine(sim.core, sim.latency, ScaledClock(sim.config.time_scale), NullEventPublisher(), sim.metrics)
    engine.start()
    state = ServerState(engine, sim.renderer, MODEL, 512, sim.tokenizer_dir, 1700000000,
                        lora_adapters=sim.lora_adapters)
    args = server_args(model=MODEL, model_path=sim.tokenizer_dir, host="127.0.0.1", port=30000, page_size=BLOCK,
                       num_pages=64, max_running_requests=8, chunked_prefill_size=2048, context_length=512,
                       kv_events_endpoint="tcp://127.0.0.1:5557", lora_paths=["sql"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=SGLangHttpApi(state, args).app()),
                                 base_url="http://sim") as c:
        yield c
    await engine.stop()


def test_sglang_routes_extend_the_shared_ones(sim: EngineSimulator) -> None:
    api = SGLangHttpApi(ServerState(None, sim.renderer, MODEL, 512, "", 0), {})  # type: ignore[arg-type]
    routes = {(r.path, m) for r in api.app().routes if isinstance(r, Route) for m in (r.methods or ()) if m != "HEAD"}
    assert {("/generate", "POST"), ("/server_info", "GET"), ("/get_server_info", "GET"), ("/model_info", "GET"),
            ("/flush_cache", "POST"), ("/v1/completions", "POST"), ("/tokenize", "POST"), ("/metrics", "GET")} <= routes
    assert sim.endpoint().labels["engine"] == "simulator-sglang" and sim.endpoint().labels["lora_adapters"] == "sql"


async def test_generate_server_info_and_metrics(client: httpx.AsyncClient) -> None:
    ids = list(range(3, 3 + 4 * BLOCK))
    first = await client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3}})
    assert first.status_code == 200, first.text
    body = first.json()
    assert len(body["output_ids"]) == 3 and isinstance(body["text"], str)
    assert body["meta_info"]["prompt_tokens"] == len(ids) and body["meta_info"]["finish_reason"]["type"] == "length"
    again = (await client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})).json()
    assert again["meta_info"]["cached_tokens"] == 3 * BLOCK  # vLLM-style cap: the last full block recomputed
    salted = (await client.post("/generate", json={"input_ids": ids, "cache_salt": "t9",
                                                    "sampling_params": {"max_new_tokens": 1}})).json()
    assert salted["meta_info"]["cached_tokens"] == 0
    lora = await client.post("/generate", json={"input_ids": ids, "lora_path": "sql", "sampling_params": {"max_new_tokens": 1}})
    assert lora.json()["meta_info"]["cached_tokens"] == 0
    assert (await client.post("/generate", json={"input_ids": ids, "lora_path": "nope"})).status_code == 404
    assert (await client.post("/generate", json={"sampling_params": {}})).status_code == 400
    stream = await client.post("/generate", json={"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2}})
    chunks = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]" and len(chunks) == 3
    info = (await client.get("/server_info")).json()
    assert info["page_size"] == BLOCK and info["version"] == "0.5.23" and info["kv_events"]["page_size"] == BLOCK
    assert (await client.get("/get_server_info")).json()["page_size"] == BLOCK
    text = (await client.get("/metrics")).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:page_size",
            "sglang:num_requests", "sglang:time_to_first_token_seconds"} <= names
    assert not any(n.startswith("vllm:") for n in names)
    sample = parse_vllm_metrics(text)  # epp reads SGLang's names
    assert sample.block_size_tokens == BLOCK and sample.num_requests_finished == 5.0
    assert 0.0 <= sample.kv_cache_usage_perc <= 1.0 and sample.num_first_tokens == 5.0
    pool = next(s.value for f in text_string_to_metric_families(text) if f.name == "sglang:max_total_num_tokens"
                for s in f.samples)
    assert pool > 0 and sample.kv_capacity_tokens == int(pool)  # SGLang's pool size, for tier-cost's admission term
