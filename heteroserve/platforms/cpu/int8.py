"""Per-channel 8-bit weights for torch's CPU int8 kernel (`_weight_int8pack_mm`: x @ (q * scale[n])^T).

Measured on a 2-core AVX-512 machine, one thread, SmolLM2-sized projections (ms per product):

| rows | float32 oneDNN | int8 kernel, bfloat16 x | int8 kernel, float32 x | dequantise + float32 matmul |
|---|---|---|---|---|
| 1 | 0.06-0.12 | 0.04-0.13 | 0.5-1.5 | 0.2-0.6 |
| 8 | 0.11-0.29 | 0.21-0.29 | 4-12 | 0.33-1.5 |
| 64 | 0.66-2.2 | 1.25-2.4 | 31-100 | 0.98-3.9 |

The kernel has a fast path for bfloat16 activations only, so activations are rounded to bfloat16 inside it
(as for the int4 kernel); it serves up to `KERNEL_MAX_ROWS` rows and larger batches dequantise on the fly.
Asymmetric weights (w = q scale + zero) add the rank-one term sum_k x[m, k] * zero[n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.quantization.int8 import Int8Weight
from heteroserve.quantization.weight import kept_on

KERNEL_MAX_ROWS = 16


@dataclass
class CpuInt8Weight:
    weight: Int8Weight  # one group per row
    scale_bf16: torch.Tensor  # bfloat16 [N]

    @classmethod
    def supports(cls, weight: Int8Weight) -> bool:
        return weight.group_size == weight.shape[1]

    @classmethod
    def pack(cls, weight: Int8Weight) -> CpuInt8Weight:
        return cls(weight, weight.scale[:, 0].to(torch.bfloat16).contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale_bf16.numel() * self.scale_bf16.element_size()

    def to(self, device: torch.device) -> CpuInt8Weight:
        return kept_on(self, torch.device("cpu"), device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x, self.weight.dequantize(x.dtype), bias)
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight.q, self.scale_bf16).to(x.dtype)
        if self.weight.zero is not None:
            out = out + x.sum(-1, keepdim=True) * self.weight.zero[:, 0].to(x.dtype)
        return out if bias is None else out + bias


@dataclass
class CpuGroupedInt8Weight:
    """Grouped 8-bit weights (GGUF Q8_0 and the 5/6-bit types kept at 8 bits, grouped GPTQ 8-bit, a tied Q8_0 LM
    head) kept at 8 bits and multiplied in float32 arithmetic by the C++ library's int8_grouped_product, which
    picks the kernel by row count: up to `KERNEL_MAX_ROWS` rows (decode) it reads them in place, a quarter of the
    bytes of a float32 copy, which bounds decode rows; larger batches dequantise 32 output rows at a time into a
    panel of the float32 GEMM and multiply there (AVX-512 builds; docs/QUANTIZATION.md has the timings), elsewhere
    `SLICE_ROWS` output rows at a time exactly into a float32 buffer small enough to stay in cache, for torch's mm.
    Either way no float copy of the weight exists.
    torch's int8 kernel would round activations to bfloat16, which changed the default model's answers."""

    weight: Int8Weight
    KERNEL_MAX_ROWS = 16
    SLICE_ROWS = 1024  # a 2.4 MB buffer at K = 576

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def to(self, device: torch.device) -> CpuGroupedInt8Weight:
        return kept_on(self, torch.device("cpu"), device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.dequantize(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        if w.group_size % 16 == 0 and cpu_kernels.load_library():
            out = torch.ops.heteroserve.int8_grouped_product(x.float(), w.q, w.scale, w.zero).to(x.dtype)
        else:
            out = self._by_slices(x)
        return out if bias is None else out + bias

    def _by_slices(self, x: torch.Tensor) -> torch.Tensor:
        """Without the C++ library (or for groups it cannot read): slices of output rows dequantised by torch."""
        w = self.weight
        n, k = w.shape
        groups = k // w.group_size
        out_t = torch.empty(n, x.shape[0], dtype=torch.float32)  # slices of output rows are contiguous here
        buffer = torch.empty(min(self.SLICE_ROWS, n), groups, w.group_size, dtype=torch.float32)
        x_t = x.float().T
        for start in range(0, n, self.SLICE_ROWS):
            rows = slice(start, min(start + self.SLICE_ROWS, n))
            count = rows.stop - start
            grouped = buffer[:count]
            torch.mul(w.q[rows].view(count, groups, w.group_size), w.scale[rows, :, None], out=grouped)
            if w.zero is not None:
                grouped += w.zero[rows, :, None]
            torch.mm(grouped.view(count, k), x_t, out=out_t[rows])
        return out_t.T.to(x.dtype)
