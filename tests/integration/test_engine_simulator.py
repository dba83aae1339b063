"""The engine simulator as a process: HTTP API, KV events over real ZMQ, /metrics, etcd membership.

A SUB socket is bound first (the simulator connects to a plain tcp://host:port, as vLLM does),
then ``python -m engine_simulator`` starts on free ports against the session's real etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import decode_seq
from kvmesh.membership import EndpointWatcher
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until_async

pytestmark = pytest.mark.integration

BLOCK = 16
MODEL = "tiny"


@dataclass
class Sim:
    proc: ManagedProcess
    port: int
    url: str
    events_endpoint: str
    sub: zmq.Socket
    messages: list[tuple[str, int, list]]

    def drain(self) -> None:
        while True:
            try:
                topic, seq, payload = self.sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.messages.append((topic.decode(), decode_seq(seq), msgspec.msgpack.decode(payload)))

    async def wait_events(self, predicate, timeout: float = 5.0) -> list[dict]:
        return await wait_until_async(
            lambda: [e for _, _, batch in self.messages for e in batch[1]],
            timeout,
            "the expected KV events",
            until=predicate,
            interval=0.02,
            before_each=self.drain,
        )


def _start(run_dir: Path, etcd: str, tokenizer_dir: Path, *extra: str) -> tuple[ManagedProcess, int, str]:
    port = free_port()
    events_endpoint = f"tcp://127.0.0.1:{free_port()}"
    return (
        ManagedProcess(
            f"engine-sim-{port}",
            python_module(
                "engine_simulator",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--model",
                MODEL,
                "--block-size-tokens",
                str(BLOCK),
                "--num-gpu-blocks",
                "256",
                "--max-num-seqs",
                "8",
                "--max-num-batched-tokens",
                "512",
                "--max-model-len",
                "2048",
                "--events-endpoint",
                events_endpoint,
                "--etcd-endpoints",
                etcd,
                "--lease-ttl-seconds",
                "10",
                "--time-scale",
                "1.0",
                "--tokenizer-path",
                str(tokenizer_dir),
                "--role",
                "both",
                *extra,
            ),
            run_dir / f"engine-sim-{port}.log",
        ),
        port,
        events_endpoint,
    )


@pytest.fixture(scope="module")
def sim(run_dir: Path, etcd: str) -> Iterator[Sim]:
    ctx = zmq.Context.instance()
    proc, port, events_endpoint = _start(run_dir, etcd, run_dir / "tokenizer")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(events_endpoint)
    proc.start()
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30)
    except TimeoutError as exc:
        proc.stop()
        raise RuntimeError(proc.log_tail()) from exc
    # A SUB attaches a new peer (and sends it its subscription) only while it processes commands,
    # i.e. inside poll/recv: poll until the engine's PUB has connected, as a live subscriber would.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        sub.poll(50)
    yield Sim(proc, port, f"http://127.0.0.1:{port}", events_endpoint, sub, [])
    proc.stop()
    sub.close(linger=0)


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ,":
            total += float(line.rsplit(" ", 1)[1])
    return total


def _sse(text: str) -> list:
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


async def test_registers_in_etcd_with_the_pinned_endpoint(sim: Sim, etcd: str, run_dir: Path) -> None:
    watcher = EndpointWatcher([etcd], model=MODEL)
    await watcher.start()
    try:
        ep_id = f"127.0.0.1:{sim.port}"
        assert await watcher.wait_for(lambda view: ep_id in view, 10)
        ep = watcher.snapshot()[ep_id]
        assert ep.url == sim.url and ep.model == MODEL and ep.block_size_tokens == BLOCK
        assert ep.events_endpoint == sim.events_endpoint and ep.role == "both"
        # tokenizer: where epp finds the files to tokenize in-process exactly as this engine does
        assert ep.labels == {"engine": "simulator", "max_model_len": "2048", "tokenizer": str(run_dir / "tokenizer")}
    finally:
        await watcher.stop()


async def test_completions_cached_tokens_and_events(sim: Sim) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        # token-id prompt: 40 tokens = 2 full blocks + 8
        ids = [1] + [(7 * i) % 2000 + 3 for i in range(39)]
        body = {"model": MODEL, "prompt": ids, "max_tokens": 4}
        first = (await client.post("/v1/completions", json=body)).json()
        assert first["object"] == "text_completion" and first["choices"][0]["finish_reason"] == "length"
        assert first["usage"] == {
            "prompt_tokens": 40,
            "total_tokens": 44,
            "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        again = (await client.post("/v1/completions", json=body)).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert (
            again["choices"][0]["text"] == first["choices"][0]["text"]
        )  # identical prompt, identical output
        expected = [external_hash_to_int(d) for d in sha256_cbor_block_hashes(ids, BLOCK)]
        events = await sim.wait_events(
            lambda evs: any(
                e["type"] == "BlockStored" and e["block_hashes"][: len(expected)] == expected for e in evs
            )
        )
        stored = next(e for e in events if e["type"] == "BlockStored" and e["block_hashes"][:2] == expected)
        assert stored["parent_block_hash"] is None and stored["token_ids"][:32] == ids[:32]
        assert stored["medium"] == "GPU" and stored["block_size"] == BLOCK
        topics = {t for t, _, _ in sim.messages}
        assert topics == {f"kv@127.0.0.1:{sim.port}@{MODEL}"}
        seqs = [s for _, s, _ in sim.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        # text prompt, streamed, with usage; BOS is prepended and counted
        tok = (await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there, engine."})).json()
        assert tok["tokens"][0] == 1 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
        reply = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Hello there, engine.",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert reply.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(reply.text)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == tok["count"]
        render = (
            await client.post(
                "/v1/completions/render", json={"model": MODEL, "prompt": "Hello there, engine."}
            )
        ).json()
        assert render[0]["token_ids"] == tok["tokens"]

        # chat, both ways; render and tokenize agree with what ran
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        chat = (
            await client.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
            )
        ).json()
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        rendered = (
            await client.post("/v1/chat/completions/render", json={"model": MODEL, "messages": messages})
        ).json()
        tokenized = (
            await client.post(
                "/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True}
            )
        ).json()
        assert (
            rendered["token_ids"] == tokenized["tokens"]
            and chat["usage"]["prompt_tokens"] == tokenized["count"]
        )
        streamed = _sse(
            (
                await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True},
                )
            ).text
        )
        assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert streamed[-1]["choices"][0]["finish_reason"] == "length"

        assert await _metric(client, "vllm:prefix_cache_hits_total") >= 32
        assert await _metric(client, "vllm:request_success_total") >= 5
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 2048


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/completions", {"model": MODEL}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 5000]}, 400),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    ],
    ids=["unknown-model", "no-prompt", "negative-max-tokens", "bad-token-id", "over-context", "bad-messages"],
)
async def test_bad_requests_get_openai_errors(sim: Sim, path: str, body: dict, status: int) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        reply = await client.post(path, json=body)
        assert reply.status_code == status
        error = reply.json()["error"]
        assert error["code"] == status and error["message"]
        assert (await client.get("/health")).status_code == 200


async def test_disconnect_aborts_and_reset_clears(sim: Sim) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        abort_metric = 'vllm:request_success_total{engine="0",finished_reason="abort"'
        aborted = await _metric(client, abort_metric)
        async with client.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "a long story",
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            },
        ) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    break

        async def running_and_usage() -> tuple[float, float]:
            return await _metric(client, "vllm:num_requests_running"), await _metric(client, "vllm:kv_cache_usage_perc")

        await wait_until_async(running_and_usage, 5, "no request running and no KV in use", until=(0, 0).__eq__)
        assert await _metric(client, "vllm:num_requests_running") == 0
        assert (
            await _metric(client, 'vllm:request_success_total{engine="0",finished_reason="abort"')
            == aborted + 1
        )

        # a non-streaming request whose client goes away is aborted too
        pending = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "another long story", "max_tokens": 1500, "ignore_eos": True},
            )
        )
        await wait_until_async(
            lambda: _metric(client, "vllm:num_requests_running"), 5, "the request to run", interval=0.02
        )
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await wait_until_async(
            lambda: _metric(client, abort_metric), 5, "a second abort", until=lambda n: n >= aborted + 2
        )
        assert await _metric(client, abort_metric) == aborted + 2
        assert await _metric(client, "vllm:num_requests_running") == 0

        assert (await client.post("/reset_prefix_cache")).status_code == 200
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "after reset", "max_tokens": 1})
        await sim.wait_events(lambda evs: any(e["type"] == "AllBlocksCleared" for e in evs))


async def test_sigterm_deregisters_and_exits(run_dir: Path, etcd: str) -> None:
    proc, port, _ = _start(run_dir, etcd, run_dir / "tokenizer", "--events-endpoint", "")
    proc.start()
    watcher = EndpointWatcher([etcd], model=MODEL)
    await watcher.start()
    try:
        ep_id = f"127.0.0.1:{port}"
        assert await watcher.wait_for(lambda view: ep_id in view, 20), proc.log_tail()
        t0 = time.monotonic()
        await asyncio.to_thread(proc.stop, 10.0)
        assert proc.proc is not None and proc.proc.returncode == 0, proc.log_tail()
        assert await watcher.wait_for(lambda view: ep_id not in view, 5)
        assert time.monotonic() - t0 < 5  # revoked, not expired (TTL 10 s)
    finally:
        await watcher.stop()
        proc.stop()
