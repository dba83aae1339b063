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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
DEFAULT_AGENTIC_BLOCKS = 768
"""Per engine with agentic sessions: 49k tokens, about three live sessions of ~15k tokens (8 tokens a trace block)."""
DEFAULT_MAX_INPUT_TOKENS = 16384
"""Mooncake prompts are capped to this (prefixes kept): 2 cores cannot move 100k-token prompts fast."""
DEFAULT_AGENTIC_MAX_INPUT_TOKENS = 24576
"""Agentic prompts (after :attr:`AgenticParams.block_tokens` scaling) are capped to this (196k trace tokens, the
trace's ~p85 at 8 tokens a block); it must fit one engine's KV pool (:data:`DEFAULT_AGENTIC_BLOCKS`)."""
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
        think_s: closed loop: sent this many model seconds after ``after`` completes (``arrival_s``
            is then only nominal); None: open loop, sent at ``arrival_s`` but never before ``after``.
    """

    index: int
    arrival_s: float
    segments: tuple[Segment, ...]
    max_tokens: int
    session: str | None = None
    after: int | None = None
    think_s: float | None = None

    @property
    def input_length(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[WorkloadRequest]
    seed: int
    params: dict[str, object] = field(default_factory=dict)


BOS_ID = 1
"""``<s>``: the simulator's tokenizer prepends it to a text prompt; token-id prompts are sent with it too."""


@functools.lru_cache(maxsize=1)
def word_vocabulary() -> tuple[tuple[int, str], ...]:
    """``(token id, text)`` of the simulator tokenizer's one-token words (``" the"``), by id.

    Each text is a space and ASCII letters that the tokenizer encodes, alone, to exactly its id. The
    ByteLevel pre-tokenizer splits text at each space-letters run, so a concatenation of these texts
    encodes to the concatenation of their ids: a prompt drawn from them has an exact text form, for
    routers that only take text (sglang-router answers 422 to token ids). 872 words in tokenizer-v1.
    """
    from tokenizers import Tokenizer

    from engine_simulator.tokenizer import ensure_tokenizer

    tok = Tokenizer.from_file(str(ensure_tokenizer(None) / "tokenizer.json"))
    out: list[tuple[int, str]] = []
    for piece, token_id in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        if piece.startswith("\u0120") and piece[1:].isascii() and piece[1:].isalpha():
            text = " " + piece[1:]
            if tok.encode(text, add_special_tokens=False).ids == [token_id]:
                out.append((token_id, text))
    if not out:
        raise RuntimeError("the simulator tokenizer has no one-token words")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _word_ids() -> tuple[int, ...]:
    return tuple(i for i, _ in word_vocabulary())


@functools.lru_cache(maxsize=1)
def _word_text() -> dict[int, str]:
    return dict(word_vocabulary())


@functools.lru_cache(maxsize=1 << 17)
def segment_block(seed: int, key: str, length: int) -> tuple[int, ...]:
    """The first ``length`` tokens of segment ``key`` under ``seed``: one-token words of :func:`word_vocabulary`.

    Deterministic across processes and Python versions (``random.Random`` seeded with a str).
    A shorter segment with the same key is a prefix of a longer one.
    """
    rng = random.Random(f"{seed}:{key}")
    return tuple(rng.choices(_word_ids(), k=length))


def prompt_tokens(request: WorkloadRequest, seed: int) -> list[int]:
    """The request's prompt as token ids (``input_length`` of them, no ``<s>``)."""
    out: list[int] = []
    for seg in request.segments:
        out.extend(segment_block(seed, seg.key, seg.length))
    return out


def request_token_ids(request: WorkloadRequest, seed: int) -> list[int]:
    """What the client sends as a token-id prompt: ``<s>`` then :func:`prompt_tokens` (``input_length + 1``)."""
    return [BOS_ID, *prompt_tokens(request, seed)]


def request_text(request: WorkloadRequest, seed: int) -> str:
    """The same prompt as text: the simulator tokenizes it (adding ``<s>``) to :func:`request_token_ids`."""
    words = _word_text()
    return "".join(words[t] for t in prompt_tokens(request, seed))


