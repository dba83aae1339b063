"""epp's decision at 100 endpoints: ``python bench/epp_decision.py [--endpoints 100] [--tokens 32768] [--plot PNG]``.

What one Pick costs epp, measured four ways on the same state (``--endpoints`` registered endpoints
with fresh scraped load, ``--prompts`` 32k-token documents of which every endpoint caches a prefix of
one, block size 64; the named config ``--config``, default ``precise-prefix``: prefix-match step,
prefix / queue / kv-utilization scorers, max-score picker):

* ``decision``: the synchronous part of a pick, given the request's prefix match (what kv_indexer or
  a local replica answered for the request's keys): live-endpoint filter, the profile's filters,
  weighted scorers and picker, and ``note_pick`` (``Scheduler`` from its fresh load snapshot on).
* ``pick (match given)``: the whole ``Scheduler.pick`` in process (validation, candidates, live filter,
  prepare step, decision, metrics), the prefix index answering the precomputed match at once.
* ``pick (local index)``: the same, the prefix index a kv_indexer ``InMemoryIndex`` in the same
  process (keys computed from the token ids, prefix walk): an event-fed local replica's cost.
* ``pick (kv_indexer Score over gRPC)`` / ``pick (Watch-fed replica)``: the same, the prefix index
  epp's real clients of a real kv_indexer servicer on 127.0.0.1 (same index): ``rpc`` mode
  (``GrpcPrefixIndex``: one ``Score`` call per pick) and ``replica`` mode (``ReplicaPrefixIndex``:
  a ``PrefixReplica`` fed by ``KVIndexer/Watch``, scored in process); then both again behind epp's
  gRPC ``Pick`` (the whole precise pick as the router sees it, minus the router).
* ``gRPC Pick (match given)``: a real ``grpc.aio`` server (epp's servicer) on 127.0.0.1 and a
  client in the same process; client-side latency, building the request included. Two requests,
  interleaved pick by pick on the same server: the router's (``services.router.clients.pick_request``:
  token ids packed in ``prompt_token_ids_packed``, ``max_endpoints`` = the router's
  ``max_fallback_attempts`` (3), ``omit_breakdown``) and the full one as before (repeated
  ``prompt_token_ids``, every fallback and breakdown: grpcurl's); then both again without a
  prompt (the transport floor). The ``gRPC Pick, kv_indexer Score (rpc)`` / ``replica`` rows send
  the router's request.

Prints p50 / p90 / p99 in milliseconds per row against the targets (decision p50 <= 0.2 ms,
p99 <= 1 ms, in process and over gRPC). Not a timed test: numbers move with machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from kvmesh._proto.kvmesh.epp.v1 import epp_pb2, epp_pb2_grpc
from kvmesh.kv_events import BlockStored
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.kv_indexer_client import GrpcPrefixIndex, ReplicaPrefixIndex
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH, TOKEN_IDS
from services.epp.scheduler import Scheduler
from services.epp.servicer import EndpointPickerServicer
from services.kv_indexer.events.pool import EventPool
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer
from services.kv_indexer.servicer import add_servicer as add_kv_indexer
from services.router.clients import PickerClient, PickQuery, pick_request
from services.router.config import RouterConfig

MODEL = "m"
CLOCK = time.perf_counter
"""The timing clock: wall (default) or ``--clock cpu`` (the process's CPU time: on a shared, loaded
machine it leaves out the time the process waited for a core, so A/B ratios stay readable)."""
BLOCK = 64


class FrozenClock:
    """The datastore's clock, held still so scraped metrics stay fresh for the whole run."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class GivenMatch:
    """A prefix index answering the match the bench set for the next request (no suspension)."""

    def __init__(self) -> None:
        self.next: PrefixMatch | None = None

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        assert self.next is not None
        return self.next


class LocalIndex:
    """kv_indexer's in-memory index in epp's process (what an event-fed local replica would cost)."""

    def __init__(self, index: InMemoryIndex) -> None:
        self.index = index

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        result = self.index.score(model, token_ids, [EndpointId(e) for e in endpoint_ids])
        return PrefixMatch(result.total_blocks, {s.endpoint_id: s.matched_blocks for s in result.scores})


