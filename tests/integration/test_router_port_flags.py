"""`kvmesh up --router-port <a port in use>` (and ``--router-grpc-port``): refused before anything starts (exit 2),
naming the CLI's own flag, not the router process's ``--http-port`` (a flag ``kvmesh up`` does not have). Real
``kvmesh up``; the router's own start-up error for a port taken in between is tests/unit/router/test_listen_flags.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.listen import bind_tcp

ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(("flag", "what"), [("--router-port", "http"), ("--router-grpc-port", "grpc")])
def test_up_router_port_in_use_is_refused_before_anything_starts(tmp_path: Path, flag: str, what: str) -> None:
    taken = bind_tcp("127.0.0.1", 0)  # listening: the router's bind of it would fail (no SO_REUSEPORT)
    port = taken.getsockname()[1]
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "kvmesh_cli.main", "up", "--engines", "1", flag,
                               str(port), "--run-dir", str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=240,
                              check=False)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stdout[-3000:]
    out = " ".join(proc.stdout.split()).replace("│", " ")  # rich wraps long lines in a box
    out = " ".join(out.split())
    assert f"cannot listen for {what} on 127.0.0.1:{port}" in out, proc.stdout[-3000:]
    assert flag in out and "choose another port" in out, proc.stdout[-3000:]
    assert "--http-port" not in out and "--grpc-port " not in out and "Traceback" not in out, proc.stdout[-3000:]
    assert "starting mesh" not in out and not (tmp_path / "run" / "etcd").exists()  # nothing started
    assert time.monotonic() - started < 60
