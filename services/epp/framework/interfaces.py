"""Contracts of the scheduling framework: the request, candidates, and the four plugin kinds.

Follows GIE's ``pkg/epp/scheduling/framework/plugins.go`` (v1.2.0): a base that only names the
plugin, and one verb per extension point; plus GIE's prepare-data step (``requestcontrol``'s
``PrepareDataPlugin`` with ``Produces``/``Consumes``; llm-d's ``ComputeBlockKeys`` is the same step
for block keys), so data several plugins read has one named producer instead of a parent class.

- :class:`PrepareStep` ``.prepare(state, request, candidates)`` (async: the cycle's only I/O, e.g.
  tokenize and kv_indexer's match) writes the keys it declares in ``produces`` into the cycle state.
  Steps run once per pick, in the order configured, before the scheduler snapshots the load.
- :class:`Filter` ``.filter(state, request, candidates) -> list[Candidate]`` (sync, pure).
- :class:`Scorer` ``.score(state, request, candidates) -> dict[EndpointId, float]`` (sync: it only
  reads the candidates and the cycle state) with every score in [0, 1] and one score per candidate.
  A score outside [0, 1], a missing or an extra key is a plugin bug:
  :class:`~services.epp.framework.profile.SchedulerProfile` logs it and fails the pick with
  :class:`PluginError` (never clamps). Being sync is what lets the scheduler rely on
  snapshot -> scores -> pick -> ``note_pick`` running without a suspension point (otherwise
  concurrent picks all score the same stale snapshot and pile onto one endpoint).
- :class:`Picker` ``.pick(state, scored) -> PickerResult``: the target first, then the rest in the
  order the picker would try them; ties are broken at random (the picker's own ``random.Random``).

Every plugin declares what it reads: ``consumes`` (cycle-state keys; the profile refuses a config
where no prepare step produces one) and ``reads_prompt`` (the request's token ids, text or
messages; a profile whose plugins all leave it False has ``needs_prompt`` False, so callers may
leave the prompt out, as SGLang's gateway does with ``needs_request_text``).

Per-request inputs travel in one :class:`SchedulingRequest` (SGLang's lesson: new inputs never change
a signature). Plugins get their collaborators (kv_indexer client, tokenizer, random source) through
the :class:`PluginHandle` given to their factory.
"""

from __future__ import annotations

import abc
import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvmesh.errors import KvmeshError
from kvmesh.hashing import DEFAULT_SCOPE, KeyScope
from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.cycle_state import CycleState, StateKey


class PluginError(KvmeshError):
    """A plugin broke its contract (e.g. a score outside [0, 1]); reported as INTERNAL."""


