"""kv_indexer benchmarks: ``python bench/kv_indexer_bench.py [score|ingest|replay|etcd-pause] [--plot PNG]``.

* ``score`` (default): fills an index with ``--endpoints`` endpoints holding overlapping prefixes
  of a long prompt, then times ``score`` (block keys + prefix walk, what one Score RPC costs inside
  the service) for prompts of several lengths and block sizes; p50/p99 in milliseconds. ``cold``
  rows hash every block (a new prompt each time, the prompt-key cache off); ``grown`` rows score
  32 chat sessions in turn, each call's prompt the session's previous one plus ``--turn-tokens``
  (only the new blocks are hashed; the prompt-key cache on, as in the service). ``keys µs/block`` is the cold key cost from a Python list.
* ``ingest``: ``--messages`` vLLM-format batches (msgpack ``EventBatch``es as vLLM 0.32 publishes
  them: per engine step 4 requests' ``BlockStored`` chains of 1-32 blocks of 16 tokens, half of
  them under a cached parent, and a ``BlockRemoved`` of what an LRU of ``--capacity`` blocks
  evicts) go through the real :class:`EventPool` (queue, sequencing, decode, parity, field filter,
  index apply) into an :class:`InMemoryIndex`; prints decode-only and end-to-end block events/s
  (a block stored or removed is one block event) and the index's memory per held block
  (tracemalloc).
* ``replay``: a publisher (the simulator's, vLLM 0.32's replay protocol over a real ZMQ ROUTER)
  buffers ``--events`` messages of one event each (stores and removals over a bounded working set);
  an :class:`EventPool` that missed them all recovers them through :class:`ZmqReplayer`. Prints the
  fetch time, the apply time and the rate.
* ``etcd-pause``: real processes (etcd, kv_indexer, ``--engines`` simulators under load, leases of
  ``--lease-ttl`` s); etcd is SIGSTOPped for ``--pause`` s, so every lease expires on resume; prints
  the time from SIGCONT until the index equals every engine's own cache again (and the streams are live).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from itertools import islice, repeat, takewhile
from operator import methodcaller
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_simulator.publisher import ZmqEventPublisher
from kvmesh.hashing import block_keys
from kvmesh.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch, make_topic
from kvmesh.types import Endpoint, EndpointId
from kvmesh_cli.launcher import free_port
from services.kv_indexer.events.pool import EndpointState, EventPool
from services.kv_indexer.events.replay import ZmqReplayer
from services.kv_indexer.index import ApplyOutcome, InMemoryIndex
from services.kv_indexer.index.residency import ResidencyLog
from services.kv_indexer.scoring import prefix_matches


def set_walk(keys: list[int], table: dict[int, dict[EndpointId, int]]) -> dict[EndpointId, int]:
    """The shared prefix walk before wave 6 (a subset test per block, ``takewhile`` once one endpoint
    is left), kept here as the ``ref walk`` column's A/B for :func:`kvmesh.prefix_index.longest_prefix_matches`."""
    first = table.get(keys[0]) if keys else None
    if not first:
        return {}
    active, result, i, n, get = set(first), {}, 1, len(keys), table.get
    while i < n and len(active) > 1:
        holders = get(keys[i])
        if not holders:
            break
        if not holders.keys() >= active:
            survivors = active.intersection(holders.keys())
            result.update(dict.fromkeys(active - survivors, i))
            active = survivors
        i += 1
    if len(active) == 1 and i < n:
        (only,) = active
        i += len(list(takewhile(methodcaller("__contains__", only), map(get, islice(keys, i, None), repeat({})))))
    result.update(dict.fromkeys(active, i))
    return result


