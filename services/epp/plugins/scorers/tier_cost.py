"""``tier-cost-scorer``: prefer the endpoint with the least expected time to first token, in model seconds.

Intent:
    Issue 9 item 4. Price every endpoint by what this request would wait there: the prefill work already
    queued on it, plus this request's own prefill, where a prompt block cached in the endpoint's GPU
    pool is free, one it holds (or reaches through kv_store) only on CPU, DISK or SHARED costs its load
    time over that tier's link, and a miss costs its recompute. One unit (seconds of the engine's step
    time) for hits, loads and queues, so a session stays on the engine holding its history until that
    engine's queue costs more than recomputing the history elsewhere, and a burst spreads because every
    pick adds its own prefill work to its target at once (pending picks, freed when the router reports
    the request's completion or a scrape shows its first token: ``services/epp/datastore.py``).
Inputs consumed:
    ``TOKEN_IDS`` and ``PREFIX_MATCH`` (the ``prefix-match`` prepare step: epp's local replica of the index, or
    kv_indexer's ``Score`` when it falls back; both give the same ``matched_blocks_by_medium``, which says on which media each endpoint holds its matched blocks). Per
    candidate, from the datastore: ``queued_prefill_tokens`` / ``unprefilled_requests`` /
    ``known_unprefilled_requests`` (epp's picks there without a first token yet, with their uncached
    tokens; pending picks included), ``num_requests_running`` (net of completions the router reported),
    ``block_size_tokens``.
Math (seconds; ``P`` = prompt tokens, ``b`` = block size of ``e``, ``m`` = matched blocks of ``e``)::

    gpu(e)      = min(m, matched_blocks_by_medium[e]["GPU"])        (all of m when the index gives no media)
    offloaded   = m - gpu(e), assigned cheapest tier first: n_t = min(left, matched_blocks_by_medium[e][t])
                  for t in CPU, DISK, SHARED by load cost; blocks no tier claims count as GPU
    load(e)     = sum_t [ n_t * b * kv_bytes_per_token / bandwidth[t] + latency[t] ]   (tiers with n_t > 0)
    own(e)      = max(0, P - m * b)                                   (tokens to recompute)
    queued(e)   = queued_prefill_tokens(e) + unknown(e) * guess(e)    (as prefill-cost-scorer)
    work(e)     = queued_weight * queued(e) + recompute_weight * own(e)             (tokens)
    steps(e)    = max(1, ceil(work(e) / max_num_batched_tokens))
    ttft(e)     = work(e) * prefill_seconds_per_token
                  + steps(e) * (step_base_seconds + running(e) * decode_seconds_per_seq) + load(e)
    dup(e)      = (max_c h(c) - h(e)) * b                             (the history e would newly hold; h = held,
                                                                       PrefixMatch.held: m less the blocks only
                                                                       reachable in a kv_store, which e still
                                                                       loads into its own pool)
    occ(e)      = clamp(max(kv_cache_usage_perc(e), occupancy_floor), 0, 1)
    evict(e)    = eviction_weight * occ(e) * dup(e) * prefill_seconds_per_token
    held(e)     = max(active_prompt_tokens(e), kv_cache_usage_perc(e) * cap(e))    (cap = kv_capacity_tokens)
    over(e)     = held(e) + P - cap(e)                               (tokens to free before P fits)
    admit(e)    = admission_wait_weight * over(e) / held(e)          (over <= held as P <= cap: at most one residency)
                  * outputs * (step_base_seconds + max(1, running(e)) * decode_seconds_per_seq)
                  (0 when over(e) <= 0, when P > cap(e) or when the capacity is unknown)
    outputs     = mean_output_tokens (the router's completions) or output_tokens_per_request before the first
    cost(e)     = ttft(e) + evict(e) + admit(e)
    score(e)    = 1 - cost(e) / max_e cost(e)                         (1 for all when every cost is 0)

    ``evict`` prices the eviction a move causes: sending the request away from the endpoint holding the
    longest match (its session's history, ``max_c m(c)`` blocks) makes the target allocate that history
    again, and the part of its pool in use (``occ``) is what those new blocks push out: other sessions'
    cached prefixes, which they will recompute. The endpoint with the longest match pays nothing, so a
    session moves only when its engine's queue costs more than its recompute elsewhere *plus* the
    recompute it forces on others there (issue 9: sessions stay put until their engine is really busy).

    ``admit`` prices vLLM 0.32's admission rule (``scheduler_reserve_full_isl``, its default): a waiting
    request starts only when KV blocks for its whole prompt are free, cached blocks included (a cached
    block nobody runs sits in the free queue and is taken out of it). Blocks held or claimed by the
    endpoint's requests in flight (``held``: epp's picks not yet completed, or the engine's own usage
    when that is higher) are freed as those requests finish; with ``held`` tokens spread over requests
    that each finish after about one residency (``outputs`` decode steps), freeing
    ``over`` of them takes about ``over / held`` of a residency. The queue term cannot see this: an
    engine whose requests are all decoding has no queued prefill, yet its pool may have no room.

    ``unknown(e) = unprefilled_requests - known_unprefilled_requests``; ``guess(e)`` = the larger of the
    known ones' mean and ``P``. Each step of a chunked prefill also advances every running request by
    one decode token (vLLM's mixed batches), hence the ``running`` term.
Parameters (defaults and their sources; all restate the engine simulator's, which kvmesh's headline
benchmark runs, so the scorer and the engines agree):
    ``prefill_seconds_per_token`` 3.25e-5, ``step_base_seconds`` 6.0e-3, ``decode_seconds_per_seq``
    3.25e-5: ``engine_simulator/latency_model.py``, profile ``llama-3.1-8b-h100`` (16.06 GFLOP per token
    at 50 % of 989 TFLOPS; 16.06 GB of weights at 80 % of 3.35 TB/s).
    ``max_num_batched_tokens`` 2048: the simulator's (and vLLM's chunked-prefill) default,
    ``engine_simulator/config.py``.
    ``kv_bytes_per_token`` 131072: Llama-3.1-8B BF16 (2 x 32 layers x 8 KV heads x 128 x 2 B),
    ``engine_simulator/offload.py`` ``KV_BYTES_PER_TOKEN_LLAMA_8B``.
    ``bandwidth_bytes_per_second`` {CPU: 50e9, DISK: 7e9, SHARED: 7e9}: ``engine_simulator/offload.py``
    ``OffloadConfig`` (PCIe 5.0 x16 at ~80 % for the host tier; a kv_store DISK/SHARED block crosses
    ``min(nvme 7e9, network 25e9, pcie 50e9)``). ``latency_seconds`` {CPU: 5e-5, DISK: 2.5e-4, SHARED:
    2.5e-4}: its ``load_latency_seconds`` (+ ``network_latency_seconds`` for the remote tiers). A CPU
    copy reached through kv_store moves at ``min(network, pcie)`` = 25e9 in the simulator; the index
    does not say which CPU it is, so CPU is priced as the local host tier.
    ``queued_weight`` (default 1.0) and ``recompute_weight`` (default 1.0): relative weight of the
    queue ahead and of this request's recompute (1/1 is the plain expected TTFT).
    ``admission_wait_weight`` (default 0.0: off) and ``output_tokens_per_request`` (default 256, a chat
    answer's order: the prior until the router has reported a completion with its output tokens, after
    which epp's mean of them is used): the ``admit`` term. Needs the engines'
    ``vllm:cache_config_info`` ``num_gpu_blocks`` label (``EndpointMetrics.kv_capacity_tokens``).
    ``eviction_weight`` (default 1.0; 0 turns ``evict`` off): the others' recompute a duplicated history
    forces, as a fraction of a recompute now. ``occupancy_floor`` (default 0.0): the least occupancy assumed
    (vLLM's ``kv_cache_usage_perc`` counts blocks held by requests, not the cached prefixes of idle
    sessions in its free queue; set it toward 1 when pools are known to be full of live histories). With
    offload on, an evicted block is reloaded rather than recomputed, so ``evict`` is an upper bound there.
Example YAML::

    - type: prefix-match
    - type: tier-cost-scorer
      name: tier-cost
      parameters: {bandwidth_bytes_per_second: {CPU: 50.0e9, DISK: 7.0e9, SHARED: 7.0e9}}
Failure modes:
    No match (kv_indexer down, tokenization failed, no tokens): ``own`` is the whole prompt everywhere,
    so the pick is by queued work and running requests (still load-aware). An index that gives no
    per-medium counts: every matched block is priced as on GPU (as ``prefill-cost-scorer`` does).
    The model assumes FCFS prefill and that loads do not overlap the queue ahead (an upper bound on the
    wait of an offloaded hit: vLLM loads while other requests run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from kvmesh.types import EndpointId, Medium
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    PluginHandle,
    PrefixMatch,
    SchedulingRequest,
    Scorer,
    ScorerCategory,
)
from services.epp.framework.registry import parse_params
from services.epp.plugins.prepare.prefix_match import (
    PREFIX_MATCH,
    TOKEN_IDS,
    prompt_token_ids,
    uncached_prompt_tokens,
)

TYPE = "tier-cost-scorer"
_OFFLOAD_TIERS = (Medium.CPU.value, Medium.DISK.value, Medium.SHARED.value)


class TierCostParams(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    prefill_seconds_per_token: float = pydantic.Field(default=3.25e-5, gt=0)
    step_base_seconds: float = pydantic.Field(default=6.0e-3, ge=0)
    decode_seconds_per_seq: float = pydantic.Field(default=3.25e-5, ge=0)
    max_num_batched_tokens: int = pydantic.Field(default=2048, ge=1)
    kv_bytes_per_token: int = pydantic.Field(default=131_072, ge=1)
    bandwidth_bytes_per_second: dict[str, float] = pydantic.Field(
        default_factory=lambda: {Medium.CPU.value: 50e9, Medium.DISK.value: 7e9, Medium.SHARED.value: 7e9})
    latency_seconds: dict[str, float] = pydantic.Field(
        default_factory=lambda: {Medium.CPU.value: 5e-5, Medium.DISK.value: 2.5e-4, Medium.SHARED.value: 2.5e-4})
    queued_weight: float = pydantic.Field(default=1.0, gt=0, le=1000)
    recompute_weight: float = pydantic.Field(default=1.0, gt=0, le=1000)
    eviction_weight: float = pydantic.Field(default=1.0, ge=0, le=1000)
    occupancy_floor: float = pydantic.Field(default=0.0, ge=0, le=1)
    admission_wait_weight: float = pydantic.Field(default=0.0, ge=0, le=1000)
    output_tokens_per_request: int = pydantic.Field(default=256, ge=1)

    @pydantic.field_validator("bandwidth_bytes_per_second", "latency_seconds")
    @classmethod
    def _tiers(cls, value: dict[str, float], info: pydantic.ValidationInfo) -> dict[str, float]:
        for tier, number in value.items():
            if tier not in _OFFLOAD_TIERS:
                raise ValueError(f"{info.field_name}: unknown tier {tier!r} (expected one of {', '.join(_OFFLOAD_TIERS)})")
            if not math.isfinite(number) or number < 0 or (info.field_name == "bandwidth_bytes_per_second" and number == 0):
                raise ValueError(f"{info.field_name}[{tier}] must be finite and > 0 (latency >= 0), got {number}")
        return value


@dataclass(frozen=True, slots=True)
class TierCostModel:
    """The coefficients of the module docstring's formula (seconds, bytes, tokens). Pure."""

    prefill_seconds_per_token: float = 3.25e-5
    step_base_seconds: float = 6.0e-3
    decode_seconds_per_seq: float = 3.25e-5
    max_num_batched_tokens: int = 2048
    kv_bytes_per_token: int = 131_072
    bandwidth: Mapping[str, float] | None = None
    latency: Mapping[str, float] | None = None
    queued_weight: float = 1.0
    recompute_weight: float = 1.0
    eviction_weight: float = 1.0
    occupancy_floor: float = 0.0
    admission_wait_weight: float = 0.0
    output_tokens_per_request: int = 256

    @classmethod
    def from_params(cls, p: TierCostParams) -> TierCostModel:
        return cls(p.prefill_seconds_per_token, p.step_base_seconds, p.decode_seconds_per_seq,
                   p.max_num_batched_tokens, p.kv_bytes_per_token, dict(p.bandwidth_bytes_per_second),
                   dict(p.latency_seconds), p.queued_weight, p.recompute_weight, p.eviction_weight,
                   p.occupancy_floor, p.admission_wait_weight, p.output_tokens_per_request)

    def tier_order(self) -> list[str]:
        """Offload tiers with a bandwidth, cheapest load per block first."""
        bandwidth = self.bandwidth or {}
        return sorted((t for t in _OFFLOAD_TIERS if bandwidth.get(t)), key=lambda t: 1.0 / bandwidth[t])

    def load_seconds(self, matched: int, by_medium: Mapping[str, int] | None, block_tokens: int) -> float:
        """Seconds to load the matched blocks not on GPU (cheapest tier first); 0 without media counts."""
        if matched <= 0 or not by_medium:
            return 0.0
        left = matched - min(matched, by_medium.get(Medium.GPU.value, 0))
        seconds = 0.0
        bandwidth, latency = self.bandwidth or {}, self.latency or {}
        for tier in self.tier_order():
            if left <= 0:
                break
            n = min(left, by_medium.get(tier, 0))
            if n > 0:
                seconds += n * block_tokens * self.kv_bytes_per_token / bandwidth[tier] + latency.get(tier, 0.0)
                left -= n
        return seconds  # blocks no tier claims (``left`` > 0): counted on GPU, the index's own view

    def ttft_seconds(self, candidate: Candidate, prompt_tokens: int, match: PrefixMatch | None) -> float:
        """Expected TTFT of a ``prompt_tokens``-token prompt on ``candidate`` (the module docstring's ``ttft(e)``)."""
        m = candidate.metrics
        own = uncached_prompt_tokens(candidate, prompt_tokens, match)
        known = m.known_unprefilled_requests
        guess = max(m.queued_prefill_tokens / known if known else 0, prompt_tokens)
        queued = m.queued_prefill_tokens + max(0, m.unprefilled_requests - known) * guess
        work = self.queued_weight * queued + self.recompute_weight * own
        steps = max(1, math.ceil(work / self.max_num_batched_tokens))
        seconds = work * self.prefill_seconds_per_token
        seconds += steps * (self.step_base_seconds + m.num_requests_running * self.decode_seconds_per_seq)
        if match is not None and match.total_blocks > 0:
            block = m.block_size_tokens or candidate.endpoint.block_size_tokens or 0
            matched = match.matched_blocks.get(candidate.id, 0)
            seconds += self.load_seconds(matched, match.matched_blocks_by_medium.get(candidate.id), block)
        return seconds

    def eviction_seconds(self, candidate: Candidate, match: PrefixMatch | None, longest: int) -> float:
        """``evict(e)`` of the module docstring: the recompute others pay for the history ``candidate`` would
        duplicate (``longest`` = the most blocks any candidate matched); 0 on the endpoint holding it."""
        if self.eviction_weight <= 0 or match is None or match.total_blocks <= 0:
            return 0.0
        dup_blocks = longest - match.held(candidate.id)
        if dup_blocks <= 0:
            return 0.0
        m = candidate.metrics
        block = m.block_size_tokens or candidate.endpoint.block_size_tokens or 0
        occupancy = min(1.0, max(m.kv_cache_usage_perc, self.occupancy_floor, 0.0))
        return self.eviction_weight * occupancy * dup_blocks * block * self.prefill_seconds_per_token

    def admission_seconds(self, candidate: Candidate, prompt_tokens: int) -> float:
        """``admit(e)`` of the module docstring: the expected wait for KV room under vLLM's full-prompt
        admission (seconds); 0 with ``admission_wait_weight`` 0, room to spare, or no known capacity."""
        m = candidate.metrics
        capacity = m.kv_capacity_tokens
        if self.admission_wait_weight <= 0 or not capacity or prompt_tokens > capacity:
            return 0.0
        held = max(float(m.active_prompt_tokens), m.kv_cache_usage_perc * capacity)
        over = held + prompt_tokens - capacity
        if over <= 0 or held <= 0:
            return 0.0
        step = self.step_base_seconds + max(1.0, m.num_requests_running) * self.decode_seconds_per_seq
        outputs = m.mean_output_tokens or self.output_tokens_per_request
        return self.admission_wait_weight * over / held * outputs * step

    def cost_seconds(self, candidate: Candidate, prompt_tokens: int, match: PrefixMatch | None,
                     longest: int = 0) -> float:
        """``cost(e)`` = :meth:`ttft_seconds` + :meth:`eviction_seconds` + :meth:`admission_seconds` (seconds)."""
        return (self.ttft_seconds(candidate, prompt_tokens, match) + self.eviction_seconds(candidate, match, longest)
                + self.admission_seconds(candidate, prompt_tokens))


