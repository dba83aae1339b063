"""``kvmesh up``/``replay`` hints carry a key of the router's tenants that limits a replay least
(``kvmesh_cli.mesh.tenant_api_key``; the tenants as the router reads them from ``KVMESH_ROUTER_TENANTS``)."""

from __future__ import annotations

import json

import pytest

from kvmesh_cli.mesh import tenant_api_key


def _env(tenants: object) -> dict[str, str]:
    return {"KVMESH_ROUTER_TENANTS": json.dumps(tenants)}


@pytest.mark.parametrize(("tenants", "key"), [
    # a rate-limited first tenant is passed over for an unlimited one (was: always the first tenant's key)
    ([{"name": "slow", "api_keys": ["sk-slow-0001"], "rate_per_second": 1, "burst": 1},
      {"name": "open", "api_keys": ["sk-open-0001", "sk-open-0002"]}], "sk-open-0001"),
    # a concurrency cap counts after the rate: the uncapped one wins
    ([{"name": "capped", "api_keys": ["sk-capped-01"], "max_concurrency": 2},
      {"name": "free", "api_keys": ["sk-free-0001"]}], "sk-free-0001"),
    # all limited: the highest rate
    ([{"name": "a", "api_keys": ["sk-aaaa-0001"], "rate_per_second": 5},
      {"name": "b", "api_keys": ["sk-bbbb-0001"], "rate_per_second": 50}], "sk-bbbb-0001"),
    # equal limits: the higher max_priority, then the first
    ([{"name": "low", "api_keys": ["sk-low-00001"]}, {"name": "hi", "api_keys": ["sk-hi-000001"], "max_priority": 10}],
     "sk-hi-000001"),
    ([{"name": "one", "api_keys": ["sk-one-00001"]}, {"name": "two", "api_keys": ["sk-two-00001"]}], "sk-one-00001"),
    # odd values are read as no limit, never an error
    ([{"name": "odd", "api_keys": ["sk-odd-00001"], "rate_per_second": "fast", "max_concurrency": True}],
     "sk-odd-00001"),
    ([{"name": "nokeys", "api_keys": []}, "junk", {"name": "k", "api_keys": ["sk-k-0000001"]}], "sk-k-0000001"),
])
def test_the_least_limited_tenant_s_key(tenants: object, key: str) -> None:
    assert tenant_api_key(_env(tenants)) == key


@pytest.mark.parametrize("raw", ["", "{not yaml: [", "[]", '{"name": "x"}', '[{"name": "x", "api_keys": [7]}]'])
def test_no_key_when_none_can_be_read(raw: str) -> None:
    assert tenant_api_key({"KVMESH_ROUTER_TENANTS": raw}) is None
