"""The KV cache of a model whose layers attend differently, as one manager per kind of layer (a KV group).

Layers with the same sliding window (None: full attention) form a group with its own block pool and its own block
table per request, so a window's layers keep only the blocks their window can see (kv_cache_manager.py) while the
full-attention layers keep the whole context: Gemma 2 alternates the two, Gemma 3 has five local layers to each
global one, and a long context costs what the global layers need. A request is scheduled only when every group
has room for it. The scheduler sees the interface of a single KVCacheManager; a step's block ids are one list
per group, in `windows` order.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroserve.core.block_pool import BlockPool, KVBlock
from heteroserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from heteroserve.core.request import Request


@dataclass(frozen=True)
class KVGroupSpec:
    sliding_window: int | None  # None: full attention
    num_blocks: int


class KVCacheGroups:
    def __init__(self, groups: list[KVGroupSpec], block_size: int, enable_prefix_caching: bool = True) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.windows = [g.sliding_window for g in groups]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.managers = [
            KVCacheManager(g.num_blocks, block_size, enable_prefix_caching, g.sliding_window) for g in groups
        ]
        self.stats = PrefixCacheStats()

    @property
    def pool(self) -> BlockPool:
        """The first group's pool (the full-attention layers' where the model has any)."""
        return self.managers[0].pool

    @property
    def num_blocks(self) -> int:
        return sum(m.pool.num_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        """The fullest group's share of used blocks: the one that runs out first."""
        return max(m.usage for m in self.managers)

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [m.block_ids(request_id) for m in self.managers]

    def find_cached_prefix(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Each group's cached full blocks of the request's prefix, cut to the length every group has."""
        found = [m.find_cached_prefix(request)[0] for m in self.managers]
        num_blocks = min(len(hits) for hits in found)
        return [hits[:num_blocks] for hits in found], num_blocks * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[list[KVBlock]] | tuple = ()
    ) -> bool:
        """All groups or none: False (nothing changed) when one of them runs out."""
        cached = list(cached_blocks) or [[] for _ in self.managers]
        if not all(m.can_allocate(request, num_new_tokens, c) for m, c in zip(self.managers, cached, strict=True)):
            return False
        for manager, hits in zip(self.managers, cached, strict=True):
            manager.take_slots(request, num_new_tokens, hits)
        return True

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)

    def cache_computed_blocks(self, request: Request) -> None:
        for manager in self.managers:
            manager.cache_computed_blocks(request)

    def reset_cache(self) -> None:
        """Forgets every unused cached block of every group (e.g. between benchmark runs)."""
        for manager in self.managers:
            manager.pool.reset_cache()