def bench(
    tokens: int, block_size: int, endpoints: int, repeats: int, mode: str = "cold", turn_tokens: int = 256
) -> tuple[float, float, float, int, float, float]:
    """p50 and p99 of one ``score`` (ms), cold key cost (µs per block), the index's blocks, and
    the p50 of the prefix walk alone (ms): the shared walk (``scoring.prefix_matches``, i.e.
    ``kvmesh.prefix_index.longest_prefix_matches``) and the walk before wave 6 (:func:`set_walk`),
    timed on the same keys and asserted equal.

    ``mode``: ``cold`` (every block hashed: a fresh prompt per repeat, the key cache off) or
    ``grown`` (each repeat's prompt extends the last by ``turn_tokens``)."""
    rnd = random.Random(0)
    prompt = [rnd.randrange(150000) for _ in range(tokens)]
    index = InMemoryIndex(prompt_key_cache_bytes=0 if mode == "cold" else 64 << 20)
    blocks = tokens // block_size
    for e in range(endpoints):
        ep = Endpoint(id=EndpointId(f"127.0.0.1:{9000 + e}"), url="", model="m", block_size_tokens=block_size)
        index.register_endpoint(ep)
        held = blocks * (e + 1) // endpoints  # endpoint e holds a growing prefix
        if held:
            index.apply(ep.id, BlockStored(block_hashes=list(range(e << 32, (e << 32) + held)), parent_block_hash=None,
                                           token_ids=prompt[: held * block_size], block_size=block_size))
        # plus unrelated blocks so the table is not tiny
        other = [rnd.randrange(50000) for _ in range(block_size * 256)]
        index.apply(ep.id, BlockStored(block_hashes=list(range((e << 32) + 10**6, (e << 32) + 10**6 + 256)),
                                       parent_block_hash=None, token_ids=other, block_size=block_size))
    score_times, key_times, walk_times, ref_walk_times = [], [], [], []
    table = index._tables[("m", block_size)]
    sessions: list[array[int]] = []
    if mode == "grown":  # chat sessions whose history grows by one turn per call, round robin
        count = min(32, repeats)
        start_len = max(tokens - turn_tokens * -(-repeats // count), tokens // 2)  # ends near `tokens`
        for s in range(count):
            history = array("I", [rnd.randrange(150000) for _ in range(start_len)])
            history[0] = 150000 + s  # a distinct first block per session
            sessions.append(history)
            index.score("m", history.tolist())  # the session's earlier call
    for r in range(repeats):
        if mode == "cold":  # the same length, a new last token: every block is hashed
            prompt[-1] = 150000 + r
            current = prompt
        else:
            session = sessions[r % len(sessions)]
            session.extend(rnd.randrange(150000) for _ in range(turn_tokens))
            current = session.tolist()
        start = time.perf_counter()
        result = index.score("m", current)
        score_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        keys = block_keys(current, block_size)
        key_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        walk = prefix_matches(keys, table)
        walk_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert set_walk(keys, table) == walk
        ref_walk_times.append(time.perf_counter() - start)
        if mode == "cold":
            assert result.scores[0].matched_blocks == blocks - 1
    score_times.sort()
    return (statistics.median(score_times) * 1e3, score_times[max(int(len(score_times) * 0.99) - 1, 0)] * 1e3,
            statistics.median(key_times) * 1e6 / max(blocks, 1), index.stats().blocks,
            statistics.median(walk_times) * 1e3, statistics.median(ref_walk_times) * 1e3)


def vllm_batches(messages: int, block_size: int, capacity: int, seed: int = 0) -> tuple[list[bytes], int, int]:
    """vLLM-format payloads of an engine with an LRU of ``capacity`` blocks; (payloads, block events, events)."""
    rnd = random.Random(seed)
    order: list[int] = []
    next_hash = 1
    payloads: list[bytes] = []
    block_events = events_total = 0
    for _ in range(messages):
        events: list[KVEvent] = []
        for _ in range(4):  # four requests finish blocks in this engine step
            count = rnd.choice((1, 1, 1, 8, 32))  # decode steps fill one block; prefills many
            parent = order[rnd.randrange(len(order))] if order and rnd.random() < 0.5 else None
            hashes = list(range(next_hash, next_hash + count))
            next_hash += count
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, block_size=block_size,
                                      token_ids=[rnd.randrange(150000) for _ in range(count * block_size)]))
            order.extend(hashes)
            block_events += count
        if len(order) > capacity:
            evicted = order[: len(order) - capacity]
            del order[: len(order) - capacity]
            events.append(BlockRemoved(block_hashes=evicted))
            block_events += len(evicted)
        events_total += len(events)
        payloads.append(encode_batch(EventBatch(ts=0.0, events=events, data_parallel_rank=0)))
    return payloads, block_events, events_total