def build_state(endpoints: int, prompts: int, tokens: int, seed: int) -> tuple[Datastore, InMemoryIndex, list[list[int]]]:
    rnd = random.Random(seed)
    docs = [[rnd.randrange(150000) for _ in range(tokens)] for _ in range(prompts)]
    datastore = Datastore(clock=FrozenClock())  # type: ignore[arg-type]
    index = InMemoryIndex()
    eps = {
        EndpointId(f"10.0.{i // 250}.{i % 250}:8000"): Endpoint(
            id=EndpointId(f"10.0.{i // 250}.{i % 250}:8000"), url=f"http://10.0.{i // 250}.{i % 250}:8000",
            model=MODEL, block_size_tokens=BLOCK,
        )
        for i in range(endpoints)
    }
    datastore.apply_membership(eps, {})
    blocks = tokens // BLOCK
    for n, (eid, ep) in enumerate(eps.items()):
        index.register_endpoint(ep)
        doc = docs[n % prompts]
        held = rnd.randint(1, blocks)
        index.apply(eid, BlockStored(block_hashes=list(range(n << 32, (n << 32) + held)), parent_block_hash=None,
                                     token_ids=doc[: held * BLOCK], block_size=BLOCK))
    scrape(datastore, rnd)
    return datastore, index, docs


def scrape(datastore: Datastore, rnd: random.Random) -> None:
    for ep in datastore.endpoints():
        datastore.record_scrape(ep.id, ScrapeSample(
            num_requests_waiting=rnd.randint(0, 8), num_requests_running=rnd.randint(0, 32),
            kv_cache_usage_perc=rnd.random(), block_size_tokens=BLOCK,
        ))


def make_scheduler(datastore: Datastore, prefix_index: object, config: str) -> Scheduler:
    source, data = resolve_scheduling_config(config)
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=prefix_index),  # type: ignore[arg-type]
                            source=source)
    live = LiveEndpointFilter("live-endpoints", LiveEndpointFilterParams())
    return Scheduler(datastore, profile, live)


ROUTER_MAX_ENDPOINTS = RouterConfig.model_fields["max_fallback_attempts"].default
"""Endpoints the router tries per pick (its ``max_fallback_attempts`` default, 3): its ``max_endpoints``."""


def router_request(request: SchedulingRequest, prompt: bool = True) -> epp_pb2.PickRequest:
    """What the router's ``PickerClient`` sends to an epp that reads packed ids (built by its own function)."""
    query = PickQuery(request.request_id, request.model, prompt_token_ids=tuple(request.token_ids))
    return pick_request(query, with_prompt=prompt, packed=True, max_endpoints=ROUTER_MAX_ENDPOINTS)


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return statistics.median(ordered) * 1e3, at(0.9), at(0.99)


