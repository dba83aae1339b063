"""Print the import picture of the tree: which unit imports which, by floor, and any arrow that runs up.

Units are the top-level packages, with ``services.<svc>`` one unit each; a package sits on the floor of
what it claims to be (``kvmesh`` is the library, even in an older tree where it still held the CLI). Floors, top to bottom (docs/ARCHITECTURE.md):
harness (``bench``, ``tests``, ``kvmesh_cli``), processes (``services.*``, ``engine_simulator``), library
(``kvmesh``). The graph is grimp's (the engine of import-linter, which enforces the same floors).

Usage: ``.venv/bin/python scripts/import_picture.py [ROOT]`` (ROOT defaults to the repo; it must be first on
``sys.path`` so another checkout is read instead of the installed one).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import grimp

FLOOR = {"bench": 3, "tests": 3, "kvmesh_cli": 3, "engine_simulator": 2, "kvmesh": 1}


def unit(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    return parts[0]


def floor(u: str) -> int:
    return 2 if u.startswith("services.") else FLOOR.get(u, 0)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(root))
    pkgs = [p for p in ("kvmesh", "kvmesh_cli", "services", "engine_simulator") if (root / p).is_dir()]
    graph = grimp.build_graph(*pkgs, cache_dir=None)
    edges: Counter[tuple[str, str]] = Counter()
    for importer in graph.modules:
        if importer.startswith("kvmesh._proto"):
            continue
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = unit(importer), unit(imported)
            if a != b and not imported.startswith("kvmesh._proto"):
                edges[(a, b)] += 1
    print(f"import picture of {root} (unit -> unit: imports)")
    for (a, b), n in sorted(edges.items(), key=lambda e: (-floor(e[0][0]), e[0])):
        arrow = "UP" if floor(b) > floor(a) else ("same floor" if floor(a) == floor(b) else "down")
        print(f"  floor {floor(a)} {a:32s} -> floor {floor(b)} {b:24s} {n:3d}  {arrow}")
    up = [e for e in edges if floor(e[1]) > floor(e[0])]
    across = [e for e in edges if floor(e[0]) == floor(e[1]) == 2]
    print(f"arrows up: {len(up)}  {sorted(up)}")
    print(f"process -> process arrows: {len(across)}  {sorted(across)}")


if __name__ == "__main__":
    main()