class _PerEvent:
    """An index without ``apply_batch``: the pool applies one event per call (the path before issue 10's batching)."""

    def __init__(self, inner: InMemoryIndex) -> None:
        self.inner = inner

    def is_registered(self, endpoint_id: EndpointId) -> bool:
        return self.inner.is_registered(endpoint_id)

    def apply(self, endpoint_id: EndpointId, event: KVEvent) -> object:
        return self.inner.apply(endpoint_id, event)


class _GeneralPath(InMemoryIndex):
    """``apply_batch`` through the general per-event code (``_apply_stored`` / ``_apply_removed`` per
    event): the batch path as it was before issue 10's wave 6 inlined the common store (the A/B's "before")."""

    def apply_batch(self, endpoint_id: EndpointId, events: Sequence[KVEvent]) -> list[ApplyOutcome]:  # type: ignore[override]
        return [self.apply(endpoint_id, event) for event in events]


async def ingest_bench(messages: int, capacity: int, repeats: int, watched: bool = False,
                       variants: tuple[str, ...] = ("batch",)) -> dict[str, float]:
    """Decode-only and end-to-end (EventPool -> InMemoryIndex) rates, and memory per held block.

    ``watched``: a replica watches (``KVIndexer/Watch``): the index records residency changes and a
    task drains them into ``WatchResponse`` deltas as the servicer does (no socket), in the same loop.
    ``variants`` (run interleaved, best of ``repeats`` each; the first is the headline row):
    ``batch`` (the pool hands the index a batch: ``InMemoryIndex.apply_batch``), ``general`` (a batch
    per call, each event through the general per-event code: the path before wave 6), ``per-event``
    (``apply`` per event), ``service`` (``batch`` through ``InstrumentedIndex``, the metrics the
    service records). ``cpu`` columns use the process's CPU time (``time.process_time``), steadier
    than wall time on a shared machine."""
    import gc
    import tracemalloc

    from kvmesh.kv_events import decode_batch
    from services.kv_indexer.events.pool import RawMessage
    from services.kv_indexer.index import InstrumentedIndex

    load = os.getloadavg()  # 1-minute load average: the figures are only comparable on a quiet machine
    payloads, block_events, events = vllm_batches(messages, 16, capacity)
    endpoint = Endpoint(id=EndpointId("127.0.0.1:1"), url="", model="m", block_size_tokens=16)
    decode_s: list[float] = []
    apply_s: dict[str, list[float]] = {v: [] for v in variants}
    cpu_s: dict[str, list[float]] = {v: [] for v in variants}
    held = 0
    for _, variant in ((r, v) for r in range(repeats) for v in variants):
        start = time.perf_counter()
        for payload in payloads:
            decode_batch(payload)
        decode_s.append(time.perf_counter() - start)
        index = InMemoryIndex()
        index.register_endpoint(endpoint)
        target: object = index
        if variant == "per-event":
            target = _PerEvent(index)
        elif variant == "general":
            index = _GeneralPath()
            index.register_endpoint(endpoint)
            target = index
        elif variant == "service":
            target = InstrumentedIndex(index)
        pool = EventPool(target, workers=1, queue_size=len(payloads) + 1)  # type: ignore[arg-type]
        pool.endpoint_joined(endpoint)
        pool.start()
        drain = None
        if watched:
            index.residency = ResidencyLog()
            drain_seq[0] = 0
            drain = asyncio.create_task(_watch_drain(index.residency))
        gc.collect()
        start = time.perf_counter()
        cpu_start = time.process_time()
        for seq, payload in enumerate(payloads):
            pool.submit(RawMessage(endpoint.id, "m", seq, payload))
        await pool.drained()
        if drain is not None:
            await asyncio.sleep(0)
            while index.residency.seq > drain_seq[0]:  # type: ignore[union-attr]  # noqa: ASYNC110
                await asyncio.sleep(0)
            drain.cancel()
            keys_sent = await asyncio.gather(drain, return_exceptions=True)
            assert index.residency is not None and index.residency.seq > 0, keys_sent
        apply_s[variant].append(time.perf_counter() - start)
        cpu_s[variant].append(time.process_time() - cpu_start)
        await pool.shutdown()
        assert pool.state(endpoint.id) is EndpointState.LIVE and not pool.stats.dropped
        held = len(index.held_blocks(endpoint.id))
    # memory: a fresh index filled by the same stream, traced
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = InMemoryIndex()
    index.register_endpoint(endpoint)
    pool = EventPool(index, workers=1, queue_size=len(payloads) + 1)
    pool.endpoint_joined(endpoint)
    pool.start()
    for seq, payload in enumerate(payloads):
        pool.submit(RawMessage(endpoint.id, "m", seq, payload))
    await pool.drained()
    await pool.shutdown()
    del pool
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    recent = len(index._endpoints[endpoint.id].recent)  # bench: what the bytes include
    decode = min(decode_s)
    apply = min(apply_s[variants[0]])
    row = {
        "messages": len(payloads), "events": events, "block_events": block_events,
        "decode_s": decode, "decode_rate": block_events / decode,
        "apply_s": apply, "rate": block_events / apply, "events_rate": events / apply,
        "cpu_rate": block_events / min(cpu_s[variants[0]]),
        "held": held, "bytes_per_block": used / max(held, 1), "recent": recent,
    }
    print(f"{'path':>9} {'messages':>8} {'events':>8} {'block events':>12} {'decode s':>8} {'decode blk/s':>12} "
          f"{'end-to-end s':>12} {'block events/s':>14} {'per CPU s':>10} {'events/s':>9} {'held blocks':>11} {'B/block':>8}")
    for variant in variants:
        wall, cpu = min(apply_s[variant]), min(cpu_s[variant])
        print(f"{variant:>9} {row['messages']:>8,} {events:>8,} {block_events:>12,} {decode:>8.3f} "
              f"{row['decode_rate']:>12,.0f} {wall:>12.3f} {block_events / wall:>14,.0f} {block_events / cpu:>10,.0f} "
              f"{events / wall:>9,.0f} {held:>11,} {row['bytes_per_block']:>8.0f}")
    print(f"(best of {repeats}; target >= 1,000,000 block events/s: {'met' if row['rate'] >= 1e6 else 'MISSED'}; "
          f"B/block = traced bytes of the index / held blocks, including {recent:,} recently removed hash->key pairs; "
          f"load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)")
    return row


