"""x86-64 and aarch64 CPUs."""

from __future__ import annotations

import os
import platform as pyplatform

import torch

from heteroserve.config import DEFAULT_CPU_KV_CACHE_BYTES
from heteroserve.platforms.interface import Platform

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
