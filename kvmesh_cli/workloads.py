"""Workloads for ``kvmesh replay``/``compare``: the Mooncake trace format and built-in generators.

A workload is a list of :class:`WorkloadRequest`, sorted by nominal arrival time (model seconds).
Prompts are token ids built from *segments*: a segment is a key and a length, and its tokens are a
deterministic function of ``(seed, key)``, so two prompts that start with the same segments start
with the same tokens (the engines' prefix caches see the sharing) while unrelated segments differ.
Tokens are drawn uniformly from ``[FIRST_TOKEN_ID, VOCAB_SIZE)``: the simulator's tokenizer has a
2048-id vocabulary whose ids 0-2 are the special tokens ``<unk>``, ``<s>``, ``</s>``.

Mooncake (FAST'25, ``kvcache-ai/Mooncake`` ``FAST25-release/traces/*.jsonl``): one JSON object per
line, ``timestamp`` (ms since the first request), ``input_length``, ``output_length`` and
``hash_ids``, one per 512-token block, prefix-chained. Each hash id becomes one segment of 512
tokens (key ``"blk:<id>"``); the last one is truncated so the prompt is exactly ``input_length``
tokens. The conversation trace's timestamps are quantised to 3-s steps; requests sharing a
timestamp are spread evenly across the gap to the next distinct timestamp (at most
``spread_max_seconds``), as the trace README recommends.

``multi-turn`` (built in, no files): conversations that each open with one of a few shared system
prompts; every turn's prompt is the previous turn's prompt plus its answer plus a new user message,
so each turn extends the previous one. Conversations start as a Poisson process; turns follow after
exponentially distributed think times. A turn is never sent before the previous turn of its
conversation has completed (``after``), so the previous prompt can be in some engine's cache.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

VOCAB_SIZE = 2048
"""Size of the engine simulator's tokenizer vocabulary."""
FIRST_TOKEN_ID = 3
"""Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>``; generated prompts never contain them."""
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake hash id."""
DEFAULT_NUM_GPU_BLOCKS = 384
"""Per engine, 64-token blocks (24.6k tokens): too few for every live conversation, enough for a quarter."""
DEFAULT_TRACE_NUM_GPU_BLOCKS = 2048
"""Per engine with a trace: 131k tokens, about ten capped Mooncake prompts."""
DEFAULT_MAX_INPUT_TOKENS = 16384
"""Mooncake prompts are capped to this (prefixes kept): 2 cores cannot move 100k-token prompts fast."""
DEFAULT_MAX_OUTPUT_TOKENS = 512


@dataclass(frozen=True)
class Segment:
    """``length`` deterministic tokens identified by ``key`` (a prefix of the key's full block)."""

    key: str
    length: int


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        index: position in the workload (0-based, arrival order).
        arrival_s: nominal arrival, model seconds since the workload's start.
        segments: the prompt, as segments (see :func:`prompt_tokens`).
        max_tokens: tokens to generate (sent with ``ignore_eos``).
        session: conversation id for multi-turn workloads, else None.
        after: index of a request that must complete before this one is sent (the previous turn).
    """

    index: int
    arrival_s: float
    segments: tuple[Segment, ...]
    max_tokens: int
    session: str | None = None
    after: int | None = None

    @property
    def input_length(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[WorkloadRequest]
    seed: int
    params: dict[str, object] = field(default_factory=dict)


@functools.lru_cache(maxsize=4096)
def segment_block(seed: int, key: str, length: int) -> tuple[int, ...]:
    """The first ``length`` tokens of segment ``key`` under ``seed``; ids in ``[3, 2048)``.

    Deterministic across processes and Python versions (``random.Random`` seeded with a str).
    A shorter segment with the same key is a prefix of a longer one.
    """
    rng = random.Random(f"{seed}:{key}")
    return tuple(rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(length))


def prompt_tokens(request: WorkloadRequest, seed: int) -> list[int]:
    """The request's prompt as token ids (``input_length`` of them)."""
    out: list[int] = []
    for seg in request.segments:
        out.extend(segment_block(seed, seg.key, seg.length))
    return out


# ---------------------------------------------------------------------------------------------
# Mooncake trace


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: Path, limit: int | None = None) -> list[TraceRow]:
    """Rows of a Mooncake trace (JSONL), in file order; at most ``limit``.

    Raises:
        ValueError: on a row without the four fields, naming the line.
    """
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append(
                    TraceRow(int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]),
                             tuple(int(h) for h in obj["hash_ids"]))
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row ({exc})") from exc
            if limit is not None and len(rows) >= limit:
                break
    return rows


