"""Registration sidecar: the pure health hysteresis, the registration value, and its config."""

from __future__ import annotations

import pytest

from kvmesh.config import load_config
from kvmesh.types import Endpoint, EndpointRole
from services.registration_sidecar.config import SidecarConfig
from services.registration_sidecar.health import (
    Action,
    HealthTracker,
    build_endpoint,
    max_model_len_from_models,
)

R, D, N = Action.REGISTER, Action.DEREGISTER, Action.NONE


@pytest.mark.parametrize(
    ("failure", "success", "polls", "expected"),
    [
        (3, 1, [True], [R]),
        (3, 1, [False, False, True], [N, N, R]),  # never registered: failures change nothing
        (3, 1, [True, False, False, False, False], [R, N, N, D, N]),
        (3, 1, [True, False, False, True, False, False, False], [R, N, N, N, N, N, D]),  # a success resets
        (1, 2, [True, True, False, True, True], [N, R, D, N, R]),
        (2, 1, [True, False, False, True], [R, N, D, R]),  # recovery re-registers
    ],
)
def test_tracker_hysteresis(failure: int, success: int, polls: list[bool], expected: list[Action]) -> None:
    tracker = HealthTracker(failure, success)
    assert [tracker.observe(p) for p in polls] == expected


def test_tracker_rejects_zero_thresholds() -> None:
    with pytest.raises(ValueError, match="thresholds"):
        HealthTracker(0, 1)


def test_build_endpoint_labels_and_round_trip() -> None:
    ep = build_endpoint("127.0.0.1:8011", "http://127.0.0.1:8011/", "tiny", 32, "tcp://127.0.0.1:5557",
                        EndpointRole.BOTH, "vllm", 512)
    assert ep.url == "http://127.0.0.1:8011"
    assert ep.labels == {"engine": "vllm", "max_model_len": "512"}
    back = Endpoint.from_json(ep.to_json())
    assert back == ep and back.labels == ep.labels and back.block_size_tokens == 32
    assert build_endpoint("h:1", "http://h:1", "m", 32, "", EndpointRole.BOTH, "vllm", None).labels == {"engine": "vllm"}


def test_max_model_len_from_vllm_models_body() -> None:
    body = {"object": "list", "data": [
        {"id": "other", "max_model_len": 9},
        {"id": "tiny", "object": "model", "owned_by": "vllm", "root": "/m", "max_model_len": 512},
    ]}
    assert max_model_len_from_models(body, "tiny") == 512
    assert max_model_len_from_models(body, "nope") is None
    assert max_model_len_from_models([], "tiny") is None
    assert max_model_len_from_models({"data": [{"id": "tiny", "max_model_len": "x"}]}, "tiny") is None


def test_config_flags_and_validation() -> None:
    cfg = load_config(SidecarConfig, ["--engine-url", "http://127.0.0.1:8011", "--model", "tiny",
                                      "--block-size-tokens", "32", "--etcd-endpoints", "127.0.0.1:2379,h:2"])
    assert cfg.endpoint_id == "127.0.0.1:8011"
    assert cfg.etcd_endpoints == ["127.0.0.1:2379", "h:2"]
    assert cfg.engine_label == "vllm" and cfg.failure_threshold == 3
    for argv in (["--model", "tiny"], ["--engine-url", "http://h:1"], ["--engine-url", "h:1", "--model", "m"],
                 ["--engine-url", "http://h", "--model", "m"]):
        with pytest.raises(SystemExit):
            load_config(SidecarConfig, argv)


def test_build_service_needs_etcd_and_starts_nothing() -> None:
    from services.registration_sidecar.app import Sidecar, build_service

    cfg = SidecarConfig(engine_url="http://127.0.0.1:8011", model="tiny")
    sidecar = build_service(cfg)
    assert isinstance(sidecar, Sidecar) and sidecar.registration is None
    with pytest.raises(SystemExit, match="--etcd-endpoints is required"):
        build_service(SidecarConfig(engine_url="http://127.0.0.1:8011", model="tiny", etcd_endpoints=[]))


def test_tracker_busy_engine_keeps_registration_within_grace() -> None:
    """Timed-out polls (a busy engine) deregister only past the grace; refused ones after the threshold."""
    tracker = HealthTracker(2, 1, unresponsive_grace_seconds=10.0)
    assert tracker.observe(True, now=0.0) is R
    assert [tracker.observe(False, unresponsive=True, now=t) for t in (1.0, 2.0, 9.0)] == [N, N, N]
    assert tracker.observe(True, now=9.5) is N  # answered again: still registered, grace reset
    assert [tracker.observe(False, unresponsive=True, now=t) for t in (10.0, 15.0, 20.0)] == [N, N, D]
    tracker = HealthTracker(2, 1, unresponsive_grace_seconds=10.0)
    tracker.observe(True, now=0.0)
    assert [tracker.observe(False, unresponsive=True, now=1.0), tracker.observe(False, now=1.5)] == [N, D]
