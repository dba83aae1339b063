"""Golden ``/metrics`` per service: metric names, help texts, types, labels and buckets are an API.

For each service, ``metrics_scenarios`` builds its metrics registry (no process), records a fixed
set of observations and renders it; the normalised text must equal ``tests/golden/metrics/<service>.prom``.
A rename, a new label or new buckets shows up as a diff in review. After an intended change, rewrite
the files with ``pytest tests/contract/test_metrics_exposition.py --update-golden`` (or
``KVMESH_UPDATE_GOLDEN=1``) and commit them with the change.
"""

from __future__ import annotations

import difflib
import subprocess
import sys

import pytest

from tests.contract.metrics_scenarios import SCENARIOS
from tests.support import TESTS_DIR, update_golden

GOLDEN_DIR = TESTS_DIR / "golden" / "metrics"
REPO_ROOT = TESTS_DIR.parent


def render_fresh(service: str) -> str:
    """The scenario's exposition, rendered in a fresh interpreter (the default registry starts empty)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.contract.metrics_scenarios", service],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("service", list(SCENARIOS))
def test_metrics_exposition_matches_golden(service: str, request: pytest.FixtureRequest) -> None:
    text = render_fresh(service)
    golden = GOLDEN_DIR / f"{service}.prom"
    if update_golden(request.config):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
        return
    assert golden.is_file(), f"{golden} missing: run pytest {__file__} --update-golden"
    expected = golden.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(golden), "rendered"))
    assert text == expected, f"/metrics of {service} changed (metric names and labels are an API):\n{diff}"


def test_every_golden_file_has_a_scenario() -> None:
    assert {p.stem for p in GOLDEN_DIR.glob("*.prom")} == set(SCENARIOS)