def factory(name: str, params: Mapping[str, Any], handle: PluginHandle) -> TierCostScorer:
    return TierCostScorer(name, TierCostModel.from_params(parse_params(TierCostParams, TYPE, name, params)))


def tier_costs(candidates: Sequence[Candidate], prompt_tokens: int, match: PrefixMatch | None,
               model: TierCostModel) -> dict[EndpointId, float]:
    """``cost(e)`` (expected TTFT + the eviction a move causes) in seconds per candidate; pure."""
    longest = 0
    if match is not None and match.total_blocks > 0:
        longest = max((match.held(c.id) for c in candidates), default=0)
    return {c.id: model.cost_seconds(c, prompt_tokens, match, longest) for c in candidates}


class TierCostScorer(Scorer):
    """Least expected TTFT (queued prefill + own prefill, GPU hits free, offloaded hits at load time), plus the
    recompute a duplicated history forces on others, scores highest."""

    type_name = TYPE
    category = ScorerCategory.BALANCE
    consumes = frozenset({TOKEN_IDS, PREFIX_MATCH})

    def __init__(self, name: str, model: TierCostModel | None = None) -> None:
        super().__init__(name)
        self.model = model or TierCostModel.from_params(TierCostParams())

    def score(
        self, state: CycleState, request: SchedulingRequest, candidates: Sequence[Candidate]
    ) -> dict[EndpointId, float]:
        tokens = prompt_token_ids(state, request)
        costs = tier_costs(candidates, len(tokens), state.get(PREFIX_MATCH), self.model)
        worst = max(costs.values())
        if worst <= 0:
            return {i: 1.0 for i in costs}
        return {i: 1.0 - c / worst for i, c in costs.items()}
