"""Signals that reach ``kvmesh up`` early (the real console script, a real etcd):

* during the CLI's own import, before any handler of the command exists: a background job (which a shell
  starts with SIGINT *ignored*) is still interrupted, exit 130 with one line and no traceback, nothing started
  (``kvmesh_cli/entry.py``; was: the signal was lost and the whole mesh came up);
* while etcd is starting (before it answers): etcd is stopped and its data folder (~123 MB of preallocated WAL)
  deleted (was: kept until the next run, which then called it a killed run's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

KVMESH = Path(sys.executable).with_name("kvmesh")
pytestmark = pytest.mark.skipif(not KVMESH.exists(), reason="the kvmesh console script is not installed in this venv")


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def _ignore_sigint() -> None:  # as a shell starts a background job
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupted_up(run_dir: Path, when: Callable[[subprocess.Popen[bytes]], bool], what: str) -> tuple[int, str]:
    """Start ``kvmesh up`` as a background job (SIGINT ignored), send SIGINT once ``when(proc)`` holds (polled
    every 2 ms, at most 60 s), and return its exit code and output."""
    proc = subprocess.Popen([str(KVMESH), "up", "--engines", "1", "--run-dir", str(run_dir)], preexec_fn=_ignore_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not when(proc) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None and when(proc), what
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(errors="replace")


def test_sigint_during_the_cli_import_ends_a_background_kvmesh_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # the CLI is still importing when its handler appears (the import takes ~0.5 s)
    code, text = _interrupted_up(run_dir, lambda proc: _catches(proc.pid, signal.SIGINT), "exited before catching SIGINT")
    assert code == 130, text
    assert "interrupted (signal 2)" in text and "Traceback" not in text, text
    assert "kvmesh ready" not in text and not (run_dir / "etcd").exists(), text


def test_sigint_while_etcd_starts_leaves_no_etcd_and_no_data(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # etcd has its data folder, and is not yet answering (or just is)
    code, text = _interrupted_up(run_dir, lambda proc: (run_dir / "etcd").exists(), "etcd never started")
    assert code == 130, text
    assert "interrupted (signal 2)" in text and "Traceback" not in text, text
    assert not (run_dir / "etcd").exists(), (sorted(p.name for p in run_dir.iterdir()), text)
    etcds = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(run_dir / "etcd"))]
    assert etcds == [], "an etcd of this run still runs"


def _cmdline_has(proc_dir: Path, text: str) -> bool:
    try:
        return text in (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def test_an_ignored_sighup_stays_ignored_while_the_cli_imports(tmp_path: Path) -> None:
    """``nohup kvmesh ...``: the entry point does not take over a SIGHUP its parent asked to ignore."""
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "import kvmesh_cli.entry as e\n"
            "sys.argv = ['kvmesh', '--help']\n"
            "try:\n    e.main()\nexcept SystemExit:\n    pass\n"
            "print('SIGHUP', 'ignored' if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else 'taken')\n"
            "print('SIGINT', 'raises' if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 'other')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "120"}, check=False)
    assert done.returncode == 0, done.stderr
    assert "compare" in done.stdout and "SIGHUP ignored" in done.stdout and "SIGINT raises" in done.stdout, done.stdout
