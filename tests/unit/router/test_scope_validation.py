"""The router carries a request's key scope: ``cache_salt`` from the body, the LoRA adapter named by
``model`` (vLLM's API: an adapter is served under its own name), and a data-parallel rank header."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidRequest, UnknownModel
from kvmesh.types import Endpoint, EndpointId, data_parallel_rank_of, dp_endpoint_id
from services.router.catalog import ModelCatalog
from services.router.validation import RequestKind, validate_request

BASE = Endpoint(EndpointId("a:1"), "http://a:1", "llama", labels={"lora_adapters": "sql, chat-ft"})
OTHER = Endpoint(EndpointId("b:1"), "http://b:1", "qwen")
CATALOG = ModelCatalog.from_endpoints([BASE, OTHER])


def test_adapter_names_map_to_their_base_model() -> None:
    assert CATALOG.base_model("sql") == "llama" and CATALOG.base_model("chat-ft") == "llama"
    assert CATALOG.base_model("llama") is None and CATALOG.names() == ["llama", "qwen"]
    request = validate_request(RequestKind.COMPLETION, {"model": "sql", "prompt": "hi"}, CATALOG, 100)
    assert (request.model, request.lora_name, request.cache_salt) == ("llama", "sql", None)
    assert request.body["model"] == "sql"  # forwarded unchanged: the engine serves the adapter
    with pytest.raises(UnknownModel):
        validate_request(RequestKind.COMPLETION, {"model": "nope", "prompt": "hi"}, CATALOG, 100)


@pytest.mark.parametrize("salt", ["", 5, ["x"]])
def test_cache_salt_must_be_a_non_empty_string(salt: object) -> None:
    with pytest.raises(InvalidRequest, match="cache_salt"):
        validate_request(RequestKind.COMPLETION, {"model": "qwen", "prompt": "hi", "cache_salt": salt}, CATALOG, 100)


def test_cache_salt_is_carried() -> None:
    request = validate_request(RequestKind.CHAT, {"model": "qwen", "messages": [{"role": "user", "content": "hi"}],
                                                  "cache_salt": "tenant-a"}, CATALOG, 100)
    assert (request.model, request.lora_name, request.cache_salt) == ("qwen", None, "tenant-a")


def test_data_parallel_rank_ids_round_trip() -> None:
    assert dp_endpoint_id("h:1", None) == dp_endpoint_id("h:1", 0) == "h:1"
    assert dp_endpoint_id("h:1", 2) == "h:1#dp2" and data_parallel_rank_of("h:1#dp2") == 2
    assert data_parallel_rank_of("h:1") is None
    ep = Endpoint(dp_endpoint_id("h:1", 2), "http://h:1", "m", data_parallel_rank=2)
    assert Endpoint.from_json(ep.to_json()) == ep
    legacy = '{"id": "h:1", "url": "http://h:1", "model": "m"}'  # registrations written before the field
    assert Endpoint.from_json(legacy).data_parallel_rank is None
