"""A run folder belongs to one running mesh (``<run_dir>/mesh.lock``, a ``flock``); etcd data left by an owner
that died is deleted before the next mesh's etcd starts, never while the owner runs, and a run with the
default folder sweeps dead runs' etcd data out of ``.run/`` (``kvmesh_cli/rundir.py``).
A real etcd on the data is in tests/integration/test_cli_usability.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvmesh_cli.mesh import Mesh, MeshSpec, MeshStartError
from kvmesh_cli.rundir import LOCK_NAME, RunDirBusy, RunDirLock, clear_stale_etcd_data, etcd_wal_in_use
from tests.support import wait_until


def _stale_etcd(run_dir: Path) -> Path:
    """An etcd data folder as a killed mesh leaves it (a WAL file nobody locks)."""
    wal = run_dir / "etcd" / "member" / "wal"
    wal.mkdir(parents=True)
    (wal / "0000000000000000-0000000000000000.wal").write_bytes(b"\0" * 64)
    return run_dir / "etcd"


def test_a_second_owner_is_refused_while_the_first_holds_the_folder(tmp_path: Path) -> None:
    first, second = RunDirLock(tmp_path), RunDirLock(tmp_path)
    assert first.acquire() is None
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(RunDirBusy, match=rf"{tmp_path} is in use by a running mesh \(pid {os.getpid()}\); "
                                         r"stop it or pick another --run-dir"):
        second.acquire()
    first.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # a clean stop leaves no owner behind
    assert second.acquire() is None  # free again, and nobody died holding it
    second.release()
    second.release()  # idempotent


def test_an_owner_killed_with_sigkill_frees_the_folder_and_is_named(tmp_path: Path) -> None:
    """The kernel drops the flock of a SIGKILLed owner; its pid stays in the file, so the next owner knows it
    did not stop (a real process, killed as ``kill -9`` would)."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from kvmesh_cli.rundir import RunDirLock
        RunDirLock(Path({str(tmp_path)!r})).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[3])
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=rf"\(pid {owner.pid}\)"):
            RunDirLock(tmp_path).acquire()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        lock = RunDirLock(tmp_path)
        assert lock.acquire() == owner.pid
        lock.release()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)


def test_stale_etcd_data_is_deleted_and_a_missing_folder_is_no_error(tmp_path: Path) -> None:
    data = _stale_etcd(tmp_path)
    assert not etcd_wal_in_use(data)
    assert clear_stale_etcd_data(tmp_path) is True
    assert not data.exists()
    assert clear_stale_etcd_data(tmp_path) is False


def test_etcd_data_whose_wal_is_locked_is_kept(tmp_path: Path) -> None:
    """etcd locks its WAL files (an OFD lock; a flock where the kernel has none): a lock held by another
    process (here a real one holding a POSIX lock, which an OFD lock conflicts with alike) keeps the data."""
    data = _stale_etcd(tmp_path)
    wal = next((data / "member" / "wal").glob("*.wal"))
    script = textwrap.dedent(f"""
        import fcntl, time
        f = open({str(wal)!r}, "r+b")
        fcntl.lockf(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        assert etcd_wal_in_use(data)
        with pytest.raises(RunDirBusy, match=rf"an etcd still runs on {data} \(it holds its WAL lock\)"):
            clear_stale_etcd_data(tmp_path, wait_s=0.2)
        assert wal.exists()
        holder.kill()
        holder.wait(10)
        wait_until(lambda: not etcd_wal_in_use(data), 5, "the WAL lock released")
        assert clear_stale_etcd_data(tmp_path, wait_s=0.2) and not data.exists()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_a_mesh_in_a_folder_another_mesh_owns_starts_nothing_and_deletes_nothing(tmp_path: Path) -> None:
    data = _stale_etcd(tmp_path)
    owner = RunDirLock(tmp_path)
    owner.acquire()
    try:
        mesh = Mesh(MeshSpec(run_dir=tmp_path, engines=1))
        with pytest.raises(MeshStartError, match="is in use by a running mesh"):
            mesh.start()
        assert mesh.members == [] and data.exists()
        assert not (tmp_path / "etcd.log").exists()
    finally:
        owner.release()


def test_the_sweep_deletes_only_dead_runs_etcd_data_under_dot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGKILLed run's folder is seldom reused (each run gets a fresh one), so its ~123 MB of etcd WAL would
    stay: a run with the default folder deletes it from every folder under ``.run/`` nobody holds."""
    from kvmesh_cli.main import _run_dir

    root = tmp_path / ".run"
    dead = [root / "up-1-111", root / "compare-2-222" / "0-0-round-robin"]  # compare keeps one folder per run
    for run in dead:
        _stale_etcd(run)
        (run / LOCK_NAME).write_text("4194304\n")  # its owner's pid; nobody holds the lock
    live = root / "up-3-333"
    _stale_etcd(live)
    held = RunDirLock(live)
    held.acquire()
    old_kvmesh = root / "up-4-444"  # no lock file: an older kvmesh's, maybe running; left alone
    _stale_etcd(old_kvmesh)
    monkeypatch.chdir(tmp_path)
    try:
        fresh = _run_dir(None, "up")
    finally:
        held.release()
    assert fresh.parent == root.resolve() and fresh.name.startswith("up-")
    assert [run for run in dead if (run / "etcd").exists()] == []
    assert all((run / LOCK_NAME).read_text() == "4194304\n" for run in dead)  # the sweep records nothing
    assert (live / "etcd").is_dir() and (old_kvmesh / "etcd").is_dir()
    out = " ".join(capsys.readouterr().out.split())
    assert f"deleted the etcd data that 2 killed earlier run(s) left in {root.resolve()}" in out, out
    assert "up-1-111" in out and "0-0-round-robin" in out and "up-3-333" not in out, out


def test_a_mesh_waits_for_a_sweep_holding_its_folder(tmp_path: Path) -> None:
    """A sweep holds a free folder's lock for one deletion; a mesh starting there meanwhile waits, not refused."""
    sweeper = RunDirLock(tmp_path)
    sweeper.acquire(owner=False)
    timer = threading.Timer(0.3, sweeper.release)
    timer.start()
    owner = RunDirLock(tmp_path)
    try:
        assert owner.acquire(wait_s=5.0) is None
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    finally:
        timer.join()
        owner.release()