def spread_timestamps(timestamps_ms: list[int], spread_max_seconds: float) -> list[float]:
    """Arrival seconds: requests sharing a timestamp spread evenly over the gap to the next one.

    ``[0, 0, 0, 3000]`` with a 3-s cap -> ``[0, 1, 2, 3]``. The last group spreads over the cap.
    Input must be sorted (Mooncake traces are).
    """
    out: list[float] = []
    i = 0
    n = len(timestamps_ms)
    while i < n:
        j = i
        while j < n and timestamps_ms[j] == timestamps_ms[i]:
            j += 1
        start = timestamps_ms[i] / 1000.0
        gap = (timestamps_ms[j] / 1000.0 - start) if j < n else spread_max_seconds
        gap = min(gap, spread_max_seconds)
        k = j - i
        out.extend(start + gap * m / k for m in range(k))
        i = j
    return out


def mooncake_workload(
    rows: list[TraceRow],
    *,
    seed: int = 0,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    spread_max_seconds: float = 3.0,
) -> Workload:
    """Requests from Mooncake rows: hash id -> 512-token segment, last block truncated.

    ``max_input_tokens`` truncates long prompts (keeping their prefix, so sharing is kept);
    ``max_output_tokens`` caps generation (outputs of 0 become 1).
    """
    arrivals = spread_timestamps([r.timestamp_ms for r in rows], spread_max_seconds)
    requests: list[WorkloadRequest] = []
    for idx, (row, arrival) in enumerate(zip(rows, arrivals, strict=True)):
        length = row.input_length if max_input_tokens is None else min(row.input_length, max_input_tokens)
        segments: list[Segment] = []
        remaining = length
        for h in row.hash_ids:
            if remaining <= 0:
                break
            take = min(MOONCAKE_BLOCK_TOKENS, remaining)
            segments.append(Segment(f"blk:{h}", take))
            remaining -= take
        if remaining > 0:  # a malformed row with too few hash ids: pad with a request-unique tail
            segments.append(Segment(f"pad:{idx}", remaining))
        out_len = max(1, row.output_length)
        if max_output_tokens is not None:
            out_len = min(out_len, max_output_tokens)
        requests.append(WorkloadRequest(idx, arrival, tuple(segments), out_len))
    return Workload(
        "mooncake", requests, seed,
        {"max_input_tokens": max_input_tokens, "max_output_tokens": max_output_tokens},
    )


# ---------------------------------------------------------------------------------------------
# Built-in generators


@dataclass(frozen=True)
class MultiTurnParams:
    """Shape of the built-in ``multi-turn`` workload (lengths in tokens, times in model seconds).

    The defaults make conversation history, not the shared system prompts, most of each prompt
    (240 requests: prompts of ~3.6k tokens on average, up to ~9.4k, over ~44 model seconds), so a
    policy that keeps a conversation on one engine reuses far more than one that spreads it: an
    offline LRU replay of 240 requests over 4 engines of 384 64-token blocks gives ~29 % hits for
    round-robin and ~69 % for prefix affinity. Long-ish prompts also make prefill (what a cache
    hit saves) large against the Python mesh's own per-request overhead.
    """

    system_prompts: int = 4
    """Distinct shared system prompts; each conversation picks one uniformly."""
    system_prompt_tokens: int = 512
    turns_min: int = 4
    turns_max: int = 8
    user_tokens_min: int = 256
    user_tokens_max: int = 1536
    answer_tokens_min: int = 32
    answer_tokens_max: int = 160
    conversation_rate_per_s: float = 1.0
    """Poisson rate of new conversations."""
    think_time_mean_s: float = 3.0
    """Mean (exponential) gap between a turn's nominal arrival and the next turn's."""


def multi_turn_workload(requests: int, *, seed: int = 0, params: MultiTurnParams | None = None) -> Workload:
    """``requests`` turns of multi-turn conversations with shared system prompts.

    Turn ``t`` of conversation ``c`` has prompt ``system + u0 + a0 + u1 + a1 + ... + u_t`` where
    ``u_i`` is a user message and ``a_i`` the (synthetic) answer of turn ``i``; its ``max_tokens``
    is ``len(a_t)``. Conversations are generated until their turns cover ``requests`` requests by
    nominal arrival, then the earliest ``requests`` are kept.

    Raises:
        ValueError: when ``requests`` < 1.
    """
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    p = params or MultiTurnParams()
    rng = random.Random(seed)
    pending: list[tuple[float, str, int, tuple[Segment, ...], int]] = []  # arrival, conv, turn, segs, max
    t_conv = 0.0
    conv = 0
    while True:
        # Stop once enough turns exist before the next conversation would start.
        if len([x for x in pending if x[0] <= t_conv]) >= requests:
            break
        sys_id = rng.randrange(p.system_prompts)
        segs: list[Segment] = [Segment(f"sys:{sys_id}", p.system_prompt_tokens)]
        turns = rng.randint(p.turns_min, p.turns_max)
        t = t_conv
        for turn in range(turns):
            segs.append(Segment(f"user:{conv}:{turn}", rng.randint(p.user_tokens_min, p.user_tokens_max)))
            answer = rng.randint(p.answer_tokens_min, p.answer_tokens_max)
            pending.append((t, f"c{conv}", turn, tuple(segs), answer))
            segs.append(Segment(f"answer:{conv}:{turn}", answer))
            t += rng.expovariate(1.0 / p.think_time_mean_s) if p.think_time_mean_s > 0 else 0.0
        conv += 1
        t_conv += rng.expovariate(p.conversation_rate_per_s)
    pending.sort(key=lambda x: (x[0], x[1], x[2]))
    kept = pending[:requests]
    last_of: dict[str, int] = {}
    out: list[WorkloadRequest] = []
    for idx, (arrival, conv_id, _turn, segs_t, answer) in enumerate(kept):
        out.append(WorkloadRequest(idx, arrival, segs_t, answer, conv_id, last_of.get(conv_id)))
        last_of[conv_id] = idx
    return Workload("multi-turn", out, seed, {"params": p.__dict__})


