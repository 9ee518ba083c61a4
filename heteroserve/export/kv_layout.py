"""Where a graph's keys and values live: our paged block pool, or one contiguous cache row per sequence.

Both layouts write a step's new keys and values first and then read every cached token of each sequence, so a
graph attends over its prefix and itself alike (a prefill chunk after a cached prefix is a prefill too). A row
whose slot is negative is padding: it writes into a scratch row that is dropped, so static-shape graphs can take
shorter inputs without touching a sequence's cache.
"""

from __future__ import annotations

import torch

from heteroserve.export.options import KV_LAYOUTS


def _write(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`cache` [slots, Hkv, D] with new[i] stored at slot rows[i]; negative rows land in a dropped scratch slot."""
    # Made in float32 and cast: ConstantOfShape takes bfloat16 only from opset 20.
    scratch = torch.zeros((1, *cache.shape[1:]), dtype=torch.float32).to(cache.dtype)
    padded = torch.cat((cache, scratch), dim=0)
    index = torch.where(rows >= 0, rows, cache.shape[0])
    return padded.index_copy(0, index, new.to(cache.dtype))[: cache.shape[0]]


class PagedKV:
    """Caches [num_blocks, block_size, Hkv, D] per layer, as the engine's block manager lays them out: token t of
    a sequence sits in block `block_tables[b, t // block_size]` at offset `t % block_size`, and the step's tokens
    are written at `slot_mapping` (block id * block_size + offset)."""

    name = "paged"

    def write(self, cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """new: [B, S, Hkv, D]; slots: [B, S] flat slot ids (-1: padding)."""
        blocks, block_size, heads, dim = cache.shape
        flat = _write(cache.reshape(blocks * block_size, heads, dim), slots.reshape(-1), new.flatten(0, 1))
        return flat.reshape(blocks, block_size, heads, dim)

    def read(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Every sequence's cached tokens in order: [B, max_blocks * block_size, Hkv, D]."""
        b, width = block_tables.shape
        gathered = cache.index_select(0, block_tables.reshape(-1))
        return gathered.reshape(b, width * cache.shape[1], cache.shape[2], cache.shape[3])


class ContiguousKV:
    """Caches [B, max_len, Hkv, D] per layer, one row per sequence: token t of sequence b is `cache[b, t]`; the
    step's tokens are written at their positions (`slots` are then b * max_len + position, -1: padding)."""

    name = "contiguous"

    def write(self, cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, length, heads, dim = cache.shape
        flat = _write(cache.reshape(b * length, heads, dim), slots.reshape(-1), new.flatten(0, 1))
        return flat.reshape(b, length, heads, dim)

    def read(self, cache: torch.Tensor, block_tables: torch.Tensor | None) -> torch.Tensor:
        return cache


def kv_layout(name: str) -> PagedKV | ContiguousKV:
    if name == "paged":
        return PagedKV()
    if name == "contiguous":
        return ContiguousKV()
    raise ValueError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {name!r}")
