"""Attention backends: what the model runner knows of a step, and the platform's way of attending over the cache.

The KV cache of a layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]; token t of a request
lives in block `block_table[t // block_size]` at offset `t % block_size`. The runner describes each step once, in
device-neutral terms (`AttentionStep`: block tables, sequence lengths, cumulative query offsets, slot mapping);
the platform's `AttentionBackend` turns that into whatever its kernels take (dense masks, padded tables, gather
indices) once per step, and every layer hands it the same metadata. The paged backend over the operator table
(paged_attention.py) is every platform's default, and with the reference operators the numerics baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionStep:
    """A step's requests as the runner flattened them: the first `num_decodes` are decode requests (their tokens
    are one-token decodes and draft tokens, each attending to its own prefix), the rest prefill chunks.

    Request i owns query rows `query_start_loc[i]:query_start_loc[i + 1]`, the last of its `seq_lens[i]` cached
    tokens after the step; its earlier tokens are already in the cache, in `block_tables[i]`."""

    block_size: int
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]  # one more entry than requests: 0, then each request's end row
    num_decodes: int
    slot_mapping: list[int]  # the cache slot of every query row, where its new key and value are written
    sliding_window: int | None
    device: torch.device

    @classmethod
    def of(
        cls,
        block_size: int,
        requests: list[tuple[list[int], int, int]],
        num_decodes: int,
        sliding_window: int | None,
        device: torch.device | str,
    ) -> AttentionStep:
        """The step of `requests`, each (block_ids, first new position, number of new tokens), decodes first."""
        query_start_loc, seq_lens, slots = [0], [], []
        for block_ids, start, n in requests:
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        tables = [list(block_ids) for block_ids, _, _ in requests]
        return cls(
            block_size, tables, seq_lens, query_start_loc, num_decodes, slots, sliding_window, torch.device(device)
        )

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def context_len(self, i: int) -> int:
        """Tokens of request i cached before this step: the position of its first query."""
        return self.seq_lens[i] - self.query_len(i)


@dataclass(frozen=True)
class ScoreModifiers:
    """What a layer does to its attention scores besides the scale and the mask (None: nothing)."""

    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    sinks: torch.Tensor | None = None  # [Hq] a logit per query head that joins the softmax and attends to nothing
    # (gpt-oss's attention sinks: the probabilities of the real keys sum to less than 1)


class AttentionBackend(ABC):
    """A platform's attention: metadata built once per step, then one call per layer that stores the step's keys
    and values in the cache and attends. Subclasses must match the reference numerics (paged_attention.py with
    the reference operators)."""

    name: str
    implements_score_modifiers: bool = False  # whether forward takes `modifiers` (ScoreModifiers)

    @abstractmethod
    def build_metadata(self, step: AttentionStep) -> Any:
        """What this backend's kernels need for the step, on `step.device`; every layer gets the same object."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        modifiers: ScoreModifiers | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] in the step's row order. Writes k, v at their slots (rounded to the
        cache's dtype) and returns the attention output [T, Hq, D]. modifiers: what the layer does to the scores
        besides scale and mask; only given to a backend that `implements_score_modifiers`."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The shape of one layer's key (or value) cache, which the model runner allocates and `forward` receives.
        The default is [blocks, block_size, heads, head_size] (slot = block * block_size + offset, the layout the
        reference operators and the CPU's kernels read); a device whose paged kernels want another layout (heads
        before the block's tokens, say) returns its own, with num_blocks first."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    def is_decode_only(self, metadata: Any) -> bool:
        """Whether the step holds decode rows only and its metadata is what the platform's fused decode layer
        reads (operators.FusedDecodeLayer); a backend whose metadata it cannot read answers False."""
        return False
