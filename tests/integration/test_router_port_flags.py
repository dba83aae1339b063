"""`kvmesh up --router-port <a port in use>`: the error names the CLI's own flag (``--router-port``), not the
router process's ``--http-port`` (a flag ``kvmesh up`` does not have). Real ``kvmesh up``, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvmesh.listen import bind_tcp

ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"PYTHONUNBUFFERED": "1"}


def test_up_router_port_in_use_names_router_port_flag(tmp_path: Path) -> None:
    taken = bind_tcp("127.0.0.1", 0)  # listening: the router's bind of it fails (no SO_REUSEPORT)
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "kvmesh_cli.main", "up", "--engines", "1", "--router-port",
                               str(port), "--run-dir", str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, timeout=240,
                              check=False)
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stdout[-3000:]
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert f"cannot listen for http on 127.0.0.1:{port}" in out, proc.stdout[-3000:]
    assert "choose another port with --router-port" in out, proc.stdout[-3000:]
    assert "--http-port" not in out and "Traceback" not in out, proc.stdout[-3000:]
