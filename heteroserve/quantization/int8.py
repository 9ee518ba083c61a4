"""8-bit weights with a scale (and optionally a zero) per group of input columns, kept compressed in memory.

w[n, k] = q[n, k] * scale[n, k // group] + zero[n, k // group],  q in -128..127 (zero absent: 0).

Symmetric formats (GGUF Q8_0, symmetric GPTQ 8-bit, `--quantization int8`) have no zero. Narrower integer
formats that have no kernel of their own (GGUF Q5_x, Q6_K, K-quant 5-bit) are kept here too: 8 bits a weight
instead of 32, read by the same code. A per-channel weight is one group as wide as the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.weight import move_tensors


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]
    group_size: int
    zero: torch.Tensor | None = None  # float32 [N, K / group], or None for symmetric weights

    def __post_init__(self) -> None:
        n, k = self.q.shape
        groups = (n, k // self.group_size)
        if self.q.dtype != torch.int8 or k % self.group_size or tuple(self.scale.shape) != groups:
            raise ValueError(
                f"int8 weight {self.q.dtype} {(n, k)} does not fit group size {self.group_size} / "
                f"scale shape {tuple(self.scale.shape)}"
            )
        if self.zero is not None and tuple(self.zero.shape) != groups:
            raise ValueError(f"int8 weight zero shape {tuple(self.zero.shape)} differs from scale shape {groups}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        tensors = (self.q, self.scale) if self.zero is None else (self.q, self.scale, self.zero)
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> Int8Weight:
        return move_tensors(self, device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(slice(None)).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The reference product: the weight expanded to x's dtype (platforms repack it for their kernels)."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def slice_rows(self, start: int, end: int) -> Int8Weight:
        zero = None if self.zero is None else self.zero[start:end].clone()
        return Int8Weight(self.q[start:end].clone(), self.scale[start:end].clone(), self.group_size, zero)

    def slice_columns(self, start: int, end: int) -> Int8Weight:
        """Columns split at group borders only (a per-channel weight is one group: it cannot be split)."""
        g = self.group_size
        if start % g or end % g:
            raise ValueError(f"8-bit groups of {g} columns cannot be split at column {start if start % g else end}")
        zero = None if self.zero is None else self.zero[:, start // g : end // g].contiguous()
        return Int8Weight(self.q[:, start:end].contiguous(), self.scale[:, start // g : end // g].contiguous(), g, zero)

    def rows(self, index) -> torch.Tensor:
        """Float32 rows `index` (an embedding lookup), without dequantising the rest."""
        q, scale = self.q[index], self.scale[index]
        grouped = q.float().unflatten(-1, (-1, self.group_size)) * scale[..., None]
        if self.zero is not None:
            grouped = grouped + self.zero[index][..., None]
        return grouped.flatten(-2)

    def permute_rows(self, order: torch.Tensor) -> Int8Weight:
        zero = None if self.zero is None else self.zero[order]
        return Int8Weight(self.q[order], self.scale[order], self.group_size, zero)

    @classmethod
    def from_int4(cls, weight: Int4Weight) -> Int8Weight:
        """4-bit weights held at 8 bits, the same values: q - 8 with the same scales and zeros."""
        q = (weight.values().to(torch.int16) - 8).to(torch.int8)
        return cls(q, weight.scale.clone(), weight.group_size, weight.zero.clone())

    def regroup(self, group_size: int) -> Int8Weight:
        """The same values in groups of `group_size` (a divisor of this one's): each scale and zero repeated."""
        if self.group_size % group_size:
            raise ValueError(f"groups of {self.group_size} cannot be split into groups of {group_size}")
        repeat = self.group_size // group_size
        zero = None if self.zero is None else self.zero.repeat_interleave(repeat, dim=1)
        return Int8Weight(self.q, self.scale.repeat_interleave(repeat, dim=1), group_size, zero)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Stacks output rows (used to fuse q/k/v and gate/up projections); all parts share one group size."""
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"cannot fuse int8 weights with different group sizes {sorted(sizes)}")
        zeros = [p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts]
        zero = None if all(p.zero is None for p in parts) else torch.cat(zeros)
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), sizes.pop(), zero)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Round-to-nearest symmetric int8, one scale per row (`group_size` None) or per group of input columns
    (for `--quantization int8` on float checkpoints)."""
    n, k = weight.shape
    group_size = group_size or k
    groups = weight.float().view(n, k // group_size, group_size)
    scale = (groups.abs().amax(-1) / 127).clamp(min=1e-12)
    q = (groups / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(n, k), scale, group_size)
