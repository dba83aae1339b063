"""The ``kvmesh`` console script: SIGINT, SIGTERM and SIGHUP are taken over before the CLI is imported.

Importing the CLI (typer, rich, grpc, the workloads) takes about half a second. Until then Python's own
handling applied: a job started in the background by a shell inherits SIGINT *ignored*, so an early
``kill -INT`` was lost and ``kvmesh up &`` went on to start a whole mesh; a Ctrl-C printed an import
traceback. Nothing has started while the CLI is being imported, so a signal then ends the process at once
with ``128 + signal`` and one line on stderr. Once imported, SIGINT raises KeyboardInterrupt (Python's
default, even where it was inherited ignored) and SIGTERM/SIGHUP are as they were, until a command's
:func:`kvmesh_cli.mesh.exit_on_signals` takes them over. An ignored SIGTERM or SIGHUP (``nohup``) stays ignored.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _while_importing(signum: int, frame: FrameType | None) -> None:
    os.write(2, f"kvmesh: interrupted (signal {signum}) before anything started\n".encode())
    os._exit(128 + signum)


def main() -> None:
    """Run the CLI (``kvmesh_cli.main:app``) with the signals handled from the first instruction on."""
    previous = {}
    for s in _SIGNALS:
        if s == signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, _while_importing)
    from kvmesh_cli.main import app

    for s, handler in previous.items():
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else handler)
    app()
