"""The default attention backend: paged attention through the platform's operator table.

Decode rows (one query each, drafts included) attend in one batched `decode_attention` call over padded block
tables and a dense mask; each prefill chunk attends causally over its cached prefix plus itself with
`prefill_attention`. The cache may be narrower than the activations (`kv_cache_dtype`): keys and values are
rounded as they are written and widened where they are read. Over the reference operators this backend is the
numerics baseline every other backend is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from heteroserve.platforms.attention import AttentionBackend, AttentionStep, ScoreModifiers
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
    """The paged backend's metadata; the CPU's fused decode layer reads its decode fields too."""

    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decodes: int = 0  # decode rows (one per query), the first rows of the batch
    decode_block_tables: torch.Tensor | None = None  # [rows, max_blocks]
    decode_mask: torch.Tensor | None = None  # [rows, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


def _window_mask(queries: torch.Tensor, keys: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """True where a query position may attend to a key position: causal, within the window if there is one."""
    mask = keys <= queries
    if sliding_window is not None:
        mask &= keys > queries - sliding_window
    return mask


class PagedAttentionBackend(AttentionBackend):
    """Today's kernels in today's order: write_kv, decode_attention for the decode rows, prefill_attention per
    chunk. With `platform.operator_table(dtype, "reference")` it is plain torch."""

    name = "paged"
    implements_score_modifiers = True

    def __init__(self, ops: OperatorTable) -> None:
        self.ops = ops

    def build_metadata(self, step: AttentionStep) -> AttentionMetadata:
        device = step.device
        meta = AttentionMetadata(torch.tensor(step.slot_mapping, dtype=torch.long, device=device))
        rows = [
            (step.context_len(i) + j, step.block_tables[i])
            for i in range(step.num_decodes)
            for j in range(step.query_len(i))
        ]
        if rows:
            width = max(len(ids) for _, ids in rows)
            tables = torch.tensor([ids + [0] * (width - len(ids)) for _, ids in rows], dtype=torch.long)
            positions = torch.tensor([pos for pos, _ in rows])[:, None]
            mask = _window_mask(positions, torch.arange(width * step.block_size)[None, :], step.sliding_window)
            meta.num_decodes = len(rows)
            meta.decode_block_tables = tables.to(device)
            meta.decode_mask = mask[:, None, None, :].to(device)
        for i in range(step.num_decodes, step.num_requests):
            n, start_pos = step.query_len(i), step.context_len(i)
            mask = None
            if start_pos > 0 or (step.sliding_window is not None and start_pos + n > step.sliding_window):
                queries = torch.arange(start_pos, start_pos + n)[:, None]
                mask = _window_mask(queries, torch.arange(start_pos + n)[None, :], step.sliding_window).to(device)
            ids = torch.tensor(step.block_tables[i], dtype=torch.long, device=device)
            meta.prefills.append(PrefillChunk(step.query_start_loc[i], n, start_pos, ids, mask))
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        modifiers: ScoreModifiers | None = None,
    ) -> torch.Tensor:
        ops = self.ops
        ops.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if metadata.num_decodes:
            b = metadata.num_decodes
            out[:b] = ops.decode_attention(
                q[:b], k_cache, v_cache, metadata.decode_block_tables, metadata.decode_mask, scale, modifiers
            )
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_queries)
            if chunk.start_pos == 0:
                keys, values = k[rows], v[rows]
            else:
                context = chunk.start_pos + chunk.num_queries
                keys = k_cache.index_select(0, chunk.block_ids).flatten(0, 1)[:context].to(q.dtype)
                values = v_cache.index_select(0, chunk.block_ids).flatten(0, 1)[:context].to(q.dtype)
            out[rows] = ops.prefill_attention(q[rows], keys, values, chunk.mask, scale, modifiers)
        return out

    def is_decode_only(self, metadata: AttentionMetadata) -> bool:
        return not metadata.prefills
