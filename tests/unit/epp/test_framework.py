"""Profile runs, registry and config-loader errors, and a conformance suite over every registered plugin."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from kvmesh.errors import NoEndpointsAvailable
from kvmesh.types import EndpointId
from services.epp.framework.cycle_state import CycleState, StateKey
from services.epp.framework.interfaces import (
    Candidate,
    ConfigError,
    Filter,
    Picker,
    PluginError,
    PluginHandle,
    PrefixMatch,
    PrepareStep,
    SchedulingRequest,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.loader import build_profile, named_configs, parse_scheduling_text, resolve_scheduling_config
from services.epp.framework.profile import SchedulerProfile, WeightedScorer
from services.epp.framework.registry import PluginRegistry
from services.epp.plugins import default_registry
from services.epp.plugins.pickers.max_score import MaxScorePicker
from services.epp.plugins.scorers.queue import QueueScorer
from tests.unit.epp.helpers import cand

REQ = SchedulingRequest(model="m")


class FixedScorer(Scorer):
    """Test-only scorer returning fixed scores (registered like a real one)."""

    type_name = "fixed-scorer"
    category = ScorerCategory.BALANCE

    def __init__(self, name: str, scores: Mapping[str, float]) -> None:
        super().__init__(name)
        self.scores = dict(scores)

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        return dict(self.scores)  # type: ignore[arg-type]


class DropFilter(Filter):
    type_name = "drop-filter"

    def __init__(self, name: str, drop: set[str]) -> None:
        super().__init__(name)
        self.drop = drop

    def filter(self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        return [c for c in candidates if c.id not in self.drop]


A, B, C = cand(8000), cand(8001), cand(8002)


def test_profile_weights_and_breakdown() -> None:
    profile = SchedulerProfile(
        "p",
        [DropFilter("f", {C.id})],
        [
            WeightedScorer(FixedScorer("x", {A.id: 1.0, B.id: 0.0}), 3),
            WeightedScorer(FixedScorer("y", {A.id: 0.0, B.id: 1.0}), 2),
        ],
        MaxScorePicker("max", random.Random(0)),
    )
    observed: list[tuple[str, str]] = []
    result = profile.run(CycleState(), REQ, [A, B, C], observer=lambda p, t, s: observed.append((p, t)))
    assert [s.id for s in result.ranked] == [A.id, B.id]
    assert result.ranked[0].scores == {"x": 1.0, "y": 0.0}
    assert [s.total for s in result.ranked] == [3.0, 2.0]
    assert result.profile == "p"
    assert observed == [
        ("filter", "drop-filter"), ("scorer", "fixed-scorer"), ("scorer", "fixed-scorer"), ("picker", "max-score-picker")
    ]


def test_profile_filter_dropping_all_is_no_endpoints() -> None:
    profile = SchedulerProfile("p", [DropFilter("f", {A.id})], [], MaxScorePicker("max"))
    with pytest.raises(NoEndpointsAvailable, match="filter 'f' dropped all 1"):
        profile.run(CycleState(), REQ, [A])


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ({A.id: 1.5, B.id: 0.0}, "outside"),
        ({A.id: -0.1, B.id: 0.0}, "outside"),
        ({A.id: float("nan"), B.id: 0.0}, "outside"),
        ({A.id: 0.5}, "missing"),
        ({A.id: 0.5, B.id: 0.5, "ghost:1": 0.5}, "unknown endpoints"),
    ],
    ids=["above-one", "negative", "nan", "missing", "extra"],
)
def test_profile_rejects_broken_scores(scores: dict[str, float], message: str) -> None:
    profile = SchedulerProfile("p", [], [WeightedScorer(FixedScorer("bad", scores), 1)], MaxScorePicker("max"))
    with pytest.raises(PluginError, match=message):
        profile.run(CycleState(), REQ, [A, B])


def test_cycle_state_typed_keys() -> None:
    key: StateKey[int] = StateKey("n")
    state = CycleState()
    assert state.get(key) is None and key not in state
    state.set(key, 3)
    assert state.get(key) == 3 and key in state


# -- registry ------------------------------------------------------------------------------
def test_registry_refuses_duplicates_and_bad_names() -> None:
    registry = default_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.register("queue-scorer", lambda n, p, h: QueueScorer(n))
    with pytest.raises(ValueError, match="kebab-case"):
        registry.register("Queue_Scorer", lambda n, p, h: QueueScorer(n))


def test_registry_unknown_type_lists_known() -> None:
    with pytest.raises(ConfigError, match=r"unknown plugin type 'nope'.*known types: kv-cache-utilization-scorer"):
        default_registry().create("nope", "x", {}, PluginHandle())


# -- config loader -------------------------------------------------------------------------
def _doc(plugins: list[dict[str, Any]], refs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"plugins": plugins, "profiles": [{"name": "default", "plugins": refs}], **extra}


Q = {"type": "queue-scorer", "name": "q"}
CASES = [
    ({"plugins": [Q]}, "profiles: Field required"),
    (_doc([Q], [{"ref": "q"}], extra_key=1), "extra_key: Extra inputs are not permitted"),
    (_doc([{"type": "nope"}], []), r"plugins\[0\]: unknown plugin type 'nope'; known types:"),
    (_doc([Q, Q], [{"ref": "q"}]), r"plugins\[1\]: duplicate plugin name 'q'"),
    (_doc([Q], [{"ref": "zz"}]), r"profiles\[0\] \('default'\).plugins\[0\]: unknown plugin ref 'zz'; defined plugins: q"),
    (_doc([Q], [{"ref": "q", "weight": 0}]), "weight: Input should be greater than 0"),
    (_doc([Q], [{"ref": "q"}, {"ref": "q"}]), "referenced twice"),
    (_doc([Q, {"type": "max-score-picker", "name": "m"}], [{"ref": "m", "weight": 2}]), "weight given for 'm'"),
    (
        _doc([{"type": "max-score-picker", "name": "a"}, {"type": "random-picker", "name": "b"}], [{"ref": "a"}, {"ref": "b"}]),
        "more than one picker: a, b",
    ),
    (_doc([{**Q, "parameters": {"x": 1}}], [{"ref": "q"}]), r"plugin 'q' \(type queue-scorer\): invalid parameters: x: Extra"),
    (
        _doc([{"type": "live-endpoint-filter", "parameters": {"max_metrics_age_seconds": -1}}], []),
        "max_metrics_age_seconds: Input should be greater than 0",
    ),
    (_doc([{"type": "prefix-match"}], []), "needs kv_indexer"),
    ({"plugins": [Q], "profiles": [{"name": "a"}, {"name": "b"}]}, "profiles: List should have at most 1 item"),
]


@pytest.mark.parametrize(("data", "message"), CASES, ids=[
    "no-profiles", "unknown-top-key", "unknown-type", "duplicate-name", "unknown-ref", "zero-weight",
    "ref-twice", "weight-on-picker", "two-pickers", "bad-param-key", "bad-param-value", "prefix-without-indexer",
    "two-profiles",
])
def test_loader_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_profile(data, default_registry(), PluginHandle(), source="cfg.yaml")


def test_loader_defaults_picker_and_weight() -> None:
    profile = build_profile(_doc([Q], [{"ref": "q"}]), default_registry(), PluginHandle())
    assert profile.picker.type_name == "max-score-picker"
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [("q", 1.0)]


def test_loader_parses_json_and_rejects_garbage() -> None:
    data = parse_scheduling_text('{"plugins": [{"type": "random-picker"}], "profiles": [{"name": "p", "plugins": [{"ref": "random-picker"}]}]}')
    assert build_profile(data, default_registry(), PluginHandle()).picker.type_name == "random-picker"
    with pytest.raises(ConfigError, match="not valid YAML/JSON"):
        parse_scheduling_text("plugins: [")
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_scheduling_text("- a\n- b\n")


class _NullIndex:
    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        return PrefixMatch(0, {})


@pytest.mark.parametrize(
    ("name", "steps", "scorers", "picker", "needs_prompt"),
    [
        ("round-robin", [], {}, "round-robin-picker", False),
        ("load-only", [], {"queue": 1.0, "kv-utilization": 1.0}, "max-score-picker", False),
        ("llm-d-blend", ["prefix-match"], {"prefix": 3.0, "queue": 2.0, "kv-utilization": 2.0}, "max-score-picker", True),
        ("precise-prefix", ["prefix-match"], {"sticky": 10.0, "prefix": 3.0, "queue": 2.0, "kv-utilization": 2.0},
         "max-score-picker", True),
        ("prefill-cost", ["prefix-match"], {"prefill-cost": 1.0, "prefix": 0.01}, "max-score-picker", True),
        ("tier-cost", ["prefix-match"], {"sticky": 10.0, "tier-cost": 1.0, "prefix": 0.01}, "max-score-picker", True),
        ("dynamo-cost", ["prefix-match"], {"dynamo-cost": 1.0, "prefix": 0.01}, "max-score-picker", True),
    ],
    ids=["round-robin", "load-only", "llm-d-blend", "precise-prefix", "prefill-cost", "tier-cost", "dynamo-cost"],
)
def test_named_configs(name: str, steps: list[str], scorers: dict[str, float], picker: str, needs_prompt: bool) -> None:
    assert name in named_configs()
    source, data = resolve_scheduling_config(name)
    profile = build_profile(data, default_registry(), PluginHandle(prefix_index=_NullIndex()), source)
    assert [s.type_name for s in profile.prepare_steps] == steps
    assert {w.scorer.name: w.weight for w in profile.scorers} == scorers
    assert profile.picker.type_name == picker
    assert profile.needs_prompt is needs_prompt


PM = {"type": "prefix-match"}
DEPENDENCY_CASES = [
    (
        _doc([{"type": "precise-prefix-cache-scorer", "name": "prefix"}], [{"ref": "prefix"}]),
        r"cfg.yaml: profiles\[0\]: profile 'default': scorer 'prefix' \(precise-prefix-cache-scorer\) consumes "
        r"'prefix-match', which no prepare step in the profile produces; add a 'prefix-match' step to the profile",
    ),
    (
        _doc([{"type": "prefill-cost-scorer", "name": "cost"}], [{"ref": "cost"}]),
        r"scorer 'cost' \(prefill-cost-scorer\) consumes 'prefix-match'",
    ),
    (  # defined but not referenced by the profile: still missing
        _doc([PM, {"type": "prefill-cost-scorer", "name": "cost"}], [{"ref": "cost"}]),
        r"scorer 'cost' \(prefill-cost-scorer\) consumes 'prefix-match'",
    ),
    (
        _doc([PM, {**PM, "name": "again"}], [{"ref": "prefix-match"}, {"ref": "again"}]),
        "'prefix-match' is produced by both 'prefix-match' and 'again'",
    ),
]


@pytest.mark.parametrize(("data", "message"), DEPENDENCY_CASES, ids=["prefix-scorer", "prefill-cost", "unreferenced", "twice"])
def test_loader_refuses_a_consumer_without_its_producer(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_profile(data, default_registry(), PluginHandle(prefix_index=_NullIndex()), source="cfg.yaml")


def test_profile_built_in_code_checks_dependencies_too() -> None:
    from services.epp.plugins.scorers.precise_prefix_cache import PrecisePrefixCacheScorer

    with pytest.raises(ConfigError, match="consumes 'prefix-match'"):
        SchedulerProfile("p", [], [WeightedScorer(PrecisePrefixCacheScorer("prefix"), 1)], MaxScorePicker("max"))


def test_needs_prompt_follows_the_plugins_that_read_it() -> None:
    step = default_registry().create("prefix-match", "pm", {}, PluginHandle(prefix_index=_NullIndex()))
    assert isinstance(step, PrepareStep) and step.reads_prompt
    queue_only = SchedulerProfile("p", [], [WeightedScorer(QueueScorer("q"), 1)], MaxScorePicker("max"))
    assert not queue_only.needs_prompt
    # A step nothing consumes still makes the profile read the prompt (it tokenizes and asks kv_indexer).
    assert SchedulerProfile("p", [], [], MaxScorePicker("max"), prepare_steps=[step]).needs_prompt


def test_resolve_path_and_unknown(tmp_path: Any) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("plugins: [{type: random-picker}]\nprofiles: [{name: p, plugins: [{ref: random-picker}]}]\n")
    assert resolve_scheduling_config(str(path))[0] == str(path)
    with pytest.raises(ConfigError, match=r"neither a named config .*load-only.* nor an existing file"):
        resolve_scheduling_config("no-such-policy")


# -- conformance: every registered plugin --------------------------------------------------
def _build_all(registry: PluginRegistry) -> list[Any]:
    handle = PluginHandle(rng=random.Random(0), prefix_index=_RandomIndex(random.Random(1)))
    return [registry.create(t, t, {}, handle) for t in registry.types()]


async def _prepared_state(steps: Sequence[PrepareStep], request: SchedulingRequest, cands: list[Candidate]) -> CycleState:
    state = CycleState()
    for step in steps:
        await step.prepare(state, request, cands)
    return state


class _RandomIndex:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        total = self.rng.randint(0, 20)
        return PrefixMatch(total, {e: self.rng.randint(0, total) for e in endpoint_ids})


def _random_candidates(rng: random.Random) -> list[Candidate]:
    return [
        cand(
            7000 + i,
            waiting=rng.randint(0, 100),
            running=rng.randint(0, 64),
            usage=rng.random(),
            pending=rng.randint(0, 5),
            age=rng.random(),
        )
        for i in range(rng.randint(1, 8))
    ]


@pytest.mark.parametrize("type_name", default_registry().types())
async def test_conformance(type_name: str) -> None:
    registry = default_registry()
    built = _build_all(registry)
    (plugin,) = [p for p in built if p.type_name == type_name]
    assert plugin.name == type_name and plugin.type_name == type_name
    # The steps producing what the plugin consumes run first, as in a profile.
    producers = [p for p in built if isinstance(p, PrepareStep) and p.produces & plugin.consumes]
    assert {k.name for k in plugin.consumes} <= {k.name for p in producers for k in p.produces}
    rng = random.Random(hash(type_name) & 0xFFFF)
    for _ in range(50):
        cands = _random_candidates(rng)
        request = SchedulingRequest(model="m", token_ids=tuple(rng.randint(0, 999) for _ in range(rng.randint(0, 40))))
        state = await _prepared_state(producers, request, cands)
        if isinstance(plugin, PrepareStep):
            await plugin.prepare(state, request, cands)
            assert all(key in state for key in plugin.produces)
        elif isinstance(plugin, Scorer):
            assert isinstance(plugin.category, ScorerCategory)
            scores = plugin.score(state, request, cands)
            assert set(scores) == {c.id for c in cands}
            assert all(0.0 <= v <= 1.0 for v in scores.values()), scores
        elif isinstance(plugin, Filter):
            kept = plugin.filter(state, request, cands)
            assert all(k in cands for k in kept)
        else:
            assert isinstance(plugin, Picker)
            profile = SchedulerProfile("p", [], [], plugin)
            result = profile.run(state, request, cands)
            assert sorted(s.id for s in result.ranked) == sorted(c.id for c in cands)