drain_seq = [0]


async def _watch_drain(log: ResidencyLog) -> int:
    """What a watcher costs the indexer's loop: residency records turned into Watch deltas."""
    from services.kv_indexer.servicer import _deltas

    wake = asyncio.Event()
    log.add_listener(wake.set)
    seq = keys = 0
    try:
        while True:
            if log.seq <= seq:
                await wake.wait()
                wake.clear()
            records = log.since(seq, 65536) or []
            seq += len(records)
            drain_seq[0] = seq
            deltas = _deltas(records)
            keys += sum(len(d.added_keys) + len(d.removed_keys) for d in deltas)
            await asyncio.sleep(0)
    except asyncio.CancelledError:
        return keys


async def replay_bench(events: int, block_size: int, working_set: int) -> None:
    """Publish ``events`` one-event messages into a replay buffer, then recover them all."""
    rnd = random.Random(0)
    replay = f"tcp://127.0.0.1:{free_port()}"
    endpoint = Endpoint(id=EndpointId("127.0.0.1:1"), url="http://127.0.0.1:1", model="m",
                        block_size_tokens=block_size, replay_endpoint=replay)
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}", make_topic(endpoint.id, "m"),
                                  replay_endpoint=replay, buffer_steps=events)
    start = time.perf_counter()
    held: list[int] = []
    for seq in range(events):
        event: KVEvent
        if len(held) >= working_set or (held and rnd.random() < 0.45):
            event = BlockRemoved(block_hashes=[held.pop(rnd.randrange(len(held)))])
        else:
            block_hash = seq + 1
            held.append(block_hash)
            event = BlockStored(block_hashes=[block_hash], parent_block_hash=None,
                                token_ids=[rnd.randrange(50000) for _ in range(block_size)], block_size=block_size)
        publisher.publish_payload(encode_batch(EventBatch(ts=0.0, events=[event], data_parallel_rank=0)))
        if seq % 200_000 == 199_999:
            print(f"  buffered {seq + 1:,} messages", file=sys.stderr)
    buffered = time.perf_counter() - start
    index = InMemoryIndex()
    index.register_endpoint(endpoint)
    replayer = ZmqReplayer()
    fetch_start = time.perf_counter()
    replies = await replayer.replay(endpoint, 0, timeout_seconds=600)
    fetch = time.perf_counter() - fetch_start
    pool = EventPool(index, workers=1, replayer=replayer, replay_timeout_seconds=600)
    pool.endpoint_joined(endpoint)
    pool.start()
    start = time.perf_counter()
    pool.recover(endpoint, "bench")
    await pool.settled()
    recover = time.perf_counter() - start
    assert len(replies) == events and pool.state(endpoint.id) is EndpointState.LIVE
    assert set(index.held_blocks(endpoint.id)) == set(held)
    await pool.shutdown()
    publisher.shutdown()
    replayer.close()
    print(f"{'events':>10} {'buffer s':>9} {'fetch s':>8} {'fetch+apply s':>13} {'events/s':>10} {'held blocks':>11}")
    print(f"{events:>10,} {buffered:>9.2f} {fetch:>8.2f} {recover:>13.2f} {events / recover:>10,.0f} {len(held):>11,}")


