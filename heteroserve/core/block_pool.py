"""A fixed pool of KV-cache blocks with reference counts and an LRU prefix cache.

Free blocks are kept in eviction order: a block whose last user leaves goes to the back, keeping its
hash, so it can still be reused by a later request with the same prefix until it is handed out again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockHash = int


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    """Chained hash of a full block: equal hashes mean equal prefixes (token ids are re-checked on a hit)."""
    return hash((parent_hash, token_ids))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()

    def forget_hash(self) -> None:
        self.block_hash, self.parent_hash, self.token_ids = None, None, ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody uses, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[KVBlock]:
        """Hands out `count` blocks from the front of the free queue, evicting their cached contents."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, only {len(self._free)} free")
        out = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cache hits, pulling unused ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops one reference on each block; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than it was used")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)  # nothing to keep: reuse first
                else:
                    self._free[block.block_id] = block

    def cache(
        self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]
    ) -> None:
        """Registers a full, in-use block for reuse; the first block with a given hash wins."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.forget_hash()

    def reset_cache(self) -> None:
        """Forgets every unused cached block (e.g. after weights change)."""
        for block in self._free.values():
            self._evict(block)
