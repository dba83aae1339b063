"""The router's pick transport, A/B in one run: one multiplexed ``EndpointPicker.PickMany`` stream vs
one unary ``Pick`` call per request (issue 10, ``pick_transport``).

epp's real servicer and scheduler (the shared server interceptors included) run in their own process
on uvloop, over a pool of ``--endpoints`` endpoints with fresh metrics; the router's real
``PickerClient`` runs in this process on uvloop, one client per transport, each reporting every
request's completion after its pick as the router does (unary: batched ``Completed`` calls;
multiplexed: riding the stream's writes). ``--rounds`` rounds alternate the transports (which one
goes first alternates too); each round runs ``--sequential`` picks one at a time (latency) and
``--concurrent`` picks from ``--concurrency`` concurrent callers (throughput), and counts the CPU
both processes spent (``/proc/<pid>/stat``). The ``precise-prefix`` profile sends ``--prompt-tokens``
token ids with each pick and scores them against an in-process stand-in index that reports no
cached prefix (the bench measures the transport, not kv_indexer).

    .venv/bin/python bench/pick_transport.py --rounds 6 --sequential 300 --concurrent 2000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TRANSPORTS = ("multiplexed", "unary")


class _NoPrefixIndex:
    """Stand-in for kv_indexer's Score in the bench: no endpoint holds a cached prefix."""

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> object:
        from services.epp.framework.interfaces import PrefixMatch

        return PrefixMatch(len(token_ids) // 64, {})


async def _serve(port_queue: multiprocessing.Queue[int], profile_name: str, endpoints: int) -> None:
    import grpc

    from kvmesh._proto.kvmesh.epp.v1 import epp_pb2_grpc
    from kvmesh.clock import ManualClock
    from kvmesh.interceptors import server_interceptors
    from kvmesh.types import Endpoint, EndpointId
    from services.epp.datastore import Datastore, ScrapeSample
    from services.epp.framework.interfaces import PluginHandle
    from services.epp.framework.loader import build_profile, resolve_scheduling_config
    from services.epp.plugins import default_registry
    from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
    from services.epp.scheduler import Scheduler
    from services.epp.servicer import EndpointPickerServicer

    datastore = Datastore(ManualClock())  # the clock stands still: every scrape stays fresh
    source, data = resolve_scheduling_config(profile_name)
    handle = PluginHandle(rng=random.Random(0), prefix_index=_NoPrefixIndex())  # type: ignore[arg-type]
    profile = build_profile(data, default_registry(), handle, source)
    pool = [Endpoint(id=EndpointId(f"127.0.0.1:{20000 + i}"), url=f"http://127.0.0.1:{20000 + i}", model="m")
            for i in range(endpoints)]
    datastore.set_endpoints({e.id: e for e in pool})
    for e in pool:
        datastore.record_scrape(e.id, ScrapeSample(0, 0, 0.0))
    server = grpc.aio.server(interceptors=server_interceptors())
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(
        EndpointPickerServicer(Scheduler(datastore, profile, LiveEndpointFilter("live"))), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_queue.put(port)
    await server.wait_for_termination()


def _server_main(port_queue: multiprocessing.Queue[int], profile_name: str, endpoints: int) -> None:
    import uvloop

    uvloop.run(_serve(port_queue, profile_name, endpoints))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(ns: argparse.Namespace, port: int, server_pid: int) -> dict[str, dict[str, list[float]]]:
    from kvmesh.types import CompletionOutcome, RequestCompletion
    from services.router.clients import PickerClient, PickQuery

    clients = {t: PickerClient(f"127.0.0.1:{port}", timeout_seconds=5.0, multiplexed=t == "multiplexed")
               for t in TRANSPORTS}
    tokens = tuple(range(ns.prompt_tokens))
    out: dict[str, dict[str, list[float]]] = {
        t: {"latency": [], "rate": [], "client_cpu": [], "server_cpu": []} for t in TRANSPORTS}
    counter = iter(range(1 << 62))

    async def one(client: PickerClient) -> float:
        request_id = f"r{next(counter)}"
        t0 = time.perf_counter()
        reply = await client.pick(PickQuery(request_id, "m", prompt_token_ids=tokens))
        elapsed = time.perf_counter() - t0
        client.report_completed(RequestCompletion(request_id, reply.candidates[0].id, ns.prompt_tokens, 0,
                                                  CompletionOutcome.SUCCESS))
        return elapsed

    try:
        for client in clients.values():
            await client.connect()
            for _ in range(50):  # warm-up: channel, GetPickerInfo, stream
                await one(client)
        for round_ in range(ns.rounds):
            order = TRANSPORTS if round_ % 2 == 0 else TRANSPORTS[::-1]
            for transport in order:
                client = clients[transport]
                c0, s0 = time.process_time(), _cpu_seconds(server_pid)
                out[transport]["latency"] += [await one(client) for _ in range(ns.sequential)]
                remaining = ns.concurrent

                async def caller(c: PickerClient = client) -> None:
                    nonlocal remaining
                    while remaining > 0:
                        remaining -= 1
                        await one(c)

                t0 = time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(ns.concurrency)))
                out[transport]["rate"].append(ns.concurrent / (time.perf_counter() - t0))
                await asyncio.sleep(0.05)  # the last completions leave
                picks = ns.sequential + ns.concurrent
                out[transport]["client_cpu"].append((time.process_time() - c0) / picks)
                out[transport]["server_cpu"].append((_cpu_seconds(server_pid) - s0) / picks)
                print(f"round {round_ + 1}/{ns.rounds} {transport}: {out[transport]['rate'][-1]:.0f} picks/s",
                      file=sys.stderr)
    finally:
        for client in clients.values():
            await client.close()
    return out


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=6, help="rounds; each runs both transports (order alternates)")
    parser.add_argument("--sequential", type=int, default=300, help="picks one at a time per round and transport")
    parser.add_argument("--concurrent", type=int, default=2000, help="picks under --concurrency per round and transport")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent callers (wrk's connections)")
    parser.add_argument("--profile", default="precise-prefix", help="epp scheduling config (load-only sends no prompt)")
    parser.add_argument("--endpoints", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    return parser


def main() -> int:
    ns = build_parser().parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue[int] = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports, ns.profile, ns.endpoints), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        import uvloop
        from rich.console import Console
        from rich.table import Table

        result = uvloop.run(_run(ns, port, server.pid or 0))
    finally:
        server.terminate()
    table = Table(title=f"pick transport, {ns.rounds} interleaved rounds, {ns.profile}, {ns.endpoints} endpoints, "
                        f"{ns.prompt_tokens}-token prompts")
    for column in ("transport", "seq p50 µs", "seq p99 µs", f"picks/s @{ns.concurrency}",
                   "router CPU µs/pick", "epp CPU µs/pick"):
        table.add_column(column, justify="left" if column == "transport" else "right")
    for transport, row in result.items():
        q = statistics.quantiles(row["latency"], n=100)
        table.add_row(transport, f"{1e6 * statistics.median(row['latency']):.0f}", f"{1e6 * q[98]:.0f}",
                      f"{statistics.median(row['rate']):.0f}", f"{1e6 * statistics.median(row['client_cpu']):.0f}",
                      f"{1e6 * statistics.median(row['server_cpu']):.0f}")
    mux, unary = result["multiplexed"], result["unary"]
    table.add_row("multiplexed / unary",
                  f"{statistics.median(mux['latency']) / statistics.median(unary['latency']):.2f}", "",
                  f"{statistics.median(mux['rate']) / statistics.median(unary['rate']):.2f}",
                  f"{statistics.median(mux['client_cpu']) / statistics.median(unary['client_cpu']):.2f}",
                  f"{statistics.median(mux['server_cpu']) / statistics.median(unary['server_cpu']):.2f}")
    console = Console()
    console.print(table)
    console.print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
