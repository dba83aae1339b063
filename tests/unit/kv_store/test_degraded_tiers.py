"""File tiers that cannot work: refused at start (``check_tier_root``, ``check_tier_paths``) or,
failing at run time, skipped: a demotion goes to the tier after the failed one, a value no tier
takes is counted lost, and an ERROR line (rate-limited) says so.

Read-only media: a tmpfs remounted read-only (root only, skipped otherwise) and ``/proc/sys``
(read-only even for root); ``chmod 0555`` only when not running as root (root writes through it).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.kv_store.app import check_tier_paths
from services.kv_store.config import KvStoreConfig
from services.kv_store.metrics import register_metrics
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, SharedFsTier, check_tier_root

PROC_SYS = Path("/proc/sys/kernel")


def remount_read_only(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


# -- start-up checks ---------------------------------------------------------------------------


def test_a_usable_directory_passes_and_the_probe_leaves_nothing(tmp_path: Path) -> None:
    assert check_tier_root(tmp_path, create=False) is None
    assert list(tmp_path.iterdir()) == []


def test_a_missing_disk_directory_is_created_but_a_missing_shared_mount_is_not(tmp_path: Path) -> None:
    assert check_tier_root(tmp_path / "nvme", create=True) is None
    assert (tmp_path / "nvme").is_dir()
    assert check_tier_root(tmp_path / "lustre", create=False) == (
        "does not exist (the shared filesystem must be mounted there)"
    )
    assert not (tmp_path / "lustre").exists()
    reason = check_tier_root(tmp_path / "no" / "parent", create=True)
    assert reason is not None and reason.startswith("cannot create the directory")


@pytest.mark.parametrize("create", [True, False], ids=["disk", "shared"])
def test_a_file_where_a_directory_is_expected(tmp_path: Path, create: bool) -> None:
    (tmp_path / "f").write_text("x")
    assert check_tier_root(tmp_path / "f", create=create) == "not a directory"


@pytest.mark.parametrize("create", [True, False], ids=["disk", "shared"])
def test_proc_sys_is_read_only_even_for_root(create: bool) -> None:
    if not PROC_SYS.is_dir():
        pytest.skip("no /proc/sys/kernel here")
    reason = check_tier_root(PROC_SYS, create=create)
    assert reason is not None and reason.startswith("not writable (a write probe failed")


def test_a_read_only_mount_is_refused(small_tmpfs: Path) -> None:
    remount_read_only(small_tmpfs)
    assert check_tier_root(small_tmpfs, create=False) == "not writable (a write probe failed: Read-only file system)"


def test_a_mode_0555_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes through mode bits (the read-only mount and /proc/sys cases cover root)")
    tmp_path.chmod(0o555)
    try:
        reason = check_tier_root(tmp_path, create=False)
    finally:
        tmp_path.chmod(0o755)
    assert reason == "not writable (a write probe failed: Permission denied)"


def test_check_tier_paths_names_the_option_and_the_path(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=rf"^--disk-path {tmp_path / 'f'}: not a directory$"):
        check_tier_paths(KvStoreConfig(disk_path=str(tmp_path / "f")))
    with pytest.raises(ValueError, match=rf"^--shared-path {tmp_path / 'f'}: not a directory$"):
        check_tier_paths(KvStoreConfig(shared_path=str(tmp_path / "f")))
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path / "x")))  # a missing mount: a degraded start, logged
    assert not (tmp_path / "x").exists()
    check_tier_paths(KvStoreConfig(disk_path=str(tmp_path / "nvme"), instance_id="a:1", shared_path=str(tmp_path)))
    assert (tmp_path / "nvme" / "a_1").is_dir()  # the instance's own directory, made at start


# -- run-time failures -------------------------------------------------------------------------


def store_with_metrics(tiers: list) -> tuple[BlockStore, CollectorRegistry]:  # type: ignore[type-arg]
    store = BlockStore(tiers)
    registry = CollectorRegistry()
    register_metrics(store, registry)
    return store, registry


def break_directory(root: Path) -> None:
    """The directory vanishes and a file takes its name: every write, even a mkdir, fails (as root too)."""
    shutil.rmtree(root)
    root.write_text("not a directory any more")


async def test_a_disk_tier_failing_mid_run_demotes_to_the_shared_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "shared").mkdir()
    store, registry = store_with_metrics(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 1000), SharedFsTier(tmp_path / "shared", 1000)]
    )
    await store.put("a", b"a" * 10)
    await store.put("b", b"b" * 10)
    await store.put("c", b"c" * 10)  # a -> disk, while the disk works
    break_directory(tmp_path / "nvme")
    caplog.set_level(logging.ERROR, logger="services.kv_store.store")
    outcomes = [await store.put(key, key.encode() * 10) for key in "def"]  # b, c, d evicted: disk fails
    assert [(o.evicted, o.lost) for o in outcomes] == [(1, 0)] * 3
    _, _, shared = store.tiers
    assert await shared.contains(list("bcd")) == [True] * 3
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "unavailable"}) == 3
    for key in "bcdef":  # every value evicted after the failure is still served (a went with the disk)
        assert (await store.get(key)).value == key.encode() * 10
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "disk"}) >= 3
    assert value("kvmesh_kv_store_lost_total", {"tier": "cpu"}) == 0
    assert value("kvmesh_kv_store_moved_bytes_total", {"tier": "sharedfs", "reason": "demote"}) >= 30
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # rate-limited: one line per tier per 10 s, not one per value
    assert errors[0].startswith("degraded mode tier=disk op=demote error=TierUnavailable")


async def test_a_full_disk_demotes_to_the_shared_tier(small_tmpfs: Path, tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    store, registry = store_with_metrics(  # a budget larger than the 64 KiB medium: ENOSPC
        [CpuTier(40 << 10), DiskTier(small_tmpfs, 1 << 30), SharedFsTier(tmp_path / "shared", 1 << 30)]
    )
    for key in "abcde":
        await store.put(key, key.encode() * (30 << 10))
    for key in "abcde":
        assert (await store.get(key)).value == key.encode() * (30 << 10)
    assert registry.get_sample_value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "full"}) >= 1
    assert store.tiers[1].stats().errors >= 1
    assert registry.get_sample_value("kvmesh_kv_store_lost_total", {"tier": "cpu"}) == 0


async def test_a_disk_remounted_read_only_mid_run_demotes_to_the_shared_tier(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    (tmp_path / "shared").mkdir()
    store, registry = store_with_metrics(
        [CpuTier(20), DiskTier(small_tmpfs, 1000), SharedFsTier(tmp_path / "shared", 1000)]
    )
    await store.put("a", b"a" * 10)
    remount_read_only(small_tmpfs)
    await store.put("b", b"b" * 10)
    await store.put("c", b"c" * 10)  # a's demotion: the disk refuses, the shared tier takes it
    assert (await store.get("a")).value == b"a" * 10
    assert registry.get_sample_value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "unavailable"}) >= 1


async def test_a_tier_too_small_for_the_value_passes_it_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A value larger than a slower tier's whole capacity is a sizing choice, not a failure: it is
    counted as dropped with reason ``too_large``, never as a degraded operation, and logged at DEBUG
    (no ERROR "degraded mode" line); the next tier takes it."""
    (tmp_path / "shared").mkdir()
    store, registry = store_with_metrics(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 5), SharedFsTier(tmp_path / "shared", 1000)]
    )
    caplog.set_level(logging.DEBUG, logger="services.kv_store.store")
    await store.put("a", b"a" * 15)
    outcome = await store.put("b", b"b" * 15)  # a does not fit the 5-byte disk tier: the shared tier takes it
    assert (outcome.evicted, outcome.lost) == (1, 0)
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "too_large"}) == 1
    assert value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "unavailable"}) == 0
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "disk"}) == 0
    assert store.tiers[1].stats().errors == 0
    assert (await store.get("a")).value == b"a" * 15
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("demote of key='a' skipped tier disk: value of 15 bytes") for m in debug), debug


