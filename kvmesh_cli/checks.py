"""Up-front checks of ``kvmesh`` options and the one way the CLI reports a failure.

Bad usage (an unknown policy, a router that is not an http(s) URL, a malformed trace) is a
:class:`typer.BadParameter` (typer prints it in its error style and exits 2) raised before anything
starts. Runtime failures (a mesh member that does not come up, an unreachable router) go through
:func:`fail`: one ``error: ...`` message on stderr, exit status 1, no traceback.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import typing
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
"""Named epp scheduling configs: ``<name>.yaml`` here (epp's loader is imported only to check one:
:func:`check_scheduling_config`)."""

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
    is a named config; otherwise it must be a file. Either is then loaded as epp loads it at start
    (:func:`check_scheduling_config`), so a config epp would refuse is refused here, before anything starts.

    Raises:
        typer.BadParameter: neither (the message lists the named configs), or a config epp would refuse.
    """
    if value and "/" not in value and (configs_dir / f"{value}.yaml").is_file():
        check_scheduling_config(configs_dir / f"{value}.yaml", param_hint)
        return value
    path = Path(value).expanduser()
    if value and path.is_file():
        check_scheduling_config(path.resolve(), param_hint)
        return str(path.resolve())
    raise typer.BadParameter(
        f"{value!r} is neither a named scheduling config ({', '.join(known_policies(configs_dir))}) "
        "nor an existing YAML file",
        param_hint=param_hint,
    )


def _one_line(message: str) -> str:
    """A multi-line message (epp's for a YAML error) as one line: PyYAML's source excerpt and ``^`` after each
    ``line N, column M:`` dropped, ``in "<unicode string>",`` said as ``at``."""
    out: list[str] = []
    in_excerpt = False
    for line in message.splitlines():
        text = line.strip()
        if in_excerpt:
            in_excerpt = not text.endswith("^")
            continue
        if not text:
            continue
        if re.search(r"line \d+, column \d+:$", text):
            text, in_excerpt = text[:-1], True
        out.append(text.replace('in "<unicode string>", ', "at "))
    return " ".join(out)


def check_scheduling_config(path: Path, param_hint: str = "--policy") -> None:
    """Load the scheduling config file ``path`` with epp's own loader (``resolve_scheduling_config`` and
    ``build_profile`` with every shipped plugin), as epp does at start: every error epp would raise (not
    YAML, not a mapping, an unknown key or plugin type, bad parameters, a missing prepare step) is raised
    here instead, before etcd or a service starts.

    Raises:
        typer.BadParameter: one line, epp's :class:`ConfigError` message (it names the file and the entry).
    """
    from services.epp.framework.interfaces import ConfigError, PluginHandle, PrefixIndex, Tokenizer
    from services.epp.framework.loader import build_profile, resolve_scheduling_config
    from services.epp.plugins import default_registry

    # the mesh's epp always has kv_indexer and a tokenizer; the plugins built here are never run, so
    # stand-ins do (with None, plugins that need them would refuse as an epp without kv_indexer does)
    handle = PluginHandle(prefix_index=typing.cast(PrefixIndex, object()), tokenizer=typing.cast(Tokenizer, object()))
    try:
        source, data = resolve_scheduling_config(str(path))
        build_profile(data, default_registry(), handle, source=source)
    except ConfigError as exc:
        raise typer.BadParameter(_one_line(str(exc)), param_hint=param_hint) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = os_error_text(exc) if isinstance(exc, OSError) else f"{path}: not UTF-8 text ({exc.reason})"
        raise typer.BadParameter(reason, param_hint=param_hint) from None


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


def api_key_refusal(url: str, status: int, api_key: str | None) -> str:
    """The one line for a router that answered ``GET /v1/models`` with 401/403: it needs a key (none was
    sent: how to give one), or it refused the one sent."""
    return (f"router {url} answered GET /v1/models with HTTP {status}: it requires an API key; "
            + ("--api-key was refused" if api_key else "pass --api-key KEY (or set KVMESH_API_KEY)"))


def probe_router(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> None:
    """Fail (exit 1) unless ``GET <url>/v1/models`` answers 200 (with ``api_key`` as a bearer token when given)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url}/v1/models", timeout=timeout_s, headers=headers)
    except httpx.HTTPError as exc:
        fail(f"router {url} is unreachable: {exc or type(exc).__name__}")
    if reply.status_code in (401, 403):
        fail(api_key_refusal(url, reply.status_code, api_key))
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
    except OSError as exc:  # the run folder on a full or read-only filesystem, a file in its place, ...
        fail(f"the mesh did not start: {os_error_text(exc)}")


def os_error_text(exc: OSError) -> str:
    """``<strerror>: <path>`` of an ``OSError`` (``Read-only file system: /ro/run/etcd``), else its text."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc) or type(exc).__name__


def _writable(folder: Path) -> str | None:
    """Why files cannot be created in the existing folder ``folder`` (None: they can). Asks the filesystem
    (``os.access`` also reports a read-only mount, for root too)."""
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only filesystem"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def check_dir_option(path: Path, param_hint: str, *, create: bool = False) -> Path:
    """A folder option (``--run-dir``, ``--timeline``) checked before anything starts: an existing folder must
    be writable; a missing one must be creatable (its nearest existing parent a writable folder), and is
    made (with its parents) only with ``create``. Returns ``path`` absolute.

    Raises:
        typer.BadParameter: ``path`` (or a parent) is a file, cannot be created, or is not writable.
    """
    path = path.expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} exists and is not a directory", param_hint=param_hint)
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise typer.BadParameter(f"cannot create {path}: {existing} is not a directory", param_hint=param_hint)
    why = _writable(existing)
    if why:
        raise typer.BadParameter(why if existing == path else f"cannot create {path}: {why}", param_hint=param_hint)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise typer.BadParameter(f"cannot create {path}: {os_error_text(exc)}", param_hint=param_hint) from None
    return path


def check_output_file(path: Path, param_hint: str) -> Path:
    """A file option written at the end (``--json-out``, ``--plot``): checked before anything starts, so a
    long run never ends in a write that cannot succeed. Its folder must exist and be writable; an existing
    ``path`` must be a writable file (it is replaced). Returns ``path`` absolute.

    Raises:
        typer.BadParameter: otherwise (a missing folder, a directory in the file's place, no write permission).
    """
    path = path.expanduser().resolve()
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory; give a file name", param_hint=param_hint)
    if not path.parent.exists():
        raise typer.BadParameter(f"the folder {path.parent} does not exist", param_hint=param_hint)
    why = _writable(path.parent)
    if why:
        raise typer.BadParameter(why, param_hint=param_hint)
    if path.exists() and not os.access(path, os.W_OK):
        raise typer.BadParameter(f"{path} exists and is not writable", param_hint=param_hint)
    return path


def new_run_dir(command: str, root: Path = Path(".run")) -> Path:
    """A fresh run folder ``<root>/<command>-YYYYMMDD-HHMMSS-<pid>`` created exclusively (``-2``, ``-3``, ...
    appended while one exists), so runs started in the same second never share a folder (nor etcd's lock).

    Raises:
        typer.BadParameter: ``root`` cannot be created or written (names ``--run-dir``, the way out).
    """
    root = check_dir_option(root, "--run-dir", create=True)
    stem = f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in range(1, 1000):
        path = root / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise typer.BadParameter(f"cannot create {path}: {os_error_text(exc)}", param_hint="--run-dir") from None
        return path
    raise typer.BadParameter(f"no free run folder {root / stem}-N", param_hint="--run-dir")
