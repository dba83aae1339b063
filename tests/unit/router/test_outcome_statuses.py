"""Every 4xx the router answers because of the client counts ``outcome="invalid"`` in
``kvmesh_router_requests_total`` (a wrong method, a bad or unknown API key, an engine's 4xx passed on),
unless the status has an outcome of its own (404 not_found, 429 rejected, 499 cancelled); other 5xx
count ``error``. An engine's 401/403/407 (the engine refusing the credentials the router presented:
a wrong ``engine_api_key``, a proxy's 407) is the router's misconfiguration: ``upstream_error``, seen by
error-rate alerts; only where the engine saw the client's own key (open mode, no engine key) is its
401/403 the client's ``invalid``. Completions and the passed-through ``/tokenize`` alike. The router's real Starlette app over a ``RequestFlow`` (engine: ``httpx.MockTransport``),
called through httpx's ASGI transport."""

from __future__ import annotations

import json

import httpx
import pytest

from services.router import metrics
from services.router.config import RouterConfig
from services.router.degraded import LocalPicker
from services.router.http_app import RouterHttpApi
from services.router.passthrough import Passthrough
from services.router.request_flow import RequestFlow
from services.router.tenants import TenantSpec
from tests.unit.router.fakes import CATALOG, MODEL, A, FakeAdmission, FakePicker, outcome_count

KEY = "sk-tenant-a-0001"
CONFIG = RouterConfig(etcd_endpoints=[], tenants=[TenantSpec(name="a", api_keys=[KEY])])


def _engine(request: httpx.Request) -> httpx.Response:
    status = int(json.loads(request.content)["prompt"])  # the test names the engine's answer (a completion, /tokenize)
    return httpx.Response(status, json={"error": {"message": "engine says no", "type": "BadRequestError",
                                                  "code": status}})


async def _call(method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None,
                config: RouterConfig = CONFIG) -> int:
    http = httpx.AsyncClient(transport=httpx.MockTransport(_engine))
    flow = RequestFlow(config, lambda: CATALOG, FakeAdmission(), FakePicker(), http)
    passthrough = Passthrough(config, http, lambda model: (A,), LocalPicker())
    app = RouterHttpApi(config, flow, lambda: CATALOG, passthrough=passthrough).app()
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
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "409"}, None, 409),  # the engine's, passed on
    ("POST", "/tokenize", {"model": MODEL, "prompt": "422"}, None, 422),
], ids=["get-chat", "put-models", "delete-completions", "unknown-key", "engine-409", "tokenize-engine-422"])
async def test_a_client_error_counts_invalid_not_error(method: str, path: str, body: dict | None,
                                                       headers: dict[str, str] | None, status: int) -> None:
    invalid, error = outcome_count("invalid"), outcome_count("error")
    assert await _call(method, path, body, headers) == status
    assert (outcome_count("invalid"), outcome_count("error")) == (invalid + 1, error)


OPEN = RouterConfig(etcd_endpoints=[])
"""Open mode (no tenants): the client's ``authorization`` goes on to the engine when no engine key is set."""
WITH_ENGINE_KEY = RouterConfig(etcd_endpoints=[], engine_api_key="sk-engine-wrong")  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize(("config", "status", "outcome"), [
    (CONFIG, 401, "upstream_error"),  # tenants: the client's key is kvmesh's, never sent: the engine wants one
    (CONFIG, 403, "upstream_error"),
    (WITH_ENGINE_KEY, 401, "upstream_error"),  # the router's own engine_api_key refused
    (WITH_ENGINE_KEY, 403, "upstream_error"),
    (OPEN, 407, "upstream_error"),  # a proxy between router and engine: never the client's
    (OPEN, 401, "invalid"),  # the client's own key went to the engine and was refused
    (OPEN, 403, "invalid"),
], ids=["tenants-401", "tenants-403", "engine-key-401", "engine-key-403", "open-407", "client-key-401", "client-key-403"])
async def test_an_engine_refusing_the_routers_credentials_counts_upstream_error(
    path: str, config: RouterConfig, status: int, outcome: str,
) -> None:
    counts = {o: outcome_count(o) for o in ("invalid", "upstream_error", "error")}
    assert await _call("POST", path, {"model": MODEL, "prompt": str(status)}, config=config) == status  # passed on
    assert {o: outcome_count(o) - n for o, n in counts.items()} == {o: float(o == outcome) for o in counts}


def test_engine_outcome_against_the_routers_own() -> None:
    Outcome = metrics.RequestOutcome
    for status in (401, 403, 407):
        assert metrics.outcome_for_status(status) is Outcome.INVALID  # the router's own answer: the client's
        assert metrics.engine_outcome(status) is Outcome.UPSTREAM_ERROR
    assert metrics.engine_outcome(401, client_credentials=True) is metrics.engine_outcome(403, True) is Outcome.INVALID
    assert metrics.engine_outcome(407, client_credentials=True) is Outcome.UPSTREAM_ERROR
    for status in (400, 404, 409, 422, 429, 500, 503, 504):
        assert metrics.engine_outcome(status) is metrics.outcome_for_status(status), status


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
