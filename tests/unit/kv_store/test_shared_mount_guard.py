"""The shared tier against an unmounted filesystem: its mount point is left behind as an empty local
directory (exists, is a directory, writable), so without a guard values would fill the local disk
and be hidden once the filesystem mounts over them.

Guards (opt-in, :func:`services.kv_store.tiers.files.shared_root_guard`): ``require_mount`` (the
root must be a mount point; a real tmpfs mounted for the test, root only) and ``marker`` (a file
the operator created on the mounted filesystem). Checked at start (``check_tier_root``,
``check_tier_paths``: a degraded start), at construction (no rescan of the local directory) and at
run time (every operation while failing, every ``GUARD_RECHECK_S`` while working).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.kv_store.app import check_tier_paths
from services.kv_store.config import KvStoreConfig
from services.kv_store.errors import TierUnavailable
from services.kv_store.metrics import register_metrics
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import GUARD_RECHECK_S, SharedFsTier, check_tier_root, shared_root_guard

MARKER = ".kvmesh-shared"
NOT_A_MOUNT = "is not a mount point (the shared filesystem is not mounted there; --shared-require-mount)"
NO_MARKER = (
    f"has no marker file {MARKER} (the shared filesystem is not mounted there, or the marker was never"
    " created on it; --shared-marker)"
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def local_files(root: Path) -> list[str]:
    """Everything under ``root`` on the local filesystem (what an unmounted tier must not write)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


