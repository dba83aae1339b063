"""DiskTier and SharedFsTier beyond the contract: restart rescan, checksums, atomic names, sharing, failures.

The disk-full and read-only cases mount a real tmpfs (root only; skipped with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from services.kv_store.errors import StorageFull, TierUnavailable
from services.kv_store.tiers.files import HEADER, DiskTier, FsyncPolicy, SharedFsTier, file_name


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


def remount_read_only(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


async def test_restart_serves_what_was_on_disk_in_lru_order(tmp_path: Path) -> None:
    root = tmp_path / "nvme" / "a"
    tier = DiskTier(root, 100)
    for key in ("a", "b", "c"):
        await tier.put(key, key.encode() * 10)
        os.utime(tier.path_of(key), (1_000 + ord(key), 1_000 + ord(key)))
    os.utime(tier.path_of("a"), (2_000, 2_000))  # a used last
    # a leftover temp file of a write interrupted by a crash
    (tier.path_of("a").parent / ".junk.tmp").write_bytes(b"partial")
    again = DiskTier(root, 100)
    assert again.lru_order() == ["b", "c", "a"]
    assert again.stats().used_bytes == 30
    assert await again.get("b") == b"b" * 10
    assert not (tier.path_of("a").parent / ".junk.tmp").exists()


async def test_restart_with_a_smaller_budget_evicts_the_oldest(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 100)
    for i, key in enumerate(("a", "b", "c")):
        await tier.put(key, b"x" * 30)
        os.utime(tier.path_of(key), (1_000 + i, 1_000 + i))
    smaller = DiskTier(tmp_path, 60)
    assert smaller.lru_order() == ["b", "c"]
    assert not tier.path_of("a").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
async def test_a_corrupt_file_is_a_miss_and_a_metric_never_wrong_bytes(tmp_path: Path, damage: str) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.put("k", b"v" * 1000)
    path = tier.path_of("k")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 10]
    else:
        data = bytearray(b"something else entirely" * 10)
    path.write_bytes(bytes(data))
    assert await tier.get("k") is None
    stats = tier.stats()
    assert (stats.corrupted, stats.misses, stats.keys, stats.used_bytes) == (1, 1, 0, 0)
    assert not path.exists()


async def test_files_are_named_by_key_hash_and_written_atomically(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, fsync=FsyncPolicy.ALL)
    await tier.put("block", b"z" * 100)
    name = file_name("block")
    path = tmp_path / name[:2] / name
    assert path.stat().st_size == HEADER.size + len(b"block") + 100
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temp file left behind


async def test_instances_share_a_namespace(tmp_path: Path) -> None:
    a = SharedFsTier(tmp_path, 1 << 20)
    b = SharedFsTier(tmp_path, 1 << 20)
    await a.put("shared-block", b"s" * 64)
    assert await b.contains(["shared-block", "other"]) == [True, False]
    assert await b.get("shared-block") == b"s" * 64
    assert b.stats().keys == 1  # adopted into b's view
    await b.evict("shared-block")
    assert await a.get("shared-block") is None  # a's view forgets a value another instance removed


async def test_concurrent_writers_of_one_key_leave_one_complete_value(tmp_path: Path) -> None:
    tiers = [SharedFsTier(tmp_path, 64 << 20) for _ in range(4)]
    values = [bytes([i]) * (1 << 20) for i in range(4)]
    reader = SharedFsTier(tmp_path, 64 << 20)

    async def read_often() -> set[bytes]:
        seen: set[bytes] = set()
        for _ in range(40):
            value = await reader.get("hot")
            if value is not None:
                seen.add(value)
            await asyncio.sleep(0)
        return seen

    results = await asyncio.gather(*(t.put("hot", v) for t, v in zip(tiers, values, strict=True)), read_often())
    seen = results[-1]
    assert isinstance(seen, set) and seen <= set(values)  # never a partial or mixed value
    assert await reader.get("hot") in values
    assert reader.stats().corrupted == 0
    assert not temp_files(tmp_path)


async def test_missing_shared_root_is_unavailable_not_created(tmp_path: Path) -> None:
    root = tmp_path / "not-mounted"
    tier = SharedFsTier(root, 1 << 20)
    with pytest.raises(TierUnavailable, match="does not exist"):
        await tier.put("k", b"v")
    with pytest.raises(TierUnavailable):
        await tier.get("k")
    assert not root.exists()
    root.mkdir()  # the mount appears: the tier recovers without a restart
    await tier.put("k", b"v")
    assert await tier.get("k") == b"v"


async def test_disk_full_is_storage_full_and_nothing_half_written(small_tmpfs: Path) -> None:
    tier = DiskTier(small_tmpfs, 1 << 30)  # a budget larger than the medium
    await tier.put("small", b"s" * 1000)
    with pytest.raises(StorageFull):
        await tier.put("big", b"b" * (256 << 10))
    assert await tier.contains(["small", "big"]) == [True, False]
    assert await tier.get("small") == b"s" * 1000
    assert not temp_files(small_tmpfs)
    assert tier.stats().errors == 1


async def test_read_only_shared_root_serves_reads_and_refuses_writes(small_tmpfs: Path) -> None:
    tier = SharedFsTier(small_tmpfs, 1 << 20)
    await tier.put("k", b"v" * 10)
    remount_read_only(small_tmpfs)
    with pytest.raises(TierUnavailable, match="Read-only"):
        await tier.put("k2", b"v")
    fresh = SharedFsTier(small_tmpfs, 1 << 20)  # an instance starting against the read-only mount
    assert fresh.lru_order() == ["k"]
    assert await fresh.get("k") == b"v" * 10
    with pytest.raises(TierUnavailable, match="Read-only"):
        await fresh.put("k3", b"v")
    assert await fresh.contains(["k", "k2", "k3"]) == [True, False, False]


async def test_meta_is_kept_with_the_value_and_handed_over_after_a_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    await tier.put("a", b"1" * 100, meta=b"block-a")
    await tier.put("b", b"2" * 50)
    os.utime(tier.path_of("a"), (1_000, 1_000))
    assert tier.path_of("a").stat().st_size == HEADER.size + 1 + len(b"block-a") + 100
    again = DiskTier(tmp_path, 1 << 20)
    assert again.take_rescanned() == [("a", b"block-a"), ("b", b"")]
    assert await again.get("a") == b"1" * 100  # the meta is not part of the value
    assert await again.get("b") == b"2" * 50


async def test_files_of_the_first_layout_are_still_served_and_checked(tmp_path: Path) -> None:
    import struct
    import zlib

    tier = DiskTier(tmp_path, 1 << 20)
    path = tier.path_of("old")
    path.parent.mkdir(parents=True)
    value = b"v1" * 40
    path.write_bytes(struct.pack("<8sIQI", b"KVMSV001", 3, len(value), zlib.crc32(value)) + b"old" + value)
    again = DiskTier(tmp_path, 1 << 20)
    assert again.take_rescanned() == [("old", b"")]
    assert await again.get("old") == value
    path.write_bytes(struct.pack("<8sIQI", b"KVMSV001", 3, len(value), zlib.crc32(value) ^ 1) + b"old" + value)
    assert await again.get("old") is None  # a checksum mismatch is a miss, never wrong bytes
    assert again.stats().corrupted == 1


async def test_a_flipped_bit_in_the_value_or_the_meta_length_is_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    for key in ("x", "y"):
        await tier.put(key, b"q" * 64, meta=b"m" * 8)
    raw = bytearray(tier.path_of("x").read_bytes())
    raw[-1] ^= 0x01
    tier.path_of("x").write_bytes(bytes(raw))
    raw = bytearray(tier.path_of("y").read_bytes())
    raw[HEADER.size - 4] ^= 0x01  # meta length: the sizes no longer add up
    tier.path_of("y").write_bytes(bytes(raw))
    assert await tier.get("x") is None and await tier.get("y") is None
    assert tier.stats().corrupted == 2
