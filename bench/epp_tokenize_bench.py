"""A Pick for a chat whose long history grew by one turn: ``python bench/epp_tokenize_bench.py [--history-tokens 30000]``.

Issue 10's target: a Pick for a chat whose 30k-token history grew by one turn since the last call
takes p50 <= 1 ms, only the new turn is tokenized and hashed, and no engine does the pool's
tokenization. What runs, all real, on 127.0.0.1:

* epp's ``Scheduler`` with the ``precise-prefix`` config (prefix-match step with tokenization, prefix /
  queue / kv-utilization scorers, max-score picker) over ``--endpoints`` endpoints with fresh load;
* the tokenizer: epp's ``InProcessTokenizer`` (the model's own HF ``tokenizers`` file and chat template,
  incremental per message prefix) with the engine's ``/tokenize`` as its fallback; every endpoint's URL
  is one real HTTP server (aiohttp) that answers ``POST /tokenize`` as vLLM does (the same tokenizer
  files, the whole chat each time) and counts the calls;
* the prefix index: epp's ``ReplicaPrefixIndex`` fed by a real kv_indexer servicer's ``Watch``; after
  each pick the picked engine "caches" the prompt (a ``BlockStored`` of its new blocks into kv_indexer's
  index), so the next pick of the session finds its prefix there, as in production.

``--sessions`` chats are grown to ``--history-tokens`` first (their first, full tokenization is the
``first call`` row), then each gets ``--turns`` more turns, round-robin (a user message and an
assistant reply of ~``--turn-tokens`` tokens each time), and each grown chat is picked once. Rows:
p50 / p90 / p99 ms of the Pick and of its tokenization alone, characters encoded per pick, blocks
hashed per pick. Modes, side by side in one run: in-process with incremental rendering (the default),
``--full-render`` the same with the chat template rendered over the whole history every call (the
code before incremental rendering), ``--levers-off`` the default path without the per-pick levers
(the window rendered twice instead of once plus the template's static generation prompt, the encoder
with offsets instead of the offset-free one, the whole prompt walked instead of only the blocks
after the last pick's match; waves 6 and 7 off too), ``--wave7-off`` the default path without wave 7's
levers alone (HF's encoder instead of the exact ASCII byte-level one, the grown text copied whole instead
of shared as a rope, the cached prefix's messages checked in Python, the 99 fallbacks listed per pick,
the sticky scorer's least queue computed over every candidate), ``--wave6-off`` the default path without wave 6's
sharing alone (each call rebuilds the chat's message dicts and size count, copies its whole text and
token ids, and finds its cached block keys by comparing bytes), ``--engine-tokenize`` tokenization through the engine's
``/tokenize`` only (the code before issue 10). ``--profile N`` prints the N heaviest functions
(cProfile, cumulative) of the default mode's incremental picks. Not a timed test: numbers move with
machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import httpx
from aiohttp import web

from engine_simulator.tokenizer import ensure_tokenizer
from kvmesh.hashing import block_keys
from kvmesh.kv_events import BlockStored
from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import ChatMessage, PluginHandle, SchedulingRequest, Tokenizer
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.kv_indexer_client import ReplicaPrefixIndex
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.plugins.scorers.session_affinity import SessionAffinityScorer
from services.epp.scheduler import Scheduler
from services.epp.tokenization.in_process import InProcessTokenizer
from services.epp.tokenization.local import LocalTokenizer
from services.epp.tokenize_client import EngineTokenizer
from services.kv_indexer.events.pool import EventPool
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.servicer import add_servicer as add_kv_indexer

MODEL = "m"
CLOCK = time.perf_counter
"""The timing clock: wall (default) or ``--clock cpu`` (the process's CPU time: on a shared, loaded
machine it leaves out the time the process waited for a core, so A/B ratios stay readable)."""
BLOCK = 64
WORDS = ["the", "cache", "keeps", "every", "block", "of", "the", "prompt", "so", "a", "later", "request", "with", "the", "same", "prefix", "skips", "its", "prefill", "and", "the", "router", "sends", "it", "where", "that", "prefix", "lives", "def", "return", "self", "for", "in", "range", "if", "else", "import", "value", "key", "token", "model", "engine", "request", "response", "agent", "tool", "call", "result", "error", "retry"]


class FrozenClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class _NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


class EngineStub:
    """Every endpoint's URL: ``POST /tokenize`` answered with the model's tokenizer (whole chat, as vLLM does), counted."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.local = LocalTokenizer(tokenizer_dir)
        self.calls = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        if "messages" in body:
            ids = self.local.chat_ids(body)
        else:
            ids = self.local.encode_text(body["prompt"], body.get("add_special_tokens", True))
        return web.json_response({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def sentence(rnd: random.Random, words: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words)) + "."


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return statistics.median(ordered) * 1e3, at(0.9), at(0.99)


class TimedTokenizer:
    """The pick's tokenizer, timed (the tokenize stage of each Pick)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.times: list[float] = []

    async def tokenize(self, request: SchedulingRequest, candidates: Any) -> Sequence[int]:
        start = CLOCK()
        try:
            return await self.inner.tokenize(request, candidates)
        finally:
            self.times.append(CLOCK() - start)


async def run(args: argparse.Namespace, mode: str) -> dict[str, object]:
    engine_tokenize = mode == "engine"
    rnd = random.Random(7)
    tok_dir = ensure_tokenizer(Path(args.workdir) / "tok")
    stub = EngineStub(tok_dir)
    await stub.start()
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
    datastore = Datastore(clock=FrozenClock())  # type: ignore[arg-type]
    index = InMemoryIndex()
    eps = {}
    for i in range(args.endpoints):
        eid = EndpointId(f"10.1.{i // 250}.{i % 250}:8000")
        eps[eid] = Endpoint(id=eid, url=f"http://127.0.0.1:{stub.port}", model=MODEL, block_size_tokens=BLOCK)
        index.register_endpoint(eps[eid])
    datastore.apply_membership(eps, {})
    for ep in datastore.endpoints():
        datastore.record_scrape(ep.id, ScrapeSample(num_requests_waiting=0, num_requests_running=rnd.randint(0, 4),
                                                    kv_cache_usage_perc=rnd.random() / 2, block_size_tokens=BLOCK))
    kv_server = grpc.aio.server()
    add_kv_indexer(kv_server, BlockIndexer(index, EventPool(index, workers=1), _NoFeed()))
    kv_port = kv_server.add_insecure_port("127.0.0.1:0")
    await kv_server.start()
    replica = ReplicaPrefixIndex(f"127.0.0.1:{kv_port}", 5.0, stale_seconds=60.0)
    feeder = asyncio.create_task(replica.run())
    engine = EngineTokenizer(http, 30.0, 0, max_prompt_chars=1 << 30, max_concurrency_per_endpoint=64)
    in_process = InProcessTokenizer({MODEL: str(tok_dir)}, engine, max_prompt_chars=1 << 30)
    tokenizer = TimedTokenizer(engine if engine_tokenize else in_process)
    source, data = resolve_scheduling_config("precise-prefix")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=replica,
                                                                   tokenizer=tokenizer), source=source)
    scheduler = Scheduler(datastore, profile, LiveEndpointFilter("live-endpoints", LiveEndpointFilterParams()))
    held: dict[str, int] = {}  # endpoint -> blocks of each session's prompt it caches (engine side)

    async def pick(session: int, messages: list[dict[str, str]]) -> tuple[float, str, int]:
        request = SchedulingRequest(
            model=MODEL, request_id=f"s{session}-{len(messages)}",
            messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages),
        )
        start = CLOCK()
        result = await scheduler.pick(request)
        elapsed = CLOCK() - start
        return elapsed, str(result.target.id), 0

    def cache_on(endpoint: str, session: int, ids: list[int]) -> None:
        """The picked engine stores the prompt's blocks (engine hashes = kvmesh keys, chained)."""
        keys = block_keys(ids, BLOCK)
        have = held.get(f"{endpoint}/{session}", 0)
        if len(keys) > have:
            parent = keys[have - 1] if have else None
            index.apply(EndpointId(endpoint), BlockStored(
                block_hashes=keys[have:], parent_block_hash=parent, token_ids=ids[have * BLOCK: len(keys) * BLOCK],
                block_size=BLOCK,
            ))
            held[f"{endpoint}/{session}"] = len(keys)

    try:
        while not replica.replica.synced:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        local = in_process.local(MODEL)
        assert local is not None
        if mode == "full-render":
            local.renderer = None  # the whole history through the chat template on every call
        if mode in ("wave7-off", "levers-off"):  # wave 7's levers off (the code before them; same tokens, same picks)
            local._ascii = None  # HF's encoder instead of the exact ASCII byte-level one
            assert local.renderer is not None
            local.renderer.rope = False  # the grown text copied whole per pick
            local.renderer.identity_scan = False  # the cached prefix's messages checked one by one in Python
            scheduler.lazy_fallbacks = False  # the 99 fallbacks listed per pick
            for plugin in profile.plugins():
                if isinstance(plugin, SessionAffinityScorer):
                    plugin.floor_shortcut = False  # the least queue computed over every candidate
        if mode in ("levers-off", "wave6-off"):  # wave 6: chats' messages, text and ids shared, not rebuilt per call
            in_process.remember_chats = False
            local.share_growth = False
        if mode == "levers-off":  # the incremental path as it was before these levers (same run, A/B)
            assert local.renderer is not None
            local.renderer.static_generation = False  # the window rendered twice (with and without the prompt)
            local._added_re = None  # the encoder with offsets
            replica.replica.reuse_walks = False  # the whole prompt walked every pick
        engine_side = stub.local  # the bench's own view of the prompt (what the engine caches): not epp's tokenizer
        chats: list[list[dict[str, str]]] = []
        first: list[float] = []
        history_tokens = []
        for s in range(args.sessions):
            messages = [{"role": "system", "content": f"You are agent {s}. " + sentence(rnd, 60)}]
            while True:
                messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
                messages.append({"role": "assistant", "content": sentence(rnd, args.turn_tokens // 2)})
                if len(messages) % 20 == 1 and len(engine_side.chat_ids({"messages": messages, "add_generation_prompt": True})) >= args.history_tokens:
                    break
            messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
            elapsed, target, _ = await pick(s, messages)
            first.append(elapsed)
            ids = engine_side.chat_ids({"messages": messages, "add_generation_prompt": True})
            history_tokens.append(len(ids))
            cache_on(target, s, ids)
            chats.append(messages)
        await asyncio.sleep(0.05)  # the replica catches up with the stores
        times: list[float] = []
        chars0 = local.stats["encoded_chars"]
        tokenizer.times.clear()
        profiler = cProfile.Profile() if args.profile and mode == "incremental" else None
        hashed0 = replica.replica._keys.hashed_blocks
        calls0 = stub.calls
        same_target = 0
        for _turn in range(args.turns):
            for s, messages in enumerate(chats):
                messages.append({"role": "assistant", "content": sentence(rnd, args.turn_tokens // 2)})
                messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
                if profiler is not None:
                    profiler.enable()
                elapsed, target, _ = await pick(s, messages)
                if profiler is not None:
                    profiler.disable()
                times.append(elapsed)
                if any(k.startswith(target + "/") and k.endswith(f"/{s}") for k in held):
                    same_target += 1
                ids = engine_side.chat_ids({"messages": messages, "add_generation_prompt": True})
                cache_on(target, s, ids)
            await asyncio.sleep(0)  # let the Watch stream deliver
        picks = len(times)
        if profiler is not None:
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(args.profile_sort).print_stats(args.profile)
        renderer = local.renderer
        return {
            "tokenize": percentiles(tokenizer.times),
            "render": dict(renderer.stats) if renderer is not None and not engine_tokenize else {},
            "first": percentiles(first),
            "incremental": percentiles(times),
            "history_tokens": statistics.mean(history_tokens),
            "chars_per_pick": (local.stats["encoded_chars"] - chars0) / picks if not engine_tokenize else float("nan"),
            "blocks_hashed_per_pick": (replica.replica._keys.hashed_blocks - hashed0) / picks,
            "engine_tokenize_calls": stub.calls - calls0,
            "fallbacks": in_process.fallbacks,
            "sticky": same_target / picks,
            "picks": picks,
            "rpc_scores": replica.rpc_scores,
        }
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await replica.close()
        await kv_server.stop(None)
        await http.aclose()
        await stub.stop()


async def tokenizer_ab(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    """The tokenization (+ the replica's block keys) of grown chats alone, in one process: the default, wave 7's
    levers off, wave 6's sharing off, interleaved per pick in random order (same chats, same calls, the same
    tokens asserted). Rows: (variant, tokenize p50 ms, keys p50 ms, p90 of their sum)."""
    from kvmesh.hashing import PrefixKeyCache
    from kvmesh.prefix_index import packed_or_ids

    rnd = random.Random(7)
    tok_dir = ensure_tokenizer(Path(args.workdir) / "tok")
    variants: dict[str, tuple[InProcessTokenizer, PrefixKeyCache, list[float], list[float]]] = {}
    for name, share, wave7 in (("default (waves 6 and 7 on)", True, True), ("wave 7 off", True, False),
                               ("wave 6 sharing off", False, True)):
        tokenizer = InProcessTokenizer({MODEL: str(tok_dir)}, None, max_prompt_chars=1 << 30)
        local = tokenizer.local(MODEL)
        assert local is not None and local.renderer is not None
        tokenizer.remember_chats = local.share_growth = share
        if not wave7:  # HF's encoder, the grown text copied whole, the prefix's messages scanned in Python
            local._ascii = None
            local.renderer.rope = local.renderer.identity_scan = False
        variants[name] = (tokenizer, PrefixKeyCache(), [], [])
    reference = LocalTokenizer(tok_dir)

    def request(messages: list[dict[str, str]]) -> SchedulingRequest:
        return SchedulingRequest(model=MODEL, request_id="ab", messages=tuple(ChatMessage(m["role"], m["content"])
                                                                           for m in messages))

    chats = []
    for s in range(args.sessions):
        messages = [{"role": "system", "content": f"You are agent {s}. " + sentence(rnd, 60)}]
        while len(messages) % 20 != 1 or len(reference.chat_ids({"messages": messages})) < args.history_tokens:
            messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
            messages.append({"role": "assistant", "content": sentence(rnd, args.turn_tokens // 2)})
        messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
        chats.append(messages)
        for tokenizer, keys, _, _ in variants.values():
            keys.block_keys(packed_or_ids(await tokenizer.tokenize(request(messages), [])), BLOCK)
    for _turn in range(args.turns):
        for messages in chats:
            messages.append({"role": "assistant", "content": sentence(rnd, args.turn_tokens // 2)})
            messages.append({"role": "user", "content": sentence(rnd, args.turn_tokens // 2)})
            order = list(variants.values())
            rnd.shuffle(order)
            results = []
            for tokenizer, keys, tok_times, key_times in order:
                req = request(messages)
                t0 = CLOCK()
                ids = await tokenizer.tokenize(req, [])
                t1 = CLOCK()
                keys.block_keys(packed_or_ids(ids), BLOCK)
                key_times.append(CLOCK() - t1)
                tok_times.append(t1 - t0)
                results.append(ids)
            assert all(r == results[0] for r in results)  # the same tokens every way
    rows = []
    for name, (_, _, tok_times, key_times) in variants.items():
        total = sorted(a + b for a, b in zip(tok_times, key_times, strict=True))
        rows.append((name, statistics.median(tok_times) * 1e3, statistics.median(key_times) * 1e3,
                     total[int(0.9 * len(total))] * 1e3))
    return rows


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--history-tokens", type=int, default=30000)
    parser.add_argument("--turn-tokens", type=int, default=200, help="words per user message + assistant reply")
    parser.add_argument("--turns", type=int, default=25, help="turns per session after the history is built")
    parser.add_argument("--engine-tokenize", action="store_true", help="also run with the engine's /tokenize only")
    parser.add_argument("--full-render", action="store_true",
                        help="also run in-process with the chat template rendered in full every call")
    parser.add_argument("--levers-off", action="store_true",
                        help="also run the incremental path without issue 10's per-pick levers (window rendered "
                             "twice, encoder with offsets, whole-prompt walk): the A/B in one run")
    parser.add_argument("--wave6-off", action="store_true",
                        help="also run the incremental path without wave 6's sharing (each call rebuilds the chat's "
                             "message dicts and size, copies its whole text and ids, finds its keys by comparing "
                             "bytes): the A/B in one run")
    parser.add_argument("--wave7-off", action="store_true",
                        help="also run the default path without wave 7's levers (HF's encoder instead of the exact "
                             "ASCII byte-level one, the grown text copied whole instead of a rope): the A/B in one run")
    parser.add_argument("--tokenizer-ab", action="store_true",
                        help="only the tokenization and block keys of grown chats, in one process: the default, wave 7's "
                             "levers off and wave 6's sharing off, interleaved per pick (use --clock thread on a loaded "
                             "machine)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the modes this many times, interleaved (A/B on a noisy machine)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N heaviest functions of the default mode's incremental picks (cProfile)")
    parser.add_argument("--profile-sort", default="cumulative", choices=("cumulative", "tottime"),
                        help="--profile's order: cumulative (default) or own time")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--clock", choices=("wall", "cpu", "thread"), default="wall",
                        help="time with the wall clock (default), the process's CPU time or this thread's (loaded machines)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    global CLOCK
    CLOCK = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}[args.clock]
    if args.tokenizer_ab:
        with tempfile.TemporaryDirectory() as tmp:
            args.workdir = args.workdir or tmp
            rows = [row for _ in range(args.repeat) for row in asyncio.run(tokenizer_ab(args))]
        print(f"tokenization of chats grown by one turn, in process: {args.sessions} sessions, ~{args.history_tokens}-token "
              f"histories, {args.turns} turns each, interleaved; {args.clock} clock")
        print(f"{'variant':<30} {'tokenize p50 ms':>16} {'block keys p50 ms':>18} {'sum p90 ms':>11}")
        for name, tok, keys, p90 in rows:
            print(f"{name:<30} {tok:>16.3f} {keys:>18.3f} {p90:>11.3f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or tmp
        modes = [("in-process (default)", "incremental")]
        modes += [("in-process, wave 7 off", "wave7-off")] if args.wave7_off else []
        modes += [("in-process, wave 6 off", "wave6-off")] if args.wave6_off else []
        modes += [("in-process, levers off", "levers-off")] if args.levers_off else []
        modes += [("in-process, full render", "full-render")] if args.full_render else []
        modes += [("engine /tokenize only", "engine")] if args.engine_tokenize else []
        results = [(label if args.repeat == 1 else f"{label} #{r + 1}", asyncio.run(run(args, flag)))
                   for r in range(args.repeat) for label, flag in modes]
    print(f"epp Pick, chats grown by one turn: {args.endpoints} endpoints, {args.sessions} sessions, "
          f"~{results[0][1]['history_tokens']:.0f}-token histories, ~{args.turn_tokens}-word turns, "
          f"{results[0][1]['picks']} incremental picks per mode; precise-prefix, Watch-fed replica; {args.clock} clock")
    print(f"{'tokenizer':<24} {'row':<12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'chars enc/pick':>15} "
          f"{'blocks hashed/pick':>19} {'engine /tokenize':>17} {'Score RPCs':>10}")
    for label, r in results:
        for row in ("first", "incremental", "tokenize"):
            p50, p90, p99 = r[row]  # type: ignore[misc]
            extra = (f"{r['chars_per_pick']:>15.0f} {r['blocks_hashed_per_pick']:>19.1f} {r['engine_tokenize_calls']:>17} "
                     f"{r['rpc_scores']:>10}") if row == "incremental" else ""
            print(f"{label:<24} {row:<12} {p50:>8.3f} {p90:>8.3f} {p99:>8.3f} {extra}")
        if r["render"]:
            print(f"{'':<24} renders: {r['render']}")
    r = results[0][1]
    p50 = r["incremental"][0]  # type: ignore[index]
    print(f"target incremental Pick p50 <= 1 ms: {'met' if p50 <= 1.0 else 'MISSED'} ({p50:.3f} ms); "
          f"no engine /tokenize: {'met' if r['engine_tokenize_calls'] == 0 and r['fallbacks'] == 0 else 'MISSED'} "
          f"({r['engine_tokenize_calls']} calls)")


if __name__ == "__main__":
    main()
