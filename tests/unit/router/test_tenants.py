"""Tenants bound by API keys, the llm-d/GIE headers, and the 401/400/429 answers (router side of issue 12)."""

from __future__ import annotations

import pytest

from kvmesh import errors
from services.router.config import RouterConfig
from services.router.http_app import RouterHttpApi, request_meta
from services.router.tenants import TenantDirectory, TenantSpec, api_key_from_headers

KEY_A = "sk-tenant-a-0001"
KEY_B = "sk-tenant-b-0001"


def directory(require: bool = False) -> TenantDirectory:
    return TenantDirectory(
        [
            TenantSpec(name="a", api_keys=[KEY_A], max_priority=10, rate_per_second=5, burst=10, max_concurrency=3),
            TenantSpec(name="b", api_keys=[KEY_B], fairness_id="team-b", max_priority=-1),
        ],
        default_flow_id="default", require_api_key=require,
    )


CONFIG = RouterConfig(etcd_endpoints=[])


@pytest.mark.parametrize(
    ("headers", "flow", "priority"),
    [
        ({"authorization": f"Bearer {KEY_A}"}, "a", 0),
        ({"authorization": f"Bearer {KEY_A}", "x-kvmesh-priority": "50"}, "a", 10),
        ({"authorization": f"bearer {KEY_A}", "x-gateway-inference-objective": "critical"}, "a", 10),
        ({"x-api-key": KEY_A, "x-kvmesh-priority": "-20"}, "a", -20),
        ({"authorization": f"Bearer {KEY_A}", "x-gateway-inference-fairness-id": "someone-else"}, "a", 0),
        ({"authorization": f"Bearer {KEY_B}"}, "team-b", -1),
        ({"authorization": f"Bearer {KEY_B}", "x-kvmesh-priority": "100"}, "team-b", -1),
        ({}, "default", 0),
        ({"x-kvmesh-priority": "10", "x-gateway-inference-fairness-id": "spoof"}, "default", 0),
        ({"x-kvmesh-priority": "-10"}, "default", -10),
    ],
    ids=["key", "capped", "objective-capped", "x-api-key-lower", "fairness-header-ignored", "fairness-id",
         "negative-max", "no-key", "no-key-capped", "no-key-lower"],
)
def test_binding(headers: dict[str, str], flow: str, priority: int) -> None:
    meta = request_meta(headers, CONFIG, tenants=directory())
    assert (meta.flow_id, meta.priority) == (flow, priority)


def test_quotas_travel_with_the_tenant() -> None:
    meta = request_meta({"authorization": f"Bearer {KEY_A}"}, CONFIG, tenants=directory())
    assert meta.admit_options is not None
    assert (meta.admit_options.rate_per_second, meta.admit_options.burst, meta.admit_options.max_concurrency) == (5, 10, 3)


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": "Bearer sk-unknown-key-0"},
        {"authorization": "Basic dXNlcjpwYXNz"},
        {"authorization": "Bearer"},
        {"authorization": "Bearer short"},
        {"authorization": "Bearer sk-has space-in-it"},
        {"x-api-key": "sk-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9"},
    ],
    ids=["unknown", "basic", "empty", "too-short", "space", "non-ascii"],
)
def test_bad_keys_are_401(headers: dict[str, str]) -> None:
    with pytest.raises(errors.Unauthenticated):
        request_meta(headers, CONFIG, tenants=directory())


def test_required_key() -> None:
    with pytest.raises(errors.Unauthenticated, match="required"):
        request_meta({}, CONFIG, tenants=directory(require=True))


def test_open_mode_trusts_headers_and_ignores_authorization() -> None:
    headers = {"authorization": "Bearer whatever", "x-gateway-inference-fairness-id": "t", "x-kvmesh-priority": "7"}
    meta = request_meta(headers, CONFIG)
    assert (meta.flow_id, meta.priority) == ("t", 7)


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"x-gateway-inference-fairness-id": "x" * 257}, "at most 256"),
        ({"x-llm-d-inference-fairness-id": "x" * 300}, "at most 256"),
        ({"x-gateway-inference-objective": "2147483648"}, "int32"),
        ({"x-gateway-inference-objective": "vip"}, "unknown inference objective"),
        ({"x-slo-ttft-ms": "0"}, "milliseconds"),
        ({"x-slo-ttft-ms": "fast"}, "milliseconds"),
        ({"x-kvmesh-queue-ttl-ms": "3600001"}, "milliseconds"),
    ],
    ids=["fairness-too-long", "llm-d-fairness-too-long", "objective-range", "objective-name", "slo-zero", "slo-word",
         "ttl-range"],
)
def test_bad_headers_are_400(headers: dict[str, str], needle: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=needle):
        request_meta(headers, CONFIG)


def test_slo_and_ttl_headers() -> None:
    meta = request_meta({"x-slo-ttft-ms": "250", "x-kvmesh-queue-ttl-ms": "1500"}, CONFIG)
    assert meta.admit_options is not None
    assert (meta.admit_options.ttft_slo_seconds, meta.admit_options.ttl_seconds) == (0.25, 1.5)
    assert request_meta({"x-llm-d-inference-fairness-id": "x" * 256}, CONFIG).flow_id == "x" * 256


def test_directory_validates() -> None:
    with pytest.raises(ValueError, match="another tenant"):
        TenantDirectory([TenantSpec(name="a", api_keys=[KEY_A]), TenantSpec(name="b", api_keys=[KEY_A])])
    with pytest.raises(ValueError, match="default_priority"):
        TenantDirectory([TenantSpec(name="a", api_keys=[KEY_A], max_priority=0, default_priority=5)])
    assert api_key_from_headers({}) is None


@pytest.mark.parametrize(
    ("exc", "status", "reason", "retry_after"),
    [
        (errors.AdmissionTTLExpired("waited", 0.0), 429, "rejected-ttl-expired", "2"),
        (errors.QueueFull("full"), 429, "rejected-saturated", "2"),
        (errors.Shed("shed"), 429, "rejected-shed", "2"),
        (errors.RateLimited("slow down", 4.2), 429, "rejected-rate-limited", "5"),
        (errors.Unauthenticated("incorrect API key provided"), 401, None, None),
        (errors.NoEndpointsAvailable("no endpoint serves model 'm'"), 503, None, "any"),
    ],
    ids=["ttl", "queue-full", "shed", "rate", "401", "503"],
)
def test_http_mapping(exc: Exception, status: int, reason: str | None, retry_after: str | None) -> None:
    api = RouterHttpApi(RouterConfig(etcd_endpoints=[], retry_after_seconds=2), flow=None, catalog=lambda: None)  # type: ignore[arg-type]
    response = api.error_response(exc, "rid")
    assert response.status_code == status
    assert response.headers.get("x-llm-d-request-dropped-reason") == reason
    if retry_after != "any":  # 503's retry-after is the router's degraded-mode business
        assert response.headers.get("retry-after") == retry_after
    assert b'"error"' in response.body and b'"message"' in response.body
