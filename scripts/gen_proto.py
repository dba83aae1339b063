"""Generate kvmesh/_proto from proto/ (the one command behind `make proto`).

protoc's Python plugin writes absolute imports that mirror the proto package
(``from kvmesh.common.v1 import common_pb2``); kvmesh keeps generated code under
``kvmesh/_proto/`` so those imports are rewritten to ``kvmesh._proto.kvmesh...``.

Usage: ``python scripts/gen_proto.py [--check]``. With ``--check`` nothing is
written; the exit status is 1 when the committed code differs from a fresh run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "kvmesh" / "_proto"
_IMPORT = re.compile(r"^from kvmesh\.(\w+)\.v1 import", re.MULTILINE)


def generate(dest: Path) -> None:
    """Run protoc over every .proto under proto/ into ``dest`` and fix imports."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in dest.rglob("*.py*"):
        text = _IMPORT.sub(r"from kvmesh._proto.kvmesh.\1.v1 import", path.read_text())
        path.write_text(text)
    for folder in [dest, *[p for p in dest.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text()
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if kvmesh/_proto is stale")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        if ns.check:
            if _snapshot(fresh) != _snapshot(OUT):
                print("kvmesh/_proto is stale: run `make proto`", file=sys.stderr)
                return 1
            return 0
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(fresh, OUT)
    print(f"generated {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
