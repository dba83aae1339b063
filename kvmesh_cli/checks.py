"""Up-front checks of ``kvmesh`` options and the one way the CLI reports a failure.

Bad usage (an unknown policy, a router that is not an http(s) URL, a malformed trace) is a
:class:`typer.BadParameter` (typer prints it in its error style and exits 2) raised before anything
starts. Runtime failures (a mesh member that does not come up, an unreachable router) go through
:func:`fail`: one ``error: ...`` message on stderr, exit status 1, no traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import httpx
import typer
from rich.console import Console
from rich.text import Text

from kvmesh_cli.mesh import MeshStartError

EPP_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "services" / "epp" / "configs"
"""Named epp scheduling configs: ``<name>.yaml`` here (read as files; epp itself is not imported)."""

err_console = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: <message>`` to stderr (verbatim, no rich markup) and exit with ``code``."""
    err_console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)
    raise typer.Exit(code)


def known_policies(configs_dir: Path = EPP_CONFIGS_DIR) -> list[str]:
    """Names of the named epp scheduling configs, sorted (``load-only``, ``precise-prefix``, ...)."""
    return sorted(p.stem for p in configs_dir.glob("*.yaml"))


def resolve_policy(value: str, param_hint: str = "--policy", configs_dir: Path = EPP_CONFIGS_DIR) -> str:
    """A named config as is, or an existing YAML file as an absolute path (epp runs elsewhere).

    Mirrors epp's ``resolve_scheduling_config``: a value without ``/`` naming ``<configs_dir>/<value>.yaml``
    is a named config; otherwise it must be a file. The file's content is checked by epp at start.

    Raises:
        typer.BadParameter: neither; the message lists the named configs.
    """
    if value and "/" not in value and (configs_dir / f"{value}.yaml").is_file():
        return value
    path = Path(value).expanduser()
    if value and path.is_file():
        return str(path.resolve())
    raise typer.BadParameter(
        f"{value!r} is neither a named scheduling config ({', '.join(known_policies(configs_dir))}) "
        "nor an existing YAML file",
        param_hint=param_hint,
    )


def check_router_url(value: str) -> str:
    """``value`` without a trailing slash, if it is an ``http://`` or ``https://`` URL with a host.

    Raises:
        typer.BadParameter: otherwise (e.g. ``notaurl`` or ``127.0.0.1:8000``).
    """
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(
            f"{value!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8000", param_hint="--router")
    return value.rstrip("/")


def probe_router(url: str, timeout_s: float = 10.0) -> None:
    """Fail (exit 1) unless ``GET <url>/v1/models`` answers 200."""
    try:
        reply = httpx.get(f"{url}/v1/models", timeout=timeout_s)
    except httpx.HTTPError as exc:
        fail(f"router {url} is unreachable: {exc or type(exc).__name__}")
    if reply.status_code != 200:
        fail(f"router {url} answered GET /v1/models with HTTP {reply.status_code}; is it a kvmesh router?")


@contextlib.contextmanager
def mesh_errors() -> Iterator[None]:
    """Turn a failed mesh start into :func:`fail` (the mesh has already stopped what it started)."""
    try:
        yield
    except MeshStartError as exc:
        fail(f"the mesh did not start: {exc}")
    except FileNotFoundError as exc:  # the etcd binary
        fail(str(exc))
    except TimeoutError as exc:  # etcd not healthy in time
        fail(f"the mesh did not start: {exc or 'timed out'}")
