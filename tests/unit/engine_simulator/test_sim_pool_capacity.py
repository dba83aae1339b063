"""The default ``max_model_len`` is what the GPU pool holds, ``(num_gpu_blocks - 1) x block_size_tokens`` (vLLM's
null block excluded), and a pool too small for any request (under 2 tokens: one prompt token, one output token)
is a config error, not an engine that advertises a context length it then refuses (a fresh user's
``--num-gpu-blocks 2 --block-size-tokens 1``: ``max_model_len`` 2, every request 400)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine_simulator.config import SimulatorConfig


@pytest.mark.parametrize(("blocks", "block_size", "expected"), [(2, 2, 2), (3, 1, 2), (65, 64, 4096), (4096, 16, 65_520)])
def test_default_max_model_len_is_the_pool(blocks: int, block_size: int, expected: int) -> None:
    config = SimulatorConfig(num_gpu_blocks=blocks, block_size_tokens=block_size, etcd_endpoints=[])
    assert config.max_model_len == min(expected, SimulatorConfig.model_fields["max_model_len"].default)


def test_a_pool_under_two_tokens_is_refused() -> None:
    with pytest.raises(ValidationError, match="holds 1 token"):
        SimulatorConfig(num_gpu_blocks=2, block_size_tokens=1, etcd_endpoints=[])