async def run(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    datastore, index, docs = build_state(args.endpoints, args.prompts, args.tokens, 0)
    rnd = random.Random(1)
    requests = []
    for r in range(args.picks):
        doc = docs[r % len(docs)]
        tokens = tuple(doc[: args.tokens - rnd.randrange(BLOCK)])  # 32k-ish, a partial last block
        result = index.score(MODEL, tokens)
        match = PrefixMatch(result.total_blocks, {s.endpoint_id: s.matched_blocks for s in result.scores})
        requests.append((SchedulingRequest(model=MODEL, request_id=f"r{r}", token_ids=tokens), match))
    given = GivenMatch()
    rows: list[tuple[str, float, float, float]] = []

    # decision only: the scheduler's synchronous part, from the fresh snapshot on
    scheduler = make_scheduler(datastore, given, args.config)
    times = []
    for r, (request, match) in enumerate(requests):
        if r % 50 == 0:
            scrape(datastore, rnd)  # load moves between scrapes (outside the timing)
        state = CycleState()
        state.set(TOKEN_IDS, list(request.token_ids))
        state.set(PREFIX_MATCH, match)
        start = CLOCK()
        candidates = scheduler._live_candidates(state, request, datastore.candidates(MODEL))
        ranked = scheduler.profile.run(state, request, candidates).ranked
        datastore.note_pick(ranked[0].id, 0)
        times.append(CLOCK() - start)
    rows.append(("decision (match given)", *percentiles(times)))

    for label, prefix_index in (("pick (match given)", given), ("pick (local index)", LocalIndex(index))):
        scheduler = make_scheduler(datastore, prefix_index, args.config)
        times = []
        for r, (request, match) in enumerate(requests):
            if r % 50 == 0:
                scrape(datastore, rnd)
            given.next = match
            start = CLOCK()
            await scheduler.pick(request)
            times.append(CLOCK() - start)
        rows.append((label, *percentiles(times)))

    if args.quick:
        rows.extend(await indexer_modes(args, datastore, index, requests, rnd))
        return rows
    # over gRPC: epp's servicer on a real server, a client in this process
    scheduler = make_scheduler(datastore, given, args.config)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    epp_pb2_grpc.add_EndpointPickerServicer_to_server(EndpointPickerServicer(scheduler), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = epp_pb2_grpc.EndpointPickerStub(channel)
            def full(req: SchedulingRequest, prompt: bool = True) -> epp_pb2.PickRequest:
                return epp_pb2.PickRequest(request_id=req.request_id, model=MODEL,
                                           prompt_token_ids=req.token_ids if prompt else ())

            def lean(req: SchedulingRequest, prompt: bool = True) -> epp_pb2.PickRequest:
                return router_request(req, prompt)

            for warm in range(20):
                given.next = requests[warm][1]
                await stub.Pick(full(requests[warm][0]), timeout=10)
                await stub.Pick(lean(requests[warm][0]), timeout=10)
            none = PrefixMatch(0, {})
            for prompt, suffix in ((True, "(match given)"), (False, "(no prompt: transport floor)")):
                ab: dict[str, list[float]] = {"lean": [], "full": []}
                for r, (req, match) in enumerate(requests):
                    if r % 50 == 0:
                        scrape(datastore, rnd)
                    for kind in ("lean", "full") if r % 2 else ("full", "lean"):  # interleaved, order alternating
                        given.next = match if prompt else none
                        build = lean if kind == "lean" else full
                        start = CLOCK()
                        await stub.Pick(build(req, prompt), timeout=10)
                        ab[kind].append(CLOCK() - start)
                rows.append((f"gRPC Pick {suffix}, router's request", *percentiles(ab["lean"])))
                rows.append((f"gRPC Pick {suffix}, full request", *percentiles(ab["full"])))
        rows.extend(await pick_many_rows(port, given, requests, datastore, rnd))
    finally:
        await server.stop(None)

    rows.extend(await indexer_modes(args, datastore, index, requests, rnd))
    return rows


async def pick_many_rows(port: int, given: GivenMatch, requests: list[tuple[SchedulingRequest, PrefixMatch]],
                         datastore: Datastore, rnd: random.Random) -> list[tuple[str, float, float, float]]:
    """The router's own path to the same servicer: its ``PickerClient`` on one ``PickMany`` stream
    (packed ids, lean response, the entry's deadline and trace context), one pick at a time; the
    query's token tuple is built before the clock starts (the router holds it from validation)."""
    client = PickerClient(f"127.0.0.1:{port}", timeout_seconds=10, multiplexed=True,
                          max_endpoints=ROUTER_MAX_ENDPOINTS)
    await client.connect()
    rows: list[tuple[str, float, float, float]] = []
    try:
        queries = [PickQuery(req.request_id, req.model, prompt_token_ids=tuple(req.token_ids)) for req, _ in requests]
        for warm in range(20):
            given.next = requests[warm][1]
            await client.pick(queries[warm])
        none = PrefixMatch(0, {})
        for prompt, suffix in ((True, "(match given)"), (False, "(no prompt: transport floor)")):
            times: list[float] = []
            for r, (req, match) in enumerate(requests):
                if r % 50 == 0:
                    scrape(datastore, rnd)
                given.next = match if prompt else none
                query = queries[r] if prompt else PickQuery(req.request_id, req.model)
                start = CLOCK()
                await client.pick(query)
                times.append(CLOCK() - start)
            rows.append((f"PickMany entry {suffix}, the router's PickerClient", *percentiles(times)))
    finally:
        await client.close()
    return rows


class _NoFeed:
    def follow(self, endpoint: Endpoint) -> None: ...
    def unfollow(self, endpoint_id: EndpointId) -> None: ...


async def indexer_modes(
    args: argparse.Namespace, datastore: Datastore, index: InMemoryIndex,
    requests: list[tuple[SchedulingRequest, PrefixMatch]], rnd: random.Random,
) -> list[tuple[str, float, float, float]]:
    """The precise pick with a real kv_indexer servicer: Score per pick (rpc) vs the Watch-fed replica."""
    rows: list[tuple[str, float, float, float]] = []
    kv_server = grpc.aio.server()
    add_kv_indexer(kv_server, BlockIndexer(index, EventPool(index, workers=1), _NoFeed()))
    kv_port = kv_server.add_insecure_port("127.0.0.1:0")
    await kv_server.start()
    rpc = GrpcPrefixIndex(f"127.0.0.1:{kv_port}", 5.0)
    replica = ReplicaPrefixIndex(f"127.0.0.1:{kv_port}", 5.0, stale_seconds=60.0)
    feeder = asyncio.create_task(replica.run())
    try:
        while not replica.replica.synced:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        for (request, match), _ in zip(requests[:50], range(50), strict=False):  # the replica's answers are kv_indexer's
            ours = await replica.score(MODEL, request.token_ids, [])
            assert ours.matched_blocks == match.matched_blocks and ours.total_blocks == match.total_blocks
        modes = (("pick (kv_indexer Score over gRPC)", rpc), ("pick (Watch-fed replica)", replica))
        for label, prefix_index in modes[1:] if args.quick else modes:
            scheduler = make_scheduler(datastore, prefix_index, args.config)
            for request, _ in requests[:20]:
                await scheduler.pick(request)
            times = []
            for r, (request, _) in enumerate(requests):
                if r % 50 == 0:
                    scrape(datastore, rnd)
                start = CLOCK()
                await scheduler.pick(request)
                times.append(CLOCK() - start)
            rows.append((label, *percentiles(times)))
        for label, prefix_index in () if args.quick else (("gRPC Pick (router's), kv_indexer Score", rpc),
                                                          ("gRPC Pick (router's), replica", replica)):
            scheduler = make_scheduler(datastore, prefix_index, args.config)
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
            epp_pb2_grpc.add_EndpointPickerServicer_to_server(EndpointPickerServicer(scheduler), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = epp_pb2_grpc.EndpointPickerStub(channel)
                    for request, _ in requests[:20]:
                        await stub.Pick(router_request(request), timeout=10)
                    times = []
                    for r, (request, _) in enumerate(requests):
                        if r % 50 == 0:
                            scrape(datastore, rnd)
                        start = CLOCK()
                        await stub.Pick(router_request(request), timeout=10)
                        times.append(CLOCK() - start)
                    rows.append((label, *percentiles(times)))
            finally:
                await server.stop(None)
        assert replica.rpc_scores == 0, "the replica fell back to Score during the run"
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await rpc.close()
        await replica.close()
        await kv_server.stop(None)
    return rows


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--prompts", type=int, default=20, help="distinct documents endpoints cache prefixes of")
    parser.add_argument("--picks", type=int, default=2000)
    parser.add_argument("--config", default="precise-prefix", help="named scheduling config or YAML path")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the rows (matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="in-process rows only (decision, pick match given / local index / replica): A/B runs")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time with the wall clock (default) or the process's CPU time (loaded machines)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    rows = asyncio.run(run(args))
    print(f"epp decision: {args.endpoints} endpoints, {args.tokens}-token prompts (block {BLOCK}), "
          f"config {args.config}, {args.picks} picks per row, {args.clock} clock")
    print(f"{'row':<58} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}  target p50<=0.2 / p99<=1")
    for label, p50, p90, p99 in rows:
        verdict = "met" if p50 <= 0.2 and p99 <= 1.0 else "MISSED"
        print(f"{label:<58} {p50:>8.3f} {p90:>8.3f} {p99:>8.3f}  {verdict}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed (pip install -e .[bench]): no plot")
            return
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [r[0] for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[1] for r in rows], width=0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r[3] for r in rows], width=0.4, label="p99")
        ax.axhline(0.2, linestyle="--", color="grey")
        ax.axhline(1.0, linestyle=":", color="grey")
        ax.set_xticks(list(x), labels, rotation=20, ha="right")
        ax.set_ylabel("ms")
        ax.set_title(f"epp Pick at {args.endpoints} endpoints, {args.tokens}-token prompts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
