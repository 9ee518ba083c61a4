"""KVCacheManager: slot allocation as tokens arrive, prefix-cache hits, and freeing."""

from __future__ import annotations

import itertools

import pytest

from heteroserve.core.kv_cache_manager import KVCacheManager
from heteroserve.core.request import Request
from heteroserve.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt: list[int], **params: object) -> Request:
    return Request(f"r{next(_ids)}", list(prompt), SamplingParams(**params))


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does around a forward pass of `num_tokens` new tokens."""
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_computed_blocks(request)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheManager(4, 0)


@pytest.mark.parametrize(
    ("block_size", "num_tokens", "blocks"),
    [(1, 1, 1), (1, 5, 5), (4, 1, 1), (4, 4, 1), (4, 5, 2), (16, 33, 3)],
)
def test_blocks_needed_rounds_up(block_size: int, num_tokens: int, blocks: int) -> None:
    assert KVCacheManager(8, block_size).blocks_needed(num_tokens) == blocks


def test_allocate_slots_grows_blocks_as_tokens_arrive() -> None:
    manager = KVCacheManager(8, block_size=4)
    request = make_request([1, 2, 3, 4, 5])

    assert manager.allocate_slots(request, 5)
    assert len(manager.block_ids(request.request_id)) == 2
    request.num_computed_tokens = 5
    owned_before = manager.block_ids(request.request_id)

    for total in range(6, 18):  # decode one token at a time
        request.append_output_token(total)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        owned = manager.block_ids(request.request_id)
        assert len(owned) == -(-total // 4)
        assert owned[: len(owned_before)] == owned_before  # existing blocks are kept, in order
        owned_before = owned
    assert manager.pool.num_used_blocks == 5
    assert manager.usage == pytest.approx(5 / 8)


def test_allocate_slots_in_chunks() -> None:
    manager = KVCacheManager(8, block_size=4)
    request = make_request(list(range(10)))
    for chunk, blocks in [(3, 1), (3, 2), (3, 3), (1, 3)]:
        assert manager.allocate_slots(request, chunk)
        request.num_computed_tokens += chunk
        assert len(manager.block_ids(request.request_id)) == blocks


def test_allocate_slots_fails_without_changing_state() -> None:
    manager = KVCacheManager(3, block_size=4)
    first = make_request(list(range(8)))
    assert manager.allocate_slots(first, 8)
    second = make_request(list(range(100, 108)))

    assert not manager.allocate_slots(second, 8)

    assert manager.block_ids(second.request_id) == []
    assert second.request_id not in manager._blocks
    assert manager.pool.num_free_blocks == 1
    assert manager.allocate_slots(second, 4)  # what does fit still can be had
    assert len(manager.block_ids(second.request_id)) == 1


def test_allocate_slots_failure_keeps_a_running_requests_blocks() -> None:
    manager = KVCacheManager(3, block_size=2)
    request = make_request([1, 2, 3])
    compute(manager, request, 3)
    owned = manager.block_ids(request.request_id)
    assert len(owned) == 2

    request.token_ids.extend([4, 5, 6, 7])
    assert not manager.allocate_slots(request, 4)  # 7 tokens need 4 blocks: 2 more, only 1 free

    assert manager.block_ids(request.request_id) == owned
    assert manager.pool.num_free_blocks == 1
    assert [b.ref_count for b in manager.pool.blocks if b.block_id in owned] == [1, 1]


def test_free_returns_every_block() -> None:
    manager = KVCacheManager(4, block_size=2)
    request = make_request([1, 2, 3, 4, 5])
    compute(manager, request, 5)
    assert manager.pool.num_free_blocks == 1

    manager.free(request)

    assert manager.pool.num_free_blocks == 4
    assert manager.block_ids(request.request_id) == []
    assert request.request_id not in manager._hashes
    assert request.request_id not in manager._num_registered
    manager.free(request)  # freeing twice is harmless
    assert manager.pool.num_free_blocks == 4


def test_no_prefix_hit_before_blocks_are_computed() -> None:
    manager = KVCacheManager(16, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks and one token
    first = make_request(prompt)
    assert manager.allocate_slots(first, len(prompt))  # scheduled but not yet computed

    assert manager.find_cached_prefix(make_request(prompt)) == ([], 0)


def test_prefix_hits_grow_with_computed_blocks() -> None:
    manager = KVCacheManager(16, block_size=4)
    prompt = list(range(1, 14))
    first = make_request(prompt)
    assert manager.allocate_slots(first, len(prompt))
    owned = manager.block_ids(first.request_id)

    for computed, hit_blocks in [(3, 0), (4, 1), (7, 1), (8, 2), (13, 3)]:
        first.num_computed_tokens = computed
        manager.cache_computed_blocks(first)
        hits, num_hit_tokens = manager.find_cached_prefix(make_request(prompt))
        assert [b.block_id for b in hits] == owned[:hit_blocks]
        assert num_hit_tokens == 4 * hit_blocks


def test_cache_computed_blocks_needs_advanced_num_computed_tokens() -> None:
    manager = KVCacheManager(16, block_size=4)
    prompt = list(range(1, 14))
    first = make_request(prompt)
    assert manager.allocate_slots(first, len(prompt))
    manager.cache_computed_blocks(first)  # nothing computed yet
    assert manager.find_cached_prefix(make_request(prompt)) == ([], 0)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_last_prompt_token_is_never_served_from_cache(block_size: int) -> None:
    manager = KVCacheManager(64, block_size=block_size)
    prompt = list(range(1, 3 * block_size + 1))  # exactly 3 full blocks
    compute(manager, make_request(prompt), len(prompt))

    hits, num_hit_tokens = manager.find_cached_prefix(make_request(prompt))
    assert len(hits) == 2
    assert num_hit_tokens == 2 * block_size

    longer = make_request(prompt + [99])
    hits, num_hit_tokens = manager.find_cached_prefix(longer)
    assert len(hits) == 3 and num_hit_tokens == 3 * block_size


def test_single_token_prompt_never_hits() -> None:
    manager = KVCacheManager(4, block_size=1)
    compute(manager, make_request([5, 6]), 2)
    assert manager.find_cached_prefix(make_request([5])) == ([], 0)
    assert len(manager.find_cached_prefix(make_request([5, 7]))[0]) == 1


def test_prefix_hit_stops_at_the_first_different_block() -> None:
    manager = KVCacheManager(16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    first = make_request(prompt)
    compute(manager, first, len(prompt))
    owned = manager.block_ids(first.request_id)

    hits, _ = manager.find_cached_prefix(make_request([1, 2, 3, 9, 5, 6, 7]))
    assert [b.block_id for b in hits] == owned[:1]
    # The hash is chained: an equal later block after a different one is not a hit.
    assert manager.find_cached_prefix(make_request([0, 2, 3, 4, 5, 6, 7])) == ([], 0)


def test_output_tokens_are_cached_too() -> None:
    manager = KVCacheManager(16, block_size=2)
    first = make_request([1, 2, 3])
    compute(manager, first, 3)
    first.append_output_token(4)
    compute(manager, first, 1)
    first.append_output_token(5)

    hits, num_hit_tokens = manager.find_cached_prefix(make_request([1, 2, 3, 4, 5]))
    assert num_hit_tokens == 4
    assert [b.block_id for b in hits] == manager.block_ids(first.request_id)[:2]


def test_cached_blocks_survive_their_request_until_evicted() -> None:
    manager = KVCacheManager(4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    first = make_request(prompt)
    compute(manager, first, len(prompt))
    owned = manager.block_ids(first.request_id)
    manager.free(first)
    assert manager.pool.num_free_blocks == 4

    hits, _ = manager.find_cached_prefix(make_request(prompt))
    assert [b.block_id for b in hits] == owned[:3]

    # Blocks are freed tail first: the partial last block (no hash) goes first, then the last cached one.
    other = make_request([50, 51, 52, 53])
    assert manager.allocate_slots(other, 4)
    assert manager.block_ids(other.request_id) == [owned[3], owned[2]]
    hits, _ = manager.find_cached_prefix(make_request(prompt))
    assert [b.block_id for b in hits] == owned[:2]


def test_allocate_slots_with_hits_shares_the_blocks() -> None:
    manager = KVCacheManager(8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    first = make_request(prompt)
    compute(manager, first, len(prompt))
    second = make_request(prompt)
    hits, num_hit_tokens = manager.find_cached_prefix(second)
    assert num_hit_tokens == 4

    assert manager.allocate_slots(second, len(prompt) - num_hit_tokens, hits)

    owned = manager.block_ids(second.request_id)
    assert owned[:2] == manager.block_ids(first.request_id)[:2]
    assert owned[2] != manager.block_ids(first.request_id)[2]
    assert [b.ref_count for b in hits] == [2, 2]
    assert manager.pool.num_used_blocks == 4

    manager.free(first)
    assert [b.ref_count for b in hits] == [1, 1]
    manager.free(second)
    assert manager.pool.num_free_blocks == 8


def test_unused_cached_hits_count_as_reclaimable() -> None:
    manager = KVCacheManager(3, block_size=4)
    prompt = list(range(9))
    first = make_request(prompt)
    compute(manager, first, 9)
    manager.free(first)  # 3 free blocks, 2 of them cached

    second = make_request(prompt)
    hits, num_hit_tokens = manager.find_cached_prefix(second)
    assert len(hits) == 2
    assert manager.allocate_slots(second, 9 - num_hit_tokens, hits)
    assert manager.pool.num_free_blocks == 0
    manager.free(second)

    third = make_request(prompt[:8] + [20, 21, 22, 23, 24])  # two hits, then 5 tokens needing 2 blocks
    hits, num_hit_tokens = manager.find_cached_prefix(third)
    assert len(hits) == 2
    assert not manager.allocate_slots(third, 13 - num_hit_tokens, hits)
    assert manager.block_ids(third.request_id) == []
    assert all(b.ref_count == 0 for b in hits)
    assert manager.pool.num_free_blocks == 3
    assert manager.find_cached_prefix(make_request(prompt))[1] == 8  # the failed attempt evicted nothing


def test_no_hits_with_prefix_caching_disabled() -> None:
    manager = KVCacheManager(16, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    first = make_request(prompt)
    compute(manager, first, 5)
    assert manager.find_cached_prefix(make_request(prompt)) == ([], 0)
    manager.free(first)
    assert all(b.block_hash is None for b in manager.pool.blocks)


def test_no_hits_when_prompt_logprobs_are_wanted() -> None:
    manager = KVCacheManager(16, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    compute(manager, make_request(prompt), 5)
    assert manager.find_cached_prefix(make_request(prompt, prompt_logprobs=1)) == ([], 0)
    assert manager.find_cached_prefix(make_request(prompt))[1] == 4


def test_record_prefix_lookup_accumulates() -> None:
    manager = KVCacheManager(4, block_size=2)
    assert (manager.stats.queries, manager.stats.hits) == (0, 0)
    manager.record_prefix_lookup(10, 4)
    manager.record_prefix_lookup(7, 0)
    assert (manager.stats.queries, manager.stats.hits) == (17, 4)


def test_preempted_request_hits_its_own_cached_blocks() -> None:
    manager = KVCacheManager(8, block_size=2)
    request = make_request([1, 2, 3, 4, 5, 6])
    compute(manager, request, 6)
    request.append_output_token(7)
    owned = manager.block_ids(request.request_id)

    manager.free(request)  # preemption: blocks freed, KV recomputed later from the tokens so far
    request.num_computed_tokens = 0

    hits, num_hit_tokens = manager.find_cached_prefix(request)
    assert num_hit_tokens == 6
    assert [b.block_id for b in hits] == owned
