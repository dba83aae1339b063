"""Strict loader for scheduling configs given as data (YAML or JSON), mirroring GIE's EndpointPickerConfig.

Shape::

    plugins:                         # every plugin instance, built through the registry
      - type: queue-scorer           # registered kebab-case type (required)
        name: queue                  # instance name (default: the type); unique
        parameters: {}               # validated by the plugin's own pydantic model
    profiles:                        # exactly one for now (no profile handler ships yet)
      - name: default
        plugins:
          - ref: queue               # a plugin instance name
            weight: 2                # scorers only; > 0; default 1

Steps, as GIE's ``configloader.go``: decode strictly (unknown keys are errors), default, validate,
then build through the registry. A profile must reference at most one picker; without one it gets a
``max-score-picker`` (GIE's default). Prepare steps and filters run in the order listed. A plugin
that consumes a cycle-state key (``precise-prefix-cache-scorer`` and ``prefill-cost-scorer`` read
``prefix-match``'s output) needs the producing step referenced in the same profile; the loader
refuses the config otherwise (it never adds a step on its own: the config says what runs). Every error is a
:class:`ConfigError` whose message names the offending entry. Named configs are the YAML files in
``services/epp/configs/``; :func:`resolve_scheduling_config` accepts a name or a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml

from services.epp.framework.interfaces import ConfigError, Filter, Picker, Plugin, PluginHandle, PrepareStep, Scorer
from services.epp.framework.profile import SchedulerProfile, WeightedScorer
from services.epp.framework.registry import PluginRegistry

NAMED_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PICKER_TYPE = "max-score-picker"


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class PluginSpec(_Strict):
    type: str = pydantic.Field(min_length=1)
    name: str | None = None
    parameters: dict[str, Any] = pydantic.Field(default_factory=dict)


class PluginRef(_Strict):
    ref: str = pydantic.Field(min_length=1)
    weight: float | None = pydantic.Field(default=None, gt=0)


class ProfileSpec(_Strict):
    name: str = pydantic.Field(min_length=1)
    plugins: list[PluginRef] = pydantic.Field(default_factory=list)


class SchedulingConfigSpec(_Strict):
    plugins: list[PluginSpec] = pydantic.Field(min_length=1)
    profiles: list[ProfileSpec] = pydantic.Field(min_length=1, max_length=1)


def named_configs() -> list[str]:
    return sorted(p.stem for p in NAMED_CONFIGS_DIR.glob("*.yaml"))


def resolve_scheduling_config(name_or_path: str) -> tuple[str, Mapping[str, Any]]:
    """Read a named config (``load-only``) or a YAML/JSON file; returns (source, decoded data).

    Raises:
        ConfigError: neither a named config nor a readable file, or not valid YAML/JSON.
    """
    named = NAMED_CONFIGS_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and named.is_file():
        path = named
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"scheduling config {name_or_path!r} is neither a named config ({', '.join(named_configs())}) "
                "nor an existing file"
            )
    return str(path), parse_scheduling_text(path.read_text(), source=str(path))


def parse_scheduling_text(text: str, source: str = "<data>") -> Mapping[str, Any]:
    """Decode YAML (a superset of JSON) into a mapping.

    Raises:
        ConfigError: not valid YAML/JSON, or not a mapping at the top.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'plugins' and 'profiles', got {type(data).__name__}")
    return data


def _format_validation(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
    )


def build_profile(
    data: Mapping[str, Any], registry: PluginRegistry, handle: PluginHandle, source: str = "<data>"
) -> SchedulerProfile:
    """Validate ``data`` and build its (single) profile.

    Raises:
        ConfigError: with the source and the exact problem.
    """
    try:
        spec = SchedulingConfigSpec.model_validate(dict(data))
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: {_format_validation(exc)}") from None
    instances: dict[str, Plugin] = {}
    for i, plugin_spec in enumerate(spec.plugins):
        name = plugin_spec.name or plugin_spec.type
        if name in instances:
            raise ConfigError(f"{source}: plugins[{i}]: duplicate plugin name {name!r}")
        try:
            instances[name] = registry.create(plugin_spec.type, name, plugin_spec.parameters, handle)
        except ConfigError as exc:
            raise ConfigError(f"{source}: plugins[{i}]: {exc}") from None
    profile_spec = spec.profiles[0]
    where = f"{source}: profiles[0] ({profile_spec.name!r})"
    steps: list[PrepareStep] = []
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    seen: set[str] = set()
    for j, ref in enumerate(profile_spec.plugins):
        plugin = instances.get(ref.ref)
        if plugin is None:
            raise ConfigError(
                f"{where}.plugins[{j}]: unknown plugin ref {ref.ref!r}; defined plugins: {', '.join(instances)}"
            )
        if ref.ref in seen:
            raise ConfigError(f"{where}.plugins[{j}]: plugin {ref.ref!r} referenced twice")
        seen.add(ref.ref)
        if isinstance(plugin, Scorer):
            scorers.append(WeightedScorer(plugin, 1.0 if ref.weight is None else ref.weight))
            continue
        if ref.weight is not None:
            raise ConfigError(f"{where}.plugins[{j}]: weight given for {ref.ref!r}, which is not a scorer")
        if isinstance(plugin, PrepareStep):
            steps.append(plugin)
        elif isinstance(plugin, Filter):
            filters.append(plugin)
        elif isinstance(plugin, Picker):
            pickers.append(plugin)
        else:  # pragma: no cover - every registered plugin is one of the four
            raise ConfigError(f"{where}.plugins[{j}]: {ref.ref!r} is not a prepare step, filter, scorer or picker")
    if len(pickers) > 1:
        raise ConfigError(f"{where}: more than one picker: {', '.join(p.name for p in pickers)}")
    picker = pickers[0] if pickers else registry.create(DEFAULT_PICKER_TYPE, DEFAULT_PICKER_TYPE, {}, handle)
    assert isinstance(picker, Picker)
    try:
        return SchedulerProfile(profile_spec.name, filters, scorers, picker, prepare_steps=steps)
    except ConfigError as exc:
        raise ConfigError(f"{source}: profiles[0]: {exc}") from None
