"""kv_store sources in the index: per-medium residency, folded into the engines that reach them.

Events are vLLM 0.32's (``kvmesh.kv_events``); an engine's offload connector stores with vLLM's
OffloadingConnector form (``BlockStored`` with ``token_ids=[]``, ``parent_block_hash=None``,
medium ``CPU``), a kv_store with full ``BlockStored``s carrying the tier's medium.
"""

from __future__ import annotations

from kvmesh.kv_events import BlockRemoved, BlockStored, EventBatch, KVEvent, encode_batch
from kvmesh.types import KV_SOURCE_LABEL, KV_STORES_LABEL, SHARED_DOMAINS_LABEL, Endpoint, EndpointId, Medium
from services.kv_indexer.events.pool import EventPool, RawMessage
from services.kv_indexer.index import InMemoryIndex
from services.kv_indexer.indexer import BlockIndexer

B = 4
TOKENS = list(range(6 * B))  # 6 blocks
E1, E2, E3 = EndpointId("127.0.0.1:8001"), EndpointId("127.0.0.1:8002"), EndpointId("127.0.0.1:8003")
S1, S2 = EndpointId("127.0.0.1:7001"), EndpointId("127.0.0.1:7002")


def engine(eid: EndpointId, stores: str = "") -> Endpoint:
    return Endpoint(id=eid, url=f"http://{eid}", model="m", block_size_tokens=B, labels={KV_STORES_LABEL: stores} if stores else {})


def source(sid: EndpointId, domains: str) -> Endpoint:
    labels = {KV_SOURCE_LABEL: "kv_store", SHARED_DOMAINS_LABEL: domains}
    return Endpoint(id=sid, url=f"grpc://{sid}", model="m", block_size_tokens=B, labels=labels)


def blocks(first: int, last: int, medium: str = "GPU") -> list[KVEvent]:
    """One BlockStored per block i in [first, last), hashes 100+i chained (as kv_store republishes them)."""
    return [
        BlockStored(
            block_hashes=[100 + i], parent_block_hash=None if i == 0 else 99 + i,
            token_ids=TOKENS[i * B : (i + 1) * B], block_size=B, medium=medium,
        )
        for i in range(first, last)
    ]


class Feed:
    def follow(self, endpoint: Endpoint) -> None: ...

    def unfollow(self, endpoint_id: EndpointId) -> None: ...


async def setup() -> tuple[BlockIndexer, EventPool, dict[EndpointId, int]]:
    index = InMemoryIndex()
    pool = EventPool(index, workers=1)
    indexer = BlockIndexer(index, pool, Feed())
    pool.start()
    members = [
        engine(E1, stores=str(S1)), engine(E2, stores=str(S2)), engine(E3),
        source(S1, "sharedfs:/lustre/kv"), source(S2, "sharedfs:/lustre/kv"),
    ]
    indexer.on_membership({m.id: m for m in members}, {})
    return indexer, pool, {}


async def send(pool: EventPool, seqs: dict[EndpointId, int], eid: EndpointId, events: list[KVEvent]) -> None:
    seq = seqs.get(eid, 0)
    seqs[eid] = seq + 1
    pool.submit(RawMessage(eid, "m", seq, encode_batch(EventBatch(ts=1.0, events=events, data_parallel_rank=0))))
    await pool.drained()


def by_id(indexer: BlockIndexer) -> dict[EndpointId, tuple[int, dict[Medium, int]]]:
    return {s.endpoint_id: (s.matched_blocks, dict(s.matched_blocks_by_medium)) for s in indexer.score("m", TOKENS).result.scores}


async def test_source_blocks_count_for_engines_that_reach_them_per_medium() -> None:
    indexer, pool, seqs = await setup()
    await send(pool, seqs, E1, blocks(0, 2))  # E1: blocks 0-1 on GPU
    await send(pool, seqs, S1, blocks(0, 4, "CPU"))  # its kv_store: blocks 0-3 in CPU memory
    scores = by_id(indexer)
    assert S1 not in scores  # a source is never scored (never routed to)
    assert scores[E1] == (4, {Medium.GPU: 2, Medium.CPU: 4})
    assert E3 not in scores and E2 not in scores  # S1's CPU is private to the engines naming it
    holders = [loc.holders for loc in indexer.lookup("m", TOKENS)]
    assert holders[0] == {E1: frozenset({Medium.GPU, Medium.CPU})}
    assert holders[3] == {E1: frozenset({Medium.CPU})}
    assert holders[4] == {}
    await pool.shutdown()


async def test_a_shared_block_counts_for_every_engine_reaching_the_shared_domain() -> None:
    indexer, pool, seqs = await setup()
    await send(pool, seqs, S1, blocks(0, 5, "SHARED"))  # written through to the shared FS by S1
    scores = by_id(indexer)
    assert scores[E1] == (5, {Medium.SHARED: 5})
    assert scores[E2] == (5, {Medium.SHARED: 5})  # E2 reaches S2, which mounts the same namespace
    assert E3 not in scores
    await pool.shutdown()


