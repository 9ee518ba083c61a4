"""Weights packed once at load for our C++ GEMMs: float32 (csrc/packed_linear.cpp) and bfloat16
(csrc/bf16_packed_linear.cpp: AVX512-BF16's dot-product instruction, elsewhere the pairs widened in registers),
both on the kernels' own thread pool.

One layout serves every row count: each product reads the weight as one sequential stream, so a decode row reads
it at the memory's pace, and oneDNN's packed layout is not needed beside it (the comparison, row count by row
count, is in bench/results/HISTORY.md, "Linear layers"; docs/PLATFORMS.md, "CPU kernels", has the read rates).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.quantization.weight import kept_on


@dataclass
class CpuPackedWeight:
    # The kernel's column panels: float32 [ceil(N / panel), K, panel], or bfloat16 [ceil(N / 32), K / 2, 32, 2]
    # (pairs of rows of k interleaved, the operand layout of vdpbf16ps).
    packed: torch.Tensor
    n: int  # output features (the last panel may be padded with zero columns)
    float_output: bool = False  # float32 results from bfloat16 activations (an LM head's logits)

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> CpuPackedWeight:
        if dtype == torch.bfloat16:
            return cls(torch.ops.heteroserve.pack_bf16_linear_weight(weight.to(dtype)), weight.shape[0])
        return cls(torch.ops.heteroserve.pack_linear_weight(weight.float()), weight.shape[0])

    @staticmethod
    def bfloat16_supports(weight: torch.Tensor) -> bool:
        """The bfloat16 kernel is loaded and reads the weight's K in pairs."""
        return weight.shape[1] % 2 == 0 and bfloat16_gemm_available()

    @property
    def shape(self) -> tuple[int, int]:
        k = self.packed.shape[1] * (2 if self.packed.dim() == 4 else 1)
        return self.n, k

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def to(self, device: torch.device) -> CpuPackedWeight:
        return kept_on(self, torch.device("cpu"), device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        _, k = self.shape
        return self.packed.transpose(1, 2).reshape(-1, k)[: self.n].to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed.dtype == torch.bfloat16:
            return torch.ops.heteroserve.bf16_packed_linear(
                x.to(torch.bfloat16), self.packed, self.n, bias, self.float_output
            )
        # x widened where the weight is float32 under bfloat16 activations: an 8-bit LM head (float32 logits), or
        # a weight the bfloat16 kernel cannot read (rounded back)
        bias = None if bias is None else bias.float()
        out = torch.ops.heteroserve.packed_linear(x.float(), self.packed, self.n, bias)
        return out if self.float_output else out.to(x.dtype)


@functools.cache
def bfloat16_gemm_available() -> bool:
    """Whether the C++ library, and with it the bfloat16 GEMM, is loaded (every build has it)."""
    return cpu_kernels.load_library()


@functools.cache
def bfloat16_gemm_kernel() -> str:
    """How this build multiplies bfloat16 pairs: AVX512-BF16's dot-product instruction, or widened in registers."""
    if not bfloat16_gemm_available():
        return "none"
    native = bool(torch.ops.heteroserve.bf16_dot_product_instruction())
    return "cpp bfloat16 gemm (AVX512-BF16 vdpbf16ps)" if native else "cpp bfloat16 gemm (pairs widened to float32)"
