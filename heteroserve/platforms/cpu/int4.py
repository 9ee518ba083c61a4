"""4-bit weights in our kernel's own layout, multiplied by our C++ kernel (csrc/int4_panel_linear.cpp) in float32
arithmetic for every number of rows.

The layout is ours, the same on every CPU: [N / 64, K, 32] bytes, byte j of input column k of a block holding
output row j of the block in its low nibble and row j + 32 in its high one, so a block of 64 output rows is laid
out column by column as the float32 GEMM's panels are. (torch's `_convert_weight_to_int4pack_for_cpu` packs
differently on AVX-512, AVX2 and aarch64, so its output cannot be a layout of ours.) Beside it, per block of 64
rows and group of inputs, the rows' scales then their zeros in float32 ([N / 64, K / group, 2, 64]), so that a
block's scales arrive in one run: w = (q - 8) scale + zero.

One kernel and one order of summation for every batch size makes a request's result independent of what else
is in its step and of how much of its prompt was cached: a decode row gets the bits the same row gets inside a
prompt. Any group size that divides K is read as it is. Activations of other dtypes are widened to float32 and
the result rounded back. Where the C++ library is missing, the platform keeps the reference Int4Weight (and
says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.quantization.int4 import Int4Weight
from heteroserve.quantization.weight import kept_on

BLOCK_ROWS = 64  # output rows per block of the layout


def pack_int4_blocks(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] 4-bit values -> the kernel's [N / 64, K, 32] bytes."""
    n, k = values.shape
    rows = values.to(torch.uint8).view(n // BLOCK_ROWS, 2, BLOCK_ROWS // 2, k)
    return (rows[:, 0] | (rows[:, 1] << 4)).transpose(1, 2).contiguous()


@dataclass
class CpuInt4Weight:
    packed: torch.Tensor  # uint8 [N / 64, K, 32], the kernel's layout
    scale_zero: torch.Tensor  # float32 [N / 64, K / group, 2, 64]: scales, then zeros
    group_size: int

    @classmethod
    def supports(cls, weight: Int4Weight) -> bool:
        return weight.shape[0] % BLOCK_ROWS == 0

    @classmethod
    def pack(cls, weight: Int4Weight) -> CpuInt4Weight:
        n, _ = weight.shape
        groups = weight.scale.shape[1]
        scale_zero = torch.stack((weight.scale, weight.zero)).view(2, n // BLOCK_ROWS, BLOCK_ROWS, groups)
        return cls(pack_int4_blocks(weight.values()), scale_zero.permute(1, 3, 0, 2).contiguous(), weight.group_size)

    @property
    def shape(self) -> tuple[int, int]:
        blocks, k, _ = self.packed.shape
        return blocks * BLOCK_ROWS, k

    def values(self) -> torch.Tensor:
        """The 4-bit integers read back from the kernel's layout (tests check it against the canonical form)."""
        low, high = self.packed & 15, self.packed >> 4
        n, k = self.shape
        return torch.cat((low, high), dim=2).permute(0, 2, 1).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Straight from the kernel's layout, in float32 arithmetic as Int4Weight.dequantize does."""
        n, k = self.shape
        groups = self.values().view(n, k // self.group_size, self.group_size).float()
        scale, zero = self.scale_zero.permute(2, 0, 3, 1).reshape(2, n, -1, 1)
        return ((groups - 8) * scale + zero).view(n, k).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.heteroserve.int4_panel_linear(x.float(), self.packed, self.scale_zero).to(x.dtype)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def to(self, device: torch.device) -> CpuInt4Weight:
        return kept_on(self, torch.device("cpu"), device)
