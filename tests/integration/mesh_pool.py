"""A real mesh (etcd, kv_indexer, flow_control, epp with precise prefix routing, router) in front of
simulated engines of chosen personalities: shared by the tenancy and mixed-pool integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

MODEL = "sim"
BLOCK = 32


@dataclass
class Pool:
    indexer: str
    epp: str
    router_http: str
    engines: dict[str, str]  # endpoint id -> personality

    def score(self, tokens: list[int], lora_name: str = "", cache_salt: str = "") -> dict[str, int]:
        with grpc.insecure_channel(self.indexer) as channel:
            reply = kv_indexer_pb2_grpc.KVIndexerStub(channel).Score(
                kv_indexer_pb2.ScoreRequest(model=MODEL, token_ids=tokens, lora_name=lora_name, cache_salt=cache_salt),
                timeout=5,
            )
        return {s.endpoint_id: s.matched_blocks for s in reply.scores}

    def wait_score(self, tokens: list[int], holder: str, until: Callable[[int], bool], what: str, **scope: str) -> None:
        wait_until(lambda: self.score(tokens, **scope).get(holder, 0), 15, what, until=until)

    def pick(self, tokens: list[int], lora_name: str = "", cache_salt: str = "") -> epp_pb2.PickResponse:
        with grpc.insecure_channel(self.epp) as channel:
            return epp_pb2_grpc.EndpointPickerStub(channel).Pick(
                epp_pb2.PickRequest(request_id="t", model=MODEL, prompt_token_ids=tokens, lora_name=lora_name,
                                    cache_salt=cache_salt),
                timeout=5,
            )

    def complete(self, tokens: list[int], model: str = MODEL, **extra: object) -> httpx.Response:
        reply = httpx.post(
            f"{self.router_http}/v1/completions",
            json={"model": model, "prompt": tokens, "max_tokens": 2, **extra},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        return reply


def prompt(seed: int, blocks: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 2000 for i in range(blocks * BLOCK)]


def cached(reply: httpx.Response) -> int:
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@contextmanager
def mesh_pool(start_service, etcd: str, run_dir: Path, engines: list[tuple[str, list[str]]]) -> Iterator[Pool]:  # type: ignore[no-untyped-def]
    """Start the mesh with one simulated engine per ``(personality, extra flags)``."""
    events_port = free_port()
    _, indexer = start_service("kv_indexer", "--events-bind-endpoint", f"tcp://127.0.0.1:{events_port}")
    _, flow = start_service("flow_control")
    _, epp = start_service("epp", "--kv-indexer-address", indexer, "--scheduling-config", "precise-prefix")
    procs: list[ManagedProcess] = []
    ids: dict[str, str] = {}
    try:
        for personality, flags in engines:
            port = free_port()
            procs.append(ManagedProcess(
                f"engine-{personality}-{port}",
                python_module(
                    "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                    "--block-size-tokens", str(BLOCK), "--num-gpu-blocks", "512", "--personality", personality,
                    "--events-endpoint", f"tcp://127.0.0.1:{events_port}", "--etcd-endpoints", etcd,
                    "--lease-ttl-seconds", "3", "--time-scale", "20",
                    "--events-replay-endpoint", "tcp://127.0.0.1:*", *flags,
                ),
                run_dir / f"engine-{personality}-{port}.log",
            ).start())
            ids[f"127.0.0.1:{port}"] = personality
        for endpoint_id in ids:
            wait_http_ok(f"http://{endpoint_id}/health", 60)
        http_port = free_port()
        start_service("router", "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address", epp)
        with grpc.insecure_channel(epp) as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            wait_until(
                lambda: [e for e in stub.ListEndpoints(epp_pb2.ListEndpointsRequest(), timeout=2).endpoints
                         if e.metrics_age_seconds >= 0],
                30,
                "epp to see and scrape every engine",
                until=lambda scraped: len(scraped) == len(ids),
            )
        router_http = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: httpx.get(f"{router_http}/v1/models").json().get("data"), 30, "the router to list the model")
        yield Pool(indexer, epp, router_http, ids)
    finally:
        for proc in procs:
            proc.stop()
