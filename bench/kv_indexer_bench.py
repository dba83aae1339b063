"""Scoring speed of the in-memory kv_indexer: ``python bench/kv_indexer_bench.py``.

Fills an index with ``--endpoints`` endpoints holding overlapping prefixes of a long prompt, then
times ``score`` (block keys + prefix walk, what one Score RPC costs inside the service) for prompts
of several lengths and block sizes. Prints a table of p50/p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvmesh.hashing import block_keys
from kvmesh.kv_events import BlockStored
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer.index import InMemoryIndex


def bench(tokens: int, block_size: int, endpoints: int, repeats: int) -> tuple[float, float, float, int]:
    rnd = random.Random(0)
    prompt = [rnd.randrange(50000) for _ in range(tokens)]
    index = InMemoryIndex()
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
    score_times, key_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = index.score("m", prompt)
        score_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        block_keys(prompt, block_size)
        key_times.append(time.perf_counter() - start)
    assert result.scores[0].matched_blocks == blocks
    score_times.sort()
    return (statistics.median(score_times) * 1e3, score_times[int(len(score_times) * 0.99) - 1] * 1e3,
            statistics.median(key_times) * 1e3, index.stats().blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    rows = [(t, b) for t in (1024, 8192, 32768, 131072) for b in (16, 64)]
    print(f"{'tokens':>8} {'block':>6} {'blocks':>7} {'endpoints':>9} {'index keys':>10} {'keys p50 ms':>11} {'score p50 ms':>12} {'score p99 ms':>12}")
    for tokens, block in rows:
        p50, p99, keys, size = bench(tokens, block, args.endpoints, args.repeats)
        print(f"{tokens:>8} {block:>6} {tokens // block:>7} {args.endpoints:>9} {size:>10} {keys:>11.3f} {p50:>12.3f} {p99:>12.3f}")


if __name__ == "__main__":
    main()
