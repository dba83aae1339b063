"""The step-time model."""

import pytest

from engine_simulator.latency_model import PROFILES, LatencyModel, get_profile


def test_formula() -> None:
    m = LatencyModel(
        base_seconds=0.01,
        prefill_seconds_per_token=0.001,
        decode_seconds_per_seq=0.002,
        decode_seconds_per_context_token=0.0001,
    )
    assert m.step_seconds(0, 0) == 0.0
    assert m.step_seconds(100, 0) == pytest.approx(0.11)
    assert m.step_seconds(0, 3, 1000) == pytest.approx(0.01 + 0.006 + 0.1)
    assert m.step_seconds(10, 2, 10) == pytest.approx(0.01 + 0.01 + 0.004 + 0.001)


def test_default_profile_is_plausible_for_llama_8b_h100() -> None:
    m = get_profile("llama-3.1-8b-h100")
    tpot = m.step_seconds(0, 1, 1024)
    assert 0.005 < tpot < 0.008  # single-stream decode ~6 ms
    prefill_rate = 2048 / m.step_seconds(2048, 0)
    assert 20_000 < prefill_rate < 40_000  # prompt tokens per second
    # monotone in every input
    assert m.step_seconds(10, 0) < m.step_seconds(20, 0)
    assert m.step_seconds(0, 1, 100) < m.step_seconds(0, 2, 100) < m.step_seconds(0, 2, 200)


def test_unknown_profile_lists_known() -> None:
    with pytest.raises(KeyError, match=r"llama-3\.1-8b-h100"):
        get_profile("nope")
    assert "llama-3.1-8b-h100" in PROFILES


def test_negative_coefficient_rejected() -> None:
    with pytest.raises(ValueError, match="base_seconds"):
        LatencyModel(base_seconds=-1)
