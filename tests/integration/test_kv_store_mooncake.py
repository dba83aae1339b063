"""kv_store's Mooncake tier against the real Mooncake 0.3.13.post1 (``mooncake-transfer-engine-non-cuda``).

Mooncake's client (its transfer engine) listens on 0.0.0.0 whatever it is told, so everything runs in
a private network namespace that has only loopback (``unshare -n``, see ``../shared/ENVIRONMENT.md``):
this test starts, inside one, a ``mooncake_master`` on 127.0.0.1 and a pytest that runs

* the StoreTier contract suite's mooncake cases (``tests/contract/test_store_tiers.py -k mooncake``);
* ``mooncake_cases.py``: two kv_store instances (two clients, one cluster) share values; a corrupt
  object is a miss; a restarted instance lists the namespace through the master's HTTP
  ``/get_all_keys`` and republishes its described values as ``BlockStored(SHARED)`` (and skips the
  rescan when the listing fails); a master that goes away makes the tier ``TierUnavailable`` and the
  store serves on from its other tiers.

Needs ``make mooncake-venv`` (``.venv-mooncake``; the ``mooncake`` package is put on the *end* of the
inner pytest's path) and ``apt-get install libibverbs1`` (``make deps``); skipped with the reason when
either is missing or namespaces are not permitted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE_VENV = ROOT / ".venv-mooncake"
SITE = MOONCAKE_VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
MASTER = MOONCAKE_VENV / "bin" / "mooncake_master"

SCRIPT = r"""
set -e
ip link set lo up
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_FORCE_TCP=1
"$MASTER" -rpc_address=127.0.0.1 -rpc_port=50551 -metrics_host=127.0.0.1 -metrics_port=50552 \
  > "$LOGDIR/master.log" 2>&1 &
echo $! > "$LOGDIR/master.pid"
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/50551) 2>/dev/null && break; sleep 0.1; done
export KVMESH_MOONCAKE_MASTER=127.0.0.1:50551 KVMESH_MOONCAKE_MASTER_PID=$(cat "$LOGDIR/master.pid")
export KVMESH_MOONCAKE_MASTER_HTTP=127.0.0.1:50552
"$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" tests/contract/test_store_tiers.py -k mooncake \
  tests/integration/mooncake_cases.py 2>&1
rc=$?
kill "$KVMESH_MOONCAKE_MASTER_PID" 2>/dev/null || true
exit $rc
"""


def _skip_reason() -> str | None:
    if not MASTER.exists() or not (SITE / "mooncake").is_dir():
        return f"{MOONCAKE_VENV} missing: run `make mooncake-venv`"
    if shutil.which("unshare") is None:
        return "unshare(1) missing: Mooncake needs a private network namespace"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        return f"no private network namespace here: {probe.stderr.decode().strip()}"
    if not any(Path(p, "libibverbs.so.1").exists() for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")):
        return "libibverbs.so.1 missing: `apt-get install libibverbs1` (make deps)"
    return None


@pytest.mark.timeout(180)
def test_mooncake_tier_in_private_netns(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    env.update(
        MASTER=str(MASTER),
        LOGDIR=str(tmp_path),
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", ""), str(SITE)])),
    )
    proc = subprocess.run(
        ["unshare", "-n", "bash", "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170
    )
    out = proc.stdout + proc.stderr
    master_log = (tmp_path / "master.log").read_text() if (tmp_path / "master.log").exists() else ""
    assert proc.returncode == 0, out[-6000:] + "\n--- master log ---\n" + master_log[-2000:]
    summary = [line for line in out.splitlines() if " passed" in line]
    assert summary and "skipped" not in summary[-1] and "failed" not in summary[-1], out[-3000:]
