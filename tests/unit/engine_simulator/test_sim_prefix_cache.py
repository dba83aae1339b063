"""The block pool: vLLM's free-queue order and eviction, ref counts, events, repeats, reset."""

import pytest

from engine_simulator.prefix_cache import PrefixCache
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def _store(cache: PrefixCache, blocks: list[int], hashes: list[int], parent: int | None = None) -> None:
    cache.cache_full_blocks(blocks, hashes, parent, list(range(len(blocks) * cache.block_size)))


def test_null_block_reserved_and_usage() -> None:
    cache = PrefixCache(num_gpu_blocks=5, block_size=4)
    assert cache.num_free_blocks == 4 and cache.usage == 0.0
    blocks = cache.allocate(2)
    assert blocks == [1, 2] and cache.usage == pytest.approx(0.5)
    assert cache.allocate(3) is None  # only 2 left
    cache.free(blocks)
    assert cache.usage == 0.0


def test_stored_event_shape_and_lookup() -> None:
    cache = PrefixCache(num_gpu_blocks=8, block_size=4)
    blocks = cache.allocate(3)
    _store(cache, blocks[:2], [11, 12])
    _store(cache, blocks[2:], [13], parent=12)
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert first.block_hashes == [11, 12] and first.parent_block_hash is None
    assert first.token_ids == list(range(8)) and first.block_size == 4 and first.medium == "GPU"
    assert first.extra_keys == [None, None] and first.lora_id is None
    assert second.parent_block_hash == 12
    assert cache.lookup([11, 12, 13, 14]) == blocks
    assert cache.take_events() == []


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    cache = PrefixCache(num_gpu_blocks=7, block_size=2)  # 6 usable
    a = cache.allocate(3)
    _store(cache, a, [1, 2, 3])
    b = cache.allocate(3)
    _store(cache, b, [4, 5, 6])
    cache.take_events()
    cache.free(a)  # a's tail first: free queue 3,2,1 (by hash)
    cache.free(b)  # then 6,5,4
    new = cache.allocate(2)
    assert new is not None
    removed = cache.take_events()
    assert removed == [BlockRemoved(block_hashes=[3]), BlockRemoved(block_hashes=[2])]
    assert cache.lookup([1, 2, 3]) == [a[0]]  # the head of the chain survives
    assert cache.lookup([4, 5, 6]) == b


def test_free_order_matches_vllm_block_pool() -> None:
    """Freed blocks: unhashed ones to the queue's head, hashed ones to its tail, each in release order.

    vLLM 0.32 ``vllm/v1/core/single_type_kv_cache_manager.py`` ``free`` releases a request's blocks in
    reverse (tail first); ``vllm/v1/core/block_pool.py`` ``BlockPool.free_blocks`` then puts the now
    unreferenced blocks without a hash in front of the free queue (``FreeKVCacheBlockQueue.prepend_n``
    in ``vllm/v1/core/kv_cache_utils.py``) and those with one at its back (``append_n``);
    ``get_new_blocks`` pops from the front and publishes ``BlockRemoved`` only for hashed blocks. So a
    request's partly filled tail block is reused before any cached block is evicted.
    """
    cache = PrefixCache(num_gpu_blocks=9, block_size=2)  # 8 usable: queue 1..8
    a = cache.allocate(3)  # [1, 2, 3]: 2 full blocks and a partial tail
    _store(cache, a[:2], [11, 12])
    b = cache.allocate(2)  # [4, 5]: 1 full block and a partial tail
    _store(cache, b[:1], [21])
    cache.take_events()
    cache.free(a)
    assert cache.free_queue() == [3, 6, 7, 8, 2, 1]  # a's tail at the head; its hashed blocks tail first
    cache.free(b)
    assert cache.free_queue() == [5, 3, 6, 7, 8, 2, 1, 4]  # the latest freed unhashed block goes first
    assert cache.allocate(5) == [5, 3, 6, 7, 8]
    assert cache.take_events() == []  # reusing unhashed blocks evicts nothing
    assert cache.allocate(2) == [2, 1]
    assert cache.take_events() == [BlockRemoved(block_hashes=[12]), BlockRemoved(block_hashes=[11])]
    assert cache.lookup([21]) == [4]