async def test_a_move_between_tiers_is_a_store_then_a_removal_and_never_a_lost_block() -> None:
    indexer, pool, seqs = await setup()
    await send(pool, seqs, S1, blocks(0, 3, "CPU"))
    move = [*blocks(0, 1, "DISK"), BlockRemoved(block_hashes=[100], medium="CPU")]
    await send(pool, seqs, S1, move)
    assert by_id(indexer)[E1] == (3, {Medium.DISK: 1, Medium.CPU: 2})
    held = indexer.index.held_blocks(S1)
    assert held[100] == {Medium.DISK} and held[101] == {Medium.CPU}
    await send(pool, seqs, S1, [BlockRemoved(block_hashes=[100], medium="DISK")])
    assert E1 not in by_id(indexer)  # block 0 is gone: no prefix
    await pool.shutdown()


async def test_offload_connector_medium_only_store_adds_cpu_to_known_blocks() -> None:
    indexer, pool, seqs = await setup()
    await send(pool, seqs, E3, blocks(0, 3))
    # vLLM 0.32 OffloadingConnector.take_events: hashes only, parent None, no tokens, medium CPU
    offload = BlockStored(block_hashes=[100, 101, 102], parent_block_hash=None, token_ids=[], block_size=B, medium="CPU")
    await send(pool, seqs, E3, [offload, BlockRemoved(block_hashes=[101, 102], medium="GPU")])
    assert by_id(indexer)[E3] == (3, {Medium.GPU: 1, Medium.CPU: 3})
    assert indexer.parity.mismatches() == {}
    await pool.shutdown()


async def test_offload_connector_default_placeholder_events_with_block_size_zero_add_cpu() -> None:
    """vLLM 0.32's OffloadingConnector without ``self_describing_kv_events`` (its default) emits each
    CPU store as a placeholder: one hash, no parent, no tokens, ``block_size=0``
    (offloading/events.py ``_placeholder_stored``). They mark known blocks as on CPU too."""
    indexer, pool, seqs = await setup()
    await send(pool, seqs, E3, blocks(0, 3))
    placeholders = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")
                    for h in (100, 101, 102)]
    await send(pool, seqs, E3, [*placeholders, BlockRemoved(block_hashes=[101, 102], medium="GPU")])
    assert by_id(indexer)[E3] == (3, {Medium.GPU: 1, Medium.CPU: 3})
    assert indexer.parity.mismatches() == {}
    # block_size 0 with token ids is no vLLM form: refused, nothing changes
    await send(pool, seqs, E3, [BlockStored(block_hashes=[103], parent_block_hash=100, token_ids=[1] * B,
                                            block_size=0, medium="GPU")])
    assert by_id(indexer)[E3] == (3, {Medium.GPU: 1, Medium.CPU: 3})
    await pool.shutdown()


def test_parity_monitor_takes_offload_placeholders_for_what_they_are() -> None:
    """vLLM 0.32's default CPU placeholder events (no tokens, ``block_size=0``) are no block-size
    mismatch: the parity monitor skips token-less stores before comparing sizes (before, the first CPU
    event of an engine run with ``--offload cpu`` made its model load-only). A token-carrying event with
    the wrong size still is one."""
    from services.kv_indexer.parity import ParityMonitor

    parity = ParityMonitor(sample_every=1)
    parity.register(engine(E3))
    parity.check(E3, BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU"))
    assert parity.mismatches() == {}
    parity.check(E3, BlockStored(block_hashes=[8], parent_block_hash=None, token_ids=[1] * (B * 2), block_size=B * 2,
                                 medium="GPU"))
    assert set(parity.mismatches()) == {E3}


def reached(indexer: BlockIndexer) -> dict[EndpointId, int]:
    return {s.endpoint_id: s.reached_blocks for s in indexer.score("m", TOKENS).result.scores}


async def test_reached_blocks_say_how_much_of_a_match_only_a_kv_store_holds() -> None:
    """A folded match says which part the engine holds itself: E1 holds blocks 0-1 and reaches 0-3 in S1,
    E2 and E1 reach 0-4 through the shared namespace, E3 holds 0-2 and reaches nothing. Routing keeps
    a session where its history is (the engine's own copy), not wherever a kv_store could load it."""
    indexer, pool, seqs = await setup()
    await send(pool, seqs, E1, blocks(0, 2))
    await send(pool, seqs, E3, blocks(0, 3))
    await send(pool, seqs, S1, blocks(0, 4, "CPU"))
    assert reached(indexer) == {E1: 2, E3: 0}
    await send(pool, seqs, S2, blocks(0, 5, "SHARED"))
    assert reached(indexer) == {E1: 3, E2: 5, E3: 0}  # E1: 5 matched (own 0-1, S1's CPU 2-3, shared 4)
    await pool.shutdown()
