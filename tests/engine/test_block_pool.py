from __future__ import annotations

import pytest

from streamserve.engine.block_pool import BlockPool


def test_free_queue_is_lru_and_removes_from_the_middle():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)  # blocks 0, 1, 2
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_block_queue.block_ids() == [3, 4, 5]
    pool.free_blocks([a[2], a[0]])
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2, 0]
    pool.touch([pool.blocks[5]])  # a hit in the middle of the queue
    assert pool.free_block_queue.block_ids() == [3, 4, 2, 0]
    assert pool.num_free_blocks == 4 and pool.blocks[5].ref_cnt == 1


def test_eviction_takes_the_least_recently_freed_cached_block():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    for block, h in zip(blocks, (111, 222, 333)):
        pool.cache_full_block(block, h)
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])
    # Freed blocks keep their hash until reused.
    assert pool.get_cached_block(222) is blocks[1]
    taken = pool.get_new_blocks(1)
    assert taken == [blocks[1]] and pool.get_cached_block(222) is None and taken[0].block_hash is None
    assert pool.get_cached_block(111) is blocks[0] and pool.get_cached_block(333) is blocks[2]
    taken = pool.get_new_blocks(1)
    assert taken == [blocks[0]] and pool.get_cached_block(111) is None


def test_ref_counts_with_shared_blocks():
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 42)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4


def test_taking_more_than_free_fails():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(ValueError, match="2 free"):
        pool.get_new_blocks(3)
