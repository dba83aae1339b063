"""Peer routers in front of the same simulated engines, for side-by-side runs (``kvmesh compare --peers``).

| peer name | process | prompt form |
| --- | --- | --- |
| ``sglang-router`` | sglang-router 0.3.2, ``--policy cache_aware`` | text (it answers 422 to token ids) |
| ``vllm-router-cache-aware`` | vllm-router 0.1.17, ``--policy cache_aware`` | token ids |
| ``vllm-router-round-robin`` | vllm-router 0.1.17, ``--policy round_robin`` | token ids |

Both are Rust routers from PyPI, installed by ``make peers-env`` into ``.venv-peers`` (gitignored;
``$KVMESH_PEERS_VENV`` points elsewhere). Quirks handled here (``../shared/ENVIRONMENT.md``,
"Peer routers"): sglang-router looks for a tokenizer on the Hugging Face hub unless given one, so it
gets the simulator's (``--tokenizer-path``); both queue or cap requests by default (vllm-router: a
100-deep queue with a 60 s timeout), which would turn load into 429s the kvmesh mesh does not
send, so concurrency, queue and payload limits are raised past anything a replay sends; their
Prometheus listeners are bound to 127.0.0.1. The text prompt the replay sends to sglang-router
tokenizes, in the engines, to exactly the token ids the others get (``workloads.request_text``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh_cli.launcher import LOOPBACK, ManagedProcess, free_port, wait_http_ok

PEERS_VENV_ENV = "KVMESH_PEERS_VENV"
DEFAULT_PEERS_VENV = Path(__file__).resolve().parent.parent / ".venv-peers"


@dataclass(frozen=True)
class PeerSpec:
    """How to start one peer router. ``kind`` picks the command line; ``policy`` its routing policy."""

    name: str
    kind: str
    """``sglang`` or ``vllm``."""
    policy: str
    prompt_format: str
    """``text`` or ``tokens``: what the replay sends through this router."""


PEERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec("sglang-router", "sglang", "cache_aware", "text"),
    "sglang-router-round-robin": PeerSpec("sglang-router-round-robin", "sglang", "round_robin", "text"),
    "vllm-router-cache-aware": PeerSpec("vllm-router-cache-aware", "vllm", "cache_aware", "tokens"),
    "vllm-router-round-robin": PeerSpec("vllm-router-round-robin", "vllm", "round_robin", "tokens"),
}
"""Peers by the name ``--peers`` takes."""


def peers_venv() -> Path:
    return Path(os.environ.get(PEERS_VENV_ENV) or DEFAULT_PEERS_VENV)


def peer_missing_reason(name: str) -> str | None:
    """Why ``name`` cannot run here (unknown, or its venv is not installed); None when it can."""
    if name not in PEERS:
        return f"unknown peer {name!r}; known: {', '.join(PEERS)}"
    venv = peers_venv()
    binary = venv / "bin" / ("vllm-router" if PEERS[name].kind == "vllm" else "python")
    if not binary.exists():
        return f"{binary} not found: run `make peers-env` (or set ${PEERS_VENV_ENV})"
    return None


def peer_argv(spec: PeerSpec, port: int, metrics_port: int, worker_urls: Sequence[str], tokenizer_dir: Path,
              venv: Path | None = None) -> list[str]:
    """The command line of ``spec`` listening on ``port`` over ``worker_urls``."""
    venv = venv or peers_venv()
    big = str(1 << 30)
    if spec.kind == "sglang":
        return [
            str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", spec.policy, "--tokenizer-path", str(tokenizer_dir),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
            "--max-payload-size", big, "--max-concurrent-requests", "-1", "--request-timeout-secs", "3600",
            "--disable-retries", "--log-level", "warn",
        ]
    if spec.kind == "vllm":
        return [
            str(venv / "bin" / "vllm-router"), "--host", LOOPBACK, "--port", str(port),
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
            "--worker-urls", *worker_urls, "--policy", spec.policy, "--max-payload-size", big,
            "--max-concurrent-requests", "100000", "--queue-size", "100000", "--queue-timeout-secs", "3600",
            "--request-timeout-secs", "3600", "--disable-retries",
        ]
    raise ValueError(f"unknown peer kind {spec.kind!r}")


class PeerRouter:
    """A peer router process over running engines; a context manager (``url`` once started).

    Raises (on enter):
        RuntimeError: the peer is unknown or not installed, or it exited or did not answer
            ``GET /v1/models`` within ``start_timeout_s`` (the message has its log tail).
    """

    def __init__(self, name: str, worker_urls: Sequence[str], run_dir: Path, tokenizer_dir: Path,
                 start_timeout_s: float = 60.0) -> None:
        missing = peer_missing_reason(name)
        if missing:
            raise RuntimeError(missing)
        self.spec = PEERS[name]
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._argv = peer_argv(self.spec, self.port, free_port(), worker_urls, tokenizer_dir)
        self._log = run_dir / f"{name}.log"
        self._timeout = start_timeout_s
        self.process: ManagedProcess | None = None

    def __enter__(self) -> PeerRouter:
        self.process = ManagedProcess(self.spec.name, self._argv, self._log, die_with_parent=True).start()
        try:
            wait_http_ok(f"{self.url}/v1/models", self._timeout)
        except Exception as exc:
            tail = self.process.log_tail()
            self.process.stop(5.0)
            raise RuntimeError(f"{self.spec.name} did not start ({exc}):\n{tail}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop(10.0)
