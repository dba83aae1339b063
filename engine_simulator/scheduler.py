"""The engine core: requests, continuous-batching scheduler, token generation. Pure: no I/O.

Follows vLLM 0.32's v1 scheduler (``vllm/v1/core/sched/scheduler.py``) closely enough that the
outside cannot tell (KV events, cached-token counts, queueing):

* Each step has a token budget of ``max_num_batched_tokens``. Running requests go first, in
  admission order: a decoding one takes 1 token, one still in (chunked) prefill takes
  ``min(remaining, budget)``. Then waiting requests in FCFS order while budget is left and fewer
  than ``max_num_seqs`` run. A request that cannot get blocks stops the waiting queue.
* Admission reserves the whole sequence (vLLM 0.32's ``scheduler_reserve_full_isl``, on by default): a
  waiting request starts only when the blocks of its whole prompt are free, not only its first chunk's.
  Requests holding KV blocks while they wait (loads from an offloaded tier, and loaded prefixes) are tried
  before the waiting queue, and a load starts only if its blocks leave free what every in-flight prefill
  still needs (vLLM's ``reserved_blocks``); see :meth:`EngineCore.schedule`.
* ``long_prefill_token_threshold`` (vLLM's ``--long-prefill-token-threshold``, off by default) caps
  every request's chunk in a step, running and waiting alike, so that one long prefill cannot take
  the whole budget while others wait; see :meth:`EngineCore.long_prefill_cap` for vLLM 0.32's rule.
* A running request that cannot get a block preempts the last admitted running request
  (vLLM's RECOMPUTE preemption: its blocks are freed, it goes back to the front of the waiting
  queue and recomputes later, usually from its own cached blocks).
* Prefix hits (vLLM ``get_computed_blocks``): the longest run of cached full blocks, but never the
  whole sequence: vLLM caps the hit at ``num_tokens - 1`` so the last token is always computed.
  A block-aligned prompt that is fully cached therefore reports ``(n_blocks - 1) * block_size``
  cached tokens and recomputes (and re-stores) its last block.
* Blocks are cached when they become full at scheduling time (``allocate_slots``), prompt and
  generated tokens alike; the events of a step are published after the step.
* Generated tokens are pseudo-random, fixed by the prompt (like greedy decoding: an identical
  prompt produces identical tokens, so its generated blocks hash identically). A token equal to
  EOS (id 2, probability 1/(tokens drawn from + 1) per token: ~1/1887 behind the server) ends the
  request unless ``ignore_eos``. The other tokens are drawn from :attr:`SchedulerConfig.sampled_token_ids` when given (the server passes the
  tokenizer's printable tokens, so no control character or lone UTF-8 byte is generated), else from
  every id above EOS. The ``i``-th of ``n`` parallel samples (``Request.sample_index``, ``i > 0``)
  draws its own sequence (vLLM's child requests sample independently); sample 0 is the request alone.
* Stop conditions as vLLM 0.32 (:mod:`engine_simulator.stopping`): EOS, then ``stop_token_ids``
  (``Request.stop_reason`` = the id), then length (``check_stop``); before ``min_tokens`` output tokens EOS
  and the stop token ids are never sampled; a request with ``Request.output_text`` also ends when a stop
  string appears in its text, in the step that completes it (vLLM's detokenizer, then an abort of the
  engine request: the same step here).
* ``Request.skip_reading_prefix_cache`` (vLLM: a request with ``prompt_logprobs``, e.g. ``echo`` with
  ``logprobs``) looks up no prefix hit, GPU or offloaded, and is not counted in the prefix-cache
  queries; its blocks are still cached.

Block hashes of a request are computed once per block and kept on the request (incremental over
generated tokens), so long prompts are hashed once even when rescheduled.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import random
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_simulator.offload import LoadPlan
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.stopping import OutputText, StopParams, suppressed_token_ids
from engine_simulator.tokenizer import EOS_ID
from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored


class FinishReason(enum.StrEnum):
    """vLLM's finish reasons (``vllm:request_success_total{finished_reason}``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Engine limits (vLLM's ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--max-model-len``) and
    vLLM 0.32's long-prefill knobs (``vllm/config/scheduler.py`` ``SchedulerConfig``).

    Attributes:
        long_prefill_token_threshold: tokens; a request (running or waiting) is given at most this many
            tokens in one step while more than one request is running or waiting
            (``--long-prefill-token-threshold``). 0, the default, disables the cap (vLLM's default too).
        long_prefill_token_threshold_adaptive: floor that cap at a fair share of the step,
            ``max_num_batched_tokens // (running + waiting)`` (``--long-prefill-token-threshold-adaptive``);
            no effect while the threshold is 0 (default False, as vLLM).
        scheduler_reserve_full_isl: admit a waiting request only when the blocks of its whole sequence are free,
            not only those of its first chunk (vLLM 0.32's ``--scheduler-reserve-full-isl``, ``allocate_slots(...,
            full_sequence_must_fit=True)``). True by default, as vLLM 0.32 (``vllm/config/scheduler.py``).

    Raises:
        ValueError: ``long_prefill_token_threshold`` negative (vLLM: ``ge=0``) or greater than
            ``max_model_len`` (vLLM's ``verify_max_model_len``, same message).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 131072
    vocab_size: int = 2048
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    scheduler_reserve_full_isl: bool = True
    sampled_token_ids: tuple[int, ...] = ()
    """Token ids generation draws from besides EOS (e.g. ``Renderer.printable_token_ids()``); empty: every id in
    ``(EOS_ID, vocab_size)``."""

    def __post_init__(self) -> None:
        check_long_prefill_token_threshold(self.long_prefill_token_threshold, self.max_model_len)


def check_long_prefill_token_threshold(threshold: int, max_model_len: int) -> None:
    """vLLM 0.32's validation of ``long_prefill_token_threshold`` (``vllm/config/scheduler.py``: the field is
    ``ge=0``; ``verify_max_model_len`` refuses one above ``max_model_len``).

    Raises:
        ValueError: ``threshold < 0`` or ``threshold > max_model_len``.
    """
    if threshold < 0:
        raise ValueError(f"long_prefill_token_threshold ({threshold}) must be >= 0 (0 disables it)")
    if threshold > max_model_len:
        raise ValueError(
            f"long_prefill_token_threshold ({threshold}) cannot be greater than the max_model_len ({max_model_len})."
        )


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter as vLLM's ``LoRARequest``: ``name`` (what clients send as ``model``), the int
    ``adapter_id`` (``lora_int_id``, >= 1) and the ``path`` it was loaded from."""

    name: str
    adapter_id: int
    path: str


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt exactly as the engine sees it (BOS included for text).
        max_tokens: output tokens to generate at most (>= 1).
        ignore_eos: keep generating after EOS.
        arrival_time: model seconds when it was added.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    arrival_time: float = 0.0
    lora: LoraAdapter | None = None
    """The LoRA adapter the request runs under (None: the base model)."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: isolates this request's prefix cache from other salts."""
    sample_index: int = 0
    """Which of ``n`` parallel samples of one prompt this is (vLLM's child ``index``): > 0 draws its own tokens."""
    skip_reading_prefix_cache: bool = False
    """vLLM's ``SamplingParams.skip_reading_prefix_cache`` (set when ``prompt_logprobs`` are asked): no prefix hit."""
    stop: StopParams = field(default_factory=StopParams)
    """``stop_token_ids`` and ``min_tokens`` act here (:meth:`EngineCore.update`, :meth:`next_token`); the stop
    strings through :attr:`output_text` (:mod:`engine_simulator.stopping`)."""
    output_text: OutputText | None = None
    """The output text with stop-string matching (the server attaches one; None: no text is tracked)."""
    stop_reason: int | str | None = None
    """vLLM's ``stop_reason``: the stop string or stop token id that finished the request (None for EOS/length)."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1 before)."""
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    """How many of ``blocks`` are registered in the cache (hashed and announced)."""
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    load_ready_time: float | None = None
    """While its prefix loads from an offloaded tier: the model time the load completes (else None)."""
    load_plan: LoadPlan | None = None
    """The last offload load of this request (blocks per tier, modeled seconds)."""
    offload_deferred: bool = False
    """Passed over in :attr:`EngineCore.waiting` because its offload lookup could not answer yet (kv_store
    confirming its blocks, vLLM's ``RETRY``) or another request is loading some of its blocks; in vLLM's
    ``deferred_waiting`` until admitted."""
    inflight_prefill: bool = False
    """In vLLM's ``Scheduler._inflight_prefills``: its load is in flight or done but not yet scheduled, or it was
    admitted with a chunk that does not finish its prefill; cleared once a step completes the prefill, and on
    preemption, finish or abort. Its remaining blocks are reserved against new loads."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    _digests: list[bytes] = field(default_factory=list, repr=False)
    _hashes: list[int] = field(default_factory=list, repr=False)
    _rng: random.Random | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def block_hashes(self, n_blocks: int, block_size: int) -> list[int]:
        """uint64 ``sha256_cbor`` hashes of the first ``n_blocks`` full blocks (computed once)."""
        have = len(self._hashes)
        if n_blocks > have:
            parent = self._digests[-1] if self._digests else None
            extra = None
            if self.lora is not None or self.cache_salt:
                extra = [self.hash_extra_keys(i) for i in range(have, n_blocks)]
            new = sha256_cbor_block_hashes(
                self.token_range(have * block_size, n_blocks * block_size), block_size, parent=parent,
                extra_keys=extra,
            )
            self._digests.extend(new)
            self._hashes.extend(external_hash_to_int(d) for d in new)
        return self._hashes[:n_blocks]

    def hash_extra_keys(self, block_index: int) -> tuple[object, ...] | None:
        """Block ``block_index``'s extra keys as vLLM 0.32 hashes them (``generate_block_hash_extra_keys``):
        ``("lora", name, path)`` on every block, ``("cache_salt", salt)`` on the first."""
        keys: list[object] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.path))
        if self.cache_salt and block_index == 0:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None

    def event_extra_keys(self, start: int, end: int) -> list[tuple[object, ...] | None]:
        """Blocks ``[start, end)``'s extra keys as vLLM 0.32 publishes them (``to_event_extra_keys``: untagged)."""
        out: list[tuple[object, ...] | None] = []
        for i in range(start, end):
            keys = self.hash_extra_keys(i)
            out.append(None if keys is None else tuple(k[1] for k in keys))  # type: ignore[index]
        return out

    def next_token(self, vocab_size: int, sampled: Sequence[int] = ()) -> int:
        """The next generated token, seeded by the prompt (and :attr:`sample_index` when > 0): EOS or one of
        ``sampled`` (empty: an id in ``(EOS_ID, vocab_size)``), each equally likely. Before ``min_tokens`` output
        tokens, EOS and ``stop_token_ids`` are masked (vLLM's ``MinTokensLogitsProcessor``): a masked draw takes
        the next allowed token of the table instead (one draw per token either way, so a preempted request
        replays the same tokens)."""
        token = self._draw(vocab_size, sampled)
        banned = suppressed_token_ids(len(self.output_token_ids), self.stop, EOS_ID)
        if token not in banned:
            return token
        table: Sequence[int] = sampled or range(EOS_ID + 1, vocab_size)
        start = table.index(token) + 1 if token in table else 0
        for k in range(len(table)):
            candidate = table[(start + k) % len(table)]
            if candidate not in banned:
                return candidate
        return token  # every token masked: nothing allowed to fall back to

    def _draw(self, vocab_size: int, sampled: Sequence[int]) -> int:
        choices = len(sampled) + 1 if sampled else vocab_size - EOS_ID
        if self._rng is None:
            key = array("q", self.prompt_token_ids).tobytes()
            if self.sample_index:
                key += b"sample:%d" % self.sample_index
            seed = hashlib.blake2b(key, digest_size=8).digest()
            self._rng = random.Random(int.from_bytes(seed, "little"))
            # a preempted request regenerates nothing: skip what it already produced
            for _ in self.output_token_ids:
                self._rng.randrange(choices)
        draw = self._rng.randrange(choices)
        if draw == 0 and not self.ignore_eos:
            return EOS_ID
        if not sampled:
            return EOS_ID + max(draw, 1)
        return sampled[max(draw, 1) - 1]


@dataclass(slots=True)
class ScheduledStep:
    """What one step computes: ``(request, num_new_tokens)`` pairs and the latency inputs."""

    scheduled: list[tuple[Request, int]]
    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestOutput:
    """A step's result for one request: tokens produced in this step, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    text: str | None = None
    """The output text this step adds, held back near a possible stop string while unfinished (vLLM's DELTA
    output); None when the request tracks no text (:attr:`Request.output_text`)."""
    error: str | None = None
    """Set (with ``finished``) when the engine died (``engine.py``): the request ends with this error, not an answer."""


class EngineCore:
    """Requests in, steps out. The async loop (``engine.py``) calls :meth:`schedule`, waits
    the step's model time, then calls :meth:`update`.

    Args:
        config: scheduler limits.
        cache: the block pool (its block size is the engine's).
    """

    def __init__(self, config: SchedulerConfig, cache: PrefixCache) -> None:
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.num_preemptions = 0
        self.loading: list[Request] = []
        """Waiting requests that hold KV blocks, in the order their loads started (vLLM's ``kv_holding_waiting``):
        loads from an offloaded tier in flight (``WAITING_FOR_REMOTE_KVS``, ``load_ready_time`` set) and loaded
        prefixes waiting for the rest of their blocks (``load_ready_time`` None). Tried before :attr:`waiting`."""
        self.external_hits_tokens = 0
        """Prompt tokens loaded from offloaded tiers instead of computed (vLLM's external prefix-cache hits)."""
        self.external_queries_tokens = 0
        """Prompt tokens looked up in the offloaded tiers: each request's tokens past its GPU hit, counted once
        when it is first scheduled and only with an offload connector (vLLM's external prefix-cache queries)."""

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS).

        Raises:
            ValueError: duplicate id, empty prompt, ``max_tokens < 1``, or a sequence longer than
                ``max_model_len``.
        """
        if request.request_id in self._by_id:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {total} tokens ({request.num_prompt_tokens} in the messages, "
                f"{request.max_tokens} in the completion). Please reduce the length of the messages or completion."
            )
        if -(-total // self.block_size) > self.cache.num_gpu_blocks - 1:
            raise ValueError(
                f"request needs {-(-total // self.block_size)} KV blocks of {self.block_size} tokens but the "
                f"engine has only {self.cache.num_gpu_blocks - 1}"
            )
        self._by_id[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request wherever it is, freeing its blocks; None if unknown or finished."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.loading:
            self.loading.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self._offload_finished(req)
        self._free(req)
        req.finish_reason = FinishReason.ABORT
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def next_load_ready(self) -> float | None:
        """Model time the earliest offload load completes (a request's, or one whose request was aborted that
        holds back a deferred request); None when nothing loads."""
        ready = min((r.load_ready_time for r in self.loading if r.load_ready_time is not None), default=None)
        offload = self.cache.offload
        done = offload.next_load_done() if offload is not None else None
        if done is None:
            return ready
        return done if ready is None else min(ready, done)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: :attr:`waiting` plus every request of :attr:`loading` (loads in flight and loaded
        prefixes alike), the value of vLLM 0.32's ``vllm:num_requests_waiting``.

        vLLM 0.32 (``vllm/v1/core/sched/scheduler.py``): ``get_request_counts`` returns ``len(self.running),
        len(self.waiting) + len(self.kv_holding_waiting)`` (line 2608-2610); ``make_stats`` reports
        ``num_waiting_reqs=num_waiting - num_deferred`` and ``num_skipped_waiting_reqs=num_deferred`` with
        ``num_deferred = len(self.deferred_waiting)`` (lines 2943-2948); and ``PrometheusStatLogger.record``
        (``vllm/v1/metrics/loggers.py``, lines 1150-1154) sets ``vllm:num_requests_waiting`` to their sum, so the
        gauge is ``waiting + kv_holding_waiting``: a request whose KV load is still ``WAITING_FOR_REMOTE_KVS``
        counts. The same ``get_request_counts`` sizes the long-prefill cap (:meth:`long_prefill_cap`).
        """
        return len(self.waiting) + len(self.loading)

    def _offload_finished(self, req: Request) -> None:
        """vLLM's ``on_request_finished``: the offload tier's recency learns every full block the request used."""
        offload = self.cache.offload
        if offload is not None and req.num_cached_blocks:
            offload.on_request_finished(req.block_hashes(req.num_cached_blocks, self.block_size))

    @property
    def num_deferred(self) -> int:
        """Waiting requests vLLM 0.32 counts as deferred (``vllm:num_requests_waiting_by_reason{reason="deferred"}``,
        ``SchedulerStats.num_skipped_waiting_reqs``): its ``deferred_waiting`` set. A request enters it when the
        waiting loop skips it (``skip_request``, scheduler.py line 906: an async load started, or a load still in
        flight) and leaves it only when admitted to ``running`` (line 1344) or finished/aborted (lines 2300, 2697),
        so every request of :attr:`loading` is in it (a finished load not yet admitted included), and so are the
        requests of :attr:`waiting` whose offload lookup was deferred (:attr:`Request.offload_deferred`; the
        simulator has no LoRA or grammar skips). ``num_waiting - num_deferred`` is the ``reason="capacity"``
        value."""
        if self.cache.offload is None:
            return len(self.loading)
        return len(self.loading) + sum(1 for r in self.waiting if r.offload_deferred)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when nothing runs, as vLLM)."""
        return self.cache.reset()

    # -- blocks -------------------------------------------------------------------------
    def _free(self, req: Request) -> None:
        if req.blocks:
            self.cache.free(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.inflight_prefill = False

    def _computed_blocks(self, req: Request) -> list[int]:
        """Prefix-hit blocks, capped so the last token is always computed (vLLM)."""
        if not self.cache.enable_caching or req.skip_reading_prefix_cache:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return []
        return self.cache.lookup(req.block_hashes(max_blocks, self.block_size))

    def _allocate(self, req: Request, num_new_tokens: int, hit_blocks: Sequence[int] = (), cache: bool = True,
                  reserved: int = 0) -> bool:
        """vLLM ``allocate_slots``: reference hits, allocate blocks for the new tokens, cache full ones. The
        blocks must fit in the free ones less ``reserved`` (vLLM's ``reserved_blocks``, for async loads)."""
        bs = self.block_size
        total = req.num_computed_tokens + len(hit_blocks) * bs + num_new_tokens
        need = -(-total // bs) - len(req.blocks) - len(hit_blocks)
        if need > 0 and need + self.cache.num_evictable(hit_blocks) > self.cache.num_free_blocks - reserved:
            return False
        if hit_blocks:
            self.cache.touch(hit_blocks)
            req.blocks.extend(hit_blocks)
            req.num_cached_blocks = len(req.blocks)
        if need > 0:
            new = self.cache.allocate(need)
            assert new is not None
            req.blocks.extend(new)
        if cache:
            self._cache_full(req, total)
        return True

    def _cache_full(self, req: Request, total: int) -> None:
        """Cache the blocks that are full once ``total`` tokens are in (known tokens only)."""
        bs = self.block_size
        num_full = min(total, req.num_tokens) // bs
        if num_full > req.num_cached_blocks:
            start = req.num_cached_blocks
            hashes = req.block_hashes(num_full, bs)
            self.cache.cache_full_blocks(
                req.blocks[start:num_full],
                hashes[start:num_full],
                hashes[start - 1] if start > 0 else None,
                req.token_range(start * bs, num_full * bs),
                lora=req.lora,
                extra_keys=req.event_extra_keys(start, num_full),
            )
            req.num_cached_blocks = num_full

    def _full_sequence_fits(self, req: Request, hit_blocks: Sequence[int] = ()) -> bool:
        """vLLM 0.32's admission check with ``scheduler_reserve_full_isl`` (``KVCacheManager.allocate_slots`` with
        ``full_sequence_must_fit``): the blocks for the request's whole sequence (``min(num_tokens,
        max_model_len)``), less those it holds and its prefix hits, plus the hits that sit evictable in the free
        queue, must all be free now (``reserved_blocks`` are not subtracted here, as in vLLM). Always True when the
        option is off."""
        if not self.config.scheduler_reserve_full_isl:
            return True
        need = self._remaining_blocks(req, len(hit_blocks))
        return need + self.cache.num_evictable(hit_blocks) <= self.cache.num_free_blocks

    def _remaining_blocks(self, req: Request, num_hit_blocks: int = 0) -> int:
        """Blocks ``req`` still needs for its whole sequence (``min(num_tokens, max_model_len)`` tokens) beyond those
        it holds and ``num_hit_blocks`` prefix hits (vLLM's ``Scheduler._request_remaining_blocks``)."""
        full = min(req.num_tokens, self.config.max_model_len)
        return max(-(-full // self.block_size) - len(req.blocks) - num_hit_blocks, 0)

    def _inflight_reserved_blocks(self) -> int:
        """vLLM 0.32's ``Scheduler._inflight_prefill_reserved_blocks``: the blocks every in-flight prefill (a load in
        flight or done, a running request whose prefill is not complete) still needs to finish."""
        return sum(self._remaining_blocks(r) for r in (*self.running, *self.loading) if r.inflight_prefill)

    def _preempt(self, req: Request) -> None:
        self._free(req)  # also leaves vLLM's _inflight_prefills, as _preempt_request does
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- the step ----------------------------------------------------------------------
    def _promote_load(self, req: Request) -> None:
        """A finished load (vLLM's ``_update_waiting_for_remote_kv``, run when the waiting loop reaches the request):
        the loaded blocks count as computed and enter the GPU prefix cache."""
        req.load_ready_time = None
        self._cache_full(req, req.num_computed_tokens)

    def _start_load(self, req: Request, hits: list[int], now: float) -> bool | str | None:
        """Offload lookup after the GPU hit (vLLM's ``get_num_new_matched_tokens``): None when no offloaded block
        follows the hit; False when the GPU has no blocks for the load; True when the load started; ``"defer"``
        when the connector cannot answer yet (vLLM's ``None`` from ``get_num_new_matched_tokens``: kv_store is
        confirming blocks, or another request is loading some of them, ``_chunks_being_loaded``), so the
        request is passed over this step and looked up again at the next.

        vLLM 0.32 admits an async load (``Scheduler.schedule``, ``load_kv_async``) with ``allocate_slots(request, 0,
        ..., num_external_computed_tokens=ext, delay_cache_blocks=True, full_sequence_must_fit=
        scheduler_reserve_full_isl, reserved_blocks=_inflight_prefill_reserved_blocks())``: the whole sequence
        must fit in the free blocks (when reserving the full ISL), and the blocks of the hit and the load must
        fit in the free blocks less what every in-flight prefill still needs. The request then joins the
        in-flight prefills, so later loads leave its remaining blocks free."""
        offload = self.cache.offload
        if offload is None or not self.cache.enable_caching or req.skip_reading_prefix_cache:
            return None
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes(max_blocks, self.block_size) if max_blocks > 0 else []
        ext = offload.lookup(hashes[len(hits):])
        if ext is None:
            return "defer"
        if ext == 0:
            return None
        if offload.being_loaded(hashes[len(hits):len(hits) + ext]):
            offload.stats.load_deferrals += 1
            return "defer"
        if not self._full_sequence_fits(req, hits) or not self._allocate(
                req, ext * self.block_size, hits, cache=False, reserved=self._inflight_reserved_blocks()):
            return False
        req.num_cached_blocks = len(hits)
        req.inflight_prefill = True
        req.load_plan = offload.start_load(hashes[len(hits):len(hits) + ext], now)
        req.load_ready_time = req.load_plan.ready_at
        req.num_computed_tokens = (len(hits) + ext) * self.block_size
        if req.num_cached_tokens < 0:  # first_scheduled_time waits for the load (vLLM: queue time includes it)
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_queries_tokens += req.num_tokens
            self.prefix_hits_tokens += len(hits) * self.block_size
            self.external_hits_tokens += ext * self.block_size
            self.external_queries_tokens += req.num_tokens - len(hits) * self.block_size
        return True

    def _offer_hits(self, req: Request, num_blocks: int) -> None:
        """Offer a request's GPU prefix-hit blocks to the offload tier, as vLLM 0.32 does (its store range starts
        at chunk 0 unless the chunks were loaded): blocks still in the CPU tier are refreshed, evicted ones are
        offloaded again (no GPU event: they are cached on the GPU already)."""
        offload = self.cache.offload
        assert offload is not None
        bs = self.block_size
        hashes = req.block_hashes(num_blocks, bs)
        offload.store(BlockStored(
            block_hashes=list(hashes), parent_block_hash=None, token_ids=req.token_range(0, num_blocks * bs),
            block_size=bs, lora_id=None if req.lora is None else req.lora.adapter_id, medium="GPU",
            lora_name=None if req.lora is None else req.lora.name, extra_keys=req.event_extra_keys(0, num_blocks),
        ))

    def long_prefill_cap(self) -> int:
        """This step's cap on one request's tokens (0: none), as vLLM 0.32 computes it once per step at the top of
        ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``).

        With ``n = running + waiting`` requests (vLLM's ``get_request_counts``, scheduler.py lines 642-643 and
        2608-2610: ``running``, ``waiting`` and ``kv_holding_waiting``, the last being the simulator's
        :attr:`loading`: loads in flight and loaded prefixes; deferred requests included, so ``n`` is
        :attr:`num_running` + :attr:`num_waiting`, the two gauges), the cap is ``long_prefill_token_threshold`` when ``n > 1`` and 0 otherwise (a lone
        request has nobody to starve and gets the whole budget). With ``long_prefill_token_threshold_adaptive``
        a non-zero cap is raised to ``max_num_batched_tokens // n`` (the whole step's budget, not what is left
        of it). The cap applies to running and waiting requests before the remaining budget does
        (``if 0 < cap < num_new_tokens: num_new_tokens = cap``), so a decode (1 token) is never cut.
        """
        cfg = self.config
        n = self.num_running + self.num_waiting
        cap = cfg.long_prefill_token_threshold if n > 1 else 0
        if cap > 0 and cfg.long_prefill_token_threshold_adaptive:
            cap = max(cap, cfg.max_num_batched_tokens // n)
        return cap

    def schedule(self, now: float) -> ScheduledStep:
        """Pick this step's work within the token budget, ``max_num_seqs`` and the long-prefill cap
        (:meth:`long_prefill_cap`), as vLLM 0.32's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``):
        running requests first (a request that cannot get a block preempts the last running one); then, unless
        this step preempted, the waiting side while budget and ``max_num_seqs`` allow: first :attr:`loading`
        (vLLM's ``kv_holding_waiting``: a load still in flight is skipped; a finished one is promoted and
        admitted), then :attr:`waiting` (FCFS: a request whose prefix continues in an offloaded tier starts a
        load, see :meth:`_start_load`, and is passed over; otherwise it is admitted). Every admission from the
        waiting side is checked by :meth:`_full_sequence_fits` (``full_sequence_must_fit``) and a refused one
        ends the step's admissions (vLLM's ``break``)."""
        if self.cache.offload is not None:
            self.cache.offload.advance(now)  # offload stores and kv_store writes due by now complete
        cap = self.long_prefill_cap()
        budget = self.config.max_num_batched_tokens
        step = ScheduledStep([])
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if 0 < cap < n:
                n = cap
            n = min(n, budget)
            while not self._allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is req:
                    break
            else:
                step.scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted
        if not step.preempted:
            k = 0  # next request of self.loading (vLLM's kv_holding_waiting) to look at; those before it are skipped
            j = 0  # next request of self.waiting; those before it were deferred by the offload lookup this step
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                if k < len(self.loading):  # vLLM drains kv_holding_waiting first
                    req = self.loading[k]
                    if req.load_ready_time is not None:
                        if req.load_ready_time > now:  # still WAITING_FOR_REMOTE_KVS: skipped this step
                            k += 1
                            continue
                        self._promote_load(req)
                    hit_tokens = req.num_computed_tokens
                    n = req.num_tokens - hit_tokens
                    if 0 < cap < n:
                        n = cap
                    n = min(n, budget)
                    if not self._full_sequence_fits(req) or not self._allocate(req, n):
                        break
                    del self.loading[k]
                    if req.first_scheduled_time is None:  # vLLM 0.32 records SCHEDULED (the end of
                        # vllm:request_queue_time_seconds) here, after its load; never before its arrival
                        req.first_scheduled_time = max(now, req.arrival_time)
                else:
                    if j >= len(self.waiting):
                        break
                    req = self.waiting[j]
                    hits = self._computed_blocks(req)
                    loading = self._start_load(req, hits, now)
                    if loading is False:
                        break
                    if loading == "defer":  # vLLM: skip_request into deferred_waiting; asked again next step
                        req.offload_deferred = True
                        j += 1
                        continue
                    req.offload_deferred = False
                    if loading:  # vLLM: skipped into kv_holding_waiting, behind the kv-holding ones seen this step
                        self.loading.append(req)
                        del self.waiting[j]
                        k += 1
                        continue
                    hit_tokens = len(hits) * self.block_size
                    n = req.num_tokens - hit_tokens
                    if 0 < cap < n:
                        n = cap
                    n = min(n, budget)
                    if not self._full_sequence_fits(req, hits) or not self._allocate(req, n, hits):
                        break
                    del self.waiting[j]
                    if hits and self.cache.offload is not None:
                        self._offer_hits(req, len(hits))
                req.num_computed_tokens = hit_tokens
                if hit_tokens + n < req.num_tokens:
                    req.inflight_prefill = True
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit_tokens
                    # A step on a schedule running late starts (in model time) before a request that arrived
                    # while the loop caught up: it was scheduled no earlier than it arrived (queue time >= 0).
                    req.first_scheduled_time = max(now, req.arrival_time)
                    if not req.skip_reading_prefix_cache:  # vLLM's record_prefix_cache_stats skips it
                        self.prefix_queries_tokens += req.num_tokens
                        self.prefix_hits_tokens += hit_tokens
                    if self.cache.offload is not None and self.cache.enable_caching and not req.skip_reading_prefix_cache:
                        self.external_queries_tokens += req.num_tokens - hit_tokens
                self.running.append(req)
                step.scheduled.append((req, n))
                budget -= n
        for req, n in step.scheduled:
            if n == 1 and req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1:
                step.decode_seqs += 1
                step.decode_context_tokens += req.num_tokens
            else:
                step.prefill_tokens += n
        return step

    def update(self, step: ScheduledStep) -> list[RequestOutput]:
        """Apply a finished step: advance computed tokens, sample, finish requests."""
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        cfg = self.config
        for req, n in step.scheduled:
            if req.finish_reason is not None:  # aborted during the step
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            req.inflight_prefill = False  # prefill complete (vLLM's _update_after_schedule)
            tok = req.next_token(cfg.vocab_size, cfg.sampled_token_ids)
            req.output_token_ids.append(tok)
            done = None
            # vLLM 0.32 check_stop (vllm/v1/core/sched/utils.py): EOS, stop token ids, then length
            if tok == EOS_ID and not req.ignore_eos:
                done = FinishReason.STOP
            elif tok in req.stop.stop_token_ids:
                done = FinishReason.STOP
                req.stop_reason = tok
            elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= cfg.max_model_len:
                done = FinishReason.LENGTH
            text = None
            if req.output_text is not None:  # vLLM's detokenizer: stop strings end the request too
                stop_string = req.output_text.update([tok], done is FinishReason.STOP)
                if stop_string is not None:
                    done = FinishReason.STOP
                    req.stop_reason = stop_string
                text = req.output_text.delta(finished=done is not None)
            if done is not None:
                req.finish_reason = done
                finished.append(req)
            outputs.append(RequestOutput(req, [tok], done is not None, text))
        for req in finished:
            self.running.remove(req)
            self._by_id.pop(req.request_id, None)
            self._offload_finished(req)
            self._free(req)
        return outputs