BUILTIN_WORKLOADS = ("multi-turn",)


def builtin_workload(name: str, requests: int, seed: int = 0) -> Workload:
    """A built-in workload by name.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name == "multi-turn":
        return multi_turn_workload(requests, seed=seed)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(BUILTIN_WORKLOADS)}")


def cap_workload(workload: Workload, max_input_tokens: int | None, max_output_tokens: int | None) -> Workload:
    """Truncate prompts (keeping prefixes) and outputs of any workload."""
    if max_input_tokens is None and max_output_tokens is None:
        return workload
    out: list[WorkloadRequest] = []
    for r in workload.requests:
        segs: Iterable[Segment] = r.segments
        if max_input_tokens is not None and r.input_length > max_input_tokens:
            kept: list[Segment] = []
            left = max_input_tokens
            for s in r.segments:
                if left <= 0:
                    break
                kept.append(Segment(s.key, min(s.length, left)))
                left -= s.length
            segs = kept
        mt = r.max_tokens if max_output_tokens is None else min(r.max_tokens, max_output_tokens)
        out.append(WorkloadRequest(r.index, r.arrival_s, tuple(segs), max(1, mt), r.session, r.after))
    return Workload(workload.name, out, workload.seed, {**workload.params,
                    "max_input_tokens": max_input_tokens, "max_output_tokens": max_output_tokens})


def workload_stats(workload: Workload) -> dict[str, float]:
    """Counts and means, for the header line of a replay."""
    n = len(workload.requests)
    if n == 0:
        return {"requests": 0}
    ins = [r.input_length for r in workload.requests]
    outs = [r.max_tokens for r in workload.requests]
    span = workload.requests[-1].arrival_s - workload.requests[0].arrival_s
    return {
        "requests": n,
        "input_tokens_mean": sum(ins) / n,
        "input_tokens_max": max(ins),
        "output_tokens_mean": sum(outs) / n,
        "span_s": span,
        "rate_per_s": (n / span) if span > 0 else math.inf,
    }


class WorkloadError(ValueError):
    """A workload that cannot be built; ``option`` names the flag at fault (``--trace`` or ``--workload``)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


def default_num_gpu_blocks(trace: Path | None) -> int:
    """KV blocks per engine that make the workload's sharing visible: more for a (long-prompt) trace."""
    return DEFAULT_TRACE_NUM_GPU_BLOCKS if trace is not None else DEFAULT_NUM_GPU_BLOCKS


def load_workload(
    trace: Path | None, workload: str, requests: int, seed: int, max_input_tokens: int | None,
    max_output_tokens: int,
) -> Workload:
    """The workload a replay/compare sends: the first ``requests`` rows of a Mooncake ``trace``, else a built-in.

    Trace prompts are capped to ``max_input_tokens`` (default :data:`DEFAULT_MAX_INPUT_TOKENS`), built-in
    ones only when it is given; ``max_tokens`` is capped to ``max_output_tokens`` in both.

    Raises:
        WorkloadError: an unknown built-in workload, or a trace that is not a Mooncake trace (the
            message names the file and line).
    """
    if trace is not None:
        try:
            rows = read_mooncake(trace, limit=requests)
            if not rows:
                raise ValueError(f"{trace}: no trace rows")
            return mooncake_workload(
                rows, seed=seed, max_input_tokens=max_input_tokens or DEFAULT_MAX_INPUT_TOKENS,
                max_output_tokens=max_output_tokens,
            )
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{trace}: not UTF-8 text ({exc.reason} at byte {exc.start})", "--trace") from None
        except (OSError, ValueError) as exc:
            raise WorkloadError(str(exc), "--trace") from None
    try:
        wl = builtin_workload(workload, requests, seed)
    except ValueError as exc:
        raise WorkloadError(str(exc), "--workload") from exc
    return cap_workload(wl, max_input_tokens, max_output_tokens)
