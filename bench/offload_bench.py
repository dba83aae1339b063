"""Offload benchmark (issue 8 item 4): a long-prompt multi-turn workload on an engine whose GPU pool cannot
keep every conversation, with KV offload off / cpu / cpu+kv_store side by side.

The engine is the simulator's own core (``EngineCore`` + ``PrefixCache`` + ``OffloadManager``, the code
``python -m engine_simulator`` runs) driven on model time by a discrete-event loop (one step = the latency
model's step time; an offload load = its modeled transfer time), so the figures are model seconds of the
``llama-3.1-8b-h100`` profile and do not depend on this machine's load. In ``cpu+kv_store`` the blocks go
to a real kv_store process over gRPC (``KVStoreUploader``: ``Put`` with the block's ``BlockStored``); a
block becomes loadable from kv_store once its put is acknowledged (puts are drained between steps).

Workload: ``--conversations`` conversations, each ``--turns`` turns; turn 1 is a unique ``--first-tokens``
prompt, each later turn appends the previous answer and ``--turn-tokens`` new tokens (so a turn's prefix
is the whole previous turn). Conversations run closed-loop (next turn an exponential think time of mean
``--think-seconds`` after the answer), first turns spread over ``--stagger-seconds``; seeded. Without offload the GPU pool evicts a conversation's prefix before its next turn
(the *prefix eviction storm*) and every turn recomputes its history; with offload it is loaded back.

    .venv/bin/python bench/offload_bench.py --png docs/offload_bench.png
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine_simulator.latency_model import get_profile
from engine_simulator.offload import OffloadConfig, OffloadManager, OffloadMode
from engine_simulator.offload_client import KVStoreUploader
from engine_simulator.prefix_cache import PrefixCache
from engine_simulator.scheduler import EngineCore, Request, SchedulerConfig
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, start_etcd, wait_grpc_healthy


@dataclass
class Result:
    mode: str
    ttft: list[float] = field(default_factory=list)
    requests: int = 0
    output_tokens: int = 0
    makespan: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    external_tokens: int = 0
    gpu_evictions: int = 0
    loads_cpu: int = 0
    loads_remote: int = 0
    puts: int = 0
    wall: float = 0.0

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft)

    @property
    def ttft_p90(self) -> float:
        return statistics.quantiles(self.ttft, n=10)[-1]


async def simulate(mode: OffloadMode, args: argparse.Namespace, kv_store: str | None) -> Result:
    bs = args.block_size
    offload = None
    if mode != OffloadMode.OFF:
        offload = OffloadManager(
            OffloadConfig(mode=mode, cpu_capacity_blocks=args.cpu_blocks, bytes_per_block=bs * 131_072), bs, "bench"
        )
    cache = PrefixCache(args.gpu_blocks, bs, offload=offload)
    core = EngineCore(SchedulerConfig(args.max_num_seqs, 2048, 131072), cache)
    latency = get_profile("llama-3.1-8b-h100")
    uploader = None
    if offload is not None and mode == OffloadMode.CPU_KV_STORE:
        assert kv_store is not None
        uploader = KVStoreUploader(offload, kv_store, value_bytes=args.put_bytes, concurrency=32)
        uploader.start()
    res = Result(str(mode))
    history: dict[int, list[int]] = {}
    rng = random.Random(args.seed)
    arrivals: list[tuple[float, int, int]] = [(rng.uniform(0, args.stagger_seconds), c, 0)
                                              for c in range(args.conversations)]
    heapq.heapify(arrivals)
    base = 3
    evictions = 0
    t_wall = time.perf_counter()
    now = 0.0
    try:
        while arrivals or core.has_work():
            while arrivals and arrivals[0][0] <= now:
                _, c, turn = heapq.heappop(arrivals)
                if turn == 0:
                    history[c] = [base + (c * 7919 + i * 31) % 2000 for i in range(args.first_tokens)]
                else:
                    history[c] += [base + (c * 104729 + turn * 613 + i * 17) % 2000 for i in range(args.turn_tokens)]
                req = Request(f"c{c}-t{turn}", list(history[c]), max_tokens=args.output_tokens, ignore_eos=True,
                              arrival_time=now)
                core.add_request(req)
            if not core.has_work():
                now = arrivals[0][0]
                continue
            step = core.schedule(now)
            if step.empty:
                if uploader is not None and offload is not None and offload.num_pending_lookups:
                    await uploader.flush(30.0)  # requests wait for kv_store to confirm their blocks
                    continue
                ready = core.next_load_ready()
                nxt = [t for t in (ready, arrivals[0][0] if arrivals else None) if t is not None]
                assert nxt, "stuck: nothing runs and nothing will arrive"
                now = max(now, min(nxt))
                continue
            now += latency.step_seconds(step.prefill_tokens, step.decode_seqs, step.decode_context_tokens)
            for out in core.update(step):
                req = out.request
                if req.first_token_time is None:
                    req.first_token_time = now
                    res.ttft.append(now - req.arrival_time)
                if out.finished:
                    c, turn = int(req.request_id[1:].split("-")[0]), int(req.request_id.split("-t")[1])
                    history[c] = req.prompt_token_ids + req.output_token_ids
                    res.requests += 1
                    res.output_tokens += len(req.output_token_ids)
                    res.prompt_tokens += req.num_prompt_tokens
                    res.cached_tokens += req.num_cached_tokens
                    if turn + 1 < args.turns:
                        heapq.heappush(arrivals, (now + rng.expovariate(1 / args.think_seconds), c, turn + 1))
            evictions += sum(1 for e in cache.take_events() if type(e).__name__ == "BlockRemoved"
                             and getattr(e, "medium", "GPU") == "GPU")
            if uploader is not None:
                await uploader.flush(30.0)
    finally:
        if uploader is not None:
            await uploader.stop()
    res.makespan = now
    res.gpu_evictions = evictions
    res.external_tokens = core.external_hits_tokens
    if offload is not None:
        res.loads_cpu = offload.stats.loaded_cpu_blocks
        res.loads_remote = offload.stats.loaded_remote_blocks
        res.puts = offload.stats.puts_done
    res.wall = time.perf_counter() - t_wall
    return res


def table(results: list[Result]) -> str:
    head = ("offload", "TTFT p50 s", "TTFT p90 s", "req/s", "out tok/s", "cached %", "loaded %", "GPU evictions",
            "CPU loads", "kv_store loads", "puts", "wall s")
    rows = [head]
    for r in results:
        rows.append((r.mode, f"{r.ttft_p50:.3f}", f"{r.ttft_p90:.3f}", f"{r.requests / r.makespan:.2f}",
                     f"{r.output_tokens / r.makespan:.0f}", f"{100 * r.cached_tokens / r.prompt_tokens:.1f}",
                     f"{100 * r.external_tokens / r.prompt_tokens:.1f}", str(r.gpu_evictions), str(r.loads_cpu),
                     str(r.loads_remote), str(r.puts), f"{r.wall:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [" | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r.mode for r in results]
    axes[0].bar(names, [r.ttft_p50 for r in results], color=["#c44", "#48c", "#4a4"][: len(results)])
    axes[0].set_ylabel("TTFT p50 (model s)")
    axes[1].bar(names, [r.requests / r.makespan for r in results], color=["#c44", "#48c", "#4a4"][: len(results)])
    axes[1].set_ylabel("requests / model s")
    fig.suptitle("long-prompt multi-turn, GPU pool smaller than the working set")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=8192)
    parser.add_argument("--turn-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--think-seconds", type=float, default=3.0, help="mean (exponential) think time, model s")
    parser.add_argument("--stagger-seconds", type=float, default=10.0, help="first turns arrive uniformly in [0, S]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--gpu-blocks", type=int, default=1200, help="GPU pool (blocks): ~76k tokens")
    parser.add_argument("--cpu-blocks", type=int, default=2400, help="CPU tier (blocks): ~154k tokens, 2x the GPU pool")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--put-bytes", type=int, default=1024, help="stand-in bytes sent per block to kv_store")
    parser.add_argument("--modes", default="off,cpu,cpu+kv_store")
    parser.add_argument("--png", type=Path, default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    modes = [OffloadMode(m.strip()) for m in args.modes.split(",") if m.strip()]
    working_set = args.conversations * (args.first_tokens + args.turns * (args.turn_tokens + args.output_tokens))
    print(f"{args.conversations} conversations x {args.turns} turns, first prompt {args.first_tokens} tokens; "
          f"working set ~{working_set // 1000}k tokens vs GPU pool {(args.gpu_blocks - 1) * args.block_size // 1000}k"
          f" and CPU tier {args.cpu_blocks * args.block_size // 1000}k tokens", flush=True)
    etcd = server = None
    address = None
    if OffloadMode.CPU_KV_STORE in modes:
        run_dir = Path(tempfile.mkdtemp(prefix="offload_bench-"))
        etcd, etcd_address = start_etcd(run_dir)
        port = free_port()
        server = ManagedProcess("kv_store", python_module(
            "services.kv_store", "--grpc-port", str(port), "--metrics-port", str(free_port()),
            "--etcd-endpoints", etcd_address, "--cpu-capacity-bytes", str(1 << 30),
            "--events-block-size-tokens", str(args.block_size)), run_dir / "kv_store.log").start()
        address = f"127.0.0.1:{port}"
        wait_grpc_healthy(address, 30.0)
    results = []
    try:
        for mode in modes:
            print(f"running offload={mode} ...", flush=True)
            results.append(asyncio.run(simulate(mode, args, address)))
    finally:
        if server is not None:
            server.stop()
        if etcd is not None:
            etcd.stop()
    print(table(results))
    if args.png is not None:
        print(f"wrote {args.png}" if plot(results, args.png) else "matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
