"""4-bit weights with a scale and a zero per group of input columns, kept compressed in memory.

w[n, k] = (q[n, k] - 8) * scale[n, k // group] + zero[n, k // group],  q in 0..15.

That form covers symmetric formats (zero = 0, e.g. GGUF Q4_0) and asymmetric ones (GGUF Q4_1:
w = d q + m, so scale = d and zero = m + 8 d). Two values share a byte: even k in the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heteroserve.quantization.weight import move_tensors


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2]
    scale: torch.Tensor  # float32 [N, K / group]
    zero: torch.Tensor  # float32 [N, K / group]
    group_size: int

    @classmethod
    def from_values(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> Int4Weight:
        """q: integer tensor [N, K] with values 0..15."""
        n, k = q.shape
        if k % group_size or k % 2 or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(
                f"int4 weight of shape {(n, k)} does not fit group size {group_size} / scale shape {tuple(scale.shape)}"
            )
        q = q.to(torch.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return cls(packed.contiguous(), scale.float().contiguous(), zero.float().contiguous(), group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def to(self, device: torch.device) -> Int4Weight:
        return move_tensors(self, device)

    def values(self) -> torch.Tensor:
        """The 4-bit integers as uint8 [N, K]."""
        low, high = self.packed & 15, self.packed >> 4
        return torch.stack((low, high), dim=-1).flatten(1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows(slice(None)).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The reference product: the weight expanded to x's dtype (platforms repack it for their kernels)."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def slice_rows(self, start: int, end: int) -> Int4Weight:
        rows = (t[start:end].clone() for t in (self.packed, self.scale, self.zero))
        return Int4Weight(*rows, self.group_size)

    def slice_columns(self, start: int, end: int) -> Int4Weight:
        """Columns split at group borders only: a group's scale and zero cannot be shared between ranks."""
        g = self.group_size
        if start % g or end % g:
            raise ValueError(f"4-bit groups of {g} columns cannot be split at column {start if start % g else end}")
        return Int4Weight(
            self.packed[:, start // 2 : end // 2].contiguous(),
            self.scale[:, start // g : end // g].contiguous(),
            self.zero[:, start // g : end // g].contiguous(),
            g,
        )

    def rows(self, index) -> torch.Tensor:
        """Float32 rows `index` (an embedding lookup), without dequantising the rest."""
        packed = self.packed[index]
        q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()
        groups = q.unflatten(-1, (-1, self.group_size))
        return ((groups - 8) * self.scale[index][..., None] + self.zero[index][..., None]).flatten(-2)

    def regroup(self, group_size: int) -> Int4Weight:
        """The same weight described with smaller groups (each scale and zero repeated), for kernels that
        accept only some group sizes; `group_size` must divide the current one."""
        if self.group_size % group_size:
            raise ValueError(f"group size {group_size} does not divide {self.group_size}")
        repeat = self.group_size // group_size
        scale, zero = self.scale.repeat_interleave(repeat, 1), self.zero.repeat_interleave(repeat, 1)
        return Int4Weight(self.packed, scale, zero, group_size)

    def permute_rows(self, order: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.packed[order], self.scale[order], self.zero[order], self.group_size)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacks output rows (used to fuse q/k/v and gate/up projections)."""
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"cannot fuse int4 weights with different group sizes {sorted(sizes)}")
        return Int4Weight(
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            sizes.pop(),
        )


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group (for `--quantization int4` on float checkpoints)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
    return Int4Weight.from_values(q.view(n, k), scale, low + 8 * scale, group_size)
