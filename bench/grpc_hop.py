"""What one request's gRPC calls cost the router, by call shape: the numbers behind the admission/pick design.

A grpc.aio server and client in two processes on 127.0.0.1 (the server echoes bytes; no protobuf
work), each shape run ``--rounds`` times sequentially, with and without the client interceptors
kvmesh's channels carry (OpenTelemetry's, which propagate the W3C trace context):

* ``admission stream``: what the router does per request today: open a stream-stream call, write
  Enqueue, read the decision, later write Complete, half-close, read the end (the slot's life is
  the stream's: flow_control frees it when the stream ends, whatever kills the router);
* ``unary``: one unary call (a Pick; or what a unary admission would cost);
* ``unary x2``: a unary admission plus a unary release (the alternative to the stream: it needs a
  lease/TTL so a crashed router does not leak its slots);
* ``stream message``: one message and its reply on a bidirectional stream opened once (the
  per-pick cost of ``PickMany`` / ``AdmitMany`` without their writer/reader tasks);
* ``stream message, tasks``: the same through a writer task and a reader task resolving a future
  by id (the router's ``_MuxCall`` shape: two extra event-loop hand-offs per message);
* ``raw socket``: one length-prefixed message and its reply over a plain asyncio TCP connection
  opened once (uvloop on both sides): the floor of any Python transport between two processes.

    .venv/bin/python bench/grpc_hop.py --rounds 2000
"""

from __future__ import annotations

import argparse
import asyncio
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

    async def echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        async for request in requests:
            await context.write(request)

    handler = grpc.method_handlers_generic_handler("bench.Hop", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream),
        "Echo": grpc.stream_stream_rpc_method_handler(echo),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def raw_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(header, "little"))
                writer.write(header + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    raw = await asyncio.start_server(raw_echo, "127.0.0.1", 0)
    raw_port = raw.sockets[0].getsockname()[1]
    port_queue.put(port)
    port_queue.put(raw_port)
    await server.wait_for_termination()


def _server_main(port_queue: multiprocessing.Queue[int]) -> None:
    import uvloop

    uvloop.run(_serve(port_queue))


class _TaskedStream:
    """The router's ``_MuxCall`` shape in a few lines: send() queues and wakes a writer task; a
    reader task resolves the caller's future."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        self._outbox: list[bytes] = []
        self._wake = asyncio.Event()
        self._waiting: asyncio.Future[bytes] | None = None
        self._tasks = (asyncio.create_task(self._write()), asyncio.create_task(self._read()))

    async def ask(self, message: bytes) -> bytes:
        self._waiting = asyncio.get_running_loop().create_future()
        self._outbox.append(message)
        self._wake.set()
        return await self._waiting

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._outbox = self._outbox, []
            for message in batch:
                await self._call.write(message)

    async def _read(self) -> None:
        while True:
            message = await self._call.read()
            if self._waiting is not None:
                self._waiting.set_result(message)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._call.cancel()


async def _client(port: int, raw_port: int, rounds: int, intercepted: bool) -> dict[str, list[float]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=aio_client_interceptors() if intercepted else None)
    unary = channel.unary_unary("/bench.Hop/Unary")
    stream = channel.stream_stream("/bench.Hop/Stream")
    echo = channel.stream_stream("/bench.Hop/Echo")
    open_stream = echo()
    tasked = _TaskedStream(echo())
    reader, writer = await asyncio.open_connection("127.0.0.1", raw_port)
    out: dict[str, list[float]] = {"admission stream": [], "unary": [], "unary x2": [], "stream message": [],
                                   "stream message, tasks": [], "raw socket": []}
    payload = b"p" * 200  # about a lean PickRequest's size
    framed = len(payload).to_bytes(4, "little") + payload
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
        await open_stream.write(payload)
        await open_stream.read()
        t4 = time.perf_counter()
        await tasked.ask(payload)
        t5 = time.perf_counter()
        writer.write(framed)
        await reader.readexactly(len(framed))
        t6 = time.perf_counter()
        if i >= 100:  # warm-up
            out["admission stream"].append(t1 - t0)
            out["unary"].append(t2 - t1)
            out["unary x2"].append(t3 - t2)
            out["stream message"].append(t4 - t3)
            out["stream message, tasks"].append(t5 - t4)
            out["raw socket"].append(t6 - t5)
    await tasked.close()
    open_stream.cancel()
    writer.close()
    await channel.close()
    return out


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=2000)
    return parser


def main() -> int:
    ns = build_parser().parse_args()
    ctx = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue[int] = ctx.Queue()
    server = ctx.Process(target=_server_main, args=(ports,), daemon=True)
    server.start()
    port = ports.get(timeout=30)
    raw_port = ports.get(timeout=30)
    import uvloop

    table = Table(title=f"gRPC call shapes, {ns.rounds} sequential rounds, client on uvloop (µs)")
    for column in ("shape", "interceptors", "p50", "p99", "mean"):
        table.add_column(column, justify="left" if column in ("shape", "interceptors") else "right")
    try:
        for intercepted in (True, False):
            result = uvloop.run(_client(port, raw_port, ns.rounds, intercepted))
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
