"""/health's one rule (services/router/readiness.py): a dependency failure the router's configuration
serves around is 200 "degraded" naming it; one it does not serve around, no live endpoint, or the
router shutting down is 503. The configurations come from RouterConfig, as app.py builds the probe."""

from __future__ import annotations

from typing import Any

import pytest

from services.router.config import RouterConfig
from services.router.readiness import SHUTTING_DOWN, ReadinessProbe, served_around


class _Check:
    def __init__(self, status: str) -> None:
        self.status = status

    async def __call__(self, timeout_seconds: float) -> str:
        return self.status


def _probe(config: RouterConfig, statuses: dict[str, str], endpoints: int = 2) -> ReadinessProbe:
    degradable, hang_tolerant = served_around(
        flow_control_failure_mode=config.flow_control_failure_mode, degraded_max_in_flight=config.degraded_max_in_flight,
        epp_failure_mode=config.epp_failure_mode, etcd=bool(config.etcd_endpoints))
    return ReadinessProbe({name: _Check(status) for name, status in statuses.items()}, lambda: endpoints, 0.5, 1.0,
                          lambda: 0.0, degradable, hang_tolerant)


ALL_SERVING = {"flow_control": "SERVING", "epp": "SERVING", "etcd": "SERVING"}
DEFAULT: dict[str, Any] = {"etcd_endpoints": ["127.0.0.1:2379"]}


@pytest.mark.parametrize(("overrides", "failure", "code", "degraded"), [
    # default config: every failure with a degraded mode is served around
    ({}, {"flow_control": "UNAVAILABLE"}, 200, ["flow_control"]),  # local admission (up to the cap)
    ({}, {"flow_control": "NOT_CONNECTED"}, 200, ["flow_control"]),
    ({}, {"epp": "UNAVAILABLE"}, 200, ["epp"]),  # local least-request pick
    ({}, {"epp": "DEADLINE_EXCEEDED"}, 200, ["epp"]),  # local pick after pick_timeout_seconds
    ({}, {"etcd": "UNAVAILABLE"}, 200, ["etcd"]),  # last known membership
    ({}, {"epp": "UNAVAILABLE", "flow_control": "UNAVAILABLE", "etcd": "UNAVAILABLE"}, 200,
     ["flow_control", "epp", "etcd"]),
    # not served around: a hung flow_control answers 504 once its lent credits are spent
    ({}, {"flow_control": "DEADLINE_EXCEEDED"}, 503, []),
    ({}, {"epp": "NOT_SERVING"}, 503, []),
    ({}, {"flow_control": "UNIMPLEMENTED"}, 503, []),
    # fail-closed configurations make that dependency's failure fatal
    ({"flow_control_failure_mode": "closed"}, {"flow_control": "UNAVAILABLE"}, 503, []),
    ({"degraded_max_in_flight": 0}, {"flow_control": "UNAVAILABLE"}, 503, []),  # cap 0: every request refused
    ({"epp_failure_mode": "closed"}, {"epp": "UNAVAILABLE"}, 503, []),
    ({"epp_failure_mode": "closed"}, {"epp": "DEADLINE_EXCEEDED"}, 503, []),
    ({"epp_failure_mode": "closed"}, {"flow_control": "UNAVAILABLE"}, 200, ["flow_control"]),  # the other one's mode stays
])
async def test_health_follows_what_the_config_serves_around(
        overrides: dict[str, Any], failure: dict[str, str], code: int, degraded: list[str]) -> None:
    config = RouterConfig(**{**DEFAULT, **overrides})
    state = await _probe(config, {**ALL_SERVING, **failure}).readiness()
    body = state.body()
    assert (200 if state.ready else 503) == code, body
    assert state.degraded == degraded
    if code == 200:
        assert body["status"] == ("degraded" if degraded else "ok") and "error" not in body
        assert body.get("degraded", []) == degraded
    else:
        assert body["status"] == "unavailable"
        for name in failure:
            if name not in degraded:
                assert f"{name} is {failure[name]}" in body["error"]["message"]  # type: ignore[index]


async def test_without_etcd_configured_etcd_is_not_checked_nor_degradable() -> None:
    degradable, hang_tolerant = served_around(flow_control_failure_mode="open", degraded_max_in_flight=256,
                                              epp_failure_mode="open", etcd=False)
    assert degradable == {"flow_control", "epp"} and hang_tolerant == {"epp"}


async def test_no_live_endpoint_is_503_even_with_every_dependency_degraded() -> None:
    state = await _probe(RouterConfig(**DEFAULT), {"flow_control": "UNAVAILABLE", "epp": "UNAVAILABLE"}, 0).readiness()
    assert not state.ready and state.failing == ["endpoints"]
    assert "no live endpoint" in state.body()["error"]["message"]  # type: ignore[index]


async def test_shutting_down_is_503_whatever_the_dependencies_say() -> None:
    probe = _probe(RouterConfig(**DEFAULT), ALL_SERVING)
    assert (await probe.readiness()).body()["status"] == "ok"
    probe.stop()
    state = await probe.readiness()
    assert not state.ready and state.failing == [SHUTTING_DOWN]
    body = state.body()
    assert body["status"] == "unavailable" and body["dependencies"] == ALL_SERVING
    assert "shutting down" in body["error"]["message"]  # type: ignore[index]
