"""BlockPool: reference counts, the free queue's eviction order, and prefix-cache lookups."""

from __future__ import annotations

import pytest

from heteroserve.core.block_pool import BlockPool, KVBlock, hash_block


def cache_block(pool: BlockPool, block: KVBlock, tokens: tuple[int, ...], parent: int | None = None) -> int:
    """Registers `block` as holding `tokens` after the prefix hashed `parent`; returns its hash."""
    block_hash = hash_block(parent, tokens)
    pool.cache(block, block_hash, parent, tokens)
    return block_hash


def free_ids(pool: BlockPool) -> list[int]:
    """The free queue, front (next to be handed out) first."""
    return list(pool._free)


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block, got 0"):
        BlockPool(0)


def test_allocate_hands_out_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0

    blocks = pool.allocate(3)

    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 3
    assert not set(free_ids(pool)) & {b.block_id for b in blocks}


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [b.ref_count for b in pool.blocks] == [1, 1, 0]


def test_allocate_zero_blocks() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_free_drops_one_reference_per_call() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])  # a second user
    assert block.ref_count == 2

    pool.free([block])
    assert block.ref_count == 1
    assert block.block_id not in free_ids(pool)
    assert pool.num_used_blocks == 1

    pool.free([block])
    assert block.ref_count == 0
    assert block.block_id in free_ids(pool)
    assert pool.num_free_blocks == 2


def test_freeing_more_often_than_allocated_raises() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="KV block 0 freed more often than it was used"):
        pool.free([block])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 2


def test_freeing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([pool.blocks[1]])


def test_cached_block_stays_reusable_after_free() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    tokens = (1, 2, 3, 4)
    block_hash = cache_block(pool, block, tokens)

    pool.free([block])

    assert pool.num_free_blocks == 4  # cached but unused blocks count as free
    assert pool.lookup(block_hash, None, tokens) is block
    pool.touch([block])
    assert block.ref_count == 1
    assert block.block_id not in free_ids(pool)
    assert pool.num_free_blocks == 3


def test_cached_blocks_are_evicted_only_when_uncached_free_blocks_run_out() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    hashes = [cache_block(pool, b, (i,)) for i, b in enumerate(blocks)]
    pool.free(blocks)

    fresh = pool.allocate(2)  # blocks 2 and 3 were never used: they go first

    assert {b.block_id for b in fresh} == {2, 3}
    assert [pool.lookup(h, None, (i,)) for i, h in enumerate(hashes)] == blocks


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [cache_block(pool, b, (10 + i,)) for i, b in enumerate(blocks)]
    pool.free([blocks[1]])
    pool.free([blocks[2]])
    pool.free([blocks[0]])

    [first] = pool.allocate(1)

    assert first is blocks[1]
    assert first.block_hash is None and first.token_ids == ()
    assert pool.lookup(hashes[1], None, (11,)) is None
    assert pool.lookup(hashes[2], None, (12,)) is blocks[2]
    assert pool.lookup(hashes[0], None, (10,)) is blocks[0]
    [second] = pool.allocate(1)
    assert second is blocks[2]
    assert pool.lookup(hashes[2], None, (12,)) is None
    assert pool.lookup(hashes[0], None, (10,)) is blocks[0]


def test_reusing_a_cached_block_refreshes_its_place_in_the_lru_order() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    hash_a = cache_block(pool, a, (1,))
    hash_b = cache_block(pool, b, (2,))
    pool.free([a, b])  # a is older
    pool.touch([a])  # a hit on a: it leaves the free queue...
    pool.free([a])  # ...and comes back as the most recently used

    [evicted] = pool.allocate(1)

    assert evicted is b
    assert pool.lookup(hash_b, None, (2,)) is None
    assert pool.lookup(hash_a, None, (1,)) is a


def test_blocks_freed_without_a_hash_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hash0 = cache_block(pool, blocks[0], (0,))
    hash1 = cache_block(pool, blocks[1], (1,))
    pool.free(blocks)  # 0 and 1 keep their hashes, 2 and 3 have nothing worth keeping

    assert free_ids(pool) == [3, 2, 0, 1]
    reused = pool.allocate(2)
    assert [b.block_id for b in reused] == [3, 2]
    assert pool.lookup(hash0, None, (0,)) is blocks[0]
    assert pool.lookup(hash1, None, (1,)) is blocks[1]


def test_touch_takes_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    hash_a = cache_block(pool, a, (7,))
    pool.free([a, b])

    pool.touch([a])
    [other] = pool.allocate(1)

    assert other is b
    assert pool.lookup(hash_a, None, (7,)) is a
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)


def test_lookup_rechecks_parent_hash_and_token_ids() -> None:
    pool = BlockPool(2)
    parent_block, block = pool.allocate(2)
    parent = cache_block(pool, parent_block, (1, 2))
    block_hash = cache_block(pool, block, (3, 4), parent)

    assert pool.lookup(block_hash, parent, (3, 4)) is block
    assert pool.lookup(block_hash, None, (3, 4)) is None
    assert pool.lookup(block_hash, parent + 1, (3, 4)) is None
    assert pool.lookup(block_hash, parent, (3, 5)) is None
    assert pool.lookup(block_hash, parent, (3,)) is None
    assert pool.lookup(block_hash + 1, parent, (3, 4)) is None


def test_hash_block_chains_the_parent() -> None:
    assert hash_block(None, (1, 2)) == hash_block(None, (1, 2))
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1))
    assert hash_block(hash_block(None, (1,)), (2,)) != hash_block(hash_block(None, (3,)), (2,))


def test_first_block_cached_under_a_hash_wins() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    block_hash = cache_block(pool, a, (5,))
    cache_block(pool, b, (5,))

    assert b.block_hash is None
    assert pool.lookup(block_hash, None, (5,)) is a
    pool.free([b, a])
    assert free_ids(pool) == [b.block_id, a.block_id]  # b had no hash, so it goes first


def test_a_block_is_cached_under_one_hash_only() -> None:
    pool = BlockPool(1)
    [block] = pool.allocate(1)
    first = cache_block(pool, block, (1,))
    second = cache_block(pool, block, (2,))
    assert pool.lookup(first, None, (1,)) is block
    assert pool.lookup(second, None, (2,)) is None


def test_caching_disabled_never_registers_blocks() -> None:
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    block_hash = cache_block(pool, block, (1,))
    assert block.block_hash is None
    assert pool.lookup(block_hash, None, (1,)) is None
    pool.free([block])
    assert free_ids(pool)[0] == block.block_id


def test_reset_cache_forgets_unused_blocks_only() -> None:
    pool = BlockPool(2)
    used, unused = pool.allocate(2)
    hash_used = cache_block(pool, used, (1,))
    hash_unused = cache_block(pool, unused, (2,))
    pool.free([unused])

    pool.reset_cache()

    assert pool.lookup(hash_unused, None, (2,)) is None
    assert unused.block_hash is None
    assert pool.lookup(hash_used, None, (1,)) is used
    assert pool.num_free_blocks == 1


def test_reallocated_block_is_forgotten_by_the_cache() -> None:
    pool = BlockPool(1)
    [block] = pool.allocate(1)
    block_hash = cache_block(pool, block, (9, 9))
    pool.free([block])

    [again] = pool.allocate(1)

    assert again is block
    assert (again.block_hash, again.parent_hash, again.token_ids) == (None, None, ())
    assert pool.lookup(block_hash, None, (9, 9)) is None
    # The same content can be registered again on a new block.
    new_hash = cache_block(pool, again, (9, 9))
    assert new_hash == block_hash and pool.lookup(block_hash, None, (9, 9)) is again