# ---------------------------------------------------------------------------------------------
# Mooncake trace


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_int(value: object, field: str, minimum: int) -> int:
    """A trace's whole-number field (``5`` or ``5.0``, not ``true`` or ``5.5``) of at least ``minimum``.

    Raises:
        ValueError: naming ``field`` and what it was.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{field} {value!r} is not a whole number")
    if value < minimum:
        raise ValueError(f"{field} {value!r} is below {minimum}")
    return int(value)


def trace_seconds(value: object, field: str, *, required: bool = False) -> float:
    """A trace's time field in seconds: a finite number >= 0 (``null`` is 0, a field the recorder left
    empty, unless ``required``).

    Raises:
        ValueError: naming ``field`` and what it was.
    """
    if value is None and not required:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} {value!r} is not a time >= 0 s")
    return float(value)


def read_mooncake(path: Path, limit: int | None = None) -> list[TraceRow]:
    """Rows of a Mooncake trace (JSONL), in file order; at most ``limit``.

    What each field may be (the FAST'25 release; ``../shared/data/traces/README.md``): ``timestamp``
    milliseconds since the first request (>= 0), ``input_length`` prompt tokens (>= 1: an empty prompt
    is no request), ``output_length`` generated tokens (>= 0; a recorded 0 is replayed as 1, the least
    an engine generates), ``hash_ids`` remapped block ids (>= 0).

    Raises:
        ValueError: on a row without the four fields or with one out of range, naming the file and line.
    """
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                hash_ids = obj["hash_ids"]
                if not isinstance(hash_ids, list):
                    raise ValueError(f"hash_ids {hash_ids!r} is not a list")
                rows.append(
                    TraceRow(trace_int(obj["timestamp"], "timestamp", 0),
                             trace_int(obj["input_length"], "input_length", 1),
                             trace_int(obj["output_length"], "output_length", 0),
                             tuple(trace_int(h, f"hash_ids[{i}]", 0) for i, h in enumerate(hash_ids)))
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
# kv-cache-tester agentic coding traces


AGENTIC_BLOCK_TOKENS = 64
"""Tokens per hash id in the kv-cache-tester traces (their ``block_size``)."""
DEFAULT_AGENTIC_ARCHIVE = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces"
    / "kv-cache-tester_agentic_traces_first100.tar.gz"
)
"""Where the checkout's sibling ``shared/`` keeps the first 100 traces (used when present)."""


@dataclass(frozen=True)
class AgenticCall:
    """One API call of a kv-cache-tester trace (times in seconds, lengths in tokens)."""

    t: float
    """Start, seconds since the (sub-)conversation's start."""
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    """One per full 64-token block, prefix-chained, comparable within one file."""
    think_s: float
    """Gap between the previous call's answer and this call (the user or the tools)."""
    api_s: float
    """How long the recorded API call took."""


@dataclass(frozen=True)
class AgenticSession:
    """One conversation: the parent's calls and its sub-agents (each a list of calls starting at ``t``)."""

    name: str
    calls: tuple[AgenticCall, ...]
    subagents: tuple[tuple[float, int, tuple[AgenticCall, ...]], ...] = ()
    """``(start t in the parent's clock, index of the parent call it follows (-1: none), calls)``."""


def _agentic_call(obj: Any, where: str) -> AgenticCall:
    """One call; ``where`` names it in an error (``requests[3]``, ``requests[5].requests[0]``).

    What each field may be (kv-cache-tester's README; ``../shared/data/traces/README.md``): ``t``,
    ``think_time``, ``api_time`` seconds >= 0, ``in`` input tokens >= 1, ``out`` output tokens >= 0
    (the recorded traces hold calls that generated nothing; replayed as 1 token), ``hash_ids``
    block ids >= 0.
    """
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"{where}.hash_ids {hash_ids!r} is not a list")
    return AgenticCall(
        trace_seconds(obj["t"], f"{where}.t", required=True),
        trace_int(obj["in"], f"{where}.in", 1), trace_int(obj["out"], f"{where}.out", 0),
        tuple(trace_int(h, f"{where}.hash_ids[{i}]", 0) for i, h in enumerate(hash_ids)),
        trace_seconds(obj.get("think_time"), f"{where}.think_time"),
        trace_seconds(obj.get("api_time"), f"{where}.api_time"),
    )


