"""Allocator refcounts and the prefix cache (hash chaining, LRU eviction, counters)."""

from __future__ import annotations

import pytest

from zserve.block_manager import BlockManager, KVCacheBlocks


def test_allocate_grows_and_free_returns_blocks() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    t = kv.allocate(0, 5)
    assert t is not None and len(t) == 2 and kv.num_free_blocks == 6
    assert kv.allocate(0, 8).block_ids == t.block_ids  # 8 tokens still fit in 2 blocks
    t2 = kv.allocate(0, 9)
    assert t2.block_ids[:2] == t.block_ids and len(t2) == 3
    assert all(kv.ref_count(b) == 1 for b in t2.block_ids)
    kv.free(0)
    assert kv.num_free_blocks == 8 and all(kv.ref_count(b) == 0 for b in t2.block_ids)
    kv.free(0)  # unknown id: no-op
    assert kv.num_free_blocks == 8


def test_allocation_failure_changes_nothing() -> None:
    kv = BlockManager(num_blocks=3, block_size=4)
    assert kv.allocate(0, 8) is not None
    assert kv.allocate(1, 9) is None  # needs 3, 1 free
    assert kv.block_table(1) == [] and kv.num_free_blocks == 1
    assert not kv.can_allocate(1, 5) and kv.can_allocate(1, 4)


def test_prefix_blocks_are_shared_with_refcounts() -> None:
    kv = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    kv.allocate(0, 10)
    kv.cache_full_blocks(0, tokens, 10)
    assert kv.num_cached_blocks() == 2  # the partial third block is not cached
    computed, hit = kv.get_computed_blocks([*tokens, 99])
    assert hit == 8 and computed.block_ids == tuple(kv.block_table(0)[:2])
    t1 = kv.allocate(1, 11, computed)
    assert t1.block_ids[:2] == computed.block_ids and len(t1) == 3
    assert [kv.ref_count(b) for b in t1.block_ids] == [2, 2, 1]
    kv.free(0)
    assert [kv.ref_count(b) for b in t1.block_ids] == [1, 1, 1]
    kv.free(1)
    assert kv.num_free_blocks == 10
    # Freed, but still findable until the slots are needed.
    assert kv.get_computed_blocks(tokens)[1] == 8


def test_one_token_is_always_left_to_compute() -> None:
    kv = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    kv.allocate(0, 8)
    kv.cache_full_blocks(0, tokens, 8)
    assert kv.get_computed_blocks(tokens)[1] == 4  # not 8: the last token must run
    assert kv.get_computed_blocks([*tokens, 1])[1] == 8


def test_hash_chains_over_the_whole_prefix() -> None:
    kv = BlockManager(num_blocks=8, block_size=2)
    kv.allocate(0, 4)
    kv.cache_full_blocks(0, [1, 2, 3, 4], 4)
    # Same second block [3, 4] after a different first block: no hit at all.
    assert kv.get_computed_blocks([9, 9, 3, 4, 5])[1] == 0
    assert kv.get_computed_blocks([1, 2, 7, 7, 5])[1] == 2
    assert kv.get_computed_blocks([1, 2, 3, 4, 5])[1] == 4


def test_eviction_is_lru_and_uncached_blocks_go_first() -> None:
    kv = BlockManager(num_blocks=4, block_size=2)
    a, b = [1, 2], [3, 4]
    for sid, toks in ((0, a), (1, b)):
        kv.allocate(sid, 3)  # one full cached block + one partial (uncached) block
        kv.cache_full_blocks(sid, [*toks, 0], 2)
    kv.free(0)
    kv.free(1)  # free order: a's blocks, then b's; a is least recently used
    assert kv.num_cached_blocks() == 2 and kv.num_free_blocks == 4
    kv.allocate(2, 4)  # two blocks: the two uncached ones, nothing evicted
    assert kv.num_cached_blocks() == 2
    kv.allocate(3, 2)  # one more: evicts a (LRU), keeps b
    assert kv.get_computed_blocks([*a, 0])[1] == 0
    assert kv.get_computed_blocks([*b, 0])[1] == 2


def test_hit_counters_and_disabled_cache() -> None:
    kv = BlockManager(num_blocks=8, block_size=2)
    kv.allocate(0, 4)
    kv.cache_full_blocks(0, [1, 2, 3, 4], 4)
    _, hit = kv.get_computed_blocks([1, 2, 3, 4, 5])
    kv.record_prefix_lookup(5, hit)
    assert (kv.prefix_hits, kv.prefix_queries) == (4, 5)
    off = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    off.allocate(0, 4)
    off.cache_full_blocks(0, [1, 2, 3, 4], 4)
    assert off.get_computed_blocks([1, 2, 3, 4, 5]) == (KVCacheBlocks(), 0)
    assert off.num_cached_blocks() == 0


def test_reclaimed_cached_blocks_count_against_free_space() -> None:
    kv = BlockManager(num_blocks=3, block_size=2)
    kv.allocate(0, 4)
    kv.cache_full_blocks(0, [1, 2, 3, 4], 4)
    kv.free(0)
    computed, hit = kv.get_computed_blocks([1, 2, 3, 4, 5])
    assert hit == 4
    # 3 blocks needed: 2 cached (ref 0, in the free queue) + 1 new = all 3 free ones.
    assert kv.can_allocate(1, 5, computed)
    assert not kv.can_allocate(1, 7, computed)
    kv.allocate(1, 5, computed)
    assert kv.num_free_blocks == 0


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
