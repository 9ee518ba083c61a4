"""Maps requests to KV blocks: prefix-cache lookup, slot allocation as tokens arrive, and freeing.

One manager serves the layers of one attention kind (a KV group, kv_cache_groups.py). For layers with a sliding
window it releases each request's blocks that have fallen out of the window: a block table keeps its length (a
token's block is still at index position // block_size) and a released entry reads RELEASED_BLOCK, which the
attention mask hides."""

from __future__ import annotations

from dataclasses import dataclass

from heteroserve.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from heteroserve.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached


# The block id a released table entry reads: any valid block serves, as no query attends to its positions.
RELEASED_BLOCK = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock | None]] = {}  # None: released (out of the window)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the prefix cache

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [RELEASED_BLOCK if b is None else b.block_id for b in self._blocks.get(request_id, ())]

    def num_live_blocks(self, request_id: str) -> int:
        """The blocks the request holds (those released out of its window not counted)."""
        return sum(1 for b in self._blocks.get(request_id, ()) if b is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached full blocks at the start of the request's tokens; the last token is always left to compute."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = None
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, parent, self._block_key(request, i))
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[KVBlock] = ()) -> bool:
        """Whether `allocate_slots` would succeed (nothing changes). Blocks released out of the window count as
        free, cache hits the window no longer sees cost nothing (they are taken and given straight back)."""
        owned = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        first = 0 if self.sliding_window is None else self._first_visible_block(num_computed)
        new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(owned) - len(cached_blocks)
        kept_hits = sum(1 for i, b in enumerate(cached_blocks, len(owned)) if b.ref_count == 0 and i >= first)
        released = sum(1 for b in owned[:first] if b is not None)
        return new_blocks <= self.pool.num_free_blocks - kept_hits + released

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[KVBlock] = ()) -> bool:
        """Makes room for `num_new_tokens` after the computed (and newly cached) ones; False if blocks run out.
        With a sliding window, the blocks no query from here on can see are released first."""
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        self.take_slots(request, num_new_tokens, cached_blocks)
        return True

    def take_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[KVBlock] = ()) -> None:
        """`allocate_slots` once `can_allocate` has said yes (KVCacheGroups checks every group first)."""
        owned = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        self.pool.touch(list(cached_blocks))
        owned.extend(cached_blocks)
        self._release_outside_window(owned, num_computed)
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(owned)
        if needed > 0:
            owned.extend(self.pool.allocate(needed))

    def _first_visible_block(self, num_computed: int) -> int:
        """The first block a query at position >= num_computed can attend to: keys after num_computed - window."""
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def _release_outside_window(self, owned: list[KVBlock | None], num_computed: int) -> None:
        if self.sliding_window is None:
            return
        end = min(self._first_visible_block(num_computed), len(owned))
        released = [b for b in owned[:end] if b is not None]
        owned[:end] = [None] * end
        self.pool.free(list(reversed(released)))

    def free(self, request: Request) -> None:
        blocks = [b for b in self._blocks.pop(request.request_id, []) if b is not None]
        self.pool.free(list(reversed(blocks)))
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def _block_key(self, request: Request, i: int) -> tuple:
        """What block i holds: its token ids, plus the content hash of every image whose tokens it covers
        (image placeholder tokens are all the same id, so the ids alone cannot tell two images apart), plus the
        LoRA adapter that computed it (the same tokens under two adapters have different KV)."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        key = tuple(request.token_ids[start:end])
        images = tuple(
            p.content_hash for p in request.image_placeholders if p.offset < end and p.offset + p.length > start
        )
        adapter = (("lora", request.lora_id),) if request.lora_id else ()
        return key + images + adapter if images or adapter else key

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(request.request_id, [])
        size = self.block_size
        while (len(hashes) + 1) * size <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self._block_key(request, i)))
        return hashes

    def cache_computed_blocks(self, request: Request) -> None:
        """Offers the request's full blocks whose KV is now computed to the prefix cache.

        Only computed blocks are offered, so a hit never reads KV that a forward pass has yet to write.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        owned = self._blocks.get(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(owned))
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            if owned[i] is None:  # released out of the window before it was offered
                continue
            parent = hashes[i - 1] if i else None
            self.pool.cache(owned[i], hashes[i], parent, self._block_key(request, i))
        self._num_registered[rid] = num_full
