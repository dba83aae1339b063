"""The simulator's one typed config (flags, ``KVMESH_ENGINE_SIMULATOR_*`` env, ``--config`` YAML).

The flags pinned in the team brief (``--host --port --model --block-size-tokens --num-gpu-blocks
--max-num-seqs --max-num-batched-tokens --max-model-len --events-endpoint --etcd-endpoints
--lease-ttl-seconds --time-scale --tokenizer-path --role``) are fields here. The simulator serves
no gRPC, so its base is :class:`~kvmesh.config.ProcessConfig`; the inherited ``--metrics-port`` is
unused (HTTP, ``/metrics`` included, is on ``--port``).
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from kvmesh.config import ProcessConfig
from kvmesh.types import EndpointRole


class SimulatorConfig(ProcessConfig):
    """A simulated vLLM 0.32 engine: OpenAI HTTP, prefix cache, KV events, etcd registration."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_ENGINE_SIMULATOR_")

    port: int = Field(8000, ge=0, le=65535)
    """HTTP port of the OpenAI API, /health, /metrics and the render endpoints."""
    model: str = "tiny"
    """Served model name (vLLM's --served-model-name)."""
    block_size_tokens: int = Field(64, ge=1, le=4096)
    """KV-cache block size in tokens (vLLM's --block-size)."""
    num_gpu_blocks: int = Field(4096, ge=2)
    """KV-cache blocks, the null block included (vLLM's --num-gpu-blocks-override)."""
    max_num_seqs: int = Field(64, ge=1)
    """Most requests running at once."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Token budget of one engine step (prefill chunks plus one per decoding sequence)."""
    max_model_len: int = Field(131072, ge=2)
    """Longest sequence (prompt + output) in tokens."""
    enable_prefix_caching: bool = True
    """Reuse cached blocks across requests (and publish KV events)."""
    events_endpoint: str = ""
    """ZMQ endpoint of the KV-event PUB socket: tcp://host:port connects, one with '*' binds; empty disables."""
    events_replay_endpoint: str = ""
    """ZMQ ROUTER endpoint (bound) serving vLLM's KV-event replay protocol (``tcp://127.0.0.1:*`` picks a
    free port, registered resolved); empty: no replay."""
    events_buffer_steps: int = Field(10_000, ge=1, le=10_000_000)
    """Messages kept for replay (vLLM's KVEventsConfig.buffer_steps)."""
    time_scale: float = Field(1.0, gt=0, le=10000)
    """Model time runs this many times faster than wall time."""
    tokenizer_path: str = ""
    """Directory with tokenizer.json (built there if missing); empty means ~/.cache/kvmesh/tokenizer-v1."""
    role: EndpointRole = EndpointRole.BOTH
    """Role registered in etcd (prefill/decode disaggregation)."""
    latency_profile: str = "llama-3.1-8b-h100"
    """Named latency-model coefficients (see engine_simulator/latency_model.py)."""
    lora_adapters: str = ""
    """Comma-separated LoRA adapter names served beside the base model (vLLM's ``--lora-modules``;
    weights are not simulated, the adapter only scopes the prefix cache and its KV events)."""
    personality: str = Field("vllm", pattern="^(vllm|sglang)$")
    """Which engine to stand in for: ``vllm`` (0.32) or ``sglang`` (0.5.23: ``/generate``,
    ``/server_info``, ``sglang:*`` metrics, SGLang's KV-event shape; ``engine_simulator/sglang.py``)."""
    fault_metrics_delay_seconds: float = Field(0.0, ge=0, le=600)
    """Fault injection (tests/faults): every GET /metrics answers this many seconds late; 0 = off."""

    @model_validator(mode="after")
    def _check(self) -> SimulatorConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        return self
