"""The scripted prompt sequence run against real vLLM, against the simulator, and recorded as fixtures.

One engine, 32-token blocks, a 24-block KV cache (23 usable: vLLM's ``--num-gpu-blocks-override 24``
counts the null block, as the simulator's ``--num-gpu-blocks`` does), ``max_model_len`` 512,
greedy decoding with ``ignore_eos`` so both engines generate exactly ``max_tokens`` tokens (their
generated token *values* differ; their *counts*, hence block counts and eviction order, do not).

Steps: a text prompt, its repeat, its extension, a block-aligned token-id prompt and its repeat
(vLLM caps a full hit at ``n - 1`` tokens), three unrelated prompts that overflow the cache
(forced eviction: ``BlockRemoved``), the first prompt again, then ``POST /reset_prefix_cache``
and one more request (``AllBlocksCleared`` comes at the engine's next step).

:func:`run_script` drives any engine URL through an :class:`EventSink` (a bound ZMQ SUB) and
returns one :class:`StepResult` per step; the recorder, the vLLM suite and the fast simulator
comparison all call it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

from kvmesh.kv_events import decode_seq

BLOCK = 32
NUM_GPU_BLOCKS = 24
MAX_MODEL_LEN = 512
MODEL = "tiny"


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["cache", "block", "prefix", "token", "engine", "router", "index", "event", "prompt", "value", "queue", "model", "server", "latency", "memory", "batch", "decode", "prefill", "policy", "score", "worker", "endpoint", "request", "stream"]
    lines = []
    for i in range(0, words, 12):
        lines.append(" ".join(rng.choice(vocab) for _ in range(min(12, words - i))) + ".")
    return "\n".join(lines) + "\n"


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


A = _text(1, 90)
STEPS: list[dict[str, Any]] = [
    {"name": "text-a", "prompt": A, "max_tokens": 8},
    {"name": "text-a-repeat", "prompt": A, "max_tokens": 8},
    {"name": "text-a-extended", "prompt": A + _text(2, 60), "max_tokens": 8},
    {"name": "ids-aligned", "prompt": _ids(3, 4 * BLOCK), "max_tokens": 1},
    {"name": "ids-aligned-repeat", "prompt": _ids(3, 4 * BLOCK), "max_tokens": 1},
    {"name": "unrelated-1", "prompt": _ids(4, 300), "max_tokens": 8},
    {"name": "unrelated-2", "prompt": _text(5, 120), "max_tokens": 8},
    {"name": "unrelated-3", "prompt": _ids(6, 330), "max_tokens": 8},
    {"name": "text-a-after-eviction", "prompt": A, "max_tokens": 8},
    {"name": "reset", "reset": True},
    {"name": "text-a-after-reset", "prompt": A, "max_tokens": 8},
]
"""The scripted sequence (dicts so they serialise into the fixtures as they are)."""


@dataclass
class StepResult:
    """What one step produced: the request, the response body, the prompt's tokens, the events."""

    name: str
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    prompt_token_ids: list[int]
    tokenize: dict[str, Any] | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    """``{"topic", "seq", "payload"}`` with the payload msgpack-decoded (maps keep their key order)."""


class EventSink:
    """A ZMQ SUB bound at ``endpoint`` (engines connect to it); optionally forwards every frame.

    ``forward_to`` (a bound SUB elsewhere, e.g. kv_indexer's) gets the same three frames from a
    PUB this sink connects, so a test can watch the events kv_indexer applies.
    """

    def __init__(self, endpoint: str, forward_to: str | None = None) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(endpoint)
        self.pub: zmq.Socket | None = None
        if forward_to:
            self.pub = ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.connect(forward_to)
        self.messages: list[dict[str, Any]] = []
        self.raw: list[list[bytes]] = []

    def drain(self, wait_ms: int = 0) -> int:
        """Receive what is queued (waiting up to ``wait_ms`` for the first frame); returns the count."""
        n = 0
        while self.sub.poll(wait_ms if n == 0 else 0):
            frames = self.sub.recv_multipart()
            if self.pub is not None:
                self.pub.send_multipart(frames)
            self.raw.append(frames)
            self.messages.append({
                "topic": frames[0].decode(),
                "seq": decode_seq(frames[1]),
                "payload": msgspec.msgpack.decode(frames[2]),
            })
            n += 1
        return n

    def settle(self, quiet_seconds: float = 0.4, timeout: float = 10.0) -> None:
        """Drain until no message arrived for ``quiet_seconds``."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            if self.drain(50):
                last = time.monotonic()
            elif time.monotonic() - last >= quiet_seconds:
                return

    def close(self) -> None:
        self.sub.close(0)
        if self.pub is not None:
            self.pub.close(0)


def events_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for m in messages for e in m["payload"][1]]


def run_script(
    url: str,
    sink: EventSink,
    model: str = MODEL,
    after_step: Callable[[StepResult], None] | None = None,
    steps: list[dict[str, Any]] = STEPS,
) -> list[StepResult]:
    """Run :data:`STEPS` against the engine at ``url``; events are collected per step via ``sink``.

    ``after_step`` runs after each step's events settled (the vLLM suite compares kv_indexer there).

    Raises:
        AssertionError: when a request fails.
    """
    results: list[StepResult] = []
    with httpx.Client(base_url=url, timeout=60.0) as client:
        sink.settle(0.2)
        for step in steps:
            before = len(sink.messages)
            if step.get("reset"):
                reply = client.post("/reset_prefix_cache")
                assert reply.status_code == 200, reply.text
                result = StepResult(step["name"], None, reply.json(), [], None)
            else:
                prompt = step["prompt"]
                tokenize = None
                if isinstance(prompt, str):
                    tok = client.post("/tokenize", json={"model": model, "prompt": prompt})
                    assert tok.status_code == 200, tok.text
                    tokenize = tok.json()
                    ids = tokenize["tokens"]
                else:
                    ids = list(prompt)
                request = {"model": model, "prompt": prompt, "max_tokens": step["max_tokens"], "temperature": 0,
                           "ignore_eos": True}
                reply = client.post("/v1/completions", json=request)
                assert reply.status_code == 200, reply.text
                result = StepResult(step["name"], request, reply.json(), ids, tokenize)
            sink.settle()
            result.messages = sink.messages[before:]
            results.append(result)
            if after_step is not None:
                after_step(result)
    return results
