"""A compressed weight whose input columns were reordered at load so that its groups are contiguous.

GPTQ's act-order (`desc_act`) quantises columns in order of decreasing activation size, so a group's columns
are scattered; `g_idx[k]` names the group of input column k. Sorting the columns by group once at load
gives a plain grouped weight that the packed kernels read, and the product then gathers the activations'
columns in the same order: y = x[:, order] @ w_sorted^T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.quantization.weight import CompressedWeight, move_tensors


@dataclass
class PermutedInput:
    weight: CompressedWeight  # Int4Weight, Int8Weight or a platform's packed form of one, over sorted columns
    order: torch.Tensor  # int64 [K]: sorted column j is input column order[j]

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.order.numel() * self.order.element_size()

    def to(self, device: torch.device) -> PermutedInput:
        return move_tensors(self, device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(-1, self.order)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.weight.matmul(self.gather(x), bias)

    def slice_rows(self, start: int, end: int) -> PermutedInput:
        """Output rows keep the column order, so they split like the inner weight's."""
        return PermutedInput(self.weight.slice_rows(start, end), self.order)

    def slice_columns(self, start: int, end: int) -> PermutedInput:
        raise ValueError("act-order weights read their input columns out of order: they cannot be split by column")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the checkpoint's column order."""
        sorted_columns = self.weight.dequantize(dtype)
        return torch.empty_like(sorted_columns).index_copy_(1, self.order, sorted_columns)

    @staticmethod
    def cat(parts: list[PermutedInput]) -> PermutedInput | None:
        """Fused projections (q/k/v, gate/up) read one input: their column orders must agree; None otherwise.

        GPTQ derives the order from the layer input's Hessian, which q, k and v share, so real checkpoints agree.
        """
        first, inner = parts[0].order, [p.weight for p in parts]
        if any(not torch.equal(p.order, first) for p in parts[1:]) or len({type(w) for w in inner}) != 1:
            return None
        return PermutedInput(type(inner[0]).cat(inner), first)
