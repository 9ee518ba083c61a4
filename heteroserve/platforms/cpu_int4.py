"""4-bit weights in the layout of torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`), multiplied by our C++
kernel (csrc/int4_panel_linear.cpp) in float32 arithmetic for every number of rows.

One kernel and one order of summation for every batch size makes a request's result independent of what else
is in its step and of how much of its prompt was cached (issue 23): before, decode rows (1-7, and every
decode-only step) took 8-bit activations on VNNI and prompts of 8+ rows float ones, and the default model
answered the demo question in French once its prompt's first blocks were cached (a 5-row prefill). Where the
C++ library is missing, torch's kernel takes every batch (activations rounded to bfloat16). The layout takes
groups of 32, 64, 128 or 256 input columns; larger groups (GPTQ per-channel) are described with smaller ones by
repeating their scales. Timings: bench/results/batch_invariance/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heteroserve.platforms import cpu_kernels
from heteroserve.quantization.int4 import Int4Weight

_BLOCK_N = 64  # the kernel's packed layout: [N / 64, K, 32] bytes, rows j and j + 32 of a block in one byte
KERNEL_GROUPS = (256, 128, 64, 32)


def kernel_group(weight: Int4Weight) -> int | None:
    """The largest group size the kernel takes that describes `weight` exactly, or None."""
    return next((g for g in KERNEL_GROUPS if weight.group_size % g == 0), None)


@dataclass
class CpuInt4Weight:
    packed: torch.Tensor  # uint8 [N / 64, K, 32], the kernel's layout
    scales_and_zeros: torch.Tensor  # bfloat16 [K / group, N, 2], for torch's kernel
    # float32 [N / 64, K / original group, 2, 64]: per block of 64 rows and group, their scales then their zeros,
    # so our kernels read a block's scales in one run (exact dequantisation: w = (q - 8) * scale + zero)
    scale_zero: torch.Tensor
    original_group: int

    @classmethod
    def supports(cls, weight: Int4Weight) -> bool:
        return weight.shape[0] % _BLOCK_N == 0 and kernel_group(weight) is not None

    @classmethod
    def pack(cls, weight: Int4Weight) -> CpuInt4Weight:
        regrouped = weight.regroup(kernel_group(weight))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values().to(torch.int32), 1)
        n, k = weight.shape
        sz = torch.stack((regrouped.scale.t(), regrouped.zero.t()), dim=-1).to(torch.bfloat16).contiguous()
        blocks = packed.view(n // _BLOCK_N, k, _BLOCK_N // 2)
        groups = weight.scale.shape[1]
        scale_zero = torch.stack((weight.scale, weight.zero)).view(2, n // _BLOCK_N, _BLOCK_N, groups)
        return cls(blocks, sz, scale_zero.permute(1, 3, 0, 2).contiguous(), weight.group_size)

    @property
    def shape(self) -> tuple[int, int]:
        blocks, k, _ = self.packed.shape
        return blocks * _BLOCK_N, k

    @property
    def group_size(self) -> int:
        """The group size the kernel reads (after any regrouping)."""
        return self.shape[1] // self.scales_and_zeros.shape[0]

    def values(self) -> torch.Tensor:
        """The 4-bit integers read back from the kernel's layout (tests check it against the canonical form)."""
        low, high = self.packed & 15, self.packed >> 4
        n, k = self.shape
        return torch.cat((low, high), dim=2).permute(0, 2, 1).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Straight from the kernel's layout, in float32 arithmetic as Int4Weight.dequantize does."""
        n, k = self.shape
        groups = self.values().view(n, k // self.original_group, self.original_group).float()
        scale, zero = self.scale_zero.permute(2, 0, 3, 1).reshape(2, n, -1, 1)
        return ((groups - 8) * scale + zero).view(n, k).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype == torch.float32 and cpu_kernels.load_library():
            out = torch.ops.heteroserve.int4_panel_linear(x, self.packed, self.scale_zero)
        else:
            n, k = self.shape
            packed = self.packed.view(n, k // 2)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), packed, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.scale_zero))
