"""kv_store as a process: chunked put/get of large values, LRU under the budget, tiers, batch calls, errors."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh._proto.kvmesh.common.v1 import common_pb2
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2 as pb
from kvmesh._proto.kvmesh.kv_store.v1 import kv_store_pb2_grpc as pb_grpc
from kvmesh_cli.launcher import free_port
from services.kv_store.tiers.files import file_name

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


async def chunks(key: str, value: bytes, chunk: int = MIB, total: int | None = None) -> AsyncIterator[pb.PutRequest]:
    total = len(value) if total is None else total
    yield pb.PutRequest(key=key, total_bytes=total, data=value[:chunk])
    for offset in range(chunk, len(value), chunk):
        yield pb.PutRequest(data=value[offset : offset + chunk])


async def get(stub: pb_grpc.KVStoreStub, key: str) -> tuple[bytes, list[pb.GetResponse]]:
    replies = [reply async for reply in stub.Get(pb.GetRequest(key=key))]
    return b"".join(r.data for r in replies), replies


async def test_large_values_lru_and_not_found(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(24 * MIB))
    a, b, c = (os.urandom(10 * MIB) for _ in range(3))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        put = await stub.Put(chunks("a", a))
        assert (put.medium, put.evicted) == (common_pb2.MEDIUM_CPU, 0)
        value, replies = await get(stub, "a")
        assert value == a
        assert len(replies) == 5  # 2 MiB chunks (--get-chunk-bytes default)
        assert (replies[0].total_bytes, replies[0].medium) == (10 * MIB, common_pb2.MEDIUM_CPU)

        assert (await stub.Put(chunks("b", b, chunk=3 * MIB))).evicted == 0
        await get(stub, "a")  # a is now more recently used than b
        assert (await stub.Put(chunks("c", c))).evicted == 1
        assert list((await stub.Contains(pb.ContainsRequest(keys=["a", "b", "c"]))).present) == [True, False, True]

        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await get(stub, "b")
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND

        assert (await stub.Delete(pb.DeleteRequest(key="a"))).deleted is True
        assert (await stub.Delete(pb.DeleteRequest(key="a"))).deleted is False

        (tier,) = (await stub.Stats(pb.StatsRequest())).tiers
        assert (tier.medium, tier.capacity_bytes, tier.used_bytes, tier.keys) == (
            common_pb2.MEDIUM_CPU,
            24 * MIB,
            10 * MIB,
            1,
        )
        assert (tier.hits, tier.misses, tier.evictions) == (2, 1, 1)


async def test_bad_puts_are_invalid_argument(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(4 * MIB))

    async def no_message() -> AsyncIterator[pb.PutRequest]:
        return
        yield

    bad_puts = {
        "empty-key": chunks("", b"x"),
        "too-few-bytes": chunks("k", b"x" * 10, total=11),
        "too-many-bytes": chunks("k", b"x" * 10, total=9),
        "larger-than-capacity": chunks("k", b"x" * 10, total=5 * MIB),
        "no-message": no_message(),
    }
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for name, stream in bad_puts.items():
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await stub.Put(stream)
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        # The service keeps serving and stored nothing.
        await stub.Put(chunks("ok", b"fine"))
        assert (await get(stub, "ok"))[0] == b"fine"
        assert (await stub.Stats(pb.StatsRequest())).tiers[0].keys == 1


def test_reflection_lists_methods(start_service) -> None:
    _, address = start_service("kv_store", "--cpu-capacity-bytes", str(MIB))
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "kvmesh.kv_store.v1.KVStore" in database.get_services()
        service = DescriptorPool(database).FindServiceByName("kvmesh.kv_store.v1.KVStore")
        assert {m.name for m in service.methods} == {
            "Put", "Get", "BatchGet", "Contains", "Lookup", "Delete", "Stats",
        }  # fmt: skip


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_kv_store_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_tiers_batch_calls_restart_and_corruption(start_service, tmp_path: Path) -> None:
    """CPU (5 MiB) -> disk -> shared FS written through; 2 MiB blocks demote, promote, survive a restart."""
    shared = tmp_path / "lustre"
    shared.mkdir()
    metrics_port = free_port()
    args = (
        "--cpu-capacity-bytes", str(5 * MIB),
        "--disk-path", str(tmp_path / "nvme"), "--instance-id", "kvs-a",
        "--shared-path", str(shared), "--write-through", "sharedfs",
    )  # fmt: skip
    proc, address = start_service("kv_store", *args, "--metrics-port", str(metrics_port))
    blocks = {f"blk-{i}": os.urandom(2 * MIB) for i in range(4)}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for key, value in blocks.items():
            await stub.Put(chunks(key, value))
        # CPU holds blk-2, blk-3; blk-0, blk-1 were demoted to disk; every block is on the shared FS
        lookup = await stub.Lookup(pb.LookupRequest(keys=[*blocks, "absent", "blk-0"]))
        assert list(lookup.present) == [True] * 4 + [False, True]
        assert list(lookup.medium) == [common_pb2.MEDIUM_DISK] * 2 + [common_pb2.MEDIUM_CPU] * 2 + [0, 3]
        assert lookup.prefix_hits == 4
        replies = [r async for r in stub.BatchGet(pb.BatchGetRequest(keys=["blk-0", "nope", "blk-3"]))]
        got: dict[int, bytes] = {}
        firsts: list[pb.BatchGetResponse] = []
        for r in replies:
            if r.index not in got:
                firsts.append(r)
            got[r.index] = got.get(r.index, b"") + r.data
        assert got == {0: blocks["blk-0"], 1: b"", 2: blocks["blk-3"]}
        assert [(r.index, r.found, r.medium) for r in firsts] == [
            (0, True, common_pb2.MEDIUM_DISK), (1, False, 0), (2, True, common_pb2.MEDIUM_CPU),
        ]  # fmt: skip
        prefix = [r async for r in stub.BatchGet(pb.BatchGetRequest(keys=["nope", "blk-1"], stop_at_first_miss=True))]
        assert [(r.index, r.found) for r in prefix] == [(0, False)]
        samples = scrape(metrics_port)
        assert samples['kvmesh_kv_store_moved_bytes_total{reason="demote",tier="disk"}'] >= 4 * MIB
        assert samples['kvmesh_kv_store_moved_bytes_total{reason="write_through",tier="sharedfs"}'] == 8 * MIB
        assert samples['kvmesh_kv_store_operation_seconds_count{op="get",tier="disk"}'] >= 1

    proc.stop()
    # corrupt blk-1 on disk and on the shared FS: it must be a miss, never wrong bytes
    for root in (tmp_path / "nvme" / "kvs-a", shared):
        name = file_name("blk-1")
        path = root / name[:2] / name
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
    metrics_port = free_port()
    _, address = start_service("kv_store", *args, "--metrics-port", str(metrics_port))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        assert (await get(stub, "blk-0"))[0] == blocks["blk-0"]  # rescan: the disk tier serves it again
        assert (await get(stub, "blk-3"))[0] == blocks["blk-3"]  # from the shared FS
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await get(stub, "blk-1")
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND
        tiers = {t.name: t for t in (await stub.Stats(pb.StatsRequest())).tiers}
        assert (tiers["disk"].corrupted, tiers["sharedfs"].corrupted) == (1, 1)
        samples = scrape(metrics_port)
        assert samples['kvmesh_kv_store_corrupted_total{medium="DISK",tier="disk"}'] == 1


UNUSABLE_TIER_PATHS = {
    "disk-path-is-a-file": ("--disk-path", "{tmp}/f", "not a directory"),
    "shared-path-is-a-file": ("--shared-path", "{tmp}/f", "not a directory"),
    "disk-path-parent-missing": ("--disk-path", "{tmp}/no/parent", "cannot create the directory: No such file or directory"),
    "disk-path-read-only": ("--disk-path", "/proc/sys/kernel", "not writable (a write probe failed: "),
}  # fmt: skip
"""A file tier kv_store cannot use: refused at start (``/proc/sys`` is read-only even for root). A shared
path that is missing or read-only is a degraded start instead (below)."""


@pytest.mark.parametrize("case", list(UNUSABLE_TIER_PATHS.values()), ids=list(UNUSABLE_TIER_PATHS))
def test_an_unusable_tier_path_refuses_to_start_with_one_line(tmp_path: Path, case: tuple[str, str, str]) -> None:
    option, path, reason = case
    path = path.format(tmp=tmp_path)
    (tmp_path / "f").write_text("x")
    done = subprocess.run(
        [sys.executable, "-m", "services.kv_store", option, path, "--grpc-port", "0", "--metrics-port", "0",
         "--etcd-endpoints", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kv_store: {option} {path}: {reason}"), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("shared", ["{tmp}/unmounted", "/proc/sys/kernel"], ids=["missing", "read-only"])
async def test_a_missing_or_read_only_shared_mount_degrades_and_the_service_stays_up(
    start_service, tmp_path: Path, shared: str
) -> None:
    """Issue 8: the shared path missing or read-only at start: one ERROR line naming it, the service
    up, values it cannot take go on (here: nowhere, counted lost), nothing served wrong; a missing
    mount point is never created."""
    shared = shared.format(tmp=tmp_path)
    metrics_port = free_port()
    args = ("--cpu-capacity-bytes", str(3 * MIB), "--shared-path", shared, "--metrics-port", str(metrics_port))
    proc, address = start_service("kv_store", *args)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        await stub.Put(chunks("a", b"a" * (2 * MIB)))
        reply = await stub.Put(chunks("b", b"b" * (2 * MIB)))  # a's demotion has nowhere to go
        assert (reply.evicted, reply.lost) == (1, 1)
        assert (await get(stub, "b"))[0] == b"b" * (2 * MIB)
        with pytest.raises(grpc.aio.AioRpcError) as exc_info:
            await get(stub, "a")
        assert exc_info.value.code() == grpc.StatusCode.NOT_FOUND
        tiers = {t.name: t for t in (await stub.Stats(pb.StatsRequest())).tiers}
        assert tiers["sharedfs"].errors >= 1
    assert scrape(metrics_port)['kvmesh_kv_store_lost_total{tier="cpu"}'] == 1
    log = proc.log_tail(400)
    assert f"degraded mode tier=sharedfs --shared-path {shared}: " in log and "ERROR" in log
    assert not (tmp_path / "unmounted").exists()


@pytest.mark.parametrize("guard", ["--shared-marker", "--shared-require-mount"])
async def test_an_unmounted_shared_filesystem_is_not_written_until_it_mounts(
    start_service, tmp_path: Path, guard: str
) -> None:
    """An unmounted filesystem leaves its mount point as an empty local directory (exists, writable).
    With a guard kv_store treats it as not mounted: one ERROR line at start, values it cannot take are
    counted lost, nothing is written to the local directory; once the filesystem arrives (its marker
    created / a tmpfs mounted there) demotions reach it without a restart."""
    if guard == "--shared-require-mount" and os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    lustre = tmp_path / "lustre"
    lustre.mkdir()
    guard_args = (guard, ".kvmesh-shared") if guard == "--shared-marker" else (guard, "true")
    metrics_port = free_port()
    args = ("--cpu-capacity-bytes", str(3 * MIB), "--shared-path", str(lustre), *guard_args,
            "--metrics-port", str(metrics_port))  # fmt: skip
    proc, address = start_service("kv_store", *args)
    mounted = False
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            await stub.Put(chunks("a", b"a" * (2 * MIB)))
            reply = await stub.Put(chunks("b", b"b" * (2 * MIB)))  # a's demotion: the tier is not mounted
            assert (reply.evicted, reply.lost) == (1, 1)
            assert list(lustre.iterdir()) == []  # the local disk under the mount point is untouched
            if guard == "--shared-marker":
                (lustre / ".kvmesh-shared").touch()  # the operator's marker, on the mounted filesystem
            else:
                mount = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(lustre)]
                await asyncio.to_thread(subprocess.run, mount, check=True)
                mounted = True
            reply = await stub.Put(chunks("c", b"c" * (2 * MIB)))  # b's demotion reaches the shared tier
            assert (reply.evicted, reply.lost) == (1, 0)
            data, replies = await get(stub, "b")
            assert data == b"b" * (2 * MIB) and replies[0].medium == common_pb2.MEDIUM_SHARED
        samples = scrape(metrics_port)
        assert samples['kvmesh_kv_store_lost_total{tier="cpu"}'] == 1
        assert samples['kvmesh_kv_store_dropped_total{reason="unavailable",tier="sharedfs"}'] == 1
    finally:
        if mounted:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(lustre)], check=False)
    if mounted:
        assert list(lustre.iterdir()) == []  # what was written went to the mounted filesystem only
    log = proc.log_tail(400)
    reason = "has no marker file .kvmesh-shared" if guard == "--shared-marker" else "is not a mount point"
    assert f"degraded mode tier=sharedfs --shared-path {lustre}: {reason}" in log and "ERROR" in log
    assert f"--shared-path {lustre} is not a mount point (the same filesystem" not in log  # guarded: no warning


async def test_tiers_failing_mid_run_pass_values_on_then_count_them_lost(start_service, tmp_path: Path) -> None:
    """The disk tier's directory turns into a file mid-run: demotions go to the shared tier; then the
    shared mount vanishes too: the value is lost, counted, logged; the service stays up."""
    shared = tmp_path / "lustre"
    shared.mkdir()
    metrics_port = free_port()
    args = ("--cpu-capacity-bytes", "4000000", "--disk-path", str(tmp_path / "nvme"), "--shared-path", str(shared))
    proc, address = start_service("kv_store", *args, "--metrics-port", str(metrics_port))
    values = {key: key.encode() * (3 * MIB) for key in "abcde"}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        await stub.Put(chunks("a", values["a"]))
        disk_root = tmp_path / "nvme" / "default"
        shutil.rmtree(disk_root)
        disk_root.write_text("the disk tier's directory is gone")
        for key in "bcd":  # each put evicts the previous value from the CPU tier; the disk refuses it
            reply = await stub.Put(chunks(key, values[key]))
            assert (reply.evicted, reply.lost) == (1, 0)  # the shared tier took it
        samples = scrape(metrics_port)
        assert samples['kvmesh_kv_store_dropped_total{reason="unavailable",tier="disk"}'] == 3
        assert samples['kvmesh_kv_store_lost_total{tier="cpu"}'] == 0
        for key in "abc":
            data, replies = await get(stub, key)
            assert data == values[key]
            assert replies[0].medium == common_pb2.MEDIUM_SHARED
        tiers = {t.name: t for t in (await stub.Stats(pb.StatsRequest())).tiers}
        assert tiers["disk"].errors >= 1

        shutil.rmtree(shared)  # the shared mount vanishes too: the next eviction has nowhere to go
        reply = await stub.Put(chunks("e", values["e"]))
        assert (reply.evicted, reply.lost) == (1, 1)  # the caller is told, not only the metric
        samples = scrape(metrics_port)
        assert samples['kvmesh_kv_store_lost_total{tier="cpu"}'] == 1
        assert samples['kvmesh_kv_store_degraded_operations_total{tier="sharedfs"}'] >= 1
        assert (await get(stub, "e"))[0] == values["e"]  # the service stays up
    log = proc.log_tail(200)
    assert "ERROR" in log and "degraded mode tier=disk op=demote error=TierUnavailable" in log
    assert "degraded mode tier=sharedfs" in log
    # a plain directory and no guard: an unmounted filesystem would not be noticed, so it is said at start
    [warning] = [line for line in log.splitlines() if f"--shared-path {shared} is not a mount point" in line]
    assert "WARNING" in warning
    assert "value lost: key=" in log and "evicted from tier cpu and no slower tier could take it" in log


BAD_KEYS = {"empty": "", "over-long": "k" * 4097}
"""Keys every kv_store call refuses the same way (``services.kv_store.store.validate_key``)."""


@pytest.mark.parametrize("bad", list(BAD_KEYS.values()), ids=list(BAD_KEYS))
async def test_a_bad_key_is_refused_alike_by_every_call(start_service, bad: str) -> None:
    """The same bad key, the same answer: ``INVALID_ARGUMENT`` from Put, Get, Delete, Contains, Lookup and
    BatchGet (a many-key call names it ``keys[i]``); BatchGet checks every key before it streams anything
    (no partial answer then a failure), nothing stored is lost and the service keeps answering."""
    _, address = start_service("kv_store")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        await stub.Put(chunks("k", b"value"))
        many = ["k", "absent", bad]
        received: list[pb.BatchGetResponse] = []

        async def batch_get_streamed() -> None:
            async for reply in stub.BatchGet(pb.BatchGetRequest(keys=many)):
                received.append(reply)

        calls = {
            "Put": lambda: stub.Put(chunks(bad, b"x")),
            "Get": lambda: get(stub, bad),
            "Delete": lambda: stub.Delete(pb.DeleteRequest(key=bad)),
            "Contains": lambda: stub.Contains(pb.ContainsRequest(keys=many)),
            "Lookup": lambda: stub.Lookup(pb.LookupRequest(keys=many)),
            "BatchGet": batch_get_streamed,
        }
        for name, call in calls.items():
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await call()
            assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            details = exc_info.value.details() or ""
            words = "must not be empty" if not bad else "exceeds 4096 bytes"
            assert words in details, (name, details)
            if name in ("Contains", "Lookup", "BatchGet"):
                assert details.startswith("keys[2] "), (name, details)
            assert ("kvmesh-error-class", "InvalidRequest") in tuple(exc_info.value.trailing_metadata() or ()), name
        assert received == []  # refused before the first message, not after two
        # Nothing was lost, and the good keys still answer.
        assert (await get(stub, "k"))[0] == b"value"
        assert list((await stub.Lookup(pb.LookupRequest(keys=["k", "absent"]))).present) == [True, False]
        assert [(r.index, r.found) for r in await batch_get_ok(stub)] == [(0, True), (1, False)]


async def batch_get_ok(stub: pb_grpc.KVStoreStub) -> list[pb.BatchGetResponse]:
    return [r async for r in stub.BatchGet(pb.BatchGetRequest(keys=["k", "absent"]))]