async def etcd_pause_bench(engines: int, pause: float, lease_ttl: int, requests: int) -> None:
    """Real processes; time from SIGCONT until the index equals every engine's cache again."""
    import grpc
    import httpx

    from engine_simulator.tokenizer import ensure_tokenizer
    from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2 as pb
    from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2_grpc
    from kvmesh_cli.launcher import ManagedProcess, python_module, start_etcd, wait_grpc_healthy, wait_http_ok

    run = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    tok = ensure_tokenizer(str(run / "tok"))
    etcd, etcd_address = start_etcd(run)
    bind = f"tcp://127.0.0.1:{free_port()}"
    grpc_port = free_port()
    procs = [ManagedProcess("kv_indexer", python_module(
        "services.kv_indexer", "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
        "--etcd-endpoints", etcd_address, "--events-bind-endpoint", bind, "--lease-ttl-seconds", str(lease_ttl),
    ), run / "kv_indexer.log").start()]
    ports = [free_port() for _ in range(engines)]
    for port in ports:
        procs.append(ManagedProcess(f"engine-{port}", python_module(
            "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", "tiny",
            "--block-size-tokens", "16", "--num-gpu-blocks", "512", "--events-endpoint", bind,
            "--events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}", "--etcd-endpoints", etcd_address,
            "--lease-ttl-seconds", str(lease_ttl), "--time-scale", "200", "--tokenizer-path", str(tok),
        ), run / f"engine-{port}.log").start())
    try:
        wait_grpc_healthy(f"127.0.0.1:{grpc_port}", 30)
        for port in ports:
            wait_http_ok(f"http://127.0.0.1:{port}/health", 30)
        stub = kv_indexer_pb2_grpc.KVIndexerStub(grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}"))
        rnd = random.Random(0)
        words = [f"w{i}" for i in range(200)]
        async with httpx.AsyncClient(timeout=60) as client:
            async def load(n: int) -> None:
                for i in range(n):
                    prompt = " ".join(words[: rnd.randint(10, 100)] + [rnd.choice(words) for _ in range(50)])
                    await client.post(f"http://127.0.0.1:{ports[i % engines]}/v1/completions",
                                      json={"model": "tiny", "prompt": prompt, "max_tokens": 4})

            async def exact() -> bool:
                for port in ports:
                    body = (await client.get(f"http://127.0.0.1:{port}/debug/kv_cache")).json()
                    try:
                        reply = await stub.EndpointBlocks(pb.EndpointBlocksRequest(endpoint_id=f"127.0.0.1:{port}"), timeout=5)
                    except grpc.aio.AioRpcError as err:
                        if err.code() == grpc.StatusCode.NOT_FOUND:  # the indexer has not met it yet
                            return False
                        raise
                    if list(reply.block_hashes) != body["block_hashes"] or reply.state != "live":
                        return False
                return True

            await load(requests)
            loading = asyncio.create_task(load(requests))
            assert etcd.proc is not None
            os.killpg(etcd.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(pause)
            os.killpg(etcd.proc.pid, signal.SIGCONT)
            resumed = time.perf_counter()
            await loading
            for _ in range(int(600 / 0.05)):  # polls a remote state: no local event to wait on
                if await exact():
                    break
                await asyncio.sleep(0.05)
            recovered = time.perf_counter() - resumed
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
        print(f"{'engines':>7} {'lease s':>7} {'pause s':>7} {'requests':>8} {'index blocks':>12} {'exact again after s':>19}")
        print(f"{engines:>7} {lease_ttl:>7} {pause:>7.0f} {2 * requests:>8} {stats.blocks:>12} {recovered:>19.2f}")
        print("(the time includes finishing the load that ran through the pause; the index is compared only after it)")
    finally:
        for proc in reversed(procs):
            proc.stop()
        if etcd.proc is not None and etcd.alive():
            os.killpg(etcd.proc.pid, signal.SIGCONT)
        etcd.stop()


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("mode", nargs="?", default="score", choices=["score", "ingest", "replay", "etcd-pause"])
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--turn-tokens", type=int, default=256, help="score: tokens a grown prompt adds per turn")
    parser.add_argument("--messages", type=int, default=20_000, help="ingest: vLLM-format batches")
    parser.add_argument("--capacity", type=int, default=50_000, help="ingest: blocks the engine's cache holds")
    parser.add_argument("--events", type=int, default=1_000_000, help="replay: buffered messages")
    parser.add_argument("--working-set", type=int, default=8192, help="replay: most blocks held at once")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--pause", type=float, default=30.0, help="etcd-pause: seconds etcd is stopped")
    parser.add_argument("--lease-ttl", type=int, default=10)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=0, help="score: only rows of this prompt length (0: all)")
    parser.add_argument("--ab", action="store_true",
                        help="ingest: also the general path (before wave 6), per-event apply (no apply_batch) "
                             "and the service's wrapping (InstrumentedIndex's metrics), interleaved with the default")
    parser.add_argument("--watched", action="store_true", help="ingest: also with a replica watching (Watch deltas built)")
    parser.add_argument("--plot", type=Path, default=None, help="score/ingest: write a PNG here (matplotlib)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.mode == "replay":
        asyncio.run(replay_bench(args.events, 16, args.working_set))
        return
    if args.mode == "etcd-pause":
        asyncio.run(etcd_pause_bench(args.engines, args.pause, args.lease_ttl, args.requests))
        return
    if args.mode == "ingest":
        variants = ("batch", "general", "per-event", "service") if args.ab else ("batch",)
        row = asyncio.run(ingest_bench(args.messages, args.capacity, max(1, min(args.repeats, 3)), variants=variants))
        if args.watched:
            print("the same, a replica watching:")
            asyncio.run(ingest_bench(args.messages, args.capacity, max(1, min(args.repeats, 3)), watched=True))
        if args.plot:
            _plot(args.plot, "kv_indexer ingest (block events/s)", ["decode only", "end to end", "target"],
                  [row["decode_rate"], row["rate"], 1e6])
        return
    rows = [(t, b, m) for t in (1024, 8192, 32768, 131072) for b in (16, 64) for m in ("cold", "grown")
            if m == "cold" or t >= 8192]
    print(f"{'tokens':>8} {'block':>6} {'blocks':>7} {'mode':>6} {'endpoints':>9} {'index keys':>10} "
          f"{'keys µs/block':>13} {'score p50 ms':>12} {'score p99 ms':>12} {'walk p50 ms':>11} {'ref walk ms':>11}")
    results = []
    for tokens, block, mode in rows:
        if args.tokens and tokens != args.tokens:
            continue
        p50, p99, keys, size, walk, ref_walk = bench(tokens, block, args.endpoints, args.repeats, mode, args.turn_tokens)
        results.append((f"{tokens // 1024}k/{block}/{mode}", p50, p99))
        print(f"{tokens:>8} {block:>6} {tokens // block:>7} {mode:>6} {args.endpoints:>9} {size:>10} {keys:>13.3f} "
              f"{p50:>12.3f} {p99:>12.3f} {walk:>11.3f} {ref_walk:>11.3f}")
    print("targets: keys <= 1 µs per 64-token block; Score of a 128k-token prompt p99 <= 2 ms")
    if args.plot:
        _plot(args.plot, "kv_indexer Score p99 (ms)", [r[0] for r in results], [r[2] for r in results])


def _plot(path: Path, title: str, labels: list[str], values: list[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot")
        return
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.6), 4))
    ax.bar(labels, values)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
