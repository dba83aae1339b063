"""Typed process configuration: defaults < YAML file < environment < command-line flags.

Two bases: :class:`ProcessConfig` (what every process has: bind host, metrics port, etcd, lease,
drain grace, log level, OTLP) and :class:`GrpcServiceConfig` (adds the gRPC port and the etcd
instance id, for the services :class:`kvmesh.server.GrpcService` runs). Every process declares
one ``<Svc>Config`` on the right base that sets only its ``env_prefix``; its fields carry their
unit in their name, a bound and an attribute docstring (which becomes the flag's help).
:func:`load_config` builds the command line from the fields, so a field ``grpc_port`` is set by
``--grpc-port``, by ``KVMESH_<SVC>_GRPC_PORT`` or by ``grpc_port:`` in the file named by
``--config``. Lists of scalars (``etcd_endpoints``) take comma-separated values on the command line
and in the environment (``a:1,b:2``; an env value that starts with ``[`` is read as a JSON list);
lists of objects, mappings and nested models take YAML/JSON (JSON only in the environment). Config
classes are the only readers of the environment (the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` included).
"""

from __future__ import annotations

import argparse
import contextvars
import difflib
import enum
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("kvmesh_config_file", default=None)


_SCALARS = (str, int, float, bool)


def _optional_inner(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else as given."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if (origin is typing.Union or str(origin) == "<class 'types.UnionType'>") and len(args) == 1:
        return args[0]
    return annotation


def _is_scalar(annotation: Any) -> bool:
    annotation = _optional_inner(annotation)
    if typing.get_origin(annotation) is Literal:
        return True
    return isinstance(annotation, type) and issubclass(annotation, (*_SCALARS, enum.Enum))


def _list_kind(annotation: Any) -> Literal["scalars", "objects", None]:
    """Whether a field's type is a list (tuple, set) of scalars (``list[str]``), of anything else
    (``list[TenantSpec]``), or no list at all; ``X | None`` is looked through."""
    annotation = _optional_inner(annotation)
    if typing.get_origin(annotation) not in (list, tuple, set, frozenset):
        return None
    args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
    return "scalars" if all(_is_scalar(arg) for arg in args or [str]) else "objects"


def _split_list(raw: str) -> list[str]:
    """``"a:1, b:2,"`` -> ``["a:1", "b:2"]`` (the plain form of a list of scalars; empty -> ``[]``)."""
    return [item.strip() for item in raw.split(",") if item.strip()]


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, except that a list-of-scalars field also takes the plain
    comma-separated form (``KVMESH_ROUTER_ETCD_ENDPOINTS=a:2379,b:2379``), as its flag does; a value that
    starts with ``[`` is still a JSON list. Lists of objects, mappings and models stay JSON."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if (
            isinstance(value, str)
            and not value.lstrip().startswith("[")
            and field is not None
            and _list_kind(field.annotation) == "scalars"
        ):
            return _split_list(value)
        return super().decode_complex_value(field_name, field, value)


class ProcessConfig(BaseSettings):
    """Fields every kvmesh process shares. Subclasses set only ``model_config = SettingsConfigDict(env_prefix=...)``.

    ``extra="forbid"``, attribute docstrings as help and ``populate_by_name`` are inherited
    (pydantic merges a subclass's ``model_config`` into its parent's).
    """

    model_config = SettingsConfigDict(
        env_prefix="KVMESH_",
        extra="forbid",
        use_attribute_docstrings=True,
        populate_by_name=True,
    )

    host: str = "127.0.0.1"
    """Interface the process's servers bind (kvmesh binds loopback unless told otherwise)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the Prometheus /metrics HTTP endpoint; 0 picks a free one."""
    etcd_endpoints: list[str] = Field(default_factory=lambda: ["127.0.0.1:2379"])
    """etcd client endpoints as host:port (the first reachable one is used); empty disables membership."""
    lease_ttl_seconds: int = Field(10, ge=2, le=3600)
    """TTL of this instance's etcd lease; a crashed instance disappears after at most this long."""
    shutdown_grace_seconds: float = Field(5.0, ge=0, le=300)
    """On SIGTERM, how long running requests may finish before they are cancelled."""
    log_level: LogLevel = "INFO"
    """Root log level."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The process's event loop: uvloop (libuv; less CPU per request on every hop, docs/BENCHMARKS.md §3)
    or the standard library's asyncio loop."""
    ports_file: str = ""
    """Where to write the ports this process bound, as JSON (``{"grpc": 41234, "metrics": 41235}``),
    once they are listening (written atomically); empty writes nothing. With port 0 this is how a
    launcher learns the ports without racing another process for them (``kvmesh up``)."""
    otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("otlp_endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    """OTLP/gRPC collector URL (standard env var OTEL_EXPORTER_OTLP_ENDPOINT); unset disables export."""
    otlp_shutdown_timeout_seconds: float = Field(1.0, ge=0, le=60)
    """On stop, how long the last spans may take to reach the OTLP collector; what is not sent by then
    is dropped (one WARNING says how many), so an unreachable collector does not hold the exit."""

    @field_validator("etcd_endpoints")
    @classmethod
    def _check_etcd_endpoints(cls, endpoints: list[str]) -> list[str]:
        for endpoint in endpoints:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"etcd endpoint {endpoint!r} is not host:port (port 1-65535)")
        return endpoints

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # the env source is rebuilt as _EnvSource (same settings: it reads them from settings_cls's model_config)
        sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvSource(settings_cls)]
        path = _config_file.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    def dump_yaml(self) -> str:
        """The fully defaulted configuration as YAML (what ``--print-config`` prints)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class GrpcServiceConfig(ProcessConfig):
    """A process that serves gRPC through :class:`kvmesh.server.GrpcService` (the five services)."""

    grpc_port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (logged at start)."""
    instance_id: str = ""
    """Name of this instance in etcd; empty means host:grpc_port."""


C = TypeVar("C", bound=ProcessConfig)


def _flag_parser(annotation: Any) -> typing.Callable[[str], Any]:
    annotation = _optional_inner(annotation)
    origin = typing.get_origin(annotation)
    kind = _list_kind(annotation)
    if kind == "scalars":
        return _split_list
    if kind == "objects":
        return yaml.safe_load
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, (dict,))):
        return yaml.safe_load
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return yaml.safe_load
    return str  # scalars: pydantic converts "5", "true", "0.5" in lax mode


class _OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (``<name>: <message> (see --help)``, exit 2), no usage dump."""

    def __init__(self, *args: Any, short_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.short_name = short_name

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.short_name}: {message} (see --help)\n")


def _short_name(prog: str | None) -> str:
    """``"python -m services.router"`` -> ``"router"``; anything else as given (default: argv[0]'s name)."""
    prog = prog or Path(sys.argv[0]).name
    return prog.rsplit("services.", 1)[-1] if "services." in prog else prog


def _constraint(error: Any) -> str:
    """One pydantic error as a constraint phrase: ``must be <= 65535``, ``must be one of ...``."""
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    bounds = {"less_than_equal": ("<=", "le"), "less_than": ("<", "lt"),
              "greater_than_equal": (">=", "ge"), "greater_than": (">", "gt")}
    if kind in bounds:
        op, key = bounds[kind]
        return f"must be {op} {ctx.get(key)}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {ctx.get('expected', '')}"
    phrases = {
        "int_parsing": "must be an integer", "int_from_float": "must be an integer",
        "float_parsing": "must be a number", "bool_parsing": "must be true or false",
        "missing": "is required", "extra_forbidden": "is not a known option",
        "dict_type": "must be a mapping", "list_type": "must be a list",
    }
    if kind in phrases:
        return phrases[kind]
    message = str(error.get("msg", kind))
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return message[:1].lower() + message[1:]


def _origin(
    cls: type[ProcessConfig], field: str, flags: dict[str, Any], raw_flags: dict[str, Any], file_keys: set[str],
    config_path: Path | None,
) -> str:
    """Where a field's offending value came from, as the user wrote it: a flag, an env var or a file key."""
    if field in flags:
        return f"--{field.replace('_', '-')} {raw_flags.get(field, flags[field])}"
    prefix = str(cls.model_config.get("env_prefix", ""))
    info = cls.model_fields.get(field)
    names = [prefix + field]
    if info is not None and isinstance(info.validation_alias, AliasChoices):
        names += [alias for alias in info.validation_alias.choices if isinstance(alias, str) and alias.isupper()]
    environ = {key.upper(): (key, value) for key, value in os.environ.items()}
    for name in names:
        if name.upper() in environ:
            key, value = environ[name.upper()]
            return f"{key}={value}"
    if field in file_keys and config_path is not None:
        return f"--config {config_path}: {field}"
    return field


def _validation_lines(
    cls: type[ProcessConfig], exc: ValidationError, flags: dict[str, Any], raw_flags: dict[str, Any],
    file_keys: set[str], config_path: Path | None,
) -> list[str]:
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ())]
        field = loc[0] if loc else ""
        if field not in cls.model_fields:  # an alias (OTEL_EXPORTER_OTLP_ENDPOINT) names its field
            field = next((name for name, info in cls.model_fields.items()
                          if isinstance(info.validation_alias, AliasChoices) and field in info.validation_alias.choices),
                         field)
        if not field:  # a model-level check (two fields together): its message names them
            lines.append(_constraint(error))
            continue
        where = _origin(cls, field, flags, raw_flags, file_keys, config_path)
        if where.startswith("--config ") and "input" in error and not isinstance(error["input"], (dict, list)):
            where += f" {error['input']}"
        inner = ".".join(loc[1:])
        lines.append(f"{where}{' (' + inner + ')' if inner else ''}: {_constraint(error)}")
    return lines


