"""The fault suite's mesh: real etcd, the five services and two simulated engines, as processes.

One mesh per module (starting it costs ~10-20 s on the 2-core machine); every fault test leaves it
whole again (restarts what it killed, resumes what it paused), and the next test checks that first.
Lease TTL 3 s, so "membership converges within the lease TTL" is checked against 3 s plus the
watch and scrape delays.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh_cli.mesh import Mesh, MeshSpec

LEASE_TTL_SECONDS = 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        run_dir=tmp_path_factory.mktemp("faults"),
        engines=2,
        policy="precise-prefix",
        time_scale=20.0,
        lease_ttl_seconds=LEASE_TTL_SECONDS,
        num_gpu_blocks=512,
    )
    with Mesh(spec) as started:
        yield started


def log_tails(mesh: Mesh, lines: int = 15) -> str:
    return "\n".join(f"--- {m.name}\n{m.process.log_tail(lines)}" for m in mesh.members)


@pytest.fixture
def run_dir_of(mesh: Mesh) -> Path:
    return mesh.spec.run_dir
