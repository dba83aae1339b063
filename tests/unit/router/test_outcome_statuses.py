"""Every 4xx the router answers because of the client counts ``outcome="invalid"`` in
``kvmesh_router_requests_total`` (a wrong method, a bad or unknown API key, an engine's 4xx passed on),
unless the status has an outcome of its own (404 not_found, 429 rejected, 499 cancelled); other 5xx
count ``error``. The router's real Starlette app over a ``RequestFlow`` (engine: ``httpx.MockTransport``),
called through httpx's ASGI transport."""

from __future__ import annotations

import json

import httpx
import pytest

from services.router import metrics
from services.router.config import RouterConfig
from services.router.http_app import RouterHttpApi
from services.router.request_flow import RequestFlow
from services.router.tenants import TenantSpec
from tests.unit.router.fakes import CATALOG, MODEL, FakeAdmission, FakePicker, outcome_count

KEY = "sk-tenant-a-0001"
CONFIG = RouterConfig(etcd_endpoints=[], tenants=[TenantSpec(name="a", api_keys=[KEY])])


def _engine(request: httpx.Request) -> httpx.Response:
    status = int(json.loads(request.content)["prompt"])  # the test names the engine's answer
    return httpx.Response(status, json={"error": {"message": "engine says no", "type": "BadRequestError",
                                                  "code": status}})


async def _call(method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None) -> int:
    flow = RequestFlow(CONFIG, lambda: CATALOG, FakeAdmission(), FakePicker(),
                       httpx.AsyncClient(transport=httpx.MockTransport(_engine)))
    app = RouterHttpApi(CONFIG, flow, lambda: CATALOG).app()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            response = await client.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}",
                                                                             **(headers or {})})
    finally:
        await flow.aclose()
    assert "error" in response.json()  # an OpenAI error body either way
    return response.status_code


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), [
    ("GET", "/v1/chat/completions", None, None, 405),
    ("PUT", "/v1/models", None, None, 405),
    ("DELETE", "/v1/completions", None, None, 405),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, {"authorization": "Bearer sk-unknown-0000"}, 401),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "403"}, None, 403),  # the engine's, passed on
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "409"}, None, 409),
], ids=["get-chat", "put-models", "delete-completions", "unknown-key", "engine-403", "engine-409"])
async def test_a_client_error_counts_invalid_not_error(method: str, path: str, body: dict | None,
                                                       headers: dict[str, str] | None, status: int) -> None:
    invalid, error = outcome_count("invalid"), outcome_count("error")
    assert await _call(method, path, body, headers) == status
    assert (outcome_count("invalid"), outcome_count("error")) == (invalid + 1, error)


def test_every_status_maps_to_its_outcome() -> None:
    Outcome = metrics.RequestOutcome
    for status in (400, 401, 402, 403, 405, 406, 408, 409, 410, 411, 413, 415, 418, 422, 431, 451):
        assert metrics.outcome_for_status(status) is Outcome.INVALID, status
    own = {404: Outcome.NOT_FOUND, 429: Outcome.REJECTED, 499: Outcome.CANCELLED, 503: Outcome.UNAVAILABLE, 504: Outcome.TIMEOUT}
    for status, outcome in own.items():
        assert metrics.outcome_for_status(status) is outcome, status
    for status in (500, 501, 502, 505, 599):
        assert metrics.outcome_for_status(status) is Outcome.ERROR, status
    assert metrics.outcome_for_status(200) is metrics.outcome_for_status(307) is Outcome.SUCCESS
