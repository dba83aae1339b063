"""A file tier's put that fails to write keeps the values it would have evicted (review of wave 10).

``FileTier.put`` used to unlink its LRU victims before writing the new value, so a write that
failed (disk full, EIO, read-only) lost the victims too. Now the new value is written first (temp
file + rename) and the victims are removed only after the rename. Faults: a real 64 KiB tmpfs that
fills up (ENOSPC) and is remounted read-only (EROFS), and ``os.replace`` failing with EIO for this
tier's root only (monkeypatched narrowly: any other path renames as usual).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from services.kv_store.errors import StorageFull, TierUnavailable
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier
from services.kv_store.tiers.files import DiskTier, FileTier, SharedFsTier
from tests.unit.kv_store.test_file_tiers import remount_read_only


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def fail_renames_under(monkeypatch: pytest.MonkeyPatch, root: Path, code: int) -> None:
    """``os.replace`` into ``root`` raises OSError(code); every other rename works."""
    real = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst).is_relative_to(root):
            raise OSError(code, os.strerror(code), str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def make(kind: str, root: Path, capacity: int) -> FileTier:
    if kind == "disk":
        return DiskTier(root, capacity)
    root.mkdir(exist_ok=True)
    return SharedFsTier(root, capacity)


@pytest.mark.parametrize("keep_victims", [False, True], ids=["last_tier", "keep_victims"])
@pytest.mark.parametrize("kind", ["disk", "sharedfs"])
@pytest.mark.parametrize(("code", "raised"), [(errno.EIO, TierUnavailable), (errno.ENOSPC, StorageFull)])
async def test_a_failed_write_keeps_the_victims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, keep_victims: bool, code: int, raised: type
) -> None:
    root = tmp_path / "tier"
    tier = make(kind, root, 20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    fail_renames_under(monkeypatch, root, code)
    with pytest.raises(raised):
        await tier.put("c", b"c" * 15, keep_victims=keep_victims)
    monkeypatch.undo()
    assert await tier.contains(["a", "b", "c"]) == [True, True, False]
    assert await tier.get("a") == b"a" * 10 and await tier.get("b") == b"b" * 10
    stats = tier.stats()
    assert (stats.used_bytes, stats.keys, stats.evictions, stats.errors) == (20, 2, 0, 1)
    assert tier.held_keys() == ["a", "b"]
    assert not temp_files(root)
    # the tier works again: the same put now evicts both
    assert (await tier.put("c", b"c" * 15)).evicted == ("a", "b")
    assert not tier.path_of("a").exists() and not tier.path_of("b").exists()


async def test_a_full_filesystem_keeps_the_victims(small_tmpfs: Path) -> None:
    """Real ENOSPC: the tmpfs holds the two 10 KiB values and less than the 40 KiB the new one
    needs; its budget (24 KiB) would evict both. The write fails, both stay."""
    tier = DiskTier(small_tmpfs, 24 << 10)
    await tier.put("a", b"a" * (10 << 10))
    await tier.put("b", b"b" * (10 << 10))
    space = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(b"f" * (space.f_bavail * space.f_frsize - (16 << 10)))
    with pytest.raises(StorageFull):
        await tier.put("c", b"c" * (20 << 10))
    assert await tier.contains(["a", "b", "c"]) == [True, True, False]
    assert await tier.get("a") == b"a" * (10 << 10)
    assert tier.stats().used_bytes == 20 << 10
    assert not temp_files(small_tmpfs)


async def test_a_read_only_remount_keeps_the_victims(small_tmpfs: Path) -> None:
    """Real EROFS: the mount turns read-only; a put that would evict fails and evicts nothing."""
    tier = DiskTier(small_tmpfs, 20)
    await tier.put("a", b"a" * 10)
    await tier.put("b", b"b" * 10)
    remount_read_only(small_tmpfs)
    with pytest.raises(TierUnavailable):
        await tier.put("c", b"c" * 15)
    assert await tier.get("a") == b"a" * 10 and await tier.get("b") == b"b" * 10
    assert tier.stats().used_bytes == 20


async def test_a_store_whose_last_tier_write_fails_demotes_nothing_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the store: a demotion into a full disk tier whose write fails (EIO) keeps the disk's
    own LRU values (they used to be unlinked first); the demoted value is then counted lost."""
    disk_root = tmp_path / "nvme"
    store = BlockStore([CpuTier(20), DiskTier(disk_root, 20)])
    for key in "abcd":
        await store.put(key, key.encode() * 10)  # CPU: c, d; disk: a, b
    fail_renames_under(monkeypatch, disk_root, errno.EIO)
    outcome = await store.put("e", b"e" * 10)  # c -> disk fails
    monkeypatch.undo()
    assert (outcome.evicted, outcome.lost) == (1, 1)
    assert store.metrics.dropped == {("disk", "unavailable"): 1}
    assert await store.contains(list("abcde")) == [True, True, False, True, True]
