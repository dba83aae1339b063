"""The whole mesh as processes: real etcd, the five services, simulated engines, real ZMQ and gRPC.

Scenarios from issue 2: requests sharing a prefix land on the engine holding it; an engine's
``AllBlocksCleared`` makes it score 0; a killed engine is never picked afterwards; every
service's methods are listed by server reflection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2
from kvmesh._proto.kvmesh.router.v1 import router_pb2
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration

MODEL = "sim"
BLOCK = 64


@dataclass
class Mesh:
    indexer: str
    flow: str
    epp: str
    store: str
    router_grpc: str
    router_http: str
    engines: dict[str, ManagedProcess]  # endpoint id -> process


@pytest.fixture
def mesh(start_service, etcd: str, run_dir: Path) -> Iterator[Mesh]:
    events_port = free_port()
    _, indexer = start_service("kv_indexer", "--events-bind-endpoint", f"tcp://127.0.0.1:{events_port}")
    _, flow = start_service("flow_control")
    _, store = start_service("kv_store")
    _, epp = start_service("epp", "--kv-indexer-address", indexer, "--scheduling-config", "precise-prefix")
    engines: dict[str, ManagedProcess] = {}
    for _ in range(2):
        port = free_port()
        engines[f"127.0.0.1:{port}"] = ManagedProcess(
            f"engine-{port}",
            python_module(
                "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                "--block-size-tokens", str(BLOCK), "--num-gpu-blocks", "512",
                "--events-endpoint", f"tcp://127.0.0.1:{events_port}", "--etcd-endpoints", etcd,
                "--lease-ttl-seconds", "3", "--time-scale", "20",
            ),
            run_dir / f"engine-{port}.log",
        ).start()
    http_port = free_port()
    try:
        for endpoint_id in engines:
            wait_http_ok(f"http://{endpoint_id}/health", 60)
        _, router_grpc = start_service(
            "router", "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address", epp
        )
        with grpc.insecure_channel(epp) as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            wait_until(
                lambda: len(stub.ListEndpoints(epp_pb2.ListEndpointsRequest(), timeout=2).endpoints),
                30,
                "epp to see both engines",
                until=lambda n: n == 2,
            )
        router_http = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: httpx.get(f"{router_http}/v1/models").json().get("data"), 30, "the router to list the model")
        yield Mesh(indexer, flow, epp, store, router_grpc, router_http, engines)
    finally:
        for proc in engines.values():
            proc.stop()


def _prompt(seed: int, blocks: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 2000 for i in range(blocks * BLOCK)]


def _complete(mesh: Mesh, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    reply = httpx.post(
        f"{mesh.router_http}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return reply


def _scores(mesh: Mesh, prompt: list[int]) -> dict[str, int]:
    with grpc.insecure_channel(mesh.indexer) as channel:
        reply = kv_indexer_pb2_grpc.KVIndexerStub(channel).Score(
            kv_indexer_pb2.ScoreRequest(model=MODEL, token_ids=prompt), timeout=5
        )
    return {s.endpoint_id: s.matched_blocks for s in reply.scores}


def _wait_held_blocks(mesh: Mesh, prompt: list[int], holder: str, until: Callable[[int], bool], what: str) -> None:
    """Wait until the indexer's matched blocks of ``prompt`` on ``holder`` satisfy ``until``."""
    wait_until(lambda: _scores(mesh, prompt).get(holder, 0), 10, what, until=until)


def test_shared_prefix_lands_on_the_engine_holding_it(mesh: Mesh) -> None:
    for seed in range(3):
        prefix = _prompt(seed, 8)
        first = _complete(mesh, prefix + [5, 6, 7])
        holder = first.headers["x-kvmesh-endpoint"]
        _wait_held_blocks(mesh, prefix, holder, lambda n: n >= 8, "indexer to learn the prefix")
        # Follow-ups share the 8-block prefix with different tails: they go to the holder and hit its cache.
        for tail in range(3):
            reply = _complete(mesh, prefix + _prompt(100 + seed * 10 + tail, 1))
            assert reply.headers["x-kvmesh-endpoint"] == holder
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * BLOCK


def test_all_blocks_cleared_scores_zero(mesh: Mesh) -> None:
    prefix = _prompt(42, 6)
    holder = _complete(mesh, prefix).headers["x-kvmesh-endpoint"]
    _wait_held_blocks(mesh, prefix, holder, lambda n: n >= 5, "indexer to learn the prefix")
    assert httpx.post(f"http://{holder}/reset_prefix_cache", timeout=5).status_code == 200
    # vLLM publishes AllBlocksCleared at its next step: send an unrelated request to that engine.
    httpx.post(
        f"http://{holder}/v1/completions", json={"model": MODEL, "prompt": [9, 9, 9], "max_tokens": 1}, timeout=10
    )
    _wait_held_blocks(mesh, prefix, holder, lambda n: n == 0, "the holder to score 0")


def test_killed_engine_is_never_picked(mesh: Mesh) -> None:
    victim_id, victim = next(iter(mesh.engines.items()))
    survivor_id = next(i for i in mesh.engines if i != victim_id)
    victim.kill()  # no deregistration: etcd forgets it when its lease (3 s) expires
    for seed in range(6):  # before the lease expires the router retries on the fallback
        reply = _complete(mesh, _prompt(200 + seed, 2))
        assert reply.headers["x-kvmesh-endpoint"] == survivor_id
    with grpc.insecure_channel(mesh.epp) as channel:
        stub = epp_pb2_grpc.EndpointPickerStub(channel)
        wait_until(
            lambda: [e.endpoint.id for e in stub.ListEndpoints(epp_pb2.ListEndpointsRequest()).endpoints],
            15,
            "epp to drop the killed engine",
            until=lambda ids: ids == [survivor_id],
        )
    wait_until(
        lambda: _scores(mesh, _prompt(200, 2)), 15, "indexer to purge the killed engine", until=lambda s: victim_id not in s
    )


def _contract(module: object, service: str) -> dict[str, set[str]]:
    """Every method of ``service`` as the generated contract (``proto/``) defines it."""
    descriptor = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {descriptor.full_name: {m.name for m in descriptor.methods}}


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ("indexer", _contract(kv_indexer_pb2, "KVIndexer")),
        ("flow", _contract(flow_control_pb2, "FlowControl")),
        ("epp", _contract(epp_pb2, "EndpointPicker")),
        ("store", _contract(kv_store_pb2, "KVStore")),
        ("router_grpc", _contract(router_pb2, "Inference")),
    ],
    ids=["kv_indexer", "flow_control", "epp", "kv_store", "router"],
)
def test_reflection_lists_every_method(mesh: Mesh, service: str, expected: dict[str, set[str]]) -> None:
    with grpc.insecure_channel(getattr(mesh, service)) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert "grpc.health.v1.Health" in services
        for name, methods in expected.items():
            assert name in services
            descriptor = database.FindFileContainingSymbol(name)
            found = {m.name for s in descriptor.service if f"{descriptor.package}.{s.name}" == name for m in s.method}
            assert found == methods
