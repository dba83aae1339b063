"""Who owns a run folder, and whether the etcd data left in it may be deleted.

A mesh that starts in ``<run_dir>`` holds an exclusive ``flock`` on ``<run_dir>/mesh.lock`` until it
stops (:class:`RunDirLock`); the file holds the owner's pid while it runs and is emptied by a clean stop.
The kernel drops a ``flock`` when its holder dies, SIGKILL included, so a lock that can be taken means
no mesh runs there: the etcd data left under ``<run_dir>/etcd`` (old registrations on leases that a
restarted etcd renews, old revisions) belongs to nobody and is deleted before the mesh's own etcd starts
(:func:`clear_stale_etcd_data`). Two guards keep a running mesh's data: the lock itself (a second mesh
in the same folder is refused), and etcd's own lock on its WAL files (an etcd still running on the data,
one no lock names: another tool, an older kvmesh, the etcd of a killed mesh still dying, is waited for
briefly, then refused).

A killed run's folder is seldom reused (each run gets a fresh ``.run/<command>-<time>-<pid>``), so its
etcd data (~123 MB of preallocated WAL) would stay for good: :func:`sweep_stale_etcd_data` deletes it
from every run folder under ``.run/`` whose lock nobody holds, under the same two guards; folders
without a lock file (an older kvmesh's) are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from pathlib import Path

LOCK_NAME = "mesh.lock"
"""The lock file in a run folder."""
ETCD_DATA_NAME = "etcd"
"""etcd's data folder in a run folder (``launcher.start_etcd``'s ``--data-dir``)."""
LOCK_WAIT_S = 2.0
"""How long a mesh retries a held lock before it is refused (a sweep holds a free folder's lock for
the few milliseconds of one deletion)."""
ETCD_RELEASE_WAIT_S = 5.0
"""How long a WAL lock is waited for (the etcd of a SIGKILLed mesh dies with it, within milliseconds)."""


class RunDirBusy(RuntimeError):
    """The run folder belongs to a running mesh, or a running etcd uses its data (one line, names the folder)."""


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/mesh.lock`` for as long as a mesh runs there.

    The descriptor is close-on-exec (Python's default), so no child of the mesh holds the lock:
    it ends with this process. Not re-entrant: a second :meth:`acquire` on the same folder, in
    this process or another, raises :class:`RunDirBusy` while the first holds it.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None
        self._owner = False

    @property
    def held(self) -> bool:
        """Whether this object holds the folder's lock now."""
        return self._fd is not None

    def acquire(self, wait_s: float = 0.0, *, owner: bool = True) -> int | None:
        """Take the lock, retrying for up to ``wait_s`` seconds; as the ``owner`` (a mesh), write this
        process's pid into the file (a sweep leaves the file as it is).

        Returns:
            The pid of a previous owner that died without stopping (the file was not emptied), else None.

        Raises:
            RunDirBusy: a running mesh holds it (its pid in the message).
            OSError: the file cannot be created (a read-only folder).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = _read_pid(fd)
                        raise RunDirBusy(f"{self.path.parent} is in use by a running mesh"
                                         f"{f' (pid {holder})' if holder else ''}; stop it or pick another "
                                         "--run-dir") from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        previous = _read_pid(fd)
        if owner:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd, self._owner = fd, owner
        return previous if previous != os.getpid() else None

    def release(self) -> None:
        """Drop the lock, the owner's after emptying the file (a clean stop); idempotent. The file stays
        (unlinking a lock file lets two later owners lock two different files)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self._owner:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def etcd_wal_in_use(data_dir: Path) -> bool:
    """Whether a running etcd holds a lock on one of ``data_dir``'s WAL files.

    etcd locks every WAL file it has open with an open-file-description lock (``F_OFD_SETLK``,
    a ``flock`` where the kernel has no OFD locks); a POSIX ``lockf`` test conflicts with the
    first and a ``flock`` test with the second, so both are tried, each released at once; a kind the
    filesystem cannot lock tells nothing.
    """
    for wal in sorted((data_dir / "member" / "wal").glob("*.wal")):
        try:
            fd = os.open(wal, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for lock, unlock in ((fcntl.lockf, fcntl.LOCK_UN), (fcntl.flock, fcntl.LOCK_UN)):
                try:
                    lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        return True
                    continue  # this kind of lock cannot be tested here (ENOLCK on some network filesystems)
                lock(fd, unlock)
        finally:
            os.close(fd)
    return False


def clear_stale_etcd_data(run_dir: Path, wait_s: float = ETCD_RELEASE_WAIT_S) -> bool:
    """Delete ``<run_dir>/etcd`` left by a mesh that did not stop. Call it holding :class:`RunDirLock`.

    Returns:
        Whether there was data to delete.

    Raises:
        RunDirBusy: an etcd still runs on the data after ``wait_s`` seconds (nothing is deleted).
    """
    data = run_dir / ETCD_DATA_NAME
    if not data.exists():
        return False
    deadline = time.monotonic() + wait_s
    while etcd_wal_in_use(data):
        if time.monotonic() > deadline:
            raise RunDirBusy(f"an etcd still runs on {data} (it holds its WAL lock); stop it or pick another "
                             "--run-dir")
        time.sleep(0.05)
    shutil.rmtree(data)
    return True


def sweep_stale_etcd_data(root: Path) -> list[Path]:
    """Delete the etcd data of every run folder under ``root`` (``.run/``: its folders and theirs, where
    ``compare`` keeps one per run) that has a lock file nobody holds and an etcd data folder no etcd runs on.

    Each folder's lock is held while its data is deleted (a mesh starting there meanwhile waits,
    :data:`LOCK_WAIT_S`); a folder that cannot be locked or read is skipped, never an error.

    Returns:
        The etcd data folders deleted.
    """
    deleted: list[Path] = []
    for lock_file in sorted([*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")]):
        run_dir = lock_file.parent
        data = run_dir / ETCD_DATA_NAME
        if not data.is_dir():
            continue
        lock = RunDirLock(run_dir)
        try:
            lock.acquire(owner=False)
        except (RunDirBusy, OSError):
            continue
        try:
            if not etcd_wal_in_use(data):
                shutil.rmtree(data, ignore_errors=True)
                deleted.append(data)
        except OSError:
            continue
        finally:
            lock.release()
    return deleted