def parse_agentic(doc: dict[str, object], name: str) -> AgenticSession:
    """One kv-cache-tester trace document -> an :class:`AgenticSession`.

    Raises:
        ValueError: when the document lacks ``requests`` or a call lacks ``t``/``in``/``out``/``hash_ids``
            or its ``block_size`` is not 64.
    """
    try:
        if int(doc.get("block_size", AGENTIC_BLOCK_TOKENS)) != AGENTIC_BLOCK_TOKENS:  # type: ignore[call-overload]
            raise ValueError(f"block_size {doc.get('block_size')} (expected {AGENTIC_BLOCK_TOKENS})")
        calls: list[AgenticCall] = []
        subs: list[tuple[float, int, tuple[AgenticCall, ...]]] = []
        items: list[Any] = doc["requests"]  # type: ignore[assignment]
        for index, item in enumerate(items):
            where = f"requests[{index}]"
            if item.get("type") == "subagent":
                subs.append((trace_seconds(item["t"], f"{where}.t", required=True), len(calls) - 1,
                             tuple(_agentic_call(c, f"{where}.requests[{j}]")
                                   for j, c in enumerate(item["requests"]) if c.get("type") != "subagent")))
            else:
                calls.append(_agentic_call(item, where))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{name}: not a kv-cache-tester trace ({exc})") from exc
    return AgenticSession(name, tuple(calls), tuple(subs))


def agentic_cache_dir(archive: Path) -> Path:
    """Where :func:`read_agentic` unpacks ``archive``: ``.run/cache/traces/<name>-<size>`` (never committed)."""
    return Path(".run") / "cache" / "traces" / f"{archive.name.split('.')[0]}-{archive.stat().st_size}"


def read_agentic(path: Path, limit: int | None = None) -> list[AgenticSession]:
    """Sessions of kv-cache-tester traces, sorted by file name: a ``.tar.gz`` (unpacked once under
    :func:`agentic_cache_dir`), a directory of ``*.json`` or one ``.json``; at most ``limit``.

    Raises:
        ValueError: a file that is not such a trace (named), or no trace found.
        OSError: unreadable files.
    """
    import tarfile

    if path.is_dir():
        files = sorted(path.rglob("*.json"))
    elif path.name.endswith((".tar.gz", ".tgz", ".tar")):
        cache = agentic_cache_dir(path)
        done = cache / ".unpacked"
        if not done.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tarfile.open(path) as tar:
                tar.extractall(cache, filter="data")
            done.touch()
        files = sorted(cache.rglob("*.json"))
    else:
        files = [path]
    out: list[AgenticSession] = []
    for f in files:
        if limit is not None and len(out) >= limit:
            break
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{f}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{f}: not a kv-cache-tester trace (not an object)")
        out.append(parse_agentic(doc, f.stem))
    if not out:
        raise ValueError(f"{path}: no kv-cache-tester trace files")
    return out


@dataclass(frozen=True)
class AgenticParams:
    """How agentic sessions become a workload (tokens and model seconds).

    ``block_tokens`` shrinks each 64-token hash block to this many tokens (8 engines of a 2-core
    machine cannot prefill 130k-token prompts at load; 8 keeps the trace's sharing and relative
    growth, with prompts an eighth of their recorded length: p50 ~13.5k tokens) and
    ``max_input_tokens`` caps the longest prompts (prefix kept).
    """

    block_tokens: int = 8
    session_gap_s: float = 2.0
    """Mean (exponential) gap between session starts (the traces carry no wall clock)."""
    calls_per_session: int | None = None
    """Keep each session's first N parent calls (and the sub-agents they start)."""
    think_scale: float = 1.0
    """Multiply recorded think times (1.0: as recorded)."""
    max_think_s: float | None = 60.0
    """Cap on a think time (a 20-minute pause says nothing about routing)."""


