"""kv_store data-path throughput against this machine's own limits, side by side in one run.

    .venv/bin/python bench/kv_store_bench.py [--values 64] [--rounds 3] [--png docs/img/kv_store_bench.png]

Measures, in one run:

1. **loopback TCP**: one stream of ``--values x --value-mib`` MiB from a child process to this one
   (``sendall`` of 2 MiB buffers / ``recv_into`` a 4 MiB buffer, timed from the first byte): the
   ceiling for one gRPC stream.
2. **gRPC** through a real kv_store process (CPU tier large enough to hold every value), each
   variant of the data path as its own row: Put from a protobuf client vs a pre-encoded client
   (:func:`services.kv_store.servicer.encode_put_requests`, one copy per chunk) with 2 MiB, 1 MiB
   and 256 KiB chunks, ``--concurrency`` streams, Get / BatchGet with a pass-through and with a
   protobuf-parsing client. The machine is shared, so the loopback baseline and every gRPC row are
   measured in ``--rounds`` interleaved rounds: the ratio is the median of the per-round ratios
   (each row against the loopback figure of its own round), with the range. For each row the
   server's CPU time per value (``/proc/<pid>/stat``) and the **CPU ceiling**: the rate the server
   could reach if that CPU time were all it needed (value bytes / CPU seconds), as a share of loopback.
3. **disk sequential**: one file of the same total size written in 2 MiB blocks and fsynced, then
   read back after ``posix_fadvise(DONTNEED)`` (measured before and after the tier reads; the mean
   is the baseline).
4. **NVMe tier** (``DiskTier`` in this process): put with fsync policy ``none`` + one ``os.sync()``
   counted in the time (as the baseline's one fsync) and with ``data`` (one fsync per value); get
   after dropping every value file from the page cache, one and ``--concurrency`` in flight; and,
   as its profile, reads of the same files without the tier: the previous read path
   (``POSIX_FADV_WILLNEED`` + CRC-32) and a plain ``open().read()``.

Prints a table of MiB/s and each kv_store figure as a percentage of its baseline (targets: >= 50 %),
and writes a bar chart with ``--png``.

``--levers`` instead runs the gRPC lever A/B (issue 8, item 5's target; docs/BENCHMARKS.md section 6):
a bare ``grpc.aio.server`` (or sync ``grpc.server``) with kv_store's servicer over a CPU tier, one
child process per variant (``--lever-server``), each variant's options on the server and the client
channel, loopback TCP measured at the start of each round and the variants rotated between rounds;
per variant the median over rounds of Put/Get (pass-through clients, 2 MiB messages) as a share of
the round's loopback, 1 and 4 streams, and the server's CPU ms per value. ``--levers-only a,b``
picks variants by substring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, start_etcd, wait_grpc_healthy
from services.kv_store.servicer import encode_put_requests
from services.kv_store.tiers.files import DiskTier, FsyncPolicy

MIB = 1 << 20
CHUNK = 2 * MIB  # one message per 2 MiB value (under gRPC's 4 MiB default limit)
PUT_METHOD = "/kvmesh.kv_store.v1.KVStore/Put"
GET_METHOD = "/kvmesh.kv_store.v1.KVStore/Get"


def _tcp_sender(port: int, total: int, block: int) -> None:
    data = os.urandom(block)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sent = 0
        while sent < total:
            sock.sendall(data)
            sent += block


def loopback_tcp(total: int, block: int) -> float:
    """Bytes per second of one loopback TCP stream from a child process."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        child = multiprocessing.get_context("spawn").Process(target=_tcp_sender, args=(port, total, block))
        child.start()
        conn, _ = server.accept()
        buf = bytearray(4 * MIB)
        view = memoryview(buf)
        got = conn.recv_into(view)  # the clock starts at the first byte, after the child's start-up
        start = time.perf_counter()
        total -= got
        got = 0
        with conn:
            while got < total:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
        elapsed = time.perf_counter() - start
        child.join()
    return got / elapsed


