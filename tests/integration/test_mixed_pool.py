"""A mixed InferencePool: one vLLM 0.32-personality and one SGLang 0.5.23-personality simulator
behind one real mesh (etcd, kv_indexer, flow_control, epp precise-prefix, router).

The SGLang engine speaks SGLang's surface (``engine_simulator/sglang.py``): ``/generate``,
``/server_info``, ``sglang:*`` metrics (epp scrapes them), SGLang's KV-event shape (kv_indexer
indexes it). Both engines serve the OpenAI API the router forwards; prefixes cached on either
engine are scored and followed, with cache hits on both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.mesh_pool import BLOCK, MODEL, Pool, cached, mesh_pool, prompt

pytestmark = pytest.mark.integration


@pytest.fixture
def pool(start_service, etcd: str, run_dir: Path) -> Iterator[Pool]:  # type: ignore[no-untyped-def]
    with mesh_pool(start_service, etcd, run_dir, [("vllm", []), ("sglang", [])]) as p:
        yield p


def test_mixed_pool_routes_with_prefix_hits_on_both_engines(pool: Pool) -> None:
    vllm_id = next(i for i, p in pool.engines.items() if p == "vllm")
    sglang_id = next(i for i, p in pool.engines.items() if p == "sglang")

    # the SGLang engine's own surface
    info = httpx.get(f"http://{sglang_id}/server_info", timeout=5).json()
    assert info["page_size"] == BLOCK and info["version"] == "0.5.23" and info["served_model_name"] == MODEL
    metrics = httpx.get(f"http://{sglang_id}/metrics", timeout=5).text
    assert "sglang:num_running_reqs{" in metrics and "sglang:token_usage{" in metrics and "vllm:" not in metrics

    # warm each engine directly with its own prefix (SGLang through its native /generate)
    p_vllm, p_sglang = prompt(11, 8), prompt(12, 8)
    assert httpx.post(f"http://{vllm_id}/v1/completions", json={"model": MODEL, "prompt": p_vllm, "max_tokens": 2},
                      timeout=30).status_code == 200
    generated = httpx.post(f"http://{sglang_id}/generate",
                           json={"input_ids": p_sglang, "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    assert generated.status_code == 200, generated.text
    meta = generated.json()["meta_info"]
    assert meta["prompt_tokens"] == len(p_sglang) and meta["completion_tokens"] == 2
    assert meta["finish_reason"]["type"] == "length"

    # kv_indexer learned both: vLLM's events and SGLang's
    pool.wait_score(p_vllm, vllm_id, lambda n: n >= 8, "the vLLM engine's prefix")
    pool.wait_score(p_sglang, sglang_id, lambda n: n >= 7, "the SGLang engine's prefix (SGLang-format events)")

    # the router sends each follow-up to the engine holding its prefix, and it hits that cache
    for seed in range(3):
        for prefix, holder in ((p_vllm, vllm_id), (p_sglang, sglang_id)):
            reply = pool.complete(prefix + prompt(100 + seed, 1)[:5])
            assert reply.headers["x-kvmesh-endpoint"] == holder
            assert cached(reply) >= 7 * BLOCK

    # a repeat through SGLang's native API reports its cached tokens too
    again = httpx.post(f"http://{sglang_id}/generate",
                       json={"input_ids": p_sglang + [7], "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert again.json()["meta_info"]["cached_tokens"] >= 8 * BLOCK
    # and epp reads the SGLang engine's load from its sglang:* metrics
    requests_total = [line for line in httpx.get(f"http://{sglang_id}/metrics", timeout=5).text.splitlines()
                      if line.startswith("sglang:num_requests_total{")]
    assert requests_total and float(requests_total[0].rsplit(" ", 1)[1]) >= 5
