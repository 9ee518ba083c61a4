"""KV groups: a sliding window's layers keep only the blocks their window can see; all groups allocate or none."""

from __future__ import annotations

from heteroserve.core.kv_cache_groups import KVCacheGroups, KVGroupSpec
from heteroserve.core.kv_cache_manager import RELEASED_BLOCK, KVCacheManager
from heteroserve.core.request import Request
from heteroserve.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 6


def _request(name: str, prompt_len: int) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams())


def _compute(manager, request: Request, num_new: int) -> None:
    """One step: room for num_new tokens, then they count as computed (and are offered to the prefix cache), and
    the request has a next token to compute."""
    assert manager.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    while request.num_tokens < request.num_computed_tokens + 1:
        request.token_ids.append(99)
    manager.cache_computed_blocks(request)


def test_a_window_keeps_the_blocks_it_can_see_and_the_table_keeps_its_length():
    manager = KVCacheManager(16, BLOCK, sliding_window=WINDOW)
    request = _request("a", 10)
    _compute(manager, request, 10)  # prompt: positions 0-9, blocks 0-2
    assert manager.num_live_blocks("a") == 3
    for _ in range(30):  # decode one token a step up to position 39
        _compute(manager, request, 1)
        position = request.num_computed_tokens - 1  # the query of the step just computed
        table = manager.block_ids("a")
        assert len(table) == position // BLOCK + 1  # a token's block is still at position // BLOCK
        first_visible = max(0, position - WINDOW + 1) // BLOCK  # the block of the oldest key that query attends
        assert manager.num_live_blocks("a") == len(table) - first_visible
        assert all(b == RELEASED_BLOCK for b in table[:first_visible])
        assert manager.num_live_blocks("a") <= -(-WINDOW // BLOCK) + 1
    assert manager.pool.num_used_blocks == manager.num_live_blocks("a")
    manager.free(request)
    assert manager.pool.num_used_blocks == 0


def test_without_a_window_nothing_is_released():
    manager = KVCacheManager(16, BLOCK)
    request = _request("a", 10)
    _compute(manager, request, 10)
    for _ in range(20):
        _compute(manager, request, 1)
    assert manager.num_live_blocks("a") == len(manager.block_ids("a")) == -(-31 // BLOCK)


def test_a_window_needs_fewer_blocks_so_a_small_pool_serves_a_long_request():
    """Eight blocks of 4 cannot hold 40 tokens, but a 6-token window needs at most three of them."""
    manager = KVCacheManager(8, BLOCK, sliding_window=WINDOW)
    request = _request("a", 4)
    _compute(manager, request, 4)
    for _ in range(36):
        _compute(manager, request, 1)
    assert request.num_computed_tokens == 40


def test_groups_allocate_all_or_nothing():
    groups = KVCacheGroups([KVGroupSpec(None, 4), KVGroupSpec(WINDOW, 16)], BLOCK)
    big = _request("big", 16)
    assert groups.allocate_slots(big, 16)
    assert groups.block_ids("big")[0] == groups.managers[0].block_ids("big")
    small = _request("small", 5)
    assert not groups.allocate_slots(small, 5)  # the full-attention group is full
    assert groups.managers[1].block_ids("small") == []  # and the window's group took nothing
    assert groups.managers[1].pool.num_used_blocks == 4
    assert groups.usage == 1.0  # the fullest group's share


def test_a_prefix_hit_is_what_every_group_still_has():
    groups = KVCacheGroups([KVGroupSpec(None, 32), KVGroupSpec(WINDOW, 32)], BLOCK)
    first = _request("first", 20)
    assert groups.allocate_slots(first, 20)
    first.num_computed_tokens = 20
    groups.cache_computed_blocks(first)
    groups.free(first)
    again = _request("again", 20)
    hits, num_cached = groups.find_cached_prefix(again)
    assert num_cached == 16 and [len(h) for h in hits] == [4, 4]  # every full block but the last token's
    # Evict the window group's second block: the hit stops before it in both groups.
    evicted = hits[1][1]
    groups.managers[1].pool._evict(evicted)
    hits, num_cached = groups.find_cached_prefix(again)
    assert num_cached == BLOCK and [len(h) for h in hits] == [1, 1]
    assert groups.allocate_slots(again, 20 - num_cached, hits)
