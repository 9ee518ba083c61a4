"""Float32 weights packed once at load for the C++ GEMM (csrc/packed_linear.cpp).

Measured on a 2-core Intel Xeon (AVX-512, no BF16), all of SmolLM2's projections and its LM head with the
weights streamed from memory (ms per forward's worth of products, same run): 1 row 20.3 vs oneDNN's packed
24.7, 8 rows 25.7 vs 32.5, 16 rows 30.9 vs 38.2, 64 rows 77.9 vs 85.2, 2048 rows 2550 vs 2606. oneDNN's
layout also read ~15 GB/s at one row in some runs, where this one streams at ~27 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CpuPackedWeight:
    packed: torch.Tensor  # float32 [ceil(N / panel), K, panel]: the kernel's column panels
    n: int  # output features (the last panel may be padded with zero columns)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> CpuPackedWeight:
        return cls(torch.ops.heteroserve.pack_linear_weight(weight.float()), weight.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.packed.transpose(1, 2).reshape(-1, self.packed.shape[1])[: self.n].to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.heteroserve.packed_linear(x, self.packed, self.n, bias)