async def test_a_write_through_tier_too_small_for_the_value_is_dropped_not_degraded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sibling on the write-through path: the put succeeds, the shared tier is skipped as
    ``too_large``, nothing is counted degraded or logged above DEBUG."""
    (tmp_path / "shared").mkdir()
    store = BlockStore([CpuTier(100), SharedFsTier(tmp_path / "shared", 10)], write_through=["sharedfs"])
    registry = CollectorRegistry()
    register_metrics(store, registry)
    caplog.set_level(logging.DEBUG, logger="services.kv_store.store")
    outcome = await store.put("big", b"x" * 50)
    assert (outcome.evicted, outcome.lost) == (0, 0)
    await store.put("small", b"y" * 5)  # written through
    assert await store.tiers[1].contains(["big", "small"]) == [False, True]
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_dropped_total", {"tier": "sharedfs", "reason": "too_large"}) == 1
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "sharedfs"}) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any(r.getMessage().startswith("write_through of key='big' skipped tier sharedfs") for r in caplog.records)


async def test_a_failing_tier_is_dropped_as_unavailable_or_full_and_counted_degraded(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    """The failure reasons stay degraded modes: a full medium (``full``) and a missing path
    (``unavailable``) are each one dropped value and one degraded operation of their tier."""
    store, registry = store_with_metrics(  # the 64 KiB medium fills before the 1 GiB budget: ENOSPC
        [CpuTier(40 << 10), DiskTier(small_tmpfs, 1 << 30), SharedFsTier(tmp_path / "missing", 1 << 30)]
    )
    for key in "abcd":
        await store.put(key, key.encode() * (30 << 10))
    value = registry.get_sample_value
    full = value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "full"})
    unavailable = value("kvmesh_kv_store_dropped_total", {"tier": "sharedfs", "reason": "unavailable"})
    assert full is not None and full >= 1
    assert unavailable == full  # every value the full disk refused went on to the missing shared path
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "disk"}) >= full
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "sharedfs"}) >= unavailable
    assert value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "too_large"}) == 0
    assert store.dropped("disk") == full and store.dropped("sharedfs") == unavailable


async def test_a_value_no_slower_tier_takes_is_counted_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "shared").mkdir()
    store, registry = store_with_metrics(
        [CpuTier(20), DiskTier(tmp_path / "nvme", 1000), SharedFsTier(tmp_path / "shared", 1000)]
    )
    await store.put("a", b"a" * 15)
    break_directory(tmp_path / "nvme")
    (tmp_path / "shared").rmdir()  # the shared mount vanishes too
    caplog.set_level(logging.ERROR, logger="services.kv_store.store")
    outcome = await store.put("b", b"b" * 15)
    assert (outcome.evicted, outcome.lost) == (1, 1)
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_lost_total", {"tier": "cpu"}) == 1
    assert value("kvmesh_kv_store_dropped_total", {"tier": "disk", "reason": "unavailable"}) == 1
    assert value("kvmesh_kv_store_dropped_total", {"tier": "sharedfs", "reason": "unavailable"}) == 1
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(m.startswith("value lost: key='a' (15 bytes) evicted from tier cpu") for m in messages), messages
    assert {m.split()[2] for m in messages if m.startswith("degraded mode")} == {"tier=disk", "tier=sharedfs"}
