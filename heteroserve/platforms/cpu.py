"""x86-64 and aarch64 CPUs."""

from __future__ import annotations

import os
import platform as pyplatform

import torch

from heteroserve.config import DEFAULT_CPU_KV_CACHE_BYTES
from heteroserve.platforms.interface import LinearOp, Platform

_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "sve", "sve2", "bf16")


def cpu_isa_flags() -> set[str]:
    """Instruction-set extensions the kernel reports (x86 'flags', arm64 'Features')."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    return {f for f in _ISA_FLAGS if f in flags}


class OneDnnLinear(LinearOp):
    """oneDNN with weights repacked once for its blocked layout: on a 2-core AVX-512 machine about 2x
    eager torch.matmul at 1-64 rows and 1.3x at 512+ (bench/README.md)."""

    name = "onednn-packed"
    PACK_ROWS = 64  # the batch size the layout is tuned for; other sizes work too

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_ROWS)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = OneDnnLinear()
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(3, 16, dtype=dtype)
        return torch.allclose(op(x, op.prepare(w)).float(), (x @ w.T).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError):
        return False


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def __init__(self) -> None:
        self.isa = cpu_isa_flags()

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.isa & {"avx512_bf16", "amx_bf16", "bf16", "sve"}:
            dtypes.append(torch.bfloat16)
        if "amx_tile" in self.isa or pyplatform.machine() == "aarch64":
            dtypes.append(torch.float16)
        return dtypes

    def linear_op(self, dtype: torch.dtype, kernels: str = "auto") -> LinearOp:
        if kernels == "auto" and dtype in (torch.float32, torch.bfloat16) and _onednn_works(dtype):
            return OneDnnLinear()
        return LinearOp()

    def kv_cache_budget_bytes(self, requested: int | None) -> int:
        return requested if requested is not None else DEFAULT_CPU_KV_CACHE_BYTES

    def configure_process(self) -> None:
        threads = os.environ.get("HETEROSERVE_NUM_THREADS")
        if threads:
            torch.set_num_threads(int(threads))

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "machine": pyplatform.machine(),
            "isa": sorted(self.isa),
            "threads": torch.get_num_threads(),
        }
