"""Step time of a continuous-batching engine, as a function of what the step computes. Pure.

One engine step (one forward pass in vLLM's v1 engine) runs the prefill chunks the scheduler
picked (at most ``max_num_batched_tokens`` tokens in all, cached prefix tokens excluded: they are
never computed) plus one token for each decoding sequence. Its duration is modelled as::

    t_step = base + prefill_tokens * prefill_per_token
                  + decode_seqs * decode_per_seq
                  + decode_context_tokens * decode_per_context_token          (seconds)

* ``base``: reading every weight once per step (memory-bound floor of a forward pass).
* ``prefill_per_token``: the compute of one prompt token, ``2 * n_params`` FLOPs.
* ``decode_per_seq``: the compute of one decode token (same FLOPs as a prefill token).
* ``decode_per_context_token``: reading one cached token's K and V in every layer (attention
  of decode is memory-bound). ``decode_context_tokens`` is the sum of the decoding sequences'
  lengths. Prefill attention's quadratic term is left out (small below ~8k tokens for 8B).

Default profile ``llama-3.1-8b-h100`` (Llama-3.1-8B, BF16, one NVIDIA H100 SXM 80GB), derived
from public numbers with a roofline and stated efficiencies:

* Model: Llama-3.1-8B config (``meta-llama/Llama-3.1-8B``: 8.03e9 parameters, 32 layers,
  8 KV heads x head_dim 128): 16.06 GB of BF16 weights; 2 x 8.03e9 = 16.06 GFLOP per token;
  KV per token = 2 (K,V) x 32 x 8 x 128 x 2 bytes = 131,072 bytes.
* GPU: NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16.
* Efficiencies: 80 % of peak bandwidth, 50 % of peak FLOPs (typical of vLLM on H100).

  =============================== ======================================= ==============
  coefficient                     derivation                              value
  =============================== ======================================= ==============
  ``base_seconds``                16.06 GB / (0.8 x 3.35 TB/s)            6.0e-3 s
  ``prefill_seconds_per_token``   16.06 GFLOP / (0.5 x 989 TFLOPS)        3.25e-5 s
  ``decode_seconds_per_seq``      same FLOPs as a prefill token           3.25e-5 s
  ``decode_seconds_per_context``  131,072 B / (0.8 x 3.35 TB/s)           4.9e-8 s
  =============================== ======================================= ==============

  So a lone decode at 1k context takes ~6.1 ms per token (TPOT) and a 2048-token prefill chunk
  ~72 ms (~28k prompt tokens/s). These are derived, not fitted; published vLLM measurements of
  Llama-3.1-8B on H100 to check them against: github.com/LambdaLabsML/vllm-benchmark (2024) and
  the Microsoft Azure HPC blog "Performance of Llama 3.1 8B AI Inference using vLLM on
  ND-H100-v5" (2025).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Coefficients of the step-time formula above (seconds)."""

    base_seconds: float = 6.0e-3
    prefill_seconds_per_token: float = 3.25e-5
    decode_seconds_per_seq: float = 3.25e-5
    decode_seconds_per_context_token: float = 4.9e-8

    def __post_init__(self) -> None:
        for name in (
            "base_seconds",
            "prefill_seconds_per_token",
            "decode_seconds_per_seq",
            "decode_seconds_per_context_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int = 0) -> float:
        """Duration of one step in model seconds; 0 for an empty step.

        Args:
            prefill_tokens: prompt tokens computed in this step (cached ones excluded).
            decode_seqs: sequences producing one token by decoding.
            decode_context_tokens: sum of those sequences' current lengths in tokens.
        """
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return 0.0
        return (
            self.base_seconds
            + prefill_tokens * self.prefill_seconds_per_token
            + decode_seqs * self.decode_seconds_per_seq
            + decode_context_tokens * self.decode_seconds_per_context_token
        )


PROFILES: dict[str, LatencyModel] = {
    "llama-3.1-8b-h100": LatencyModel(),
}
"""Named coefficient sets (``--latency-profile``)."""


def get_profile(name: str) -> LatencyModel:
    """The named profile.

    Raises:
        KeyError: for an unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown latency profile {name!r}; known: {sorted(PROFILES)}") from None
