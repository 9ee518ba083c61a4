"""Paged attention: the cache layout, the per-step metadata, and the order of the platform's operators.

The KV cache of a layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; token t of a
request lives in block `block_table[t // block_size]` at offset `t % block_size`. The flattened batch
holds decode tokens (one query each, attended in one batched call) first, then prefill chunks, each of
which attends causally over its cached prefix plus itself. The cache may be narrower than the activations
(`kv_cache_dtype`): keys and values are rounded as they are written and widened where they are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from heteroserve.platforms.operators import OperatorTable


@dataclass
class PrefillChunk:
    query_start: int  # offset in the flattened batch
    num_queries: int
    start_pos: int  # position of the first query token; tokens before it are read from the cache
    block_ids: torch.Tensor
    mask: torch.Tensor | None  # None: plain causal over the chunk itself


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_attention_metadata(
    block_size: int,
    slot_mapping: list[int],
    decodes: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int, int, list[int]]],
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """decodes: (position, block_ids) per one-token request; prefills: (query_start, n, start_pos, block_ids)."""
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device))
    if decodes:
        width = max(len(ids) for _, ids in decodes)
        tables = torch.tensor([ids + [0] * (width - len(ids)) for _, ids in decodes], dtype=torch.long)
        positions = torch.tensor([pos for pos, _ in decodes])[:, None]
        keys = torch.arange(width * block_size)[None, :]
        mask = keys <= positions
        if sliding_window is not None:
            mask &= keys > positions - sliding_window
        meta.num_decodes = len(decodes)
        meta.decode_block_tables = tables.to(device)
        meta.decode_mask = mask[:, None, None, :].to(device)
    for query_start, n, start_pos, block_ids in prefills:
        mask = None
        if start_pos > 0 or (sliding_window is not None and start_pos + n > sliding_window):
            queries = torch.arange(start_pos, start_pos + n)[:, None]
            keys = torch.arange(start_pos + n)[None, :]
            mask = keys <= queries
            if sliding_window is not None:
                mask &= keys > queries - sliding_window
            mask = mask.to(device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        meta.prefills.append(PrefillChunk(query_start, n, start_pos, ids, mask))
    return meta


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    ops: OperatorTable,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]. Writes k, v into the cache, returns [T, Hq, D]."""
    ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        b = meta.num_decodes
        out[:b] = ops.decode_attention(q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
        if chunk.start_pos == 0:
            keys, values = k[rows], v[rows]
        else:
            context = chunk.start_pos + chunk.num_queries
            keys = k_cache.index_select(0, chunk.block_ids).flatten(0, 1)[:context].to(q.dtype)
            values = v_cache.index_select(0, chunk.block_ids).flatten(0, 1)[:context].to(q.dtype)
        out[rows] = ops.prefill_attention(q[rows], keys, values, chunk.mask, scale)
    return out