def agentic_workload(
    sessions: list[AgenticSession], *, seed: int = 0, params: AgenticParams | None = None,
    max_output_tokens: int | None = None, max_input_tokens: int | None = None, limit: int | None = None,
) -> Workload:
    """Closed-loop requests from agentic sessions (the first ``limit`` by nominal arrival).

    Each call's prompt is its hash ids as ``block_tokens``-token segments (key ``"<session>:<id>"``: ids
    are local to a file, and sub-agents share it) plus a call-unique tail for the partial block
    (scaled the same way). A parent call is sent ``think_s`` after the previous parent call's
    answer; a sub-agent starts after the parent call it follows (plus its recorded gap) and chains
    its own calls the same way; the parent does not wait for it (the traces show parents calling
    while their sub-agents run). Sessions start as a Poisson process (``session_gap_s``).
    """
    p = params or AgenticParams()
    rng = random.Random(seed)
    scale = p.block_tokens / AGENTIC_BLOCK_TOKENS

    def think(x: float) -> float:
        x *= p.think_scale
        return min(x, p.max_think_s) if p.max_think_s is not None else x

    pending: list[tuple[float, AgenticSession, AgenticCall, str, int | None, float | None]] = []

    def add(sess: AgenticSession, call: AgenticCall, tag: str, arrival: float, after: int | None,
            think_s: float | None) -> int:
        pending.append((arrival, sess, call, tag, after, think_s))
        return len(pending) - 1

    def build(index: int, item: tuple[float, AgenticSession, AgenticCall, str, int | None, float | None],
              after: int | None) -> WorkloadRequest:
        arrival, sess, call, tag, _after, think_s = item
        segs = [Segment(f"{sess.name}:{h}", p.block_tokens) for h in call.hash_ids]
        tail = round((call.input_tokens - AGENTIC_BLOCK_TOKENS * len(call.hash_ids)) * scale)
        if tail > 0 or not segs:
            segs.append(Segment(f"{sess.name}:{tag}:tail", max(1, tail)))
        if max_input_tokens is not None and sum(x.length for x in segs) > max_input_tokens:
            kept, left = [], max_input_tokens
            for x in segs:
                if left <= 0:
                    break
                kept.append(Segment(x.key, min(x.length, left)))
                left -= x.length
            segs = kept
        out_len = max(1, call.output_tokens if max_output_tokens is None else min(call.output_tokens,
                                                                                   max_output_tokens))
        return WorkloadRequest(index, arrival, tuple(segs), out_len, sess.name, after, think_s)

    start = 0.0
    for sess in sessions:
        calls = sess.calls if p.calls_per_session is None else sess.calls[: p.calls_per_session]
        parent_idx: list[int] = []
        parent_end: list[float] = []  # nominal: arrival + recorded API time
        prev: int | None = None
        t = start
        for k, call in enumerate(calls):
            th = None if prev is None else think(call.think_s)
            t = t if th is None else parent_end[-1] + th
            prev = add(sess, call, f"p{k}", t, prev, th)
            parent_idx.append(prev)
            parent_end.append(t + call.api_s)
        for j, (t_sub, follows, sub_calls) in enumerate(sess.subagents):
            if follows >= len(parent_idx):
                continue
            if follows >= 0:
                f_call = calls[follows]
                gap: float | None = think(max(0.0, t_sub - f_call.t - f_call.api_s))
                anchor: int | None = parent_idx[follows]
                ts = parent_end[follows] + (gap or 0.0)
            else:
                anchor, gap, ts = None, None, start + t_sub
            sprev = anchor
            for k, call in enumerate(sub_calls):
                th = gap if k == 0 else think(call.think_s)
                sprev = add(sess, call, f"s{j}.{k}", ts, sprev, th if sprev is not None else None)
                ts += call.api_s + (think(sub_calls[k + 1].think_s) if k + 1 < len(sub_calls) else 0.0)
        start += rng.expovariate(1.0 / p.session_gap_s) if p.session_gap_s > 0 else 0.0
    # index order = nominal arrival, a valid send order (every `after` precedes its dependant)
    order = sorted(range(len(pending)), key=lambda i: (pending[i][0], i))
    if limit is not None:
        order = order[:limit]
    remap = {old: new for new, old in enumerate(order)}
    requests = []
    for new, old in enumerate(order):
        after = pending[old][4]
        requests.append(build(new, pending[old], None if after is None else remap[after]))
    return Workload("agentic", requests, seed, {"params": p.__dict__, "sessions": len(sessions)})


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


def synthetic_agentic_sessions(sessions: int, *, seed: int = 0) -> list[AgenticSession]:
    """Agentic coding sessions shaped like the kv-cache-tester traces, for a machine without them.

    In the traces' own units (64-token hash blocks, seconds): a first prompt of 250-1100 blocks
    (16k-70k tokens: tools, system prompt, task), each later call adds the previous answer plus a
    lognormal tool result (median ~10 blocks), outputs lognormal (median ~240 tokens), think times
    lognormal (median 12 s, as the traces' p50), 12-40 calls; one session in five starts a
    sub-agent of 4-10 calls with its own 100-200-block prompt after its third call.

    Raises:
        ValueError: when ``sessions`` < 1.
    """
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    rng = random.Random(f"agentic:{seed}")
    out: list[AgenticSession] = []
    for s in range(sessions):
        ids = iter(range(1, 1 << 30))
        calls = _synthetic_chain(rng, ids, rng.randint(250, 1100), rng.randint(12, 40))
        subs: list[tuple[float, int, tuple[AgenticCall, ...]]] = []
        if rng.random() < 0.2 and len(calls) > 3:
            sub = _synthetic_chain(rng, ids, rng.randint(100, 200), rng.randint(4, 10))
            subs.append((calls[2].t + calls[2].api_s + 1.0, 2, sub))
        out.append(AgenticSession(f"synthetic-{s:03d}", calls, tuple(subs)))
    return out


