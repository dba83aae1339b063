"""Requests lost and status classes when flow_control or epp is killed -9 under load.

For each fault (``flow_control``, ``epp``): a fresh mesh (2 simulated engines, round-robin),
``--requests`` completions sent at ``--concurrency``, the dependency SIGKILLed once a third of them
has been sent; then 20 more requests and one gRPC ``Complete`` after the kill. Prints a table of
status classes (2xx / 4xx / 429 / 503 / 500 / transport error) and writes JSON when asked.

Uses only the stable harness API (``Mesh(MeshSpec)``, ``mesh.members``), so the same script can be
run against an older tree for a before/after comparison::

    .venv/bin/python bench/degraded_modes.py                       # this tree
    git archive HEAD | tar -x -C /tmp/head && cd /tmp/head && \\
        PYTHONPATH=/tmp/head /work/main/.venv/bin/python /work/main/bench/degraded_modes.py   # the commit
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from kvmesh._proto.kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_cli.mesh import Mesh, MeshSpec

MODEL = "sim-bench"


def _klass(code: int) -> str:
    if code == 599:
        return "transport"
    if code in (429, 503, 500, 504):
        return str(code)
    return f"{code // 100}xx"


async def _run(mesh: Mesh, victim: str, requests: int, concurrency: int) -> dict[str, object]:
    sem = asyncio.Semaphore(concurrency)
    sent = 0
    killed_at: float | None = None
    start = time.monotonic()

    async def one(client: httpx.AsyncClient, i: int) -> int:
        nonlocal sent, killed_at
        async with sem:
            sent += 1
            if sent == requests // 3 and killed_at is None:
                for m in mesh.members:
                    if m.name == victim:
                        m.process.kill()
                killed_at = time.monotonic() - start
            try:
                reply = await client.post(f"{mesh.router_url}/v1/completions",
                                          json={"model": MODEL, "prompt": f"req {i} hello", "max_tokens": 4})
            except httpx.HTTPError:
                return 599
            return reply.status_code

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        during = collections.Counter(_klass(c) for c in await asyncio.gather(*(one(client, i) for i in range(requests))))
        after = collections.Counter()
        for i in range(20):
            try:
                reply = await client.post(f"{mesh.router_url}/v1/completions",
                                          json={"model": MODEL, "prompt": f"after {i}", "max_tokens": 2})
                after[_klass(reply.status_code)] += 1
            except httpx.HTTPError:
                after["transport"] += 1
    router = next(m for m in mesh.members if m.name == "router")
    with grpc.insecure_channel(router.grpc or "") as channel:
        try:
            router_pb2_grpc.InferenceStub(channel).Complete(
                router_pb2.CompletionRequest(model=MODEL, prompt="grpc after", max_tokens=2), timeout=30)
            grpc_code = "OK"
        except grpc.RpcError as exc:
            grpc_code = exc.code().name
    return {"victim": victim, "during": dict(during), "after": dict(after), "grpc_after": grpc_code,
            "killed_at_s": round(killed_at or 0.0, 2)}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json-out", type=Path)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = []
    for victim in ("flow_control", "epp"):
        with tempfile.TemporaryDirectory() as tmp:
            spec = MeshSpec(run_dir=Path(tmp), engines=2, policy="round-robin", time_scale=50.0, model=MODEL,
                            num_gpu_blocks=256)
            with Mesh(spec) as mesh:
                rows.append(asyncio.run(_run(mesh, victim, args.requests, args.concurrency)))
    print(f"{'killed':<14}{'during (' + str(args.requests) + ' requests)':<44}{'20 after':<28}grpc after")
    for row in rows:
        fmt = lambda c: " ".join(f"{k}={v}" for k, v in sorted(c.items()))  # noqa: E731
        print(f"{row['victim']:<14}{fmt(row['during']):<44}{fmt(row['after']):<28}{row['grpc_after']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