class Mounter:
    """Mounts and unmounts a small tmpfs on a directory (a shared filesystem arriving and leaving)."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def mount(self, where: Path) -> None:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        self.mounted.append(where)

    def umount(self, where: Path) -> None:
        subprocess.run(["umount", str(where)], check=True)
        self.mounted.remove(where)


@pytest.fixture
def mounter() -> Iterator[Mounter]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    m = Mounter()
    try:
        yield m
    finally:
        for where in reversed(m.mounted):
            subprocess.run(["umount", "-l", str(where)], check=False)


# -- start-up checks ---------------------------------------------------------------------------


def test_an_empty_mount_point_passes_without_a_guard_and_fails_each_guard(tmp_path: Path) -> None:
    assert check_tier_root(tmp_path, create=False) is None  # the defect: an unmounted mount point looks fine
    assert check_tier_root(tmp_path, create=False, require_mount=True) == NOT_A_MOUNT
    assert check_tier_root(tmp_path, create=False, marker=MARKER) == NO_MARKER
    assert local_files(tmp_path) == []  # refused before the write probe; the marker is never created


def test_a_mounted_filesystem_passes_require_mount(tmp_path: Path, mounter: Mounter) -> None:
    lustre = tmp_path / "lustre"
    lustre.mkdir()
    mounter.mount(lustre)
    assert check_tier_root(lustre, create=False, require_mount=True) is None
    assert shared_root_guard(lustre / ".", require_mount=True, marker="") is None
    (lustre / "kvmesh").mkdir()  # a subdirectory of the mount is no mount point: the marker guards it
    assert check_tier_root(lustre / "kvmesh", create=False, require_mount=True) == NOT_A_MOUNT
    (lustre / "kvmesh" / MARKER).touch()
    assert check_tier_root(lustre / "kvmesh", create=False, marker=MARKER) is None


def test_a_marker_present_passes_and_both_guards_combine(tmp_path: Path) -> None:
    (tmp_path / MARKER).touch()
    assert check_tier_root(tmp_path, create=False, marker=MARKER) is None
    assert check_tier_root(tmp_path, create=False, require_mount=True, marker=MARKER) == NOT_A_MOUNT
    (tmp_path / MARKER).unlink()
    (tmp_path / MARKER).mkdir()  # any entry of that name counts (created by the operator)
    assert check_tier_root(tmp_path, create=False, marker=MARKER) is None


def test_check_tier_paths_degrades_on_a_failed_guard_and_warns_without_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="services.kv_store.app")
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path), shared_require_mount=True))
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path), shared_marker=MARKER))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"degraded mode tier=sharedfs --shared-path {tmp_path}: {reason}; the tier stays configured and each"
        " demotion to it goes on to the next tier until the path is usable"
        for reason in (NOT_A_MOUNT, NO_MARKER)
    ]
    assert local_files(tmp_path) == []
    caplog.clear()
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path)))  # no guard, no mount point: a WARNING
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.levelno == logging.WARNING
    assert warning.getMessage().startswith(f"--shared-path {tmp_path} is not a mount point")
    assert "--shared-require-mount" in warning.getMessage() and "--shared-marker" in warning.getMessage()
    caplog.clear()
    (tmp_path / MARKER).touch()
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path), shared_marker=MARKER))  # guarded and mounted: quiet
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_check_tier_paths_is_quiet_on_a_mount_point(tmp_path: Path, mounter: Mounter, caplog: pytest.LogCaptureFixture) -> None:
    mounter.mount(tmp_path)
    caplog.set_level(logging.WARNING, logger="services.kv_store.app")
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path)))
    check_tier_paths(KvStoreConfig(shared_path=str(tmp_path), shared_require_mount=True))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("marker", ["a/b", "/abs", ".", "..", "x\0y"])
def test_the_marker_is_a_plain_file_name(marker: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="plain file name"):
        KvStoreConfig(shared_path=str(tmp_path), shared_marker=marker)
    with pytest.raises(ValueError, match="plain file name"):
        SharedFsTier(tmp_path, 100, marker=marker)


# -- the tier at run time ----------------------------------------------------------------------


async def test_an_unmarked_root_is_unavailable_and_never_written(tmp_path: Path) -> None:
    clock = Clock()
    tier = SharedFsTier(tmp_path, 1000, marker=MARKER, clock=clock)
    for op in (tier.put("k", b"v"), tier.get("k"), tier.contains(["k"]), tier.evict("k")):
        with pytest.raises(TierUnavailable, match="has no marker file"):
            await op
    assert tier.stats().errors == 4
    assert local_files(tmp_path) == []


async def test_the_marker_arriving_and_leaving_is_noticed_without_a_restart(tmp_path: Path) -> None:
    """While failing, every operation re-checks (the mount is used at once); while working, the
    guard is re-checked every GUARD_RECHECK_S (an unmount is noticed within it)."""
    clock = Clock()
    tier = SharedFsTier(tmp_path, 1000, marker=MARKER, clock=clock)
    with pytest.raises(TierUnavailable):
        await tier.put("k", b"v")
    (tmp_path / MARKER).touch()  # the filesystem is mounted (its marker appears)
    await tier.put("k", b"v")
    assert (await tier.get("k")) == b"v"
    (tmp_path / MARKER).unlink()  # unmounted
    assert (await tier.get("k")) == b"v"  # within GUARD_RECHECK_S: not re-checked yet
    clock.now += GUARD_RECHECK_S
    with pytest.raises(TierUnavailable, match="has no marker file"):
        await tier.put("j", b"w")
    with pytest.raises(TierUnavailable):
        await tier.get("k")
    assert not tier.path_of("j").exists()


async def test_require_mount_follows_a_real_mount_and_unmount(tmp_path: Path, mounter: Mounter) -> None:
    clock = Clock()
    lustre = tmp_path / "lustre"
    lustre.mkdir()
    tier = SharedFsTier(lustre, 1 << 20, require_mount=True, clock=clock)
    with pytest.raises(TierUnavailable, match="is not a mount point"):
        await tier.put("k", b"before the mount")
    mounter.mount(lustre)
    await tier.put("k", b"on the mounted filesystem")
    assert (await tier.get("k")) == b"on the mounted filesystem"
    mounter.umount(lustre)
    clock.now += GUARD_RECHECK_S
    with pytest.raises(TierUnavailable, match="is not a mount point"):
        await tier.put("j", b"after the unmount")
    with pytest.raises(TierUnavailable):
        await tier.get("k")
    assert local_files(lustre) == []  # nothing ever reached the local directory under the mount point


async def test_a_guarded_tier_does_not_rescan_values_left_in_the_mount_point(tmp_path: Path) -> None:
    """Values an unguarded instance wrote into the bare mount point are neither adopted nor served
    by a guarded one (they are the local disk's, not the shared namespace's)."""
    unguarded = SharedFsTier(tmp_path, 1000)
    await unguarded.put("stray", b"on the local disk")
    guarded = SharedFsTier(tmp_path, 1000, marker=MARKER)
    assert guarded.held_keys() == [] and guarded.take_rescanned() == []
    store = BlockStore([CpuTier(100), guarded])
    assert await store.contains(["stray"]) == [False]
    assert await store.media(["stray"]) == [None]


async def test_the_store_passes_values_on_while_the_guard_fails(tmp_path: Path) -> None:
    """At the store: a demotion and a write-through to the unmounted tier are dropped as
    ``unavailable`` (a degraded mode), the value goes on (here: lost, no slower tier), and the put
    answers; nothing lands in the mount point."""
    store = BlockStore([CpuTier(20), SharedFsTier(tmp_path, 1000, marker=MARKER)], write_through=["sharedfs"])
    registry = CollectorRegistry()
    register_metrics(store, registry)
    await store.put("a", b"a" * 15)
    outcome = await store.put("b", b"b" * 15)
    assert (outcome.evicted, outcome.lost) == (1, 1)
    value = registry.get_sample_value
    assert value("kvmesh_kv_store_dropped_total", {"tier": "sharedfs", "reason": "unavailable"}) == 3
    assert value("kvmesh_kv_store_degraded_operations_total", {"tier": "sharedfs"}) >= 3
    assert local_files(tmp_path) == []
