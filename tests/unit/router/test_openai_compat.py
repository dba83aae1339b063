"""Issue 7, pure parts: which headers reach the engine, the pool key, model memory (503 vs 404), request shapes."""

from __future__ import annotations

import pytest

from kvmesh import errors
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog, ModelMemory
from services.router.config import RouterConfig
from services.router.headers import forwarded_headers
from services.router.http_errors import http_error
from services.router.validation import ModelUnavailable, RequestKind, resolve_model, validate_request

CLIENT = [
    ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "5"), ("TE", "trailers"), ("Upgrade", "h2c"),
    ("Host", "router"), ("Content-Length", "10"), ("Accept-Encoding", "gzip"), ("traceparent", "00-a-b-01"),
    ("x-request-id", "r1"), ("x-data-parallel-rank", "3"), ("x-kvmesh-priority", "5"),
    ("x-gateway-inference-fairness-id", "t"), ("x-llm-d-inference-objective", "critical"), ("x-slo-ttft-ms", "10"),
    ("x-api-key", "sk-1234567890"), ("Cookie", "s=1"), ("Proxy-Authorization", "Basic x"),
    ("Authorization", "Bearer sk-client-0001"),
    ("User-Agent", "OpenAI/Python"), ("OpenAI-Organization", "org"), ("x-stainless-lang", "python"), ("baggage", "k=v"),
]


def test_only_end_to_end_non_kvmesh_headers_pass() -> None:
    passed = dict(forwarded_headers(CLIENT, pass_authorization=False))
    assert passed == {"user-agent": "OpenAI/Python", "openai-organization": "org", "x-stainless-lang": "python",
                      "baggage": "k=v"}
    assert dict(forwarded_headers(CLIENT, pass_authorization=True))["authorization"] == "Bearer sk-client-0001"


def test_pool_key_wins_over_default_and_is_secret() -> None:
    config = RouterConfig(etcd_endpoints=[], engine_api_key="sk-default-1", engine_api_keys={"a": "sk-pool-a-1"})
    assert config.engine_key_for("a") == "sk-pool-a-1" and config.engine_key_for("b") == "sk-default-1"
    assert "sk-pool-a-1" not in config.dump_yaml() and RouterConfig(etcd_endpoints=[]).engine_key_for("a") is None


def _ep(port: int, model: str) -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model=model, labels={})


def test_model_memory_503_then_404_after_expiry() -> None:
    memory = ModelMemory(60.0)
    memory.observe(ModelCatalog.from_endpoints([_ep(1, "a"), _ep(2, "b")]), now=0.0)
    catalog = memory.observe(ModelCatalog.from_endpoints([_ep(2, "b")]), now=10.0)
    with pytest.raises(ModelUnavailable):
        resolve_model("a", catalog)
    with pytest.raises(errors.UnknownModel):
        resolve_model("never", catalog)
    assert memory.next_expiry() == 70.0
    with pytest.raises(errors.UnknownModel):
        resolve_model("a", memory.current(catalog, 70.0))
    assert resolve_model("a", memory.observe(ModelCatalog.from_endpoints([_ep(3, "a")]), 11.0)) == ("a", None)
    gone = memory.observe(ModelCatalog(), 12.0)  # every endpoint gone: both remembered, still 503
    with pytest.raises(ModelUnavailable):
        resolve_model("b", gone)


@pytest.mark.parametrize("status", [429, 503])
def test_every_429_and_503_carries_retry_after(status: int) -> None:
    exc = ModelUnavailable("x") if status == 503 else errors.QueueFull("x")
    assert http_error(exc, 2).headers == {"retry-after": "2"}


CATALOG = ModelCatalog.from_endpoints([Endpoint(id=EndpointId("h:1"), url="http://h:1", model="m",
                                                labels={"max_model_len": "4096"})])


@pytest.mark.parametrize(("prompt", "n", "count", "estimate"), [
    (["ab", "cd"], 1, 2, 4), ([[1, 2, 3], [1, 2, 4]], 1, 2, 6), ("abcd", 2, 1, 2), ([[7]], 3, 1, 1),
])
def test_batches_and_n_are_sized_prompts_times_n(prompt: object, n: int, count: int, estimate: int) -> None:
    routed = validate_request(RequestKind.COMPLETION, {"model": "m", "prompt": prompt, "n": n, "max_tokens": 5}, CATALOG, 10_000)
    assert (routed.prompt_count, routed.n, routed.prompt_tokens_estimate) == (count, n, estimate)
    assert routed.admission_max_tokens == 5 * n * count


def test_chat_text_parts_join_with_newline_and_other_parts_pass() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]
    routed = validate_request(RequestKind.CHAT, {"model": "m", "messages": [{"role": "user", "content": content}]}, CATALOG, 10)
    assert routed.messages == (("user", "a\nb"),)


def test_embeddings_and_responses_validate() -> None:
    emb = validate_request(RequestKind.EMBEDDINGS, {"model": "m", "input": ["a", "b"]}, CATALOG, 10)
    assert emb.prompt_count == 2
    resp = validate_request(RequestKind.RESPONSES, {"model": "m", "input": "hi", "instructions": "be brief",
                                                    "max_output_tokens": 7}, CATALOG, 100)
    assert resp.messages == (("system", "be brief"), ("user", "hi")) and resp.max_tokens == 7