class ConfigError(ValueError):
    """A scheduling config or plugin parameter is invalid; the message says exactly what and where."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """Everything one pick may look at.

    Attributes:
        request_id: the caller's id (for logs).
        model: served model name (non-empty).
        token_ids: the prompt as token ids when the caller has them (empty otherwise); read only
            (a :class:`~kvmesh.prefix_index.PackedTokenIds` when the caller sent them packed).
        prompt: completion prompt text ("" when absent).
        messages: chat messages (empty when absent).
        exclude_endpoint_ids: endpoints not to pick (e.g. one that just failed).
        scope: the LoRA adapter and ``cache_salt`` the request runs under (default: neither);
            prefix matches count only blocks cached in the same scope.
        render: the request's token-changing fields as the client sent them (``PickRequest.render_json``:
            ``add_special_tokens``, ``truncate_prompt_tokens``; chat also ``messages`` verbatim, ``tools``,
            ``documents``, ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
            ``continue_final_message``); empty: vLLM's defaults. Read only.
    """

    model: str
    request_id: str = ""
    token_ids: Sequence[int] = ()  # a tuple, or a PackedTokenIds (PickRequest.prompt_token_ids_packed)
    prompt: str = ""
    messages: tuple[ChatMessage, ...] = ()
    exclude_endpoint_ids: frozenset[str] = frozenset()
    scope: KeyScope = DEFAULT_SCOPE
    render: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """An engine's last scraped vLLM metrics.

    Attributes:
        num_requests_waiting: ``vllm:num_requests_waiting`` (requests).
        num_requests_running: ``vllm:num_requests_running`` (requests).
        kv_cache_usage_perc: ``vllm:kv_cache_usage_perc``, a fraction in [0, 1] despite the name.
        block_size_tokens: ``block_size`` label of ``vllm:cache_config_info`` (None when absent).
        kv_capacity_tokens: tokens the engine's KV pool holds, ``(num_gpu_blocks - 1) * block_size`` from
            ``vllm:cache_config_info`` (SGLang: ``sglang:max_total_num_tokens``; None when absent).
        age_seconds: seconds since the last successful scrape when this snapshot was taken, less the
            time epp's own event loop lagged meanwhile (services/epp/datastore.py, "Freshness net of
            epp's own lag"; None when never scraped).
        pending_picks: picks sent to this endpoint that its metrics do not show yet (requests).
        consecutive_failures: scrapes failed in a row since the last success.
        unprefilled_requests: requests (epp's picks, or waiting + pending without the engine's
            first-token count) that have not had their first token yet.
        known_unprefilled_requests: how many of those epp picked itself (their tokens are known).
        queued_prefill_tokens: prompt tokens (uncached at pick time) of those known requests (tokens).
        active_prompt_tokens: whole prompts of epp's picks here not yet completed (tokens; Dynamo's
            active blocks, services/epp/datastore.py "Active prompt tokens").
        routed_prefill_tokens: uncached prompt tokens of epp's picks here, each decayed by its age with the
            datastore's half-life (tokens; services/epp/datastore.py "Routed prefill").
        mean_output_tokens: the endpoint's model's mean output tokens per request, exponentially weighted over
            the successful completions the router reported (tokens; None before the first).
    """

    num_requests_waiting: float = 0.0
    num_requests_running: float = 0.0
    kv_cache_usage_perc: float = 0.0
    block_size_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    age_seconds: float | None = None
    pending_picks: int = 0
    consecutive_failures: int = 0
    unprefilled_requests: int = 0
    known_unprefilled_requests: int = 0
    queued_prefill_tokens: int = 0
    active_prompt_tokens: int = 0
    routed_prefill_tokens: float = 0.0
    mean_output_tokens: float | None = None

    @property
    def queue_depth(self) -> float:
        """Waiting + running + pending picks: the load the queue scorer ranks by."""
        return self.num_requests_waiting + self.num_requests_running + self.pending_picks


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint with its last scraped metrics, as plugins see it."""

    endpoint: Endpoint
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    id: EndpointId = field(init=False, compare=False, repr=False)
    """``endpoint.id``, stored (a plain attribute: scorers read it once per candidate per pick)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", self.endpoint.id)


class ScorerCategory(enum.StrEnum):
    """What a scorer optimises (GIE/llm-d): cache affinity, load distribution, or balance."""

    AFFINITY = "affinity"
    DISTRIBUTION = "distribution"
    BALANCE = "balance"


class ExtensionPoint(enum.StrEnum):
    """Where a plugin runs; a label of ``kvmesh_epp_plugin_duration_seconds``."""

    FILTER = "filter"
    PREPARE = "prepare"
    SCORER = "scorer"
    PICKER = "picker"


class Plugin(abc.ABC):
    """Base of every plugin: ``type_name`` (kebab-case registry key) and ``name`` (this instance).

    Attributes:
        consumes: cycle-state keys this plugin reads; a profile without a prepare step producing
            each of them is a :class:`ConfigError` at load time.
        reads_prompt: whether it reads the request's prompt (token ids, text or messages).
    """

    type_name: ClassVar[str]
    extension_point: ClassVar[ExtensionPoint]
    consumes: ClassVar[frozenset[StateKey[Any]]] = frozenset()
    reads_prompt: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PrepareStep(Plugin):
    """Fetches per-pick data once and writes it to the cycle state for the plugins that consume it."""

    extension_point: ClassVar[ExtensionPoint] = ExtensionPoint.PREPARE
    produces: ClassVar[frozenset[StateKey[Any]]]

    @abc.abstractmethod
    async def prepare(self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]) -> None:
        """Write every key in ``produces`` into ``state`` (None values included, so readers can tell).

        Runs before the scheduler snapshots the endpoints' load. Must not raise for I/O failures
        (degrade instead: write what a failure means, e.g. no match).
        """


class Filter(Plugin):
    extension_point: ClassVar[ExtensionPoint] = ExtensionPoint.FILTER

    @abc.abstractmethod
    def filter(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        """Return the candidates that may serve ``request`` (a subset, order kept)."""


class Scorer(Plugin):
    extension_point: ClassVar[ExtensionPoint] = ExtensionPoint.SCORER
    category: ClassVar[ScorerCategory]

    @abc.abstractmethod
    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        """One score in [0, 1] per candidate id (higher is better). Called with >= 1 candidate.

        Reads only ``candidates``, ``request`` and the keys it ``consumes``; no I/O.
        """


class ScoredCandidate:
    """A candidate with its per-scorer raw scores (by scorer name) and weighted total.

    ``ScoredCandidate(candidate, scores, total)``; treat as immutable. A profile builds one per
    candidate per pick (100 at 100 endpoints), so it is a plain ``__slots__`` class (a frozen
    dataclass costs twice as much to build) and the profile's rows read ``scores`` lazily from the
    pick's shared score columns (:class:`ScoreColumns`): only a caller that looks at the breakdown
    (the gRPC response, a DEBUG log, a trace) pays for the dict.
    """

    __slots__ = ("_columns", "_row", "_scores", "candidate", "total")

    candidate: Candidate
    total: float

    def __init__(self, candidate: Candidate, scores: dict[str, float], total: float) -> None:
        self.candidate = candidate
        self._scores: dict[str, float] | None = scores
        self.total = total
        self._columns: ScoreColumns | None = None
        self._row = 0

    @classmethod
    def rows(cls, candidates: Sequence[Candidate], totals: Sequence[float], columns: ScoreColumns) -> list[ScoredCandidate]:
        """One row per candidate (same order), ``scores`` read from ``columns`` on first access."""
        new = object.__new__
        rows: list[ScoredCandidate] = []
        append = rows.append
        for row, (candidate, total) in enumerate(zip(candidates, totals, strict=True)):
            scored = new(cls)
            scored.candidate = candidate
            scored.total = total
            scored._scores = None
            scored._columns = columns
            scored._row = row
            append(scored)
        return rows

    @property
    def scores(self) -> dict[str, float]:
        """Raw score per scorer name (the profile's order)."""
        scores = self._scores
        if scores is None:
            columns = self._columns
            assert columns is not None
            row = self._row
            scores = self._scores = {name: column[row] for name, column in zip(columns.names, columns.columns, strict=True)}
        return scores

    @property
    def id(self) -> EndpointId:
        return self.candidate.id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScoredCandidate):
            return NotImplemented
        return (self.candidate, self.scores, self.total) == (other.candidate, other.scores, other.total)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ScoredCandidate(candidate={self.candidate!r}, scores={self.scores!r}, total={self.total!r})"