async def _pb_put_stream(key: str, value: bytes, chunk: int) -> AsyncIterator[pb.PutRequest]:
    view = memoryview(value)
    yield pb.PutRequest(key=key, total_bytes=len(value), data=bytes(view[:chunk]))
    for offset in range(chunk, len(value), chunk):
        yield pb.PutRequest(data=bytes(view[offset : offset + chunk]))


async def _raw_put_stream(key: str, value: bytes, chunk: int) -> AsyncIterator[bytes]:
    for message in encode_put_requests(key, value, chunk):
        yield message


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Series:
    """One row's per-round figures: bytes/s, the round's loopback bytes/s, server CPU s per value."""

    rates: list[float] = field(default_factory=list)
    baselines: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [r / b for r, b in zip(self.rates, self.baselines, strict=True)]


async def grpc_round(
    address: str, values: list[bytes], concurrency: int, server_pid: int, tcp: float, series: dict[str, Series]
) -> None:
    """Every gRPC variant once against ``tcp`` (this round's loopback figure)."""
    total = sum(len(v) for v in values)
    n = len(values)
    options = [("grpc.max_receive_message_length", 8 * MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        raw_put = channel.stream_unary(
            PUT_METHOD, request_serializer=lambda b: b, response_deserializer=pb.PutResponse.FromString
        )
        raw_get = channel.unary_stream(
            GET_METHOD, request_serializer=pb.GetRequest.SerializeToString, response_deserializer=lambda b: b
        )

        async def timed(name: str, work: Callable[[], object]) -> None:
            cpu0 = cpu_seconds(server_pid)
            start = time.perf_counter()
            await work()  # type: ignore[misc]
            elapsed = time.perf_counter() - start
            row = series.setdefault(name, Series())
            row.rates.append(total / elapsed)
            row.baselines.append(tcp)
            row.cpu.append((cpu_seconds(server_pid) - cpu0) / n)

        async def puts(raw: bool, chunk: int, streams: int) -> None:
            sem = asyncio.Semaphore(streams)

            async def one(i: int, value: bytes) -> None:
                async with sem:
                    if raw:
                        await raw_put(_raw_put_stream(f"v{i}", value, chunk))
                    else:
                        await stub.Put(_pb_put_stream(f"v{i}", value, chunk))

            await asyncio.gather(*(one(i, v) for i, v in enumerate(values)))

        async def gets(raw: bool, streams: int) -> None:
            sem = asyncio.Semaphore(streams)
            got = 0

            async def one(i: int) -> None:
                nonlocal got
                async with sem:
                    if raw:
                        async for message in raw_get(pb.GetRequest(key=f"v{i}")):
                            got += len(message)
                    else:
                        async for reply in stub.Get(pb.GetRequest(key=f"v{i}")):
                            got += len(reply.data)

            await asyncio.gather(*(one(i) for i in range(n)))
            assert got >= total, (got, total)

        async def batch_get() -> None:
            got = 0
            async for message in channel.unary_stream(
                "/kvmesh.kv_store.v1.KVStore/BatchGet",
                request_serializer=pb.BatchGetRequest.SerializeToString,
                response_deserializer=lambda b: b,
            )(pb.BatchGetRequest(keys=[f"v{i}" for i in range(n)])):
                got += len(message)
            assert got >= total

        await raw_put(_raw_put_stream("warm", values[0], CHUNK))
        await timed("Put, protobuf client, 2 MiB messages", lambda: puts(False, CHUNK, 1))
        await timed("Put, pre-encoded client, 2 MiB messages", lambda: puts(True, CHUNK, 1))
        await timed("Put, pre-encoded, 1 MiB chunks", lambda: puts(True, MIB, 1))
        await timed("Put, pre-encoded, 256 KiB chunks", lambda: puts(True, 256 * 1024, 1))
        await timed(f"Put, pre-encoded, {concurrency} streams", lambda: puts(True, CHUNK, concurrency))
        await timed("Get, protobuf client", lambda: gets(False, 1))
        await timed("Get, pass-through client", lambda: gets(True, 1))
        await timed(f"Get, pass-through, {concurrency} streams", lambda: gets(True, concurrency))
        await timed("BatchGet (1 call), pass-through", batch_get)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_sequential(root: Path, total: int, block: int) -> tuple[float, float]:
    """(write, read) bytes per second of one file in ``block`` writes + fsync, cold read."""
    path = root / "seq.bin"
    data = os.urandom(block)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    while written < total:
        written += os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    write_rate = total / (time.perf_counter() - start)
    _drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(block)
        while f.readinto(buf):
            pass
    read_rate = total / (time.perf_counter() - start)
    path.unlink()
    return write_rate, read_rate


def _plain_read(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            f.read()


def _old_tier_read(paths: list[Path]) -> None:
    """The tier's previous read path: ``POSIX_FADV_WILLNEED`` on the whole file, one read, CRC-32."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            data = os.read(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        zlib.crc32(data)


def _drop_all(tier: DiskTier, n: int) -> None:
    for i in range(n):
        _drop_cache(tier.path_of(f"v{i}"))


async def disk_tier(root: Path, values: list[bytes], concurrency: int) -> dict[str, float]:
    """name -> bytes per second: tier put (fsync none + os.sync, and fsync data), cold tier get (1 and
    ``concurrency`` in flight), and reads of the same files without the tier (the profile)."""
    total = sum(len(v) for v in values)
    n = len(values)
    rates: dict[str, float] = {}
    synced = DiskTier(root / "tier-data", total * 2, fsync=FsyncPolicy.DATA)
    start = time.perf_counter()
    for i, value in enumerate(values):
        await synced.put(f"v{i}", value)
    rates["NVMe tier put, fsync=data (each value)"] = total / (time.perf_counter() - start)
    tier = DiskTier(root / "tier", total * 2)
    start = time.perf_counter()
    for i, value in enumerate(values):
        await tier.put(f"v{i}", value)
    os.sync()
    rates["NVMe tier put, fsync=none + one sync"] = total / (time.perf_counter() - start)
    paths = [tier.path_of(f"v{i}") for i in range(n)]
    _drop_all(tier, n)
    start = time.perf_counter()
    _old_tier_read(paths)
    rates["previous read path (WILLNEED + CRC-32), cold"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    start = time.perf_counter()
    for i in range(n):
        assert await tier.get(f"v{i}") is not None
    rates["NVMe tier get, cold (SEQUENTIAL + XXH3)"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            assert await tier.get(f"v{i}") is not None

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    rates[f"NVMe tier get, cold, {concurrency} in flight"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    start = time.perf_counter()
    _plain_read(paths)
    rates["plain open().read() of the tier's files, cold"] = total / (time.perf_counter() - start)
    return rates


READ_CHUNK = [
    ("grpc.experimental.tcp_read_chunk_size", 2 * MIB),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 * 1024),
    ("grpc.experimental.tcp_max_read_chunk_size", 8 * MIB),
]
BIG_MESSAGES = [("grpc.max_receive_message_length", 64 * MIB), ("grpc.max_send_message_length", 64 * MIB)]
WINDOWS = [("grpc.http2.max_frame_size", 16 * MIB - 1), ("grpc.http2.lookahead_bytes", 64 * MIB), ("grpc.http2.bdp_probe", 0)]
LEVERS: dict[str, dict[str, Any]] = {
    "aio, defaults (kv_store today)": {"server": {"mode": "aio"}, "client": []},
    "aio, tcp_read_chunk 2M/min 256K/max 8M": {"server": {"mode": "aio", "options": READ_CHUNK}, "client": READ_CHUNK},
    "aio, read chunk + 64 MiB message limits": {
        "server": {"mode": "aio", "options": READ_CHUNK + BIG_MESSAGES}, "client": READ_CHUNK + BIG_MESSAGES,
    },
    "aio, max_frame 16M + lookahead 64M, no BDP": {"server": {"mode": "aio", "options": WINDOWS}, "client": WINDOWS},
    "aio, read chunk + frame/window": {
        "server": {"mode": "aio", "options": READ_CHUNK + WINDOWS}, "client": READ_CHUNK + WINDOWS,
    },
    "aio, max_frame 16M only": {
        "server": {"mode": "aio", "options": WINDOWS[:1]}, "client": WINDOWS[:1],
    },
    "aio, SO_RCVBUF 8M (grpc.tcp_receive_buffer_size)": {
        "server": {"mode": "aio", "options": [("grpc.tcp_receive_buffer_size", 8 * MIB)]},
        "client": [("grpc.tcp_receive_buffer_size", 8 * MIB)],
    },
    "aio, tcp_max_read_buffer 16M": {
        "server": {"mode": "aio", "options": [("grpc.experimental.tcp_max_read_buffer_size", 16 * MIB)]},
        "client": [("grpc.experimental.tcp_max_read_buffer_size", 16 * MIB)],
    },
    "aio, http2 write_buffer 8M": {
        "server": {"mode": "aio", "options": [("grpc.http2.write_buffer_size", 8 * MIB)]},
        "client": [("grpc.http2.write_buffer_size", 8 * MIB)],
    },
    "aio, Get in 256 KiB messages": {"server": {"mode": "aio", "chunk": 256 * 1024}, "client": []},
    "sync grpc.server, 8 threads": {"server": {"mode": "sync"}, "client": []},
    "sync, 8 threads + read chunk": {"server": {"mode": "sync", "options": READ_CHUNK}, "client": READ_CHUNK},
    "aio x2 processes, SO_REUSEPORT": {
        "server": {"mode": "aio", "options": [("grpc.so_reuseport", 1)]}, "client": [], "procs": 2,
    },
}


def lever_server(spec: str) -> None:
    """Serve Put/Get on 127.0.0.1 until killed (``--lever-server JSON``); prints the bound port."""
    from concurrent import futures

    from services.kv_store.servicer import (
        _GET_DATA_FIELD,
        SERVICE_NAME,
        KVStoreServicer,
        add_to_server,
        encode_get_chunk,
        parse_put_request,
    )
    from services.kv_store.store import BlockStore
    from services.kv_store.tiers.cpu import CpuTier

    cfg = json.loads(spec)
    options = [tuple(o) for o in cfg.get("options", [])]
    chunk = cfg.get("chunk", CHUNK)
    address = f"127.0.0.1:{cfg.get('port', 0)}"
    if cfg["mode"] == "sync":  # the same wire handling in a thread pool (no event loop)
        values: dict[str, bytes] = {}

        def put(requests: Any, context: Any) -> pb.PutResponse:
            first = next(requests)
            parts = [first.data, *(m.data for m in requests)]
            values[first.key] = b"".join(parts)
            return pb.PutResponse()

        def get(request: pb.GetRequest, context: Any) -> Any:
            view = memoryview(values[request.key])
            head = pb.GetResponse(total_bytes=len(view)).SerializeToString()
            yield encode_get_chunk(head, _GET_DATA_FIELD, view[:chunk])
            for offset in range(chunk, len(view), chunk):
                yield encode_get_chunk(b"", _GET_DATA_FIELD, view[offset : offset + chunk])

        handlers = {
            "Put": grpc.stream_unary_rpc_method_handler(
                put, request_deserializer=parse_put_request, response_serializer=pb.PutResponse.SerializeToString
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                get, request_deserializer=pb.GetRequest.FromString, response_serializer=lambda b: b
            ),
        }
        sync = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=options)
        sync.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        print(sync.add_insecure_port(address), flush=True)
        sync.start()
        sync.wait_for_termination()
        return

    async def serve() -> None:
        server = grpc.aio.server(options=options)
        add_to_server(KVStoreServicer(BlockStore([CpuTier(8 << 30)]), chunk), server)
        print(server.add_insecure_port(address), flush=True)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def lever_round(
    ports: list[int], client_options: list[Any], values: list[bytes], pids: list[int]
) -> dict[str, tuple[float, float]]:
    """Put then Get of every value with 1 and 4 streams; name -> (bytes/s, server CPU s per value)."""
    n, total = len(values), sum(len(v) for v in values)
    channels = [  # one connection each (own subchannel pool), spread over the server processes
        grpc.aio.insecure_channel(
            f"127.0.0.1:{ports[i % len(ports)]}",
            options=[*client_options, ("grpc.use_local_subchannel_pool", 1), ("kvmesh.bench.channel", i)],
        )
        for i in range(4)
    ]
    puts = [c.stream_unary(PUT_METHOD, request_serializer=lambda b: b, response_deserializer=pb.PutResponse.FromString)
            for c in channels]
    gets = [c.unary_stream(GET_METHOD, request_serializer=pb.GetRequest.SerializeToString, response_deserializer=lambda b: b)
            for c in channels]
    for put in puts:
        await put(_raw_put_stream("warm", values[0], CHUNK))
    out: dict[str, tuple[float, float]] = {}
    for streams in (1, 4):
        used = streams if len(ports) > 1 else 1
        sem = asyncio.Semaphore(streams)

        async def one_put(i: int, value: bytes, sem: asyncio.Semaphore = sem, used: int = used) -> None:
            async with sem:
                await puts[i % used](_raw_put_stream(f"v{i}", value, CHUNK))

        async def one_get(i: int, sem: asyncio.Semaphore = sem, used: int = used) -> int:
            async with sem:
                return sum([len(m) async for m in gets[i % used](pb.GetRequest(key=f"v{i}"))])

        cpu0, start = sum(map(cpu_seconds, pids)), time.perf_counter()
        await asyncio.gather(*(one_put(i, v) for i, v in enumerate(values)))
        out[f"Put x{streams}"] = (total / (time.perf_counter() - start), (sum(map(cpu_seconds, pids)) - cpu0) / n)
        cpu0, start = sum(map(cpu_seconds, pids)), time.perf_counter()
        got = sum(await asyncio.gather(*(one_get(i) for i in range(n))))
        out[f"Get x{streams}"] = (total / (time.perf_counter() - start), (sum(map(cpu_seconds, pids)) - cpu0) / n)
        assert got >= total, (got, total)
    for channel in channels:
        await channel.close()
    return out


def run_levers(values: list[bytes], rounds: int, only: str | None) -> None:
    """The lever A/B (module docstring): prints one row per variant."""
    import subprocess
    import sys

    names = [k for k in LEVERS if not only or any(part in k for part in only.split(","))]
    results: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in names}
    total = sum(len(v) for v in values)
    for r in range(rounds):
        tcp = loopback_tcp(total, len(values[0]))
        print(f"round {r + 1}: loopback TCP {tcp / MIB:.0f} MiB/s, load {os.getloadavg()[0]:.1f}", flush=True)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            lever = LEVERS[name]
            port = free_port() if lever.get("procs", 1) > 1 else 0
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--lever-server", json.dumps({**lever["server"], "port": port})],
                    stdout=subprocess.PIPE, text=True,
                )
                for _ in range(lever.get("procs", 1))
            ]
            try:
                ports = [int(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
                out = asyncio.run(lever_round(ports, lever["client"], values, [p.pid for p in procs]))
            finally:
                for p in procs:
                    p.terminate()
                    p.wait()
            for key, (rate, cpu) in out.items():
                results[name].setdefault(key, []).append((rate / tcp, cpu))
            print(f"  {name}: " + ", ".join(f"{k} {rate / tcp:.0%} {cpu * 1e3:.2f} ms" for k, (rate, cpu) in out.items()),
                  flush=True)
    cols = ["Put x1", "Get x1", "Put x4", "Get x4"]
    print("\n| variant | " + " | ".join(f"{c} (of loopback)" for c in cols) + " | server CPU ms/value Put x1 / Get x1 |")
    print("|---|" + "---:|" * len(cols) + "---|")
    for name in names:
        row = results[name]
        share = [f"{statistics.median(x[0] for x in row[c]):.0%}" for c in cols]
        cpu = [statistics.median(x[1] for x in row[c]) * 1e3 for c in ("Put x1", "Get x1")]
        print(f"| {name} | " + " | ".join(share) + f" | {cpu[0]:.2f} / {cpu[1]:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--values", type=int, default=64)
    parser.add_argument("--value-mib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of loopback + every gRPC row")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--disk-dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--png", default=None)
    parser.add_argument("--levers", action="store_true", help="run the gRPC lever A/B instead (module docstring)")
    parser.add_argument("--levers-only", default=None, help="comma-separated substrings of lever names")
    parser.add_argument("--lever-server", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.lever_server:
        lever_server(args.lever_server)
        return
    size = args.value_mib * MIB
    values = [os.urandom(size) for _ in range(min(args.values, 32))]
    values = [values[i % len(values)] for i in range(args.values)]
    total = size * args.values
    if args.levers:
        print(f"lever A/B: {args.values} values x {args.value_mib} MiB, {args.rounds} rounds, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        run_levers(values, args.rounds, args.levers_only)
        return
    print(f"{args.values} values x {args.value_mib} MiB = {total // MIB} MiB per measurement, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    run_dir = Path(tempfile.mkdtemp(prefix="kv_store_bench-"))
    etcd, etcd_address = start_etcd(run_dir)
    port = free_port()
    server = ManagedProcess(
        "kv_store",
        python_module(
            "services.kv_store",
            "--grpc-port",
            str(port),
            "--metrics-port",
            str(free_port()),
            "--etcd-endpoints",
            etcd_address,
            "--cpu-capacity-bytes",
            str(2 * total + 64 * MIB),
        ),
        run_dir / "kv_store.log",
    ).start()
    series: dict[str, Series] = {}
    try:
        wait_grpc_healthy(f"127.0.0.1:{port}", 30.0)
        assert server.proc is not None
        for r in range(args.rounds):
            tcp = loopback_tcp(total, size)
            print(f"round {r + 1}: loopback TCP {tcp / MIB:.0f} MiB/s", flush=True)
            asyncio.run(grpc_round(f"127.0.0.1:{port}", values, args.concurrency, server.proc.pid, tcp, series))
    finally:
        server.stop()
        etcd.stop()

    # name, MiB/s, baseline name, baseline MiB/s, ratio, ratio range, server CPU ms/value, CPU ceiling
    rows: list[tuple[str, float, str, float, float, str, str, str]] = []
    for name, row in series.items():
        ratios = row.ratios()
        cpu = statistics.median(row.cpu)
        base = statistics.median(row.baselines)
        rows.append((
            f"gRPC {name}", statistics.median(row.rates), "loopback TCP", base, statistics.median(ratios),
            f"{min(ratios):.0%}-{max(ratios):.0%}", f"{cpu * 1e3:.1f}", f"{size / cpu / base:.0%}" if cpu else "",
        ))

    disk_root = Path(tempfile.mkdtemp(prefix="kv_store_disk-", dir=args.disk_dir))
    seq_write, seq_read = disk_sequential(disk_root, total, size)
    tier_rates = asyncio.run(disk_tier(disk_root, values, args.concurrency))
    _, seq_read_after = disk_sequential(disk_root, total, size)
    print(f"disk sequential read (cold): {seq_read / MIB:.0f} MiB/s before, {seq_read_after / MIB:.0f} after the tier reads")
    seq_read = (seq_read + seq_read_after) / 2
    for name, rate in tier_rates.items():
        base_name, base = ("disk seq write+fsync", seq_write) if "put" in name else ("disk seq read (cold)", seq_read)
        rows.append((name, rate, base_name, base, rate / base, "", "", ""))

    print()
    print("| measurement | MiB/s | baseline | baseline MiB/s | ratio (median) | range | target | server CPU ms/value | CPU ceiling |")
    print("|---|---:|---|---:|---:|---|---|---:|---:|")
    for name, rate, base_name, base, ratio, spread, cpu_ms, ceiling in rows:
        met = "met" if ratio >= 0.5 else "MISSED"
        verdict = "(profile)" if name.startswith(("previous", "plain")) else f">= 50 % {met}"
        print(f"| {name} | {rate / MIB:.0f} | {base_name} | {base / MIB:.0f} | {ratio:.0%} | {spread} | {verdict} "
              f"| {cpu_ms} | {ceiling} |")

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 6))
        names = [r[0] for r in rows]
        ax.barh(names, [r[1] / MIB for r in rows], label="kv_store")
        ax.barh(names, [r[3] / MIB for r in rows], fill=False, edgecolor="black", label="baseline (same run)")
        ax.set_xlabel("MiB/s")
        ax.invert_yaxis()
        ax.set_title(f"kv_store data path, {args.value_mib} MiB values")
        ax.legend(loc="lower right")
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
