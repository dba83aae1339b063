"""The simulator's one typed config (flags, ``KVMESH_ENGINE_SIMULATOR_*`` env, ``--config`` YAML).

The flags pinned in the team brief (``--host --port --model --block-size-tokens --num-gpu-blocks
--max-num-seqs --max-num-batched-tokens --max-model-len --events-endpoint --etcd-endpoints
--lease-ttl-seconds --time-scale --tokenizer-path --role``) are fields here, and so are vLLM 0.32's
``--long-prefill-token-threshold`` and ``--long-prefill-token-threshold-adaptive`` (same names, defaults and
validation as ``vllm/config/scheduler.py``). The simulator serves no gRPC, so its base is
:class:`~kvmesh.config.ProcessConfig`; the inherited ``--metrics-port`` is unused (HTTP, ``/metrics``
included, is on ``--port``).
"""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from engine_simulator.scheduler import check_long_prefill_token_threshold
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
    """Longest sequence (prompt + output) in tokens. Left at its default, it is cut to what the KV cache
    holds, ``(num_gpu_blocks - 1) * block_size_tokens`` (the null block excluded), as vLLM never serves a
    context its KV cache cannot hold (at start-up it refuses a ``max_model_len`` that does not fit):
    otherwise a chat without ``max_tokens`` (which defaults to the room left in the context) could never
    be scheduled. An explicit value is kept (vLLM with ``--num-gpu-blocks-override`` starts too)."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """vLLM 0.32's ``--long-prefill-token-threshold`` (``vllm/config/scheduler.py``): while more than one request
    is running or waiting, no request gets more than this many tokens in one step, so a long prefill shares
    the step's budget with newer requests instead of running to its end first (FCFS chunked prefill); a lone
    request is not capped. 0 (the default, as vLLM's) disables it. Must be <= ``max_model_len``."""
    long_prefill_token_threshold_adaptive: bool = False
    """vLLM 0.32's ``--long-prefill-token-threshold-adaptive``: raise that cap to a fair share of the step,
    ``max_num_batched_tokens // (running + waiting requests)``. Here a value flag (``true``/``false``), where
    vLLM's is a switch (``--long-prefill-token-threshold-adaptive`` / ``--no-...``). No effect at threshold 0."""
    scheduler_reserve_full_isl: bool = True
    """vLLM 0.32's ``--scheduler-reserve-full-isl`` (``vllm/config/scheduler.py``, default true, as here): admit a
    waiting request only when its whole sequence's KV blocks are free, not only its first chunk's; a load from an
    offloaded tier is checked the same way (README "Long prefills and admission"). ``false``: first-chunk
    admission, the simulator's behaviour before this field existed."""
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
    api_key: SecretStr = SecretStr("")
    """vLLM's ``--api-key``: requests to ``/v1/*`` need ``Authorization: Bearer <key>`` (401 otherwise); empty: open.
    Shown as ``**********`` in ``--print-config`` and the start-up config log line."""
    runner: str = Field("generate", pattern="^(generate|pooling)$")
    """vLLM's ``--runner``: ``generate`` (completions, chat, responses) or ``pooling`` (``/v1/embeddings`` only)."""
    offload: str = Field("off", pattern=r"^(off|cpu|cpu\+kv_store)$")
    """KV offload connector (vLLM 0.32's OffloadingConnector semantics, ``engine_simulator/offload.py``):
    ``off``; ``cpu`` (blocks copied to a local CPU tier as they fill, loaded back over PCIe on a GPU miss);
    ``cpu+kv_store`` (also written to kv_store at ``--kv-stores`` and loaded from it over the network)."""
    offload_cpu_blocks: int = Field(16384, ge=1)
    """Capacity of the CPU tier in blocks (vLLM's ``kv_connector_extra_config.num_cpu_blocks``), LRU."""
    offload_bytes_per_block: int = Field(0, ge=0)
    """Modeled KV bytes of one block; 0: 131,072 B/token (Llama-3.1-8B BF16) x ``--block-size-tokens``."""
    offload_pcie_bandwidth: float = Field(50e9, gt=0)
    """Host<->GPU bytes/s (PCIe 5.0 x16, 64 GB/s per direction, at ~80 %)."""
    offload_nvme_bandwidth: float = Field(7e9, gt=0)
    """Bytes/s of a kv_store value on disk (PCIe 4.0 x4 datacenter NVMe sequential read)."""
    offload_network_bandwidth: float = Field(25e9, gt=0)
    """Bytes/s to kv_store (one 200 Gb/s NIC per GPU)."""
    offload_max_remote_blocks: int = Field(262_144, ge=1)
    """kv_store block hashes the connector remembers (LRU); each is confirmed by a kv_store ``Lookup`` before a load."""
    kv_stores: str = ""
    """Comma-separated gRPC addresses of the kv_store instances the connector writes to (the first one) and
    registers in the ``kv_stores`` label; needed by ``--offload cpu+kv_store``."""
    offload_put_value_bytes: int = Field(4096, ge=1, le=64 << 20)
    """Bytes actually sent per block in a kv_store Put (a stand-in payload: the simulator holds no KV; the
    modeled transfer uses ``--offload-bytes-per-block``)."""
    fault_metrics_delay_seconds: float = Field(0.0, ge=0, le=600)
    """Fault injection (tests/faults): every GET /metrics answers this many seconds late; 0 = off."""

    @model_validator(mode="after")
    def _check(self) -> SimulatorConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        capacity = (self.num_gpu_blocks - 1) * self.block_size_tokens
        if capacity < 2:  # one prompt token and one output token: the least any request needs
            raise ValueError(f"num_gpu_blocks {self.num_gpu_blocks} x block_size_tokens {self.block_size_tokens} holds "
                             f"{capacity} token(s) (the null block excluded): too small to serve any request (2 tokens)")
        if "max_model_len" not in self.model_fields_set and self.max_model_len > capacity:
            self.max_model_len = capacity
        check_long_prefill_token_threshold(self.long_prefill_token_threshold, self.max_model_len)
        if self.offload == "cpu+kv_store" and not self.kv_stores.strip():
            raise ValueError("--offload cpu+kv_store needs --kv-stores (kv_store gRPC addresses)")
        return self
