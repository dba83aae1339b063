"""cache_salt and LoRA adapters are part of kvmesh's block keys, end to end through a real mesh.

Engines are vLLM-personality simulators serving LoRA adapter ``sql`` (vLLM 0.32's extra keys:
``("lora", name, path)`` on every block, ``("cache_salt", salt)`` on the first, published untagged
in ``BlockStored.extra_keys`` with ``lora_id``/``lora_name``). The router carries the OpenAI body's
``cache_salt`` and the adapter named by ``model`` into epp's ``PickRequest``; epp passes them to
kv_indexer's ``Score``; kv_indexer keys the engines' events in the same scope. A tenant's salted
prefix never scores (nor routes, nor hits the cache) for another tenant, another adapter or the
base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.mesh_pool import BLOCK, Pool, cached, mesh_pool, prompt

pytestmark = pytest.mark.integration


@pytest.fixture
def pool(start_service, etcd: str, run_dir: Path) -> Iterator[Pool]:  # type: ignore[no-untyped-def]
    with mesh_pool(start_service, etcd, run_dir, [("vllm", ["--lora-adapters", "sql"])] * 2) as p:
        yield p


def _prefix_scores(reply) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {b.endpoint_id: b.scores["prefix"] for b in reply.breakdown}


def test_salted_prefix_never_scores_for_another_tenant(pool: Pool) -> None:
    prefix = prompt(1, 8)
    first = pool.complete(prefix + [5, 6, 7], cache_salt="tenant-a")
    holder = first.headers["x-kvmesh-endpoint"]
    pool.wait_score(prefix, holder, lambda n: n >= 8, "the indexer to learn tenant-a's prefix", cache_salt="tenant-a")

    # request side and event side agree only within the scope
    assert pool.score(prefix) == {}
    assert pool.score(prefix, cache_salt="tenant-b") == {}
    assert pool.score(prefix, lora_name="sql") == {}
    assert pool.score(prefix, lora_name="sql", cache_salt="tenant-a") == {}
    # epp: the prefix scorer sees tenant-a's blocks only for tenant-a
    picked = pool.pick(prefix + [9], cache_salt="tenant-a")
    assert picked.target.id == holder and _prefix_scores(picked)[holder] > 0
    assert set(_prefix_scores(pool.pick(prefix + [9], cache_salt="tenant-b")).values()) == {0.0}
    assert set(_prefix_scores(pool.pick(prefix + [9])).values()) == {0.0}

    # through the router: tenant-a follows its prefix and hits the cache ...
    again = pool.complete(prefix + [8, 8, 8], cache_salt="tenant-a")
    assert again.headers["x-kvmesh-endpoint"] == holder and cached(again) >= 8 * BLOCK
    # ... tenant-b, with the very same prompt, hits nothing wherever it lands
    other = pool.complete(prefix + [8, 8, 8], cache_salt="tenant-b")
    assert cached(other) == 0
    # a bad salt is the client's error
    bad = httpx.post(f"{pool.router_http}/v1/completions",
                     json={"model": "sim", "prompt": prefix, "max_tokens": 1, "cache_salt": ""}, timeout=10)
    assert bad.status_code == 400 and "cache_salt" in bad.text


def test_lora_adapter_prefix_is_its_own(pool: Pool) -> None:
    prefix = prompt(2, 8)
    first = pool.complete(prefix + [5, 6, 7], model="sql")  # the adapter named as the model (vLLM's API)
    holder = first.headers["x-kvmesh-endpoint"]
    pool.wait_score(prefix, holder, lambda n: n >= 8, "the indexer to learn the adapter's prefix", lora_name="sql")
    assert pool.score(prefix) == {}  # the base model has none of it
    again = pool.complete(prefix + [8, 8, 8], model="sql")
    assert again.headers["x-kvmesh-endpoint"] == holder and cached(again) >= 8 * BLOCK
    base = pool.complete(prefix + [8, 8, 8])
    assert cached(base) == 0
    pool.wait_score(prefix, base.headers["x-kvmesh-endpoint"], lambda n: n >= 8, "the base model's own copy")
    assert set(pool.score(prefix, lora_name="sql")) == {holder}