def _synthetic_chain(rng: random.Random, ids: Iterator[int], first_blocks: int, n_calls: int) -> tuple[AgenticCall, ...]:
    """One agent's calls: a prompt of ``first_blocks`` new blocks that grows by answer + tool result per call."""
    blocks = [next(ids) for _ in range(first_blocks)]
    calls: list[AgenticCall] = []
    t = 0.0
    for k in range(n_calls):
        if k:
            blocks += [next(ids) for _ in range(max(1, int(rng.lognormvariate(math.log(10), 1.0))))]
        out_tokens = max(16, min(4000, int(rng.lognormvariate(math.log(240), 0.8))))
        think = 0.0 if k == 0 else min(300.0, rng.lognormvariate(math.log(12), 1.2))
        api = 2.0 + out_tokens / 60.0
        t += think
        calls.append(AgenticCall(t, 64 * len(blocks) + rng.randrange(64), out_tokens, tuple(blocks), think, api))
        t += api
        blocks += [next(ids) for _ in range(out_tokens // 64)]
    return tuple(calls)


def scale_load(workload: Workload, rate_scale: float) -> Workload:
    """The workload offered ``rate_scale`` times faster: arrivals and think times divided by it.

    Open-loop traces (Mooncake) then arrive ``rate_scale`` times as often; closed-loop sessions start
    that much closer together and think that much less (each call still waits for the previous answer).

    Raises:
        ValueError: when ``rate_scale`` <= 0.
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if rate_scale == 1.0:
        return workload
    reqs = [WorkloadRequest(r.index, r.arrival_s / rate_scale, r.segments, r.max_tokens, r.session, r.after,
                            None if r.think_s is None else r.think_s / rate_scale) for r in workload.requests]
    return Workload(workload.name, reqs, workload.seed, {**workload.params, "rate_scale": rate_scale})


def block_keys(request: WorkloadRequest, block_size: int, bos: bool = True) -> list[int]:
    """Prefix-chained identities of the full ``block_size``-token blocks of the request as sent.

    Computed from segments, never tokens: a block is the ``(segment key, start, end)`` pieces it
    covers (equal pieces are equal tokens, by :func:`segment_block`), chained with its predecessor,
    so two requests share block ``i`` exactly when they share the first ``i + 1`` blocks of tokens.
    ``bos`` counts the ``<s>`` the client sends first.
    """
    pieces: list[tuple[str, int, int]] = [("<s>", 0, 1)] if bos else []
    for seg in request.segments:
        pieces.append((seg.key, 0, seg.length))
    keys: list[int] = []
    cur: list[tuple[str, int, int]] = []
    fill = 0
    prev = 0
    for key, lo, hi in pieces:
        while lo < hi:
            take = min(hi - lo, block_size - fill)
            cur.append((key, lo, lo + take))
            lo += take
            fill += take
            if fill == block_size:
                prev = hash((prev, tuple(cur)))
                keys.append(prev)
                cur = []
                fill = 0
    return keys


def oracle_hits(requests: Iterable[WorkloadRequest], block_size: int) -> tuple[int, int]:
    """``(hit tokens, prompt tokens)`` of one infinite prefix cache serving ``requests`` in order.

    A request hits its longest prefix of blocks seen before, never its last token (vLLM 0.32 computes
    at least one: at most ``(n - 1) // block_size`` blocks hit), as the engines count
    ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``. Prompts count the ``<s>``.
    """
    seen: set[int] = set()
    hits = queries = 0
    for r in requests:
        n = r.input_length + 1
        keys = block_keys(r, block_size)
        usable = (n - 1) // block_size
        k = 0
        while k < min(usable, len(keys)) and keys[k] in seen:
            k += 1
        hits += k * block_size
        queries += n
        seen.update(keys)
    return hits, queries


BUILTIN_WORKLOADS = ("agentic", "agentic-synthetic", "multi-turn")
"""``agentic``: the kv-cache-tester traces at :data:`DEFAULT_AGENTIC_ARCHIVE` when present, else the
synthetic sessions (``agentic-synthetic``); ``multi-turn``: chat conversations."""
DEFAULT_SYNTHETIC_SESSIONS = 48


def builtin_workload(name: str, requests: int, seed: int = 0) -> Workload:
    """A built-in workload by name.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name == "multi-turn":
        return multi_turn_workload(requests, seed=seed)
    if name in ("agentic", "agentic-synthetic"):
        return first_requests(agentic_workload(synthetic_agentic_sessions(DEFAULT_SYNTHETIC_SESSIONS, seed=seed),
                                               seed=seed), requests)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(BUILTIN_WORKLOADS)}")


def first_requests(workload: Workload, n: int) -> Workload:
    """The first ``n`` requests by index (arrival order, so every kept ``after`` is kept too)."""
    if n >= len(workload.requests):
        return workload
    return Workload(workload.name, workload.requests[:n], workload.seed, workload.params)


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
        out.append(WorkloadRequest(r.index, r.arrival_s, tuple(segs), max(1, mt), r.session, r.after, r.think_s))
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


def default_num_gpu_blocks(trace: Path | None, workload: str = "multi-turn") -> int:
    """KV blocks per engine that make the workload's sharing visible: more for long-prompt workloads."""
    if (trace is not None and is_agentic_trace(trace)) or (trace is None and workload.startswith("agentic")):
        return DEFAULT_AGENTIC_BLOCKS
    return DEFAULT_TRACE_NUM_GPU_BLOCKS if trace is not None else DEFAULT_NUM_GPU_BLOCKS


def is_agentic_trace(path: Path) -> bool:
    """kv-cache-tester traces: a directory, a ``.tar.gz``/``.tgz``/``.tar`` or a ``.json``; else Mooncake JSONL."""
    return path.is_dir() or path.name.endswith((".tar.gz", ".tgz", ".tar", ".json"))


def load_workload(
    trace: Path | None, workload: str, requests: int, seed: int, max_input_tokens: int | None,
    max_output_tokens: int, agentic: AgenticParams | None = None,
) -> Workload:
    """The workload a replay/compare sends (its first ``requests`` requests).

    ``trace``: a Mooncake JSONL (first ``requests`` rows; prompts capped to ``max_input_tokens``,
    default :data:`DEFAULT_MAX_INPUT_TOKENS`) or kv-cache-tester agentic traces (:func:`read_agentic`,
    :func:`agentic_workload` with ``agentic``). Else a built-in: ``agentic`` reads
    :data:`DEFAULT_AGENTIC_ARCHIVE` when it exists and generates sessions otherwise. ``max_tokens``
    is capped to ``max_output_tokens`` everywhere.

    Raises:
        WorkloadError: an unknown built-in workload, or a trace that cannot be read (the message
            names the file and line).
    """
    if trace is None and workload == "agentic" and DEFAULT_AGENTIC_ARCHIVE.exists():
        trace = DEFAULT_AGENTIC_ARCHIVE
    if trace is not None and is_agentic_trace(trace):
        try:
            sessions = read_agentic(trace)
            wl = agentic_workload(sessions, seed=seed, params=agentic, max_output_tokens=max_output_tokens,
                                  max_input_tokens=max_input_tokens or DEFAULT_AGENTIC_MAX_INPUT_TOKENS, limit=requests)
            return first_requests(Workload(f"agentic:{trace.name}", wl.requests, wl.seed, wl.params), requests)
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{trace}: not UTF-8 text ({exc.reason} at byte {exc.start})", "--trace") from None
        except (OSError, ValueError) as exc:
            raise WorkloadError(str(exc), "--trace") from None
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
    if workload in ("agentic", "agentic-synthetic"):
        wl = agentic_workload(synthetic_agentic_sessions(DEFAULT_SYNTHETIC_SESSIONS, seed=seed), seed=seed,
                              params=agentic, max_output_tokens=max_output_tokens,
                              max_input_tokens=max_input_tokens or DEFAULT_AGENTIC_MAX_INPUT_TOKENS,
                              limit=requests)
        return first_requests(Workload("agentic-synthetic", wl.requests, wl.seed, wl.params), requests)
    try:
        wl = builtin_workload(workload, requests, seed)
    except ValueError as exc:
        raise WorkloadError(str(exc), "--workload") from exc
    return cap_workload(wl, max_input_tokens, max_output_tokens)
