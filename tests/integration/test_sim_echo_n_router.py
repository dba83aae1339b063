"""``n``, ``echo`` and the generated text, end to end: real etcd, flow_control, epp and router in front of one
simulated engine held to vLLM 0.32.0 (``vllm/entrypoints/openai/completion/serving.py``,
``chat_completion/serving.py``, ``sampling_params.py`` ``_verify_greedy_sampling``; see
``tests/unit/engine_simulator/test_sim_echo_n_beam.py`` for the engine alone).

The router forwards the body unchanged: the answer through it is the engine's (choices indexed
``prompt * n + i``, echoed prompts, the engine's own 400 for ``n`` with greedy sampling), and the usage it
reads from an ``n > 1`` stream is the summed one.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim-echo"


@dataclass
class Mesh:
    router: str
    engine: str


@pytest.fixture
def mesh(start_service: Any, etcd: str, run_dir: Path) -> Iterator[Mesh]:
    port = free_port()
    proc = ManagedProcess(
        f"engine-echo-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                      "--block-size-tokens", "16", "--num-gpu-blocks", "256", "--max-model-len", "2048",
                      "--etcd-endpoints", etcd, "--lease-ttl-seconds", "2", "--time-scale", "200"),
        run_dir / f"engine-echo-{port}.log",
    ).start()
    try:
        engine = f"http://127.0.0.1:{port}"
        wait_http_ok(engine + "/health", 60)
        _, flow = start_service("flow_control")
        _, epp = start_service("epp", "--scheduling-config", "round-robin")
        http_port = free_port()
        start_service("router", "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address", epp)
        router = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: {m["id"] for m in httpx.get(f"{router}/v1/models").json()["data"]}, 30,
                   "the router to list the model", until=lambda ids: MODEL in ids)
        yield Mesh(router, engine)
    finally:
        proc.stop()


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30)


def _sse(reply: httpx.Response) -> list[dict[str, Any]]:
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_n_and_echo_pass_through_the_router(mesh: Mesh) -> None:
    prompts = ["alpha beta", "gamma"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 4, "ignore_eos": True}
    routed = _post(mesh.router + "/v1/completions", body)
    assert routed.status_code == 200, routed.text
    direct = _post(mesh.engine + "/v1/completions", body).json()
    answer = routed.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    # the same prompt generates the same tokens: the routed answer is the engine's, choice by choice
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in direct["choices"]]
    assert all(c["text"].startswith(prompts[c["index"] // 2]) for c in answer["choices"])
    assert answer["choices"][0]["text"] != answer["choices"][1]["text"]  # two samples of one prompt
    assert answer["usage"]["completion_tokens"] == 16


def test_streamed_n_through_the_router_sums_usage(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "stream several", "n": 3, "echo": True, "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(_post(mesh.router + "/v1/completions", body))
    first: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            first.setdefault(choice["index"], choice["text"])
    assert sorted(first) == [0, 1, 2] and all(t.startswith("stream several") for t in first.values())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


def test_chat_echo_and_n_through_the_router(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure,"}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True, "n": 2, "max_tokens": 3,
            "ignore_eos": True}
    reply = _post(mesh.router + "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["message"]["content"].startswith("Sure,") for c in choices)


def test_greedy_n_is_the_engines_400_through_the_router(mesh: Mesh) -> None:
    reply = _post(mesh.router + "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0,
                                                    "max_tokens": 2})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


def test_generated_text_is_printable_through_the_router(mesh: Mesh) -> None:
    reply = _post(mesh.router + "/v1/completions", {"model": MODEL, "prompt": ["p1", "p2", "p3", "p4"], "n": 4,
                                                    "max_tokens": 128, "ignore_eos": True})
    texts = [c["text"] for c in reply.json()["choices"]]
    assert len(texts) == 16 and sum(map(len, texts)) > 16 * 128  # tokens average more than one character
    for text in texts:
        assert "\ufffd" not in text
        assert all(unicodedata.category(ch) != "Cc" or ch in "\n\t" for ch in text), repr(text)


def test_echo_with_max_tokens_0_through_the_router(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "prompt only", "echo": True, "max_tokens": 0}
    assert _post(mesh.engine + "/v1/completions", body).json()["choices"][0]["text"] == "prompt only"
    reply = _post(mesh.router + "/v1/completions", body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "prompt only"