def test_free_order_with_several_unhashed_blocks_and_refcounts() -> None:
    """Release order is kept inside each end; still-referenced blocks stay out of the queue."""
    cache = PrefixCache(num_gpu_blocks=8, block_size=2, enable_caching=False)  # nothing ever hashed
    a = cache.allocate(3)  # [1, 2, 3]
    cache.free(a)
    assert cache.free_queue() == [3, 2, 1, 4, 5, 6, 7]
    cache = PrefixCache(num_gpu_blocks=8, block_size=2)
    a = cache.allocate(4)  # [1, 2, 3, 4]
    _store(cache, a[:2], [11, 12])
    cache.touch(cache.lookup([11]))  # a second sequence shares block 1
    cache.free(a)
    assert cache.free_queue() == [4, 3, 5, 6, 7, 2]
    cache.free([1])
    assert cache.free_queue() == [4, 3, 5, 6, 7, 2, 1]


def test_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(num_gpu_blocks=4, block_size=2)  # 3 usable
    a = cache.allocate(2)
    _store(cache, a, [1, 2])
    cache.free(a)
    hit = cache.lookup([1, 2])
    assert cache.num_evictable(hit) == 2
    cache.touch(hit)  # a second sequence uses them
    assert cache.ref_count(a[0]) == 1 and cache.num_free_blocks == 1
    assert cache.allocate(2) is None
    assert cache.allocate(1) is not None
    assert not [e for e in cache.take_events() if isinstance(e, BlockRemoved)]


def test_shared_block_refcount() -> None:
    cache = PrefixCache(num_gpu_blocks=4, block_size=2)
    a = cache.allocate(1)
    _store(cache, a, [9])
    cache.touch(cache.lookup([9]))
    assert cache.ref_count(a[0]) == 2
    cache.free(a)
    assert cache.ref_count(a[0]) == 1 and cache.num_free_blocks == 2
    cache.free(a)
    assert cache.num_free_blocks == 3 and cache.lookup([9]) == a


def test_repeat_republishes_and_duplicate_hashes_evict_separately() -> None:
    """vLLM stores a recomputed block again (same hash, new physical block) and announces it again."""
    cache = PrefixCache(num_gpu_blocks=4, block_size=2)
    a = cache.allocate(1)
    _store(cache, a, [7])
    b = cache.allocate(1)
    _store(cache, b, [7])
    events = cache.take_events()
    assert events[0] == events[1]
    cache.free(a)
    cache.free(b)
    cache.allocate(3)
    assert cache.take_events() == [BlockRemoved(block_hashes=[7]), BlockRemoved(block_hashes=[7])]
    assert cache.lookup([7]) == []


def test_reset_only_when_idle() -> None:
    cache = PrefixCache(num_gpu_blocks=4, block_size=2)
    a = cache.allocate(1)
    _store(cache, a, [5])
    cache.take_events()
    assert cache.reset() is False
    cache.free(a)
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.lookup([5]) == []
    cache.allocate(3)
    assert cache.take_events() == []  # cleared blocks are not "removed" again


def test_disabled_caching_has_no_hits_or_events() -> None:
    cache = PrefixCache(num_gpu_blocks=4, block_size=2, enable_caching=False)
    a = cache.allocate(1)
    _store(cache, a, [5])
    assert cache.take_events() == [] and cache.lookup([5]) == []


@pytest.mark.parametrize(("blocks", "size"), [(1, 4), (4, 0)], ids=["no-usable-block", "zero-block-size"])
def test_rejects_bad_sizes(blocks: int, size: int) -> None:
    with pytest.raises(ValueError):
        PrefixCache(blocks, size)
