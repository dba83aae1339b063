"""Lay out what the compose-up check builds: the repository's sources and the compose file, with Jaeger
swapped for the OTLP sink (``otlp_sink.py``; Jaeger's image cannot be pulled on a machine without a
registry) and profile-only services (GPU vLLM) dropped. Nothing in the repository is written.

``stage(dest)`` -> the compose file's path relative to ``dest`` (``compose.check.yml``, at the root: the
check passes ``--project-directory`` = ``dest``, so build contexts are rebased from ``compose/`` to it).
``dest/requirements.txt`` is the kvmesh image's requirements at its build context's root, where
``compose_up_check.sh`` fills ``wheelhouse/`` for the offline build.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
COPY = ["kvmesh", "services", "engine_simulator", "docker", "compose", ".dockerignore"]
CHECK_FILE = "compose.check.yml"


def check_compose(users: dict) -> dict:
    """The users' compose file (parsed) with Jaeger replaced by the sink and profile services removed."""
    services = {name: copy.deepcopy(svc) for name, svc in users["services"].items() if not svc.get("profiles")}
    for svc in services.values():
        if "build" in svc:
            svc["build"]["context"] = os.path.normpath(os.path.join("compose", svc["build"]["context"]))
    kvmesh = services["router"]
    services["jaeger"] = {
        "image": kvmesh["image"],
        "build": kvmesh["build"],
        "init": True,
        "command": ["python", "/sink/otlp_sink.py"],
        "volumes": ["./tests/compose/otlp_sink.py:/sink/otlp_sink.py:ro"],
        "ports": ["127.0.0.1:16686:16686"],
        "healthcheck": {
            "test": ["CMD", "python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:16686/', timeout=2)"],
            "interval": "2s", "timeout": "3s", "retries": 30,
        },
    }
    return {"services": services}


def stage(dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    (dest / "tests" / "compose").mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "tests" / "compose" / "otlp_sink.py", dest / "tests" / "compose" / "otlp_sink.py")
    shutil.copy2(REPO / "tests" / "compose" / "probe.py", dest / "tests" / "compose" / "probe.py")
    shutil.copy2(REPO / "docker" / "requirements.txt", dest / "requirements.txt")
    users = yaml.safe_load((REPO / "compose" / "docker-compose.yml").read_text())
    (dest / CHECK_FILE).write_text(yaml.safe_dump(check_compose(users), sort_keys=False))
    return CHECK_FILE
