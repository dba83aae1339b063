"""kv_store data-path throughput against this machine's own limits, side by side in one run.

    .venv/bin/python bench/kv_store_bench.py [--values 256] [--value-mib 2] [--png docs/img/kv_store_bench.png]

Measures, in one run:

1. **loopback TCP**: one stream of ``--values x --value-mib`` MiB from a child process to this one
   (``sendall`` of 2 MiB buffers / ``recv_into`` a 4 MiB buffer, timed from the first byte): the
   ceiling for one gRPC stream.
2. **gRPC Put / Get / BatchGet** of ``--values`` values of ``--value-mib`` MiB through a real
   kv_store process (CPU tier large enough to hold them all; 2 MiB chunks both ways), one stream
   at a time, plus Put with ``--concurrency`` streams in flight; for each, the server's CPU time per
   value (from ``/proc/<pid>/stat``), the profile that explains a miss.
3. **disk sequential**: one file of the same total size written in 2 MiB blocks and fsynced, then
   read back after ``posix_fadvise(DONTNEED)`` (page cache dropped for that file).
4. **NVMe tier** (``DiskTier`` in this process, fsync policy ``none`` + one ``os.sync()`` counted in
   the time, as the baseline's one fsync): put of the same values, then get after dropping every
   value file from the page cache (one and ``--concurrency`` in flight), and a plain
   ``open().read()`` of the same files as the profile of what a per-file read costs on this disk.

Prints a table of MiB/s and each kv_store figure as a percentage of its baseline (targets: >= 50 %),
and writes a bar chart with ``--png``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, start_etcd, wait_grpc_healthy
from services.kv_store.tiers.files import DiskTier

MIB = 1 << 20
CHUNK = 2 * MIB  # one message per 2 MiB value (under gRPC's 4 MiB default limit)


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


async def _put_stream(key: str, value: bytes) -> AsyncIterator[pb.PutRequest]:
    view = memoryview(value)
    yield pb.PutRequest(key=key, total_bytes=len(value), data=bytes(view[:CHUNK]))
    for offset in range(CHUNK, len(value), CHUNK):
        yield pb.PutRequest(data=bytes(view[offset : offset + CHUNK]))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def grpc_rates(
    address: str, values: list[bytes], concurrency: int, server_pid: int
) -> dict[str, tuple[float, float]]:
    """name -> (bytes per second, server CPU ms per value)."""
    total = sum(len(v) for v in values)
    rates: dict[str, tuple[float, float]] = {}
    n = len(values)
    options = [("grpc.max_receive_message_length", 8 * MIB)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        await stub.Put(_put_stream("warm", values[0]))
        cpu0 = cpu_seconds(server_pid)
        start = time.perf_counter()
        for i, value in enumerate(values):
            await stub.Put(_put_stream(f"v{i}", value))
        rates["gRPC Put (1 stream)"] = (
            total / (time.perf_counter() - start),
            (cpu_seconds(server_pid) - cpu0) * 1e3 / n,
        )

        cpu0 = cpu_seconds(server_pid)
        start = time.perf_counter()
        got = 0
        for i in range(len(values)):
            async for reply in stub.Get(pb.GetRequest(key=f"v{i}")):
                got += len(reply.data)
        assert got == total, (got, total)
        rates["gRPC Get (1 stream)"] = (
            total / (time.perf_counter() - start),
            (cpu_seconds(server_pid) - cpu0) * 1e3 / n,
        )

        cpu0 = cpu_seconds(server_pid)
        start = time.perf_counter()
        got = 0
        async for reply in stub.BatchGet(pb.BatchGetRequest(keys=[f"v{i}" for i in range(len(values))])):
            got += len(reply.data)
        assert got == total
        rates["gRPC BatchGet (1 call)"] = (
            total / (time.perf_counter() - start),
            (cpu_seconds(server_pid) - cpu0) * 1e3 / n,
        )

        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, value: bytes) -> None:
            async with sem:
                await stub.Put(_put_stream(f"c{i}", value))

        cpu0 = cpu_seconds(server_pid)
        start = time.perf_counter()
        await asyncio.gather(*(one(i, v) for i, v in enumerate(values)))
        rates[f"gRPC Put ({concurrency} streams)"] = (
            total / (time.perf_counter() - start),
            (cpu_seconds(server_pid) - cpu0) * 1e3 / n,
        )
    return rates


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


def _drop_all(tier: DiskTier, n: int) -> None:
    for i in range(n):
        _drop_cache(tier.path_of(f"v{i}"))


async def disk_tier(root: Path, values: list[bytes], concurrency: int) -> dict[str, float]:
    """name -> bytes per second: tier put (+ os.sync), cold tier get (1 and ``concurrency`` in
    flight), and a plain ``open().read()`` of the same files (the profile of a per-file read)."""
    total = sum(len(v) for v in values)
    n = len(values)
    tier = DiskTier(root / "tier", total * 2)
    rates: dict[str, float] = {}
    start = time.perf_counter()
    for i, value in enumerate(values):
        await tier.put(f"v{i}", value)
    os.sync()
    rates["NVMe tier put (+sync)"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    start = time.perf_counter()
    for i in range(n):
        assert await tier.get(f"v{i}") is not None
    rates["NVMe tier get (cold)"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            assert await tier.get(f"v{i}") is not None

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    rates[f"NVMe tier get (cold, {concurrency} in flight)"] = total / (time.perf_counter() - start)
    _drop_all(tier, n)
    start = time.perf_counter()
    _plain_read([tier.path_of(f"v{i}") for i in range(n)])
    rates["plain read of the tier's files (cold)"] = total / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=256)
    parser.add_argument("--value-mib", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--disk-dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    size = args.value_mib * MIB
    values = [os.urandom(size) for _ in range(min(args.values, 32))]
    values = [values[i % len(values)] for i in range(args.values)]
    total = size * args.values
    print(f"{args.values} values x {args.value_mib} MiB = {total // MIB} MiB per measurement", flush=True)

    rows: list[tuple[str, float, str, float, str]] = []
    tcp = loopback_tcp(total, size)
    print(f"loopback TCP: {tcp / MIB:.0f} MiB/s", flush=True)

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
            str(4 * total + 64 * MIB),
        ),
        run_dir / "kv_store.log",
    ).start()
    try:
        wait_grpc_healthy(f"127.0.0.1:{port}", 30.0)
        assert server.proc is not None
        rates = asyncio.run(grpc_rates(f"127.0.0.1:{port}", values, args.concurrency, server.proc.pid))
    finally:
        server.stop()
        etcd.stop()
    for name, (rate, cpu_ms) in rates.items():
        rows.append((name, rate, "loopback TCP", tcp, f"{cpu_ms:.1f}"))

    disk_root = Path(tempfile.mkdtemp(prefix="kv_store_disk-", dir=args.disk_dir))
    seq_write, seq_read = disk_sequential(disk_root, total, size)
    for name, rate in asyncio.run(disk_tier(disk_root, values, args.concurrency)).items():
        if "put" in name:
            rows.append((name, rate, "disk seq write+fsync", seq_write, ""))
        else:
            rows.append((name, rate, "disk seq read (cold)", seq_read, ""))

    print()
    print("| measurement | MiB/s | baseline | baseline MiB/s | ratio | target | server CPU ms/value |")
    print("|---|---:|---|---:|---:|---|---:|")
    for name, rate, base_name, base, cpu_ms in rows:
        ratio = rate / base
        verdict = "met" if ratio >= 0.5 else "MISSED"
        print(
            f"| {name} | {rate / MIB:.0f} | {base_name} | {base / MIB:.0f} | {ratio:.0%} | >= 50 % {verdict} | {cpu_ms} |"
        )

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = [r[0] for r in rows]
        ax.barh(names, [r[1] / MIB for r in rows], label="kv_store")
        ax.barh(names, [r[3] / MIB for r in rows], fill=False, edgecolor="black", label="baseline (same run)")
        ax.set_xlabel("MiB/s")
        ax.set_title(f"kv_store data path, {args.value_mib} MiB values")
        ax.legend(loc="lower right")
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
