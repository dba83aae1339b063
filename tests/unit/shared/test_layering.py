"""The import floors of docs/ARCHITECTURE.md are a contract that fails the build.

``make lint`` runs ``lint-imports`` (import-linter) on the tree with the contracts in
``pyproject.toml`` ``[tool.importlinter]``. These tests prove the contracts have teeth: a copy
of the tree with one forbidden import planted per kind of crossing must be rejected, and each
crossing must be named in the report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("kvmesh", "kvmesh_cli", "services", "engine_simulator", "bench", "tests")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# (module planted, the import it makes, what the report must say): one per kind of crossing.
CROSSINGS = [
    ("kvmesh/_x_lib_up.py", "import services.router.metrics", "kvmesh._x_lib_up -> services.router.metrics"),
    ("kvmesh/_x_lib_sim.py", "import engine_simulator.tokenizer", "kvmesh._x_lib_sim -> engine_simulator.tokenizer"),
    ("kvmesh/_x_lib_cli.py", "import kvmesh_cli.workloads", "kvmesh._x_lib_cli -> kvmesh_cli.workloads"),
    ("services/_x_svc_cli.py", "import kvmesh_cli.report", "services._x_svc_cli -> kvmesh_cli.report"),
    ("engine_simulator/_x_sim_up.py", "import services.epp.metrics", "engine_simulator._x_sim_up -> services.epp"),
    ("services/epp/_x_cross.py", "import services.router.metrics", "services.epp._x_cross -> services.router.metrics"),
    ("services/kv_store/tiers/_x_io.py", "import grpc", "services.kv_store.tiers._x_io -> grpc"),
    ("services/flow_control/queues/_x_io.py", "import httpx", "services.flow_control.queues._x_io -> httpx"),
    ("services/router/validation_x.py", "import grpc", None),  # not a core module: allowed
    ("bench/_x_cmd.py", "import kvmesh_cli.main", "bench._x_cmd -> kvmesh_cli.main"),
]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "fixtures", "golden", "configs")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dest / pkg, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH first on sys.path: the copy shadows the editable install of the real tree.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "pyproject.toml"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    root = tmp_path_factory.mktemp("tree")
    _copy_tree(root)
    for rel, stmt, _ in CROSSINGS:
        (root / rel).write_text(f'"""A planted crossing."""\n\n{stmt}\n')
    return _lint(root)


def test_the_tree_keeps_every_floor(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout or "broken" not in result.stdout


def test_a_planted_crossing_fails_the_build(planted: subprocess.CompletedProcess[str]) -> None:
    assert planted.returncode != 0
    assert "BROKEN" in planted.stdout


@pytest.mark.parametrize(("rel", "stmt", "reported"), CROSSINGS, ids=[c[0] for c in CROSSINGS])
def test_each_kind_of_crossing_is_named(
    planted: subprocess.CompletedProcess[str], rel: str, stmt: str, reported: str | None
) -> None:
    module = rel.removesuffix(".py").replace("/", ".")
    if reported is None:
        assert f"{module} " not in planted.stdout, planted.stdout
    else:
        assert reported in planted.stdout, planted.stdout
