"""``run_interruptible`` and ``exit_on_signals`` under real signals, in a subprocess (so the signal handlers
are the process's own, in its main thread): the first SIGINT cancels the coroutine; a second and a third
SIGINT sent while the loop unwinds (a task still cancelling, the default executor still shutting down) are
ignored, never raised inside the loop's clean-up, and no traceback is printed. Before, the handlers in
force before were put back as soon as the coroutine ended, while ``asyncio.run`` still cancelled the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import OutputLines

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import asyncio, contextlib, signal, sys, threading, time
    from kvmesh_cli.mesh import exit_on_signals, run_interruptible

    cancelled = threading.Event()
    initial = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in the background by a shell (CI), else Python's

    def log(line):
        print(line, flush=True)

    def executor_job():  # the default executor's shutdown waits for it, after the tasks are cancelled
        cancelled.wait(60)
        time.sleep(2.0)  # outlasts background()'s 1 s of clean-up
        log("executor job done")

    async def background():  # not awaited by work(): the runner's clean-up cancels it after work ends
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            log("background unwinding")
            cancelled.set()
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # Python code running in this task's step: where a signal lands
                time.sleep(0.01)
            log("background done")
            raise

    async def work():
        asyncio.get_running_loop().run_in_executor(None, executor_job)
        keep = asyncio.create_task(background())
        await asyncio.sleep(0)
        log("ready")
        await asyncio.sleep(60)
        return keep

    guarded = sys.argv[1] == "guarded"
    try:
        with exit_on_signals(then_ignore=True) if guarded else contextlib.nullcontext():
            run_interruptible(work())
    except KeyboardInterrupt as exc:
        after = signal.getsignal(signal.SIGINT)
        want = signal.SIG_IGN if guarded else initial  # bare: the handler in force before, put back
        log(f"interrupted: {exc}; handler afterwards as expected: {after is want}")
        sys.exit(130)
    log("not interrupted")
''')


@pytest.mark.parametrize("mode", ["bare", "guarded"])
def test_second_and_third_signal_while_the_loop_unwinds_are_ignored(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "interrupt.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), mode], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = OutputLines(proc)
    try:
        lines.wait_for("ready")
        proc.send_signal(signal.SIGINT)
        lines.wait_for("background unwinding")
        proc.send_signal(signal.SIGINT)  # lands in the cancelled task's step
        seen = lines.wait_for("background done")
        assert "executor job done" not in seen, seen
        proc.send_signal(signal.SIGINT)  # lands while the default executor shuts down
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = lines.rest()
    assert proc.returncode == 130, text
    assert text.splitlines() == [
        "ready", "background unwinding", "background done", "executor job done",
        "interrupted: signal 2; handler afterwards as expected: True"], text
    for noise in ("Traceback", "never retrieved", "Exception ignored"):
        assert noise not in text, text


def test_a_coroutine_that_ends_before_any_signal_returns_its_value_and_restores_the_handlers() -> None:
    from kvmesh_cli.mesh import run_interruptible

    async def value() -> int:
        return 42

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert run_interruptible(value()) == 42
    assert {s: signal.getsignal(s) for s in before} == before