@dataclass(frozen=True, slots=True)
class ScoreColumns:
    """One pick's raw scores as columns: ``columns[k][i]`` is scorer ``names[k]``'s score of candidate ``i``."""

    names: tuple[str, ...]
    columns: tuple[Sequence[float], ...]


@dataclass(frozen=True, slots=True)
class PickerResult:
    """``ranked[0]`` is the target; the rest are fallbacks in the order to try them."""

    ranked: list[ScoredCandidate]

    @property
    def target(self) -> ScoredCandidate:
        return self.ranked[0]


class Picker(Plugin):
    extension_point: ClassVar[ExtensionPoint] = ExtensionPoint.PICKER

    @abc.abstractmethod
    def pick(self, state: CycleState, scored: Sequence[ScoredCandidate]) -> PickerResult:
        """Rank ``scored`` (>= 1 entry); ties broken at random."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """kv_indexer's answer: full blocks in the prompt and, per endpoint, the matched prefix in blocks.

    ``matched_blocks_by_medium``: per endpoint, of its matched blocks how many it holds on each medium
    (``"GPU"``, ``"CPU"``, ``"DISK"``, ``"SHARED"``; a block on two media counts in both: kv_indexer's
    ``EndpointScore.matched_blocks_by_medium``). Empty when the index does not say (then every matched
    block is taken to be on GPU).

    ``reached_blocks``: per endpoint, of its matched blocks how many lie past its own longest run: blocks it
    can only load from a kv_store it reaches (kv_indexer's ``EndpointScore.reached_blocks``; absent: 0).
    :meth:`held` is what the endpoint itself holds: the match that says where a session's history *is*
    (``session-affinity-scorer``, ``precise-prefix-cache-scorer``), while every endpoint reaching one
    kv_store can load the same history.
    """

    total_blocks: int
    matched_blocks: dict[str, int]
    matched_blocks_by_medium: dict[str, dict[str, int]] = field(default_factory=dict)
    reached_blocks: dict[str, int] = field(default_factory=dict)

    def held(self, endpoint_id: str) -> int:
        """Matched blocks ``endpoint_id`` holds itself (its own GPU/CPU/DISK copies), >= 0."""
        matched = self.matched_blocks.get(endpoint_id, 0)
        return matched - self.reached_blocks.get(endpoint_id, 0) if self.reached_blocks else matched


class PrefixIndex(Protocol):
    """The global KV-block index (kv_indexer's ``Score``), as the ``prefix-match`` step needs it."""

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        """Raises any exception on failure (timeout, unreachable); the step degrades to no match.

        A request with a non-default :class:`~kvmesh.hashing.KeyScope` is scored through
        ``score_scoped(model, token_ids, endpoint_ids, scope)`` when the index has it (kv_indexer's
        client does), else it gets no match (never another scope's blocks)."""
        ...


class Tokenizer(Protocol):
    """Turns a request's text or messages into token ids exactly as the engine will."""

    async def tokenize(self, request: SchedulingRequest, candidates: Sequence[Candidate]) -> Sequence[int]:
        """Raises any exception on failure; the caller degrades. The ids are read only (the
        in-process tokenizer returns its cache's own :class:`~kvmesh.prefix_index.PackedTokenIds`)."""
        ...


@dataclass
class PluginHandle:
    """Collaborators a plugin factory may use; absent ones are None (the factory then refuses)."""

    rng: random.Random = field(default_factory=random.Random)
    prefix_index: PrefixIndex | None = None
    tokenizer: Tokenizer | None = None


__all__ = [
    "Candidate",
    "ChatMessage",
    "ConfigError",
    "EndpointMetrics",
    "ExtensionPoint",
    "Filter",
    "Picker",
    "PickerResult",
    "Plugin",
    "PluginError",
    "PluginHandle",
    "PrefixIndex",
    "PrefixMatch",
    "PrepareStep",
    "SchedulingRequest",
    "ScoreColumns",
    "ScoredCandidate",
    "Scorer",
    "ScorerCategory",
    "Tokenizer",
]
