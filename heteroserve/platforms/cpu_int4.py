"""4-bit weights in the layout of torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`).

The kernel rounds activations to bfloat16 and is fast only with native bfloat16 (AVX512-BF16 micro-kernels).
Measured on a 2-core AVX-512 machine for SmolLM2's projections: at one row it reads 4 bits a weight and beats
float32 oneDNN several times over (decode). Batches of `PANEL_MIN_ROWS` rows and more go to our C++ kernel on
the same layout (dequantised block by block into cache, float32 arithmetic), prefill batches on CPUs with
native bfloat16 to one bfloat16 GEMM. The kernel accepts groups of 32, 64, 128 or 256 input columns; larger
groups (GPTQ per-channel) are described with smaller ones by repeating their scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heteroserve.platforms import cpu_kernels
from heteroserve.quantization.int4 import Int4Weight

_BLOCK_N = 64  # the kernel's packed layout: [N / 64, K, 32] bytes, rows j and j + 32 of a block in one byte
# From this many rows (a prefill) the weight is dequantised to bfloat16 for one bfloat16 GEMM instead, where the
# CPU multiplies bfloat16 natively: measured at 2048 rows on SmolLM2's projections, 2.1 + 18 ms against the
# kernel's 45 ms (gate/up), 0.9 + 9.4 against 23 (down); break-even near 256 rows. Same error as the kernel's
# (relative ~3e-3, from the bfloat16 activations both round to).
BF16_GEMM_MIN_ROWS = 512
# From this many rows (below the bfloat16 GEMM's bound, or at any size without native bfloat16) our C++ kernel
# (csrc/int4_panel_linear.cpp) dequantises each block of 64 rows into cache and multiplies it there in float32.
# SmolLM2's 120 projections on a 2-core Intel Xeon without AVX512-BF16: 8 rows 16.3 ms against torch's kernel's
# 16.8, 16 rows 24.4 vs 30.7, 64 rows 74.9 vs 128.6 (the float32 GEMM: 79.6), 512 rows 510 vs 935; at 1-4 rows
# torch's kernel, which reads the 4 bits without expanding them, is faster (6.1 vs 12.1 ms at one row); where
# the C++ library has AVX512-VNNI and VBMI, our integer kernel (csrc/int4_vnni_linear.cpp: activations rounded to
# 8 bits per 32 inputs, as llama.cpp's) takes those rows instead: SmolLM2's 120 projections on the 2-core Xeon at
# 1, 2, 4, 7 rows in 0.79, 0.69, 0.74, 0.51x torch's kernel's time. It would beat the panel kernel too (8, 16, 64,
# 256 rows: 0.27, 0.41, 0.82, 0.89x), but a linear layer cannot tell a decode batch from a short prompt, and
# prompts need float32 activations: prefilled with 8-bit ones, the shipped default model answered the demo
# question in French (as peers.md saw vLLM do in bfloat16). The fused decode layer can tell: DECODE_VNNI_MAX_ROWS.
PANEL_MIN_ROWS = 8
# A decode-only step (the fused decode layer, cpu_decode_layer.py) is a batch of decode rows, never a prompt: there
# the VNNI kernel takes every step up to the default max_num_seqs, and a request's rows are rounded the same way
# whether it decodes alone or in a batch.
DECODE_VNNI_MAX_ROWS = 256
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
    bf16_gemm: bool = False  # the CPU multiplies bfloat16 natively: large batches take the bfloat16 GEMM

    @classmethod
    def supports(cls, weight: Int4Weight) -> bool:
        return weight.shape[0] % _BLOCK_N == 0 and kernel_group(weight) is not None

    @classmethod
    def pack(cls, weight: Int4Weight, bf16_gemm: bool = False) -> CpuInt4Weight:
        regrouped = weight.regroup(kernel_group(weight))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values().to(torch.int32), 1)
        n, k = weight.shape
        sz = torch.stack((regrouped.scale.t(), regrouped.zero.t()), dim=-1).to(torch.bfloat16).contiguous()
        blocks = packed.view(n // _BLOCK_N, k, _BLOCK_N // 2)
        groups = weight.scale.shape[1]
        scale_zero = torch.stack((weight.scale, weight.zero)).view(2, n // _BLOCK_N, _BLOCK_N, groups)
        return cls(blocks, sz, scale_zero.permute(1, 3, 0, 2).contiguous(), weight.group_size, bf16_gemm)

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
        rows = x.shape[0]
        if self.bf16_gemm and rows >= BF16_GEMM_MIN_ROWS:
            out = F.linear(x.to(torch.bfloat16), self.dequantize(torch.bfloat16)).to(x.dtype)
            return out if bias is None else out + bias
        if rows >= PANEL_MIN_ROWS and x.dtype == torch.float32 and cpu_kernels.load_library():
            out = torch.ops.heteroserve.int4_panel_linear(x, self.packed, self.scale_zero)
            return out if bias is None else out + bias
        if x.dtype == torch.float32 and self.original_group % 32 == 0 and cpu_kernels.int4_vnni_available():
            out = torch.ops.heteroserve.int4_vnni_linear(x, self.packed, self.scale_zero)
            return out if bias is None else out + bias
        n, k = self.shape
        packed = self.packed.view(n, k // 2)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), packed, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        return out if bias is None else out + bias

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.scale_zero))