READ_ELSEWHERE = frozenset({"KVMESH_EPP_PORT", "KVMESH_FLOW_CONTROL_PORT", "KVMESH_KV_INDEXER_PORT", "KVMESH_KV_STORE_PORT"})
"""Environment variables that share a service's prefix but are no setting of it, read by something else
(``compose/docker-compose.yml``'s published host ports, ``docs/compose.md``): :func:`unknown_env_lines`
leaves them alone."""


def unknown_env_lines(cls: type[ProcessConfig], environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """One line per environment variable that starts with ``cls``'s ``env_prefix`` (case-insensitively, as
    pydantic-settings reads them) but sets no field of it, so it would be silently ignored (a typo:
    ``KVMESH_ROUTER_HTTP_PROT``): ``KVMESH_ROUTER_HTTP_PROT is not a setting (did you mean
    KVMESH_ROUTER_HTTP_PORT?); ignored``, the suggestion being the closest field (:mod:`difflib`), if any
    is close. Names in :data:`READ_ELSEWHERE` are skipped, and so is every name when the prefix is empty
    or the bare ``KVMESH_`` (shared by every process)."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    if prefix in ("", "KVMESH_"):
        return []
    # pydantic-settings reads prefix + field name for every field (aliased ones too: populate_by_name)
    fields = {name.upper() for name in cls.model_fields}
    lines = []
    for key in sorted(os.environ if environ is None else environ):
        upper = key.upper()
        if not upper.startswith(prefix) or upper[len(prefix):] in fields or upper in READ_ELSEWHERE:
            continue
        close = difflib.get_close_matches(upper[len(prefix):], sorted(fields), n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        lines.append(f"{key} is not a setting{hint}; ignored")
    return lines


def load_config(cls: type[C], argv: list[str] | None = None, prog: str | None = None) -> C:
    """Parse flags, environment and ``--config FILE`` into ``cls``.

    ``--print-config`` prints the resulting configuration as YAML and exits 0.

    An environment variable with ``cls``'s prefix that names no field is ignored, with one stderr line
    each, written before validation (logging is not set up yet): ``<name>: KVMESH_ROUTER_HTTP_PROT is
    not a setting (did you mean KVMESH_ROUTER_HTTP_PORT?); ignored`` (:func:`unknown_env_lines`).

    Raises:
        SystemExit: 2 on an unknown flag or a value that fails validation. Each error is one
            stderr line ``<name>: <where>: <constraint>``, where ``<where>`` is the flag as given
            (``--port 99999``), the env var (``KVMESH_ROUTER_HTTP_PORT=abc``) or the file key
            (``--config f.yaml: http_port``); no usage dump, no traceback.
    """
    short = _short_name(prog)
    # allow_abbrev=False: `--port 8123` must not silently mean `--ports-file 8123` (argparse matches prefixes)
    parser = _OneLineParser(
        prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0], allow_abbrev=False, short_name=short,
    )
    parser.add_argument("--config", type=Path, help="YAML file with any of the fields below")
    parser.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    converters: dict[str, typing.Callable[[str], Any]] = {}
    for name, info in cls.model_fields.items():
        converters[name] = _flag_parser(info.annotation)
        default = info.default if info.default_factory is None else info.default_factory()  # type: ignore[call-arg]
        if isinstance(default, enum.Enum):
            default = default.value
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            # argparse %-formats help strings: a literal "%" in a docstring ("~80 %") must be doubled
            help=f"{info.description or ''} (default: {default!r})".replace("%", "%%"),
        )
    ns = vars(parser.parse_args(argv))
    sys.stderr.write("".join(f"{short}: {line}\n" for line in unknown_env_lines(cls)))
    config_path = ns.pop("config")
    print_config = ns.pop("print_config")
    file_keys: set[str] = set()
    if config_path is not None:
        if not config_path.exists():
            parser.error(f"--config {config_path}: no such file")
        if not config_path.is_file():
            parser.error(f"--config {config_path}: not a regular file")
        try:
            loaded = yaml.safe_load(config_path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            parser.error(f"--config {config_path}: not valid YAML: {first}")
        if loaded is not None and not isinstance(loaded, dict):
            parser.error(f"--config {config_path}: expected a mapping of field: value, got {type(loaded).__name__}")
        file_keys = {str(key) for key in (loaded or {})}
    flags: dict[str, Any] = {}
    for name, raw in ns.items():
        try:
            flags[name] = converters[name](raw)
        except yaml.YAMLError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            parser.error(f"--{name.replace('_', '-')} {raw}: not valid YAML/JSON: {first}")
    token = _config_file.set(config_path)
    try:
        config = cls(**flags)
    except ValidationError as exc:
        lines = _validation_lines(cls, exc, flags, ns, file_keys, config_path)
        sys.stderr.write("".join(f"{short}: {line}\n" for line in lines))
        raise SystemExit(2) from None
    except SettingsError as exc:  # an env var pydantic-settings cannot decode (a mapping that is not JSON)
        match = re.search(r'field "(\w+)"', str(exc))
        field = match.group(1) if match else ""
        where = _origin(cls, field, {}, {}, set(), None) if field else str(exc)
        field_info = cls.model_fields.get(field)
        # a list of scalars never gets here unless it starts with "[" (else it is split on commas)
        expected = {"objects": "; expected a JSON list of objects ([{...}, ...])",
                    "scalars": "; expected a JSON list ([...]) or comma-separated values"}
        hint = expected.get(str(_list_kind(field_info.annotation)), "") if field_info is not None else ""
        sys.stderr.write(f"{short}: {where}: not valid JSON{hint}\n")
        raise SystemExit(2) from None
    except ValueError as exc:
        parser.error(str(exc).splitlines()[0])
    finally:
        _config_file.reset(token)
    if print_config:
        sys.stdout.write(config.dump_yaml())
        raise SystemExit(0)
    return config
