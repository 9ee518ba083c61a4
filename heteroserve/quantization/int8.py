"""8-bit weights with one scale per group of 32 input columns (GGUF Q8_0): w[n, k] = q[n, k] * scale[n, k // 32].

Used for the token embedding, which is read by rows (a lookup dequantises only the rows it needs) and,
when tied, also serves as the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(slice(None)).to(dtype)

    def rows(self, index) -> torch.Tensor:
        """Float32 rows `index` (an embedding lookup), without dequantising the rest."""
        q, scale = self.q[index], self.scale[index]
        grouped = q.float().unflatten(-1, (-1, self.group_size)) * scale[..., None]
        return grouped.flatten(-2)

    def permute_rows(self, order: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[order], self.scale[order], self.group_size)
