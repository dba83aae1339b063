"""What one request's gRPC calls cost the router, by call shape: the numbers behind the admission/pick design.

A grpc.aio server and client in two processes on 127.0.0.1 (the server echoes bytes; no protobuf
work), each shape run ``--rounds`` times sequentially, with and without the client interceptors
kvmesh's channels carry (OpenTelemetry's, which propagate the W3C trace context):

* ``admission stream``: what the router does per request today: open a stream-stream call, write
  Enqueue, read the decision, later write Complete, half-close, read the end (the slot's life is
  the stream's: flow_control frees it when the stream ends, whatever kills the router);
* ``unary``: one unary call (a Pick; or what a unary admission would cost);
* ``unary x2``: a unary admission plus a unary release (the alternative to the stream: it needs a
  lease/TTL so a crashed router does not leak its slots).

    .venv/bin/python bench/grpc_hop.py --rounds 2000
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from rich.console import Console
from rich.table import Table


async def _serve(port_queue: multiprocessing.Queue[int]) -> None:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            if request == b"enqueue":
                yield b"dispatched"
        # the stream ended (Complete + half-close): the slot is free

    handler = grpc.method_handlers_generic_handler("bench.Hop", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_queue.put(port)
    await server.wait_for_termination()


def _server_main(port_queue: multiprocessing.Queue[int]) -> None:
    import uvloop

    uvloop.run(_serve(port_queue))


async def _client(port: int, rounds: int, intercepted: bool) -> dict[str, list[float]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=aio_client_interceptors() if intercepted else None)
    unary = channel.unary_unary("/bench.Hop/Unary")
    stream = channel.stream_stream("/bench.Hop/Stream")
    out: dict[str, list[float]] = {"admission stream": [], "unary": [], "unary x2": []}
    for i in range(rounds + 100):
        t0 = time.perf_counter()
        call = stream()
        await call.write(b"enqueue")
        await call.read()
        await call.write(b"complete")
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
        t1 = time.perf_counter()
        await unary(b"pick")
        t2 = time.perf_counter()
        await unary(b"admit")
        await unary(b"release")
        t3 = time.perf_counter()
        if i >= 100:  # warm-up
            out["admission stream"].append(t1 - t0)
            out["unary"].append(t2 - t1)
            out["unary x2"].append(t3 - t2)
    await channel.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    ns = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue[int] = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    port = ports.get(timeout=30)
    import uvloop

    table = Table(title=f"gRPC call shapes, {ns.rounds} sequential rounds, client on uvloop (µs)")
    for column in ("shape", "interceptors", "p50", "p99", "mean"):
        table.add_column(column, justify="left" if column in ("shape", "interceptors") else "right")
    try:
        for intercepted in (True, False):
            result = uvloop.run(_client(port, ns.rounds, intercepted))
            for shape, values in result.items():
                q = statistics.quantiles(values, n=100)
                table.add_row(shape, "OpenTelemetry" if intercepted else "none",
                              f"{1e6 * statistics.median(values):.0f}", f"{1e6 * q[98]:.0f}", f"{1e6 * statistics.fmean(values):.0f}")
    finally:
        server.terminate()
    Console().print(table)
    Console().print("command: " + " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
